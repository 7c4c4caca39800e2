"""Loops and cut lines in completions: what the stop rules that end them change.

    python bench/repetition.py REPO_GIT_DIR [REPO_GIT_DIR ...] [--functions 20] [--model default]

Each repository's HEAD (extracted under bench/.work/, not committed) gives held-out functions
(the sample bench/speculation.py draws). Per function, as a developer writing it would ask, the
rest of the body not yet there (the prefix is the file up to the cursor, the suffix the file
after the function):
- two block cursors: at the start of its body's first line and of its middle line, the
  indentation typed (auto mode makes these multi-line);
- with ``--mid-line`` (on by default), two mid-line cursors: in the first two body lines with
  ``=`` or ``return``, just after ``= `` or ``return `` (single-line; the truth is the rest of
  that line).
The daemon's default request (auto mode; 64 tokens, 12 lines).

Three engines with the same settings answer every request, one after the other:
- ``rules on`` (as shipped): a completion that ends in a loop (a line three times, a block of
  2-4 lines twice, six nearly equal lines) stops there and keeps the first copy (stop reason
  ``repetition``); so does a line that runs away inside itself (a unit of 3-9 characters six
  times back to back, of 10 or more three times: ``stops.line_loop``); one the token or time
  budget cut drops its partial last line;
- ``no near-block rule``: the loop rule without its near-equal blocks (a block of 2-4 lines
  three times, each line within 10 % edits of its line a block before; the code before it);
- ``no line-loop rule``: that, and the rule for loops inside a line disabled (the code before it);
- ``rules off``: all the rules disabled (the code before them).
``--arms`` runs some of them (``rules on`` first).

The loop rules' false positives: over every .py file of the same checkouts, at every line
position, whether the 12 lines of real code ending there would count as a loop, and whether a
line of real code, typed to any of its characters, would count as a line loop (a completion
that wrote exactly the truth would be cut there).

Reports per arm: stop reasons, tokens generated and decode time, completions that show a
loop, lines shown and how many of them are the truth's line at the same place, partial lines
shown, acceptance (the truth starts with the completion) and characters it saves.
Writes ``bench/results/repetition.{md,json}``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LINES_ROWS, RESULTS, STOP_REASONS_ROW, arm_table, header, write_results  # noqa: E402
from speculation import checkout, held_out  # noqa: E402

from codecomplete.daemon.replay import lines_right  # noqa: E402
from codecomplete.model import stops  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings  # noqa: E402
from codecomplete.model.engine import Engine  # noqa: E402

ARMS = ("rules on", "no near-block rule", "no line-loop rule", "rules off")


_MID = re.compile(r"^\s*(?:return |[\w.\[\]'\"]+(?:: [\w\[\]., ]+)? = )")  # `return ` or `name = `


def cursors(git_dirs: list[Path], functions: int, mid_line: bool = True) -> list[dict]:
    out = []
    for git_dir in git_dirs:
        name, root = checkout(git_dir)
        files, funcs, _ = held_out(root, functions, 0)
        for f in funcs:
            text = files[f["path"]]
            lines = text[f["start"]:f["end"]].split("\n")
            for k in sorted({0, len(lines) // 2}):
                cur = lines[k]
                indent = cur[: len(cur) - len(cur.lstrip())]
                out.append({"repo": name, "path": f["path"], "line": k, "kind": "block",
                            "prefix": text[:f["start"]] + "".join(x + "\n" for x in lines[:k]) + indent,
                            "suffix": "\n" + text[f["end"]:], "indent": indent,
                            "truth": "\n".join([cur[len(indent):], *lines[k + 1:]])})
            if not mid_line:
                continue
            mids = [(k, m.end()) for k, line in enumerate(lines)
                    if (m := _MID.match(line)) and line[m.end():].strip()][:2]
            for k, at in mids:
                cur = lines[k]
                out.append({"repo": name, "path": f["path"], "line": k, "kind": "mid-line",
                            "prefix": text[:f["start"]] + "".join(x + "\n" for x in lines[:k]) + cur[:at],
                            "suffix": "\n" + text[f["end"]:], "indent": cur[: len(cur) - len(cur.lstrip())],
                            "line_prefix": cur[:at], "truth": cur[at:]})
    return out


def real_code(git_dirs: list[Path], window: int = 12) -> dict:
    """At how many line positions of the repositories' own code the loop rule fires: the
    ``window`` lines ending at a non-blank line taken as a completion's whole lines."""
    positions, fired, examples, near = 0, 0, [], []
    for git_dir in git_dirs:
        name, root = checkout(git_dir)
        for path in sorted(root.rglob("*.py")):
            lines = path.read_text(errors="replace").split("\n")
            for j in range(1, len(lines) + 1):
                if not lines[j - 1].strip():
                    continue
                positions += 1
                win = lines[max(0, j - window):j]
                keep = stops.repetition_cut(win)
                if keep is not None:
                    fired += 1
                    at = {"repo": name, "path": path.relative_to(root).as_posix(), "line": j, "lines": win[keep - 1:]}
                    examples.append(at)
                    with _Rules("no near-block rule"):
                        if stops.repetition_cut(win) is None:
                            near.append(at)
    return {"positions": positions, "fired": fired, "examples": examples, "near_block": near}


def real_lines(git_dirs: list[Path]) -> dict:
    """How many lines of the repositories' own code the line-loop rule would cut: a line counts
    when, typed (as a completion would write it) to any of its characters, it ends in a loop."""
    lines, fired, examples = 0, 0, []
    maybe = re.compile(r"(.{3,%d}?)\1{2,}" % stops.LINE_LOOP_UNIT)  # any repeat at all: the few lines worth a look
    for git_dir in git_dirs:
        name, root = checkout(git_dir)
        for path in sorted(root.rglob("*.py")):
            for j, line in enumerate(path.read_text(errors="replace").split("\n"), 1):
                if not line.strip():
                    continue
                lines += 1
                if maybe.search(line) and any(stops.line_loop(line[:e]) for e in range(3, len(line) + 1)):
                    fired += 1
                    examples.append({"repo": name, "path": path.relative_to(root).as_posix(), "line": j,
                                     "text": line.strip()})
    return {"lines": lines, "fired": fired, "examples": examples}


class _Rules:
    """The stop rules as they were before the line-loop rule (``line``) and before the loop and
    cut-line rules (``all``)."""

    def __init__(self, arm: str):
        self.arm = arm

    def __enter__(self):
        self.cut, self.finish, self.line = stops.repetition_cut, stops.StopRules.finish, stops.StopRules._line_loop
        self.near = stops.NEAR_BLOCK_COPIES
        if self.arm == "rules on":
            return
        stops.NEAR_BLOCK_COPIES = 0
        if self.arm == "no near-block rule":
            return
        stops.StopRules._line_loop = lambda rules, text: None
        if self.arm == "rules off":
            stops.repetition_cut = lambda *a, **k: None
            finish = self.finish
            stops.StopRules.finish = lambda rules, text, budget_cut=False: finish(rules, text)

    def __exit__(self, *exc):
        stops.repetition_cut, stops.StopRules.finish, stops.StopRules._line_loop = self.cut, self.finish, self.line
        stops.NEAR_BLOCK_COPIES = self.near


def shows_loop(text: str, line_prefix: str) -> bool:
    lines = text.split("\n")
    return any(stops.repetition_cut(lines[:k], line_prefix) is not None for k in range(2, len(lines) + 1))


def shows_line_loop(text: str, line_prefix: str) -> bool:
    """A shown line (typed to any character) ends in a loop inside it, written by the model."""
    lines = text.split("\n")
    for k, line in enumerate(lines):
        typed = line_prefix if k == 0 else ""
        full = typed + line
        if any(stops.line_loop(full[:e], len(typed)) for e in range(len(typed) + 3, len(full) + 1)):
            return True
    return False


def measure(c, cur: dict, tokenizer) -> dict:
    text = c.text.rstrip()
    shown = text.split("\n")
    lines, right = lines_right(text, cur["truth"])
    accepted = bool(text.strip()) and cur["truth"].startswith(text)
    # a line the budget cut: in the tokens the model generated, no line break follows the text shown
    raw = tokenizer.decode(c.token_ids, skip_special_tokens=True)
    after = raw[raw.rfind(text) + len(text):].lstrip(" \t") if text else ""
    partial = c.stop_reason in ("max_tokens", "time_budget") and len(shown) > 1 and not after.startswith("\n")
    return {"reason": c.stop_reason, "tokens": c.generated_tokens, "decode_ms": c.timings.get("decode_ms", 0.0),
            "lines": lines, "lines_right": right, "loop": shows_loop(text, cur.get("line_prefix", cur["indent"])),
            "line_loop": shows_line_loop(text, cur.get("line_prefix", cur["indent"])),
            "partial_line": partial, "accepted": accepted, "chars_saved": len(text) if accepted else 0,
            "multiline": c.multiline, "text": text}


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    lines = sum(r["lines"] for r in rows)
    return {"requests": n, "stop_reasons": dict(Counter(r["reason"] for r in rows).most_common()),
            "tokens_mean": round(statistics.mean(r["tokens"] for r in rows), 1),
            "tokens_total": sum(r["tokens"] for r in rows),
            "decode_ms_mean": round(statistics.mean(r["decode_ms"] for r in rows), 1),
            "decode_ms_p90": round(statistics.quantiles([r["decode_ms"] for r in rows], n=10)[-1], 1),
            "loops_shown": sum(r["loop"] for r in rows), "line_loops_shown": sum(r["line_loop"] for r in rows),
            "partial_lines_shown": sum(r["partial_line"] for r in rows),
            "lines_shown": lines, "lines_right": sum(r["lines_right"] for r in rows),
            "lines_wrong": lines - sum(r["lines_right"] for r in rows),
            "accepted": sum(r["accepted"] for r in rows), "chars_saved": sum(r["chars_saved"] for r in rows)}


def table(summary: dict, arms=ARMS) -> list[str]:
    keys = [STOP_REASONS_ROW,
            ("completions showing a loop of lines", lambda s: s["loops_shown"]),
            ("completions showing a loop inside a line", lambda s: s["line_loops_shown"]),
            ("completions ending in a cut partial line", lambda s: s["partial_lines_shown"]),
            *LINES_ROWS,
            ("tokens generated, mean (total)", lambda s: f"{s['tokens_mean']} ({s['tokens_total']})"),
            ("decode ms, mean / p90", lambda s: f"{s['decode_ms_mean']} / {s['decode_ms_p90']}")]
    return arm_table(keys, summary, arms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repos", nargs="+", type=Path, help="git directories (as fetch brings them)")
    ap.add_argument("--functions", type=int, default=20, help="held-out functions per repository")
    ap.add_argument("--model", default="default")
    ap.add_argument("--no-mid-line", dest="mid_line", action="store_false", help="block cursors only")
    ap.add_argument("--out", default=str(RESULTS / "repetition"), help="results path without extension")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from: " + ", ".join(ARMS))
    args = ap.parse_args()
    arms = tuple(a for a in ARMS if a in args.arms.split(","))
    if not arms or arms[0] != "rules on" or len(arms) != len(args.arms.split(",")):
        sys.exit(f"--arms: 'rules on' and any of {ARMS[1:]}")
    work = cursors(args.repos, args.functions, args.mid_line)
    fp = real_code(args.repos)
    fp_lines = real_lines(args.repos)
    engines = {}
    for arm in arms:  # one after the other: transformers' loading is not thread-safe
        engines[arm] = e = Engine(EngineSettings(model=args.model)).start()
        e.ready.wait()
        if e.load_error:
            sys.exit(e.load_error)
    rows = {arm: [] for arm in arms}
    for i, cur in enumerate(work):
        order = arms[i % len(arms):] + arms[:i % len(arms)]  # no arm always runs first
        for arm in order:
            req = CompletionRequest(prefix=cur["prefix"], suffix=cur["suffix"],
                                    session_key=f"{cur['repo']}:{cur['path']}:{cur['kind']}")
            with _Rules(arm):
                c = engines[arm].complete(req)
            rows[arm].append({"repo": cur["repo"], "path": cur["path"], "line": cur["line"], "kind": cur["kind"],
                              **measure(c, cur, engines[arm].lm.tokenizer)})
        print(i, cur["repo"], cur["path"], cur["kind"], [rows[a][-1]["reason"] for a in arms], flush=True)
    for e in engines.values():
        e.close()
    kinds = sorted({c["kind"] for c in work})
    summary = {"all": {arm: summarize(rows[arm]) for arm in arms}}
    for kind in kinds:
        summary[kind] = {arm: summarize([r for r in rows[arm] if r["kind"] == kind]) for arm in arms}

    def pairs(a: str, b: str) -> dict:
        both = list(zip(rows[a], rows[b]))
        return {"changed": sum(x["text"] != y["text"] for x, y in both),
                "prefix": sum(y["text"].startswith(x["text"]) for x, y in both),
                "examples": [{"repo": x["repo"], "path": x["path"], "kind": x["kind"], a: x["text"], b: y["text"]}
                             for x, y in both if x["text"] != y["text"]]}
    compare = {arm: pairs("rules on", arm) for arm in arms[1:]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    repos = ", ".join(sorted({c["repo"] for c in work}))
    counts = Counter(c["kind"] for c in work)
    md = [header("Loops and cut lines in completions"), "",
          f"Model `{args.model}`, daemon defaults (auto mode, 64 tokens, 12 lines), no repository index. "
          f"{len(work)} cursors in held-out functions of {repos}: {counts['block']} block cursors (two per "
          "function: the body's first line and its middle line, indentation typed; multi-line) and "
          f"{counts.get('mid-line', 0)} mid-line cursors (just after `= ` or `return ` in the body's first two "
          f"such lines; single-line, the truth is the rest of the line). Engines ({', '.join(arms)}) answer each "
          "request: `rules on` is the daemon as shipped; `no near-block rule` leaves out the loop rule's near-equal "
          "blocks (the code before them); `no line-loop rule` also disables the rule for loops inside a line "
          "(the code before it); `rules off` disables those, the loop rule and the cut-line rule.", ""]
    for kind in ["all", *kinds]:
        md += [f"**{'All cursors' if kind == 'all' else kind.capitalize() + ' cursors'}** "
               f"({len(rows[arms[0]]) if kind == 'all' else counts[kind]}):", ""] + table(summary[kind], arms) + [""]
    for other, c in compare.items():
        md += [f"`rules on` against `{other}`: {c['changed']} of {len(work)} texts differ; every `rules on` text "
               f"is a prefix of the other: {c['prefix']} of {len(work)}."]
    md += ["", "A line counts as the truth's when it equals (stripped) the held-out body's line at the same "
           "place; a cut partial line is a last line after which the model's own tokens have no line break "
           "(the budget cut it). A loop inside a line: a shown line that, at some character, ends in a unit "
           "repeated as `stops.line_loop` counts it. "
           "Decode time is each engine's own; every engine keeps its own KV store and verified cache.", "",
           f"**The loop rule on real code** (false positives): of {fp['positions']} non-blank line positions "
           f"in these repositories' .py files, the 12 lines ending there count as a loop at {fp['fired']} "
           f"({100 * fp['fired'] / max(1, fp['positions']):.3f} %). A completion writing exactly that code "
           f"would stop there, keeping the first copy; {len(fp['near_block'])} of them only by the near-equal blocks. "
           "Examples (last lines of each; all in the json), the near-equal blocks' first:", ""]
    for e in (fp["near_block"] + [e for e in fp["examples"] if e not in fp["near_block"]])[:10]:
        md += [f"- `{e['repo']}/{e['path']}:{e['line']}`: " + " / ".join(f"`{x.strip()}`" for x in e["lines"][-3:])]
    md += ["", f"**The line-loop rule on real code**: of {fp_lines['lines']} non-blank lines, {fp_lines['fired']} "
           f"({100 * fp_lines['fired'] / max(1, fp_lines['lines']):.3f} %) end in a loop at some character. "
           "A completion writing exactly that line would stop after the loop's first copy:", ""]
    md += [f"- `{e['repo']}/{e['path']}:{e['line']}`: `{e['text'][:100]}`" for e in fp_lines["examples"][:8]]
    for other in ("no near-block rule", "no line-loop rule"):
        ex = compare[other]["examples"] if other in compare else []
        if ex:
            md += ["", f"Texts that differ (`rules on` / `{other}`, first 8):", ""]
            md += [f"- `{e['repo']}/{e['path']}` ({e['kind']}): `{e['rules on'][-80:]!r}` / "
                   f"`{e[other][-120:]!r}`" for e in ex[:8]]
    md += [""]
    write_results(args.out, md, {"summary": summary, "compare": compare, "real_code": fp,
                                 "real_lines": fp_lines, "rows": rows})


if __name__ == "__main__":
    main()
