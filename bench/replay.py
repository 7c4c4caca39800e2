"""Replay sessions made from real repositories' git history through the real daemon.

    python bench/replay.py REPO_GIT_DIR [REPO_GIT_DIR ...] [--commits 4] [--max-requests 8] [--out DIR]

For each repository (a clone or bare mirror; its code is never committed here):
``codecomplete-daemon sessions from-git`` makes one typing session per recent commit,
then ``codecomplete-daemon replay`` plays them through the daemon for each scheme,
compressed (each request awaited), and once more in real time (speed 2, two users) for
the first repository to show requests dropped while the user types on.  The per-run
reports stay under ``bench/results/replay/`` (``--out``); ``bench/results/replay.md`` (``--out`` + .md)
gathers them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, run  # noqa: E402

from codecomplete.daemon.sessions import TYPING, read_sessions, rest_of_line_at_requests  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repos", nargs="+", type=Path)
    ap.add_argument("--commits", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=8)
    ap.add_argument("--schemes", default="baseline,efim,efim-nospec,efim-through")
    ap.add_argument("--model", default="default")
    ap.add_argument("--typing", default=TYPING[0], choices=TYPING,
                    help="how sessions from-git types new lines (docs/sessions.md)")
    ap.add_argument("--out", default=str(RESULTS / "replay"), help="the results: OUT.md, and the reports under OUT/")
    args = ap.parse_args()
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "codecomplete.daemon"]
    sections, commands, after = [], [], {}
    for i, repo in enumerate(args.repos):
        name = repo.resolve().parent.name if repo.name in ("repo", ".git") else repo.name
        sessions = out_root / f"{name}.sessions.jsonl"
        commands.append(run(exe + ["sessions", "from-git", str(repo), "--commits", str(args.commits),
                                   "--out", str(sessions), "--seed", "1", "--typing", args.typing]))
        rests = [r for s in read_sessions(sessions) for r in rest_of_line_at_requests(s)[:args.max_requests]]
        after[name] = (sum(bool(r.strip()) for r in rests), len(rests))
        runs = [("compressed, 1 user", ["--speed", "0", "--max-requests", str(args.max_requests)], name)]
        if i == 0:
            runs.append(("real time, 2 users", ["--speed", "1", "--users", "2", "--max-sessions", "2"],
                         f"{name}-realtime"))
        for label, extra, folder in runs:
            out = out_root / folder
            commands.append(run(exe + ["replay", str(sessions), "--scheme", args.schemes, "--model", args.model,
                                       *extra, "--out", str(out)]))
            report = json.loads((out / "report.json").read_text())
            sections.append((name, label, folder, report["summary"]))
            # Per-request records and daemon logs quote the repository's code: keep the numbers only.
            (out / "report.json").write_text(json.dumps({"meta": report["meta"], "summary": report["summary"]}, indent=1))
            shutil.rmtree(out / "logs", ignore_errors=True)
        sessions.unlink()  # derived from the repository's code: not committed
    lines = [header("Replay of editing sessions from git history"),
             "Sessions: `sessions from-git` on recent commits (synthetic, human-like typing with typos; "
             f"docs/sessions.md). Model: `{args.model}`. `baseline` has no KV reuse; `efim` reuses KV with EFIM "
             "prompts; both use retrieval speculation (the daemon's default), `efim-nospec` is `efim` without it; "
             "these send every request to the model. `efim-through` is the daemon as shipped: `efim`, and a "
             "request made while the user types the start of the last completion is answered with its rest "
             "without the model (typed through), and a request for text an earlier request saw gets that "
             "request's completion (cached). "
             "Acceptance = the completion is a prefix of what was typed next. Decode ms/token and tokens/pass are "
             "the daemon's own counters over the run.",
             "", "Commands:", ""] + [f"    {c}" for c in commands] + [""]
    lines += [f"Typing `{args.typing}`: requests of the compressed runs with code after the cursor on its line: "
              + ", ".join(f"{name} {k} of {n}" for name, (k, n) in after.items()) + ".", ""]
    lines += ["| repository | run | scheme | requests | answered / stale / superseded / empty | latency p50 / p90 / p99 ms "
              "| acceptance | exact | edit sim. | chars saved | reuse | decode ms/token | tokens/pass "
              "| typed through | cached |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, label, folder, summary in sections:
        for s in summary:
            st, lat = s["status"], s["latency_ms"]
            es = s["edit_similarity"]
            lines.append(f"| {name} | {label} | {s['scheme']} | {s['requests']} | {st['answered']} / {st['stale']} / "
                         f"{st['superseded']} / {st['empty']} | {lat['p50']} / {lat['p90']} / {lat['p99']} | "
                         f"{s['acceptance']:.3f} | {s['exact_match']:.3f} | {es if es is not None else '-'} | "
                         f"{s['chars_saved']} of {s['chars_typed_after_requests']} | {s['reuse_rate']} | "
                         f"{s.get('decode_ms_per_token')} | {s.get('tokens_per_pass')} | {s.get('typed_through', 0)} | "
                         f"{s.get('cached', 0)} |")
    lines += ["", "Per-run reports (JSON, Markdown, latency CDF and reuse-per-round plots): "
              + ", ".join(f"[`{out_root.name}/{f}/`]({out_root.name}/{f}/report.md)" for _, _, f, _ in sections)]
    out_root.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
