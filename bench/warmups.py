"""Warm-ups (completion.warm_ms): editing sessions replayed in real time with and without them.

A request at a place the daemon has not prefilled yet (a file just opened, a jump to another
hunk) pays a cold prefill: about a second for a 1k-token prompt on two CPU cores, while the
user types on, so it is often dropped as stale.  With warm-ups the daemon prefills the prompt
at the user's first edit there, before the request.  This benchmark replays the same
sessions through the real daemon (``codecomplete-daemon replay``, the ``efim-through``
scheme as shipped, one user, recorded timing: ``--speed 1``) once with warm-ups off
(``completion.warm_ms=0``) and once on (the default), in that order per session file, and
reports per setting:

- requests answered and stale (dropped because the user typed on before the answer);
- latency p50 / p90 / max of the answered requests, and of every request (a stale one's
  latency is how long it ran before it was dropped);
- the KV reuse rate, and requests with less than half of their prompt reused ("cold");
- whether the completions are the same: a warm-up plans the prompt a request would get and
  leaves the EFIM sessions alone, so a request answered in both runs should get the same text.

    python bench/warmups.py --repos GIT1,GIT2 [--commits 4] [--model default] [--out bench/results/warmups]

(each a git directory, as ``fetch`` brings; sessions come from its history: ``sessions from-git``)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, replay_settings, write_results  # noqa: E402

from codecomplete.daemon.replay import pct  # noqa: E402

WORK = Path(__file__).resolve().parent / ".work" / "warmups"
DEFAULT_MS = 50  # completion.warm_ms as shipped


def is_cold(r: dict) -> bool:
    """A request that reused less than half of its prompt from the KV store."""
    return bool(r["prompt_tokens"]) and (r["reused_tokens"] or 0) < r["prompt_tokens"] / 2


def summary(report: dict) -> dict:
    s = report["summary"][0]
    reqs = report["runs"][0]["requests"]
    answered = [r["latency_ms"] for r in reqs if r["status"] == "answered"]
    every = [r["latency_ms"] for r in reqs if r["latency_ms"] is not None]
    cold = sum(map(is_cold, reqs))
    return {"requests": len(reqs), "answered": s["status"]["answered"], "stale": s["status"]["stale"],
            "superseded": s["status"]["superseded"], "answered_p50": pct(answered, 0.5),
            "answered_p90": pct(answered, 0.9), "answered_max": round(max(answered), 1) if answered else None,
            "all_p50": pct(every, 0.5), "all_p90": pct(every, 0.9), "all_max": round(max(every), 1) if every else None,
            "reuse": s["reuse_rate"], "cold": cold, "edit_similarity": s["edit_similarity"],
            "exact_match": s["exact_match"], "chars_saved": s["chars_saved"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repos", required=True, help="comma-separated git directories")
    ap.add_argument("--commits", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=str(RESULTS / "warmups"))
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    results = {}
    for git in args.repos.split(","):
        name, runs = replay_settings(git, WORK, "completion.warm_ms", (0, DEFAULT_MS), args.commits, args.seed,
                                     args.model)
        off, on = (runs[ms]["runs"][0]["requests"] for ms in (0, DEFAULT_MS))
        both = [(a, b) for a, b in zip(off, on) if a["status"] == b["status"] == "answered"]
        results[name] = {"off": summary(runs[0]), "on": summary(runs[DEFAULT_MS]),
                         "answered_in_both": len(both),
                         "same_completion": sum(a["completion"] == b["completion"] for a, b in both)}
        print(name, json.dumps(results[name]), file=sys.stderr)
    lines = [header("Warm-ups: editing sessions replayed in real time with and without them"), "",
             f"Sessions: `sessions from-git --commits {args.commits} --seed {args.seed}` of each repository "
             "(code not committed); replayed by `codecomplete-daemon replay --scheme efim-through --speed 1 "
             f"--users 1` with `completion.warm_ms` 0, then {DEFAULT_MS} (shipped); model `{args.model}`. "
             "Latency in ms; a stale request's latency is how long it ran before the user's typing dropped it.",
             "", "| repository | warm-ups | requests | answered / stale / superseded | answered p50 / p90 / max | "
             "every request p50 / p90 / max | reuse | cold (<50 % reused) | edit sim. | exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for key, label in (("off", "off"), ("on", f"{DEFAULT_MS} ms")):
            s = r[key]
            lines.append(f"| {name} | {label} | {s['requests']} | {s['answered']} / {s['stale']} / {s['superseded']} | "
                         f"{s['answered_p50']} / {s['answered_p90']} / {s['answered_max']} | "
                         f"{s['all_p50']} / {s['all_p90']} / {s['all_max']} | {s['reuse']} | {s['cold']} | "
                         f"{s['edit_similarity']} | {s['exact_match']} |")
    lines += ["", "Requests answered in both runs with the same completion: " + "; ".join(
        f"{name} {r['same_completion']} of {r['answered_in_both']}" for name, r in results.items()) + "."]
    write_results(args.out, lines, results)


if __name__ == "__main__":
    main()
