"""Mid-line completions inside brackets the editor closed: does the accepted line keep its closers?

    python bench/closers.py REPO_GIT_DIR [REPO_GIT_DIR ...] [--per-repo 15] [--model default]
                            [--ext py,js,ts,java,rs] [--out PATH]

An editor that closes pairs (VS Code by default, Neovim's autopairs) leaves ``foo(|)`` as the
user types ``foo(``.  A completion that ends with that ``)`` rewrote it, and its item replaces
it (``stops.rewrites_rest``); one that does not goes before it.  Ending with the ``)`` is not
enough: after ``print(`` the text ``len(x)`` ends with it but leaves ``print(`` open, and
covering the ``)`` loses a closer (``print(len(x)``), which happens where the tokenizer writes
the two ``)`` as two tokens (the stop rule cuts at the first).  ``rewrites_rest`` now also asks
the text to close what that code closes, takes a text that ends with the closers and a statement's
end (``x);``) as rewriting them, and offers no text that is only that code again
(``stops.CLOSER_RULES``).

Cursors: each repository's HEAD (extracted under bench/.work/, not committed), files of the
given extensions; in a deterministic sample, a call's ``(`` (after a name, its matching ``)`` on
the same line, something between them) on a line that is not a comment.  The prefix is the file
up to and including that ``(``; after the cursor the closers of every bracket the line opened so
far (what the editor put there as the line was typed: ``x = f(g(|))``), then a line break and the
file after the line.  The truth: the line up to where those brackets are closed.  And as many
cursors after a block or literal opened at a line's end (``{``, ``[``, ``(``; closed on a later line
at the opener's indentation): the editor's closers after the cursor (``app.get(x, () => {|})``),
then the file after the closing line; the truth, the lines through the closing one.  A
multi-line completion that ends with its own closing line (``});``) rewrote the ``})`` after the
cursor (the statement's end after closers), where before the two were doubled.

Two arms on one engine, each request in both (order alternating; no time budget, so the arms differ
only by the rule): ``balanced`` (as shipped) and ``ends with`` (the rule before:
``stops.CLOSER_RULES = False``).  Per arm: the line as accepting the completion
leaves it (the item replaces the closers where the text rewrote them), whether it equals the truth,
whether its brackets are as the truth's (none left open, none closed twice), stop reasons.
Writes ``bench/results/closers.{md,json}``.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, source_files, write_results  # noqa: E402
from speculation import checkout  # noqa: E402

from codecomplete.model import stops  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings  # noqa: E402
from codecomplete.model.engine import Engine  # noqa: E402

ARMS = ("balanced", "ends with")
KINDS = ("call", "block")
_CALL = re.compile(r"\w\(")
_COMMENT = re.compile(r"^\s*(#|//|/\*|\*)")


def code_chars(line: str, start: int = 0):
    """(index, character) of ``line`` from ``start`` outside strings (quotes and what they hold
    skipped, a backslash escaping inside them)."""
    quote, escaped = None, False
    for i in range(start, len(line)):
        ch = line[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'`":
            quote = ch
        else:
            yield i, ch


def unbalanced(line: str) -> tuple[int, int]:
    """Brackets a line leaves open and closers it has too many of (strings skipped)."""
    depth, extra = [], 0
    pairs = {"(": ")", "[": "]", "{": "}"}
    for _, ch in code_chars(line):
        if ch in pairs:
            depth.append(pairs[ch])
        elif ch in ")]}":
            if depth and depth[-1] == ch:
                depth.pop()
            else:
                extra += 1
    return len(depth), extra


def closing_end(line: str, start: int, closers: str) -> int | None:
    """Where (after ``start``) the brackets behind ``closers`` are all closed in ``line``."""
    need, depth = len(closers), 0
    for i, ch in code_chars(line, start):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth:
                depth -= 1
            else:
                need -= 1
                if need == 0:
                    return i + 1
    return None


def cursors(git_dirs: list[Path], per_repo: int, exts: tuple[str, ...], seed: int = 0) -> list[dict]:
    out = []
    for git_dir in git_dirs:
        name, root = checkout(git_dir)
        found = []
        def skip(path: Path) -> bool:
            return "test" in path.relative_to(root).as_posix().lower() or path.name.endswith(".d.ts")

        for path, text in source_files(root, exts, skip):
            lines = text.split("\n")
            for n, line in enumerate(lines):
                if _COMMENT.match(line) or len(line) > 160:
                    continue
                block = block_cursor(name, path.relative_to(root).as_posix(), lines, n)
                if block is not None:
                    found.append(block)
                for m in _CALL.finditer(line):
                    at = m.end()
                    before = line[:at]
                    closers = stops.open_pairs(before.lstrip(), quotes=False)
                    if not closers or stops.open_pairs(before) != stops.open_pairs(before, quotes=False):
                        continue  # inside a string, or a quote the line left open
                    end = closing_end(line, at, closers)
                    if end is None or line[at] == ")":
                        continue
                    found.append({"kind": "call", "repo": name, "path": path.relative_to(root).as_posix(), "line": n,
                                  "prefix": "".join(x + "\n" for x in lines[:n]) + before,
                                  "suffix": closers + "\n" + "\n".join(lines[n + 1:]),
                                  "closers": closers, "before": before, "truth": line[:end], "whole": line})
        rng = random.Random(f"{seed}:{name}")
        for kind in KINDS:
            of_kind = [c for c in found if c["kind"] == kind]
            out += rng.sample(of_kind, min(per_repo, len(of_kind)))
    return out


def block_cursor(repo: str, path: str, lines: list[str], n: int) -> dict | None:
    """A block or literal opened at the end of line ``n`` (``{``, ``[``, ``(``) and closed on a
    later line at its indentation: the cursor after the opener, the editor's closers after it,
    the truth the lines up to and with the closing one."""
    line = lines[n].rstrip()
    if not line or line[-1] not in "{[(" or _COMMENT.match(line):
        return None
    closers = stops.open_pairs(line.lstrip(), quotes=False)
    if not closers or stops.open_pairs(line) != closers:
        return None
    indent = stops.leading_ws(line)
    for j in range(n + 1, min(len(lines), n + 40)):
        if lines[j].strip() and len(stops.leading_ws(lines[j])) <= len(indent):
            break
    else:
        return None
    if j - n < 2 or stops.leading_ws(lines[j]) != indent or not lines[j].strip().startswith(closers[0]):
        return None
    return {"kind": "block", "repo": repo, "path": path, "line": n,
            "prefix": "".join(x + "\n" for x in lines[:n]) + line, "suffix": closers + "\n" + "\n".join(lines[j + 1:]),
            "closers": closers, "before": line, "truth": "\n".join(lines[n:j + 1])}


def accepted_line(text: str, cur: dict) -> str:
    """The cursor's line (its first line, for a text of several) after accepting ``text``: the item
    replaces the closers where the text rewrote them (lsp.server's range), else goes before them."""
    covered = "\n" in text or stops.rewrites_rest(text, cur["closers"], cur["before"])  # several lines: the first
    return (cur["before"] + text + ("" if covered else cur["closers"])).split("\n")[0]


def accepted(text: str, cur: dict) -> str:
    """The code from the cursor's line's start after accepting ``text``, up to the end of the
    editor's closers (a block's: its last line)."""
    if stops.rewrites_rest(text, cur["closers"], cur["before"]):
        return cur["before"] + text.rstrip()
    return cur["before"] + text + cur["closers"]


def measure(c, cur: dict) -> dict:
    text = c.text
    shown = bool(text.strip())
    if cur["kind"] == "call":
        got = accepted_line(text, cur) if shown else ""
        multi = "\n" in text
    else:
        got = accepted(text, cur) if shown else ""
        multi = False
    truth_open, truth_extra = unbalanced(cur["truth"])
    opened, extra = unbalanced(got) if got else (truth_open, truth_extra)
    counted = shown and not multi
    return {"reason": c.stop_reason, "text": text, "accepted": got, "shown": shown, "multi": multi,
            "exact": cur["whole"].startswith(got) and len(got) >= len(cur["truth"]) if cur["kind"] == "call" else
            got.split("\n")[-1].strip() == cur["truth"].split("\n")[-1].strip(),
            "left_open": counted and opened > truth_open, "closed_twice": counted and extra > truth_extra,
            "covers": shown and stops.rewrites_rest(text, cur["closers"], cur["before"])}


def summarize(rows: list[dict]) -> dict:
    shown = [r for r in rows if r["shown"]]
    return {"requests": len(rows), "shown": len(shown), "several lines": sum(r["multi"] for r in shown),
            "stop_reasons": dict(Counter(r["reason"] for r in rows).most_common()),
            "line equal to the truth": sum(r["exact"] for r in rows),
            "a bracket left open": sum(r["left_open"] for r in rows),
            "a bracket closed twice": sum(r["closed_twice"] for r in rows),
            "item replaces the closers": sum(r["covers"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repos", nargs="+", type=Path, help="git directories (as fetch brings them)")
    ap.add_argument("--per-repo", type=int, default=15)
    ap.add_argument("--model", default="default")
    ap.add_argument("--ext", default="py,js,ts,java,rs")
    ap.add_argument("--out", default=str(RESULTS / "closers"))
    args = ap.parse_args()
    exts = tuple(e.strip().lstrip(".") for e in args.ext.split(",") if e.strip())
    work = cursors(args.repos, args.per_repo, exts)
    engine = Engine(EngineSettings(model=args.model)).start()
    engine.ready.wait()
    if engine.load_error:
        sys.exit(engine.load_error)
    rows = {arm: [] for arm in ARMS}
    for i, cur in enumerate(work):
        for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
            stops.CLOSER_RULES = arm == ARMS[0]
            c = engine.complete(CompletionRequest(prefix=cur["prefix"], suffix=cur["suffix"], time_budget_ms=600_000,
                                                  session_key=f"{arm}:{cur['repo']}:{cur['path']}:{cur['line']}"))
            rows[arm].append({"kind": cur["kind"], "repo": cur["repo"], "path": cur["path"], "line": cur["line"],
                              "truth": cur["truth"], "closers": cur["closers"], **measure(c, cur)})
        print(i, cur["kind"], cur["repo"], cur["path"], cur["line"],
              [(rows[a][-1]["reason"], rows[a][-1]["accepted"][-30:]) for a in ARMS], flush=True)
    stops.CLOSER_RULES = True
    engine.close()
    summary = {kind: {arm: summarize([r for r in rows[arm] if r["kind"] == kind]) for arm in ARMS} for kind in KINDS}
    repos = ", ".join(sorted({c["repo"] for c in work}))
    calls, blocks = (sum(c["kind"] == k for c in work) for k in KINDS)
    md = [header("Completions inside brackets the editor closed: the accepted code's closers"), "",
          f"Model `{args.model}`, daemon defaults (auto mode, 64 tokens, 12 lines) but no time budget, no repository "
          f"index. {repos} ({', '.join('.' + e for e in exts)} files): {calls} cursors just after a call's `(` "
          f"(`call`), {blocks} after a block or literal opened at a line's end (`block`: `{{`, `[`, `(`, closed on "
          "a later line at its indentation), the closers of the line's open brackets after the cursor. `balanced` "
          "is the daemon as shipped, `ends with` the rule before. Brackets counted on what accepting the "
          "completion leaves (a call: the cursor's line, texts of several lines not counted; a block: from its "
          "line through the editor's closers) against the truth's; a call's line is `equal` when the file's "
          "line starts with it and it reaches the truth's end, a block's when its last line equals the closing "
          "line.", ""]
    for kind, keys in (("call", ["shown", "several lines", "line equal to the truth", "a bracket left open",
                                 "a bracket closed twice", "item replaces the closers"]),
                       ("block", ["shown", "line equal to the truth", "a bracket left open", "a bracket closed twice",
                                  "item replaces the closers"])):
        name = "last line equal to the closing line" if kind == "block" else None
        md += [f"### {kind}", "", "| | " + " | ".join(ARMS) + " |", "|---|" + "---|" * len(ARMS)]
        md += [f"| {name if k == 'line equal to the truth' and name else k} | "
               + " | ".join(str(summary[kind][a][k]) for a in ARMS) + " |" for k in keys]
        reasons = [", ".join(f"{r} {n}" for r, n in summary[kind][a]["stop_reasons"].items()) for a in ARMS]
        md += ["| stop reasons | " + " | ".join(reasons) + " |", ""]
    changed = [(x, y) for x, y in zip(rows[ARMS[0]], rows[ARMS[1]]) if x["accepted"] != y["accepted"]]
    md += [f"Accepted code that differs: {len(changed)} of {len(work)} (last lines, `balanced` / `ends with` / "
           "truth):", ""]
    for x, y in changed[:20]:
        last = [r.split("\n")[-1].strip()[-60:] for r in (x["accepted"], y["accepted"], x["truth"])]
        md += [f"- {x['kind']} `{x['repo']}/{x['path']}:{x['line'] + 1}`: `{last[0]}` / `{last[1]}` / `{last[2]}`"]
    md += [""]
    write_results(args.out, md, {"summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
