"""Loops and cut lines in multi-line completions: what the stop rules that end them change.

    python bench/repetition.py REPO_GIT_DIR [REPO_GIT_DIR ...] [--functions 20] [--model default]

Each repository's HEAD (extracted under bench/.work/, not committed) gives held-out functions
(the sample bench/speculation.py draws). Two cursors per function, as a developer writing it
would ask: at the start of its body's first line and of its middle line, the indentation
typed, the rest of the body not yet there (the prefix is the file up to the cursor, the
suffix the file after the function). The daemon's default request (auto mode, which is
multi-line on these lines; 64 tokens, 12 lines).

Two engines with the same settings answer every request, one after the other:
- ``rules on`` (as shipped): a completion that ends in a loop (a line three times, a block of
  2-4 lines twice, six nearly equal lines) stops there and keeps the first copy (stop reason
  ``repetition``); one the token or time budget cut drops its partial last line;
- ``rules off``: those two rules disabled (the code before them).

The loop rule's false positives: over every .py file of the same checkouts, at every line
position, whether the 12 lines of real code ending there would count as a loop (a completion
that wrote exactly the truth would be cut there).

Reports per arm: stop reasons, tokens generated and decode time, completions that show a
loop, lines shown and how many of them are the truth's line at the same place, partial lines
shown, acceptance (the truth starts with the completion) and characters it saves.
Writes ``bench/results/repetition.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402
from speculation import checkout, held_out  # noqa: E402

from codecomplete.daemon.replay import lines_right  # noqa: E402
from codecomplete.model import stops  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings  # noqa: E402
from codecomplete.model.engine import Engine  # noqa: E402

ARMS = ("rules on", "rules off")


def cursors(git_dirs: list[Path], functions: int) -> list[dict]:
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
                out.append({"repo": name, "path": f["path"], "line": k,
                            "prefix": text[:f["start"]] + "".join(x + "\n" for x in lines[:k]) + indent,
                            "suffix": "\n" + text[f["end"]:], "indent": indent,
                            "truth": "\n".join([cur[len(indent):], *lines[k + 1:]])})
    return out


def real_code(git_dirs: list[Path], window: int = 12) -> dict:
    """At how many line positions of the repositories' own code the loop rule fires: the
    ``window`` lines ending at a non-blank line taken as a completion's whole lines."""
    positions, fired, examples = 0, 0, []
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
                    examples.append({"repo": name, "path": path.relative_to(root).as_posix(), "line": j,
                                     "lines": win[keep - 1:]})
    return {"positions": positions, "fired": fired, "examples": examples}


class _RulesOff:
    """The stop rules as they were before the loop and cut-line rules."""

    def __enter__(self):
        self.cut, self.finish = stops.repetition_cut, stops.StopRules.finish
        stops.repetition_cut = lambda *a, **k: None
        finish = self.finish
        stops.StopRules.finish = lambda rules, text, budget_cut=False: finish(rules, text)

    def __exit__(self, *exc):
        stops.repetition_cut, stops.StopRules.finish = self.cut, self.finish


def shows_loop(text: str, indent: str) -> bool:
    lines = text.split("\n")
    return any(stops.repetition_cut(lines[:k], indent) is not None for k in range(2, len(lines) + 1))


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
            "lines": lines, "lines_right": right, "loop": shows_loop(text, cur["indent"]),
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
            "loops_shown": sum(r["loop"] for r in rows), "partial_lines_shown": sum(r["partial_line"] for r in rows),
            "lines_shown": lines, "lines_right": sum(r["lines_right"] for r in rows),
            "lines_wrong": lines - sum(r["lines_right"] for r in rows),
            "accepted": sum(r["accepted"] for r in rows), "chars_saved": sum(r["chars_saved"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repos", nargs="+", type=Path, help="git directories (as fetch brings them)")
    ap.add_argument("--functions", type=int, default=20, help="held-out functions per repository")
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    work = cursors(args.repos, args.functions)
    fp = real_code(args.repos)
    engines = {}
    for arm in ARMS:  # one after the other: transformers' loading is not thread-safe
        engines[arm] = e = Engine(EngineSettings(model=args.model)).start()
        e.ready.wait()
        if e.load_error:
            sys.exit(e.load_error)
    rows = {arm: [] for arm in ARMS}
    for i, cur in enumerate(work):
        order = ARMS if i % 2 == 0 else ARMS[::-1]  # neither arm always runs first
        for arm in order:
            req = CompletionRequest(prefix=cur["prefix"], suffix=cur["suffix"],
                                    session_key=f"{cur['repo']}:{cur['path']}")
            if arm == "rules off":
                with _RulesOff():
                    c = engines[arm].complete(req)
            else:
                c = engines[arm].complete(req)
            rows[arm].append({"repo": cur["repo"], "path": cur["path"], "line": cur["line"],
                              **measure(c, cur, engines[arm].lm.tokenizer)})
        print(i, cur["repo"], cur["path"], [rows[a][-1]["reason"] for a in ARMS], flush=True)
    for e in engines.values():
        e.close()
    summary = {arm: summarize(rows[arm]) for arm in ARMS}
    changed = sum(a["text"] != b["text"] for a, b in zip(rows["rules on"], rows["rules off"]))
    prefix_of_off = sum(b["text"].startswith(a["text"]) for a, b in zip(rows["rules on"], rows["rules off"]))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "repetition.json").write_text(json.dumps({"summary": summary, "changed": changed,
                                                         "on_is_prefix_of_off": prefix_of_off,
                                                         "real_code": fp, "rows": rows}, indent=1))
    repos = ", ".join(sorted({c["repo"] for c in work}))
    keys = [("stop reasons", lambda s: ", ".join(f"{k} {v}" for k, v in s["stop_reasons"].items())),
            ("completions showing a loop", lambda s: s["loops_shown"]),
            ("completions ending in a cut partial line", lambda s: s["partial_lines_shown"]),
            ("lines shown", lambda s: s["lines_shown"]),
            ("  the truth's line at that place", lambda s: s["lines_right"]),
            ("  other lines", lambda s: s["lines_wrong"]),
            ("accepted (the truth starts with it)", lambda s: s["accepted"]),
            ("characters saved by accepted ones", lambda s: s["chars_saved"]),
            ("tokens generated, mean (total)", lambda s: f"{s['tokens_mean']} ({s['tokens_total']})"),
            ("decode ms, mean / p90", lambda s: f"{s['decode_ms_mean']} / {s['decode_ms_p90']}")]
    md = [header("Loops and cut lines in multi-line completions"), "",
          f"Model `{args.model}`, daemon defaults (auto mode, 64 tokens, 12 lines), no repository index. "
          f"{len(work)} cursors in held-out functions of {repos} (two per function: the body's first line "
          "and its middle line, indentation typed). Two engines answer each request: `rules on` is the daemon "
          "as shipped; `rules off` disables the loop rule and the cut-line rule.", "",
          "| | " + " | ".join(ARMS) + " |", "|---|---|---|"]
    md += [f"| {label} | " + " | ".join(str(f(summary[a])) for a in ARMS) + " |" for label, f in keys]
    md += ["", f"Texts that differ: {changed} of {len(work)}; every `rules on` text is a prefix of the "
           f"`rules off` one: {prefix_of_off} of {len(work)} (the rules only cut).", "",
           "A line counts as the truth's when it equals (stripped) the held-out body's line at the same "
           "place; a cut partial line is a last line after which the model's own tokens have no line break "
           "(the budget cut it). "
           "Decode time is each engine's own; both engines keep their own KV store and verified cache.", "",
           f"**The loop rule on real code** (false positives): of {fp['positions']} non-blank line positions "
           f"in these repositories' .py files, the 12 lines ending there count as a loop at {fp['fired']} "
           f"({100 * fp['fired'] / max(1, fp['positions']):.3f} %). A completion writing exactly that code "
           "would stop there, keeping the first copy. Examples (last lines of each; all in "
           "`repetition.json`):", ""]
    for e in fp["examples"][:6]:
        md += [f"- `{e['repo']}/{e['path']}:{e['line']}`: " + " / ".join(f"`{x.strip()}`" for x in e["lines"][-3:])]
    md += [""]
    (RESULTS / "repetition.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
