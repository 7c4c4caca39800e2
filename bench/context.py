"""Repository snippets at the prompt's head: what they buy in the replay harness, what they cost.

    python bench/context.py REPO_GIT_DIR [REPO_GIT_DIR ...] [--max-requests 40]

For each repository (a clone or bare mirror; its code is never committed here) two sets of
typing sessions (``codecomplete-daemon sessions from-git``): the newest 4 commits (seed 1)
and the 4 before them (``--skip 4``, seed 2). Each set is replayed compressed (each request
awaited) through the daemon with the ``efim`` scheme and with ``efim-context``
(``completion.context_snippets`` = 4: definitions of names used at the cursor, then similar
chunks by BM25, rendered as comments at the prompt's head). Both send every request to the
model. Writes ``bench/results/context_snippets.{md,json}``: per repository and set, and
pooled, acceptance, exact match, edit similarity, characters saved and latency.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, run  # noqa: E402

SETS = (("newest", ["--seed", "1"]), ("older", ["--seed", "2", "--skip", "4"]))


def session_sets(repos: list[Path], work: Path, commands: list[str]):
    """Per repository and set of SETS: (repository name, set label, its sessions file), made
    with ``sessions from-git`` under ``work`` (each command line appended to ``commands``)."""
    exe = [sys.executable, "-m", "codecomplete.daemon"]
    for repo in repos:
        name = repo.resolve().parent.name if repo.name in ("repo", ".git") else repo.name
        for label, how in SETS:
            sessions = work / f"{name}-{label}.sessions.jsonl"
            commands.append(run(exe + ["sessions", "from-git", str(repo), "--commits", "4", *how,
                                       "--out", str(sessions)]))
            yield name, label, sessions


def pooled(runs: list[dict]) -> dict:
    """Scores over every request of ``runs`` (one scheme's runs): the harness's own summary of
    them taken as one run, and the requests whose prompt opened with snippets."""
    from codecomplete.daemon.replay import summarize

    s = summarize({"scheme": runs[0]["scheme"], "wall_seconds": None,
                   "requests": [r for run in runs for r in run["requests"]]})
    return {"requests": s["requests"], "answered": s["status"]["answered"], "acceptance": s["acceptance"],
            "exact_match": s["exact_match"], "edit_similarity": s["edit_similarity"],
            "chars_saved": s["chars_saved"], "chars_typed": s["chars_typed_after_requests"],
            "latency_ms": s["latency_ms"],
            "with_context": sum((run.get("daemon") or {}).get("counters", {}).get("with_context") or 0 for run in runs)}


def row(label: str, scheme: str, s: dict) -> str:
    lat = s["latency_ms"]
    return (f"| {label} | {scheme} | {s['requests']} | {s['with_context']} | {s['acceptance']:.3f} | "
            f"{s['exact_match']:.3f} | {s['edit_similarity']:.4f} | {s['chars_saved']} of {s['chars_typed']} | "
            f"{lat['p50']} / {lat['p90']} / {lat['p99']} | {lat['mean']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repos", nargs="+", type=Path)
    ap.add_argument("--max-requests", type=int, default=40, help="per session")
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    exe = [sys.executable, "-m", "codecomplete.daemon"]
    work = Path(tempfile.mkdtemp(prefix="cc-bench-context-"))
    commands, results = [], []
    for name, label, sessions in session_sets(args.repos, work, commands):
        out = work / f"{name}-{label}"
        commands.append(run(exe + ["replay", str(sessions), "--scheme", "efim,efim-context", "--model",
                                   args.model, "--speed", "0", "--max-requests", str(args.max_requests),
                                   "--out", str(out)]))
        report = json.loads((out / "report.json").read_text())
        results.append({"repo": name, "set": label, "runs": {r["scheme"]: r for r in report["runs"]}})
    schemes = ("efim", "efim-context")
    table = {"per_set": [{"repo": x["repo"], "set": x["set"], **{s: pooled([x["runs"][s]]) for s in schemes}}
                         for x in results],
             "by_set": {label: {s: pooled([x["runs"][s] for x in results if x["set"] == label]) for s in schemes}
                        for label, _ in SETS},
             "all": {s: pooled([x["runs"][s] for x in results]) for s in schemes}}
    cols = ("| repository | scheme | requests | with snippets | acceptance | exact | edit sim. | chars saved | "
            "latency p50 / p90 / p99 ms | mean ms |")
    lines = [header("Repository snippets in the prompt (replay harness)"), "",
             f"Model `{args.model}`; `efim` (no snippets, the default) against `efim-context` "
             "(`completion.context_snippets = 4`, 256 tokens at most). Sessions: `sessions from-git`, "
             "the newest 4 commits (seed 1) and the 4 before them (`--skip 4`, seed 2); replayed compressed, each "
             f"request awaited, at most {args.max_requests} requests per session. Both schemes send every request "
             "to the model (no typing through, no cache). `with snippets`: requests whose prompt opened with "
             "snippets.", "", "Commands:", ""] + [f"    {c}" for c in commands] + ["", "## Pooled", "", cols,
                                                                                   "|---|---|---|---|---|---|---|---|---|---|"]
    for s in schemes:
        lines.append(row("all", s, table["all"][s]))
    for label, _ in SETS:
        for s in schemes:
            lines.append(row(f"{label} commits", s, table["by_set"][label][s]))
    lines += ["", "## Per repository and set", "", cols, "|---|---|---|---|---|---|---|---|---|---|"]
    for x in table["per_set"]:
        for s in schemes:
            lines.append(row(f"{x['repo']} ({x['set']})", s, x[s]))
    (RESULTS / "context_snippets.json").write_text(json.dumps({"commands": commands, **table}, indent=1))
    (RESULTS / "context_snippets.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
