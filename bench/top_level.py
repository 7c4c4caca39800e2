"""Multi-line completions on a blank line at a file's top level: what stopping at the next
top-level paragraph changes.

    python bench/top_level.py REPO_GIT_DIR [REPO_GIT_DIR ...] [--per-repo 20] [--model default] [--indented]
                              [--ext py] [--out PATH]

Inside a block a multi-line completion ends where the code goes back left of the cursor's
line (``block_end``); at the top level nothing is left of column 0, so a completion ran on
to its 12 lines, two blank lines, the suffix's next line or a loop.  ``StopRules`` now also
stops a top-level completion before a line at column 0 that follows a blank line, once the
completion has code: one paragraph (a definition with its body, a group of statements).

Cursors: each repository's HEAD (extracted under bench/.work/, not committed), its .py files;
in a deterministic sample of them, a top-level paragraph (a line at column 0 after a blank
line, with code before it) is held out: the prefix is the file up to that line, the suffix
the file from the next paragraph on (a line break first), the truth the paragraph.  A
developer writing a new function, class or statement group between others.

``--indented``: the same for definitions inside a block, the rule ``definition_paragraphs``
(a method in a class body, a nested function): a line that starts a definition
(``stops.starts_definition``: ``def``, ``class``, a decorator, a method's header in a brace
language, an annotation or doc comment before one), indented, after a blank line is held out up
to the next line at or left of its indentation after a blank line (or left of it at once); the
prefix ends with its indentation typed on the fresh line.  On such a line, a completion that
starts a definition stops before a line back at the cursor's indentation after a blank line.
A third arm, ``first keywords only``, is the rule as it first shipped (Python's keywords and
``function``/``fn``/``func`` at the line's start).  ``--ext js,ts,java,rs`` draws the cursors
from other languages' files (default: .py).

Two arms on one engine, each request in both (the order alternating; no time budget, so the
arms differ only by the rule): ``paragraph stop``
(as shipped) and ``before`` (the rule off).  Per arm: stop reasons, lines shown and how
many equal the truth's line at their place, acceptance (the truth starts with the
completion) and the characters accepted completions save, tokens generated.
Writes ``bench/results/top_level.{md,json}``.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (LINES_ROWS, RESULTS, STOP_REASONS_ROW, arm_table, header, source_files,  # noqa: E402
                    write_results)
from speculation import checkout  # noqa: E402

from codecomplete.daemon.replay import lines_right  # noqa: E402
from codecomplete.model import stops  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings  # noqa: E402
from codecomplete.model.engine import Engine  # noqa: E402

ARMS = ("paragraph stop", "before")
# --indented: also the rule as it first shipped, which knew Python's definitions and ``function``/``fn``/``func``
# only (no modifiers before them, no methods of brace languages, no annotations, doc comments or attributes)
KEYWORDS_ARM = "first keywords only"
_FIRST_DEFINITION = re.compile(r"(?:async\s+)?(?:def|class|function|fn|func)\s|@\w")


def first_keywords(line: str) -> bool:
    return bool(_FIRST_DEFINITION.match(line.lstrip()))


def paragraphs(text: str) -> list[tuple[int, int]]:
    """(first line, end line) of each top-level paragraph after the first: a line at column 0
    after a blank line, up to the next such line."""
    lines = text.split("\n")
    starts = [i for i in range(1, len(lines))
              if lines[i].strip() and not lines[i][0].isspace() and not lines[i - 1].strip()
              and any(x.strip() for x in lines[:i])]
    return [(a, b) for a, b in zip(starts, starts[1:] + [len(lines)])]


def definitions(text: str) -> list[tuple[int, int]]:
    """(first line, end line) of each indented definition that follows a blank line: up to the
    next line at or left of its indentation after a blank line, or left of it."""
    lines = text.split("\n")
    width = [stops.indent_width(stops.leading_ws(x)) for x in lines]
    out = []
    for a in range(1, len(lines)):
        if not (lines[a].strip() and width[a] > 0 and not lines[a - 1].strip()
                and stops.starts_definition(lines[a]) and any(x.strip() for x in lines[:a])):
            continue
        b = a + 1
        while b < len(lines) and not (lines[b].strip() and (width[b] < width[a] or (
                width[b] == width[a] and not lines[b - 1].strip()))):
            b += 1
        out.append((a, b))
    return out


def cursors(git_dirs: list[Path], per_repo: int, seed: int = 0, indented: bool = False,
            exts: tuple[str, ...] = ("py",)) -> list[dict]:
    out = []
    for git_dir in git_dirs:
        name, root = checkout(git_dir)
        found = []
        for path, text in source_files(root, exts):
            lines = text.split("\n")
            for a, b in (definitions if indented else paragraphs)(text):
                indent = stops.leading_ws(lines[a])
                body = "\n".join(lines[a:b]).rstrip()[len(indent):]
                if len(body) < 20:
                    continue
                found.append({"repo": name, "path": path.relative_to(root).as_posix(), "line": a,
                              "prefix": "".join(x + "\n" for x in lines[:a]) + indent,
                              "suffix": "\n" + "\n".join(lines[b:]), "truth": body})
        rng = random.Random(f"{seed}:{name}")
        out += rng.sample(found, min(per_repo, len(found)))
    return out


def measure(c, cur: dict) -> dict:
    text = c.text.rstrip()
    lines, right = lines_right(text, cur["truth"])
    accepted = bool(text.strip()) and cur["truth"].startswith(text)
    return {"reason": c.stop_reason, "tokens": c.generated_tokens, "lines": lines, "lines_right": right,
            "accepted": accepted, "chars_saved": len(text) if accepted else 0, "text": text}


def summarize(rows: list[dict]) -> dict:
    lines = sum(r["lines"] for r in rows)
    right = sum(r["lines_right"] for r in rows)
    return {"requests": len(rows), "stop_reasons": dict(Counter(r["reason"] for r in rows).most_common()),
            "lines_shown": lines, "lines_right": right, "lines_wrong": lines - right,
            "accepted": sum(r["accepted"] for r in rows), "chars_saved": sum(r["chars_saved"] for r in rows),
            "tokens_mean": round(statistics.mean(r["tokens"] for r in rows), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repos", nargs="+", type=Path, help="git directories (as fetch brings them)")
    ap.add_argument("--per-repo", type=int, default=20, help="held-out paragraphs per repository")
    ap.add_argument("--model", default="default")
    ap.add_argument("--indented", action="store_true", help="indented definitions (definition_paragraphs)")
    ap.add_argument("--ext", default="py", help="file extensions the cursors are drawn from, comma-separated "
                                                  "(js,ts,java,rs...)")
    ap.add_argument("--out", default=None, help="results path without extension (default: top_level, "
                                                 "top_level_indented)")
    args = ap.parse_args()
    out = args.out or str(RESULTS / ("top_level_indented" if args.indented else "top_level"))
    rule = "definition_paragraphs" if args.indented else "top_level_paragraphs"
    exts = tuple(e.strip().lstrip(".") for e in args.ext.split(",") if e.strip())
    work = cursors(args.repos, args.per_repo, indented=args.indented, exts=exts)
    engine = Engine(EngineSettings(model=args.model)).start()
    engine.ready.wait()
    if engine.load_error:
        sys.exit(engine.load_error)
    arms = (ARMS[0], KEYWORDS_ARM, ARMS[1]) if args.indented else ARMS
    shipped_detector = stops.starts_definition
    rows = {arm: [] for arm in arms}
    for i, cur in enumerate(work):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            setattr(stops.StopRules, rule, arm != "before")
            stops.starts_definition = first_keywords if arm == KEYWORDS_ARM else shipped_detector
            c = engine.complete(CompletionRequest(prefix=cur["prefix"], suffix=cur["suffix"], time_budget_ms=600_000,
                                                  session_key=f"{arm}:{cur['repo']}:{cur['path']}:{cur['line']}"))
            rows[arm].append({"repo": cur["repo"], "path": cur["path"], "line": cur["line"], **measure(c, cur)})
        print(i, cur["repo"], cur["path"], cur["line"], [rows[a][-1]["reason"] for a in arms], flush=True)
    setattr(stops.StopRules, rule, True)
    stops.starts_definition = shipped_detector
    engine.close()
    summary = {arm: summarize(rows[arm]) for arm in arms}
    both = list(zip(rows[ARMS[0]], rows[ARMS[1]]))
    changed = [(x, y) for x, y in both if x["text"] != y["text"]]
    keys = [STOP_REASONS_ROW, *LINES_ROWS, ("tokens generated, mean", lambda s: s["tokens_mean"])]
    repos = ", ".join(sorted({c["repo"] for c in work}))
    what = ("indented definitions (cursor on the blank line where the definition starts, its indentation "
            "typed; suffix: the file from the next line at or left of that indentation on)" if args.indented else
            "top-level paragraphs (cursor on the blank line where the paragraph starts; suffix: the file from the "
            "next paragraph on)")
    md = [header("Indented definitions: stopping where the definition ends" if args.indented else
                 "Top-level multi-line completions: stopping at the next paragraph"), "",
          f"Model `{args.model}`, daemon defaults (auto mode, 64 tokens, 12 lines) but no time budget (a "
          "wall-clock cut would differ between the arms), no repository index. "
          f"{len(work)} held-out {what} of {repos} "
          f"({', '.join('.' + e for e in exts)} files). `paragraph stop` is the daemon as shipped, "
          f"`before` the same engine with the rule (`StopRules.{rule}`) off"
          + (f", `{KEYWORDS_ARM}` the rule with the definitions it first knew (`def`, `class`, `function`, `fn`, "
             "`func`, `async def`, a decorator, each at the line's start)." if args.indented else "."), ""]
    md += arm_table(keys, summary, arms)
    if args.indented:
        first = sum(x["text"] != y["text"] for x, y in zip(rows[ARMS[0]], rows[KEYWORDS_ARM]))
        md += ["", f"Texts where `paragraph stop` and `{KEYWORDS_ARM}` differ: {first} of {len(work)}."]
    md += ["", f"Texts that differ: {len(changed)} of {len(work)}; each `paragraph stop` text a prefix of "
           f"`before`'s: {sum(y['text'].startswith(x['text']) for x, y in changed)} of {len(changed)}.", "",
           "Texts that differ (the shipped text's last line / what `before` showed after it, first 10):", ""]
    for x, y in changed[:10]:
        md += [f"- `{x['repo']}/{x['path']}:{x['line'] + 1}`: `{x['text'].split(chr(10))[-1][:60]!r}` / "
               f"`{y['text'][len(x['text']):][:100]!r}`"]
    md += [""]
    write_results(out, md, {"summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
