"""The prefix window (``completion.max_prefix_tokens``): what more of the file before the
cursor buys in the replay harness, and what it costs.

    python bench/prefix_window.py REPO_GIT_DIR [REPO_GIT_DIR ...] [--windows 512,1024,2048] [--max-requests 40]

The sessions of ``bench/context.py`` (per repository: the newest 4 commits, seed 1, and the
4 before them, seed 2), replayed compressed with the ``efim`` scheme once per window
(``--set completion.max_prefix_tokens=N``). Every request reaches the model. Writes
``bench/results/prefix_window.{md,json}``: pooled and per set, acceptance, exact match,
edit similarity, characters saved and latency.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, run  # noqa: E402
from context import SETS, pooled, row, session_sets  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repos", nargs="+", type=Path)
    ap.add_argument("--windows", default="512,1024,2048", help="max_prefix_tokens values")
    ap.add_argument("--max-requests", type=int, default=40, help="per session")
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    exe = [sys.executable, "-m", "codecomplete.daemon"]
    work = Path(tempfile.mkdtemp(prefix="cc-bench-window-"))
    commands, results = [], []
    for name, label, sessions in session_sets(args.repos, work, commands):
        runs = {}
        for w in windows:  # settings interleaved per set: the machine's speed drifts
            out = work / f"{name}-{label}-{w}"
            commands.append(run(exe + ["replay", str(sessions), "--scheme", "efim", "--model", args.model,
                                       "--speed", "0", "--max-requests", str(args.max_requests),
                                       "--set", f"completion.max_prefix_tokens={w}", "--out", str(out)]))
            runs[w] = json.loads((out / "report.json").read_text())["runs"][0]
        results.append({"repo": name, "set": label, "runs": runs})
    table = {"per_set": [{"repo": x["repo"], "set": x["set"], **{str(w): pooled([x["runs"][w]]) for w in windows}}
                         for x in results],
             "by_set": {label: {str(w): pooled([x["runs"][w] for x in results if x["set"] == label])
                                for w in windows} for label, _ in SETS},
             "all": {str(w): pooled([x["runs"][w] for x in results]) for w in windows}}
    cols = ("| sessions | max_prefix_tokens | requests | with snippets | acceptance | exact | edit sim. | "
            "chars saved | latency p50 / p90 / p99 ms | mean ms |")
    lines = [header("Prefix window (replay harness)"), "",
             f"Model `{args.model}`, scheme `efim` (every request reaches the model), `completion.max_prefix_tokens` "
             f"{', '.join(map(str, windows))} (the suffix window stays 256 tokens). Sessions as in "
             f"`bench/context.py`: the newest 4 commits (seed 1) and the 4 before them (`--skip 4`, seed 2), at most "
             f"{args.max_requests} requests per session, replayed compressed (each request awaited).", "",
             "Commands:", ""] + [f"    {c}" for c in commands] + ["", "## Pooled", "", cols,
                                                                  "|---|---|---|---|---|---|---|---|---|---|"]
    for w in windows:
        lines.append(row("all", str(w), table["all"][str(w)]))
    for label, _ in SETS:
        for w in windows:
            lines.append(row(f"{label} commits", str(w), table["by_set"][label][str(w)]))
    lines += ["", "## Per repository and set", "", cols, "|---|---|---|---|---|---|---|---|---|---|"]
    for x in table["per_set"]:
        for w in windows:
            lines.append(row(f"{x['repo']} ({x['set']})", str(w), x[str(w)]))
    (RESULTS / "prefix_window.json").write_text(json.dumps({"commands": commands, **table}, indent=1))
    (RESULTS / "prefix_window.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
