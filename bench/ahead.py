"""The warm-up ahead of a window move (engine.ahead_chars): editing sessions replayed in real
time with it off and on.

In a file longer than the prefix window (``completion.max_prefix_tokens``, 1024 tokens: about
3,000 characters before the cursor) the window's start moves on a 16-line grid as the user
types on, and every token of the prompt after it shifts: the request or EFIM rebase after the
move prefills the whole window cold (about 1.3-1.6 s on two AVX2 cores for the default
model).  With ``engine.ahead_chars`` the idle engine prefills the next window's opening
(``<P>`` + its lines up to the cursor's) when the move is that many characters away, so that
request prefills only the lines typed since.  This benchmark replays the same sessions through
the real daemon (``codecomplete-daemon replay``, the ``efim-through`` scheme as shipped, one
user, recorded timing: ``--speed 1``) with ``engine.ahead_chars=0`` and then the default, in
that order per session file, and reports per setting:

- requests answered and stale (dropped because the user typed on before the answer);
- latency p50 / p90 / p99 / max of the answered requests, and of every request (a stale one's
  latency is how long it ran before it was dropped);
- the KV reuse rate, requests with less than half of their prompt reused ("cold"), and those
  of them less than 16 lines from the same file's last request (cold while typing:
  what a window move costs; the rest are jumps and newly opened files, which warm-ups cover);
- the engine's ahead counters (openings prefilled, tokens, ms);
- whether the completions are the same (the warm-up changes no prompt).

    python bench/ahead.py --repos GIT1[,GIT2] [--commits 3] [--max-requests 100] [--out bench/results/ahead]

(each a git directory, as ``fetch`` brings; sessions come from its history: ``sessions from-git``)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, replay_settings, write_results  # noqa: E402
from warmups import is_cold  # noqa: E402
from warmups import summary as replay_summary  # noqa: E402

from codecomplete.daemon.replay import pct  # noqa: E402

WORK = Path(__file__).resolve().parent / ".work" / "ahead"
DEFAULT_CHARS = 600  # engine.ahead_chars as shipped
NEAR = 16  # lines from the file's last request: typing on, not a jump


def typing_cold(reqs: list[dict]) -> list[int]:
    """Indices of the cold requests (< 50 % of the prompt reused) within NEAR lines of the
    same file's previous request."""
    last: dict[str, int] = {}
    out = []
    for i, r in enumerate(reqs):
        at = r["line"]
        prev = last.get(r["uri"])
        last[r["uri"]] = at
        if prev is not None and abs(at - prev) < NEAR and is_cold(r):
            out.append(i)
    return out


def summary(report: dict) -> dict:
    """``warmups.summary`` with the p99s, the cold requests while typing and the ahead counters."""
    reqs = report["runs"][0]["requests"]
    eng = report["runs"][0]["daemon"]["engine"]
    answered = [r["latency_ms"] for r in reqs if r["status"] == "answered"]
    every = [r["latency_ms"] for r in reqs if r["latency_ms"] is not None]
    return {**replay_summary(report), "answered_p99": pct(answered, 0.99), "all_p99": pct(every, 0.99),
            "typing_cold": len(typing_cold(reqs)), "ahead_prefills": eng.get("ahead_prefills"),
            "ahead_tokens": eng.get("ahead_tokens"), "ahead_ms": round(eng.get("ahead_ms") or 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repos", required=True, help="comma-separated git directories")
    ap.add_argument("--commits", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--suffix", default=".py")
    ap.add_argument("--max-requests", type=int, default=100, help="per session (0: all)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=str(RESULTS / "ahead"))
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    results = {}
    for git in args.repos.split(","):
        name, runs = replay_settings(git, WORK, "engine.ahead_chars", (0, DEFAULT_CHARS), args.commits, args.seed,
                                     args.model, ("--suffix", args.suffix), ("--max-requests", str(args.max_requests)))
        off, on = (runs[c]["runs"][0]["requests"] for c in (0, DEFAULT_CHARS))
        both = [(a, b) for a, b in zip(off, on) if a["status"] == b["status"] == "answered"]
        moved = typing_cold(off)  # the off run's cold requests while typing, and the same requests on
        results[name] = {"off": summary(runs[0]), "on": summary(runs[DEFAULT_CHARS]),
                         "answered_in_both": len(both),
                         "same_completion": sum(a["completion"] == b["completion"] for a, b in both),
                         "typing_cold_off": [{k: off[i][k] for k in ("latency_ms", "prompt_tokens", "reused_tokens",
                                                                       "status")} for i in moved],
                         "same_requests_on": [{k: on[i][k] for k in ("latency_ms", "prompt_tokens", "reused_tokens",
                                                                       "status")} for i in moved]}
        print(name, json.dumps(results[name]), file=sys.stderr)
    lines = [header("Warm-up ahead of a window move: editing sessions replayed in real time with it off and on"), "",
             f"Sessions: `sessions from-git --commits {args.commits} --seed {args.seed} --suffix {args.suffix}` of "
             "each repository (code not committed); replayed by `codecomplete-daemon replay --scheme efim-through "
             f"--speed 1 --users 1 --max-requests {args.max_requests}` with `engine.ahead_chars` 0, then "
             f"{DEFAULT_CHARS} (shipped); model `{args.model}`. Latency in ms; a stale request's latency is how long "
             "it ran before the user's typing dropped it. Cold: less than half of the prompt reused; while typing: "
             f"within {NEAR} lines of the file's last request.", "",
             "| repository | ahead | requests | answered / stale / superseded | answered p50 / p90 / p99 / max | "
             "every request p50 / p90 / p99 / max | reuse | cold | cold while typing | ahead: openings / tokens / ms "
             "| edit sim. | exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for key, label in (("off", "off"), ("on", f"{DEFAULT_CHARS} chars")):
            s = r[key]
            lines.append(f"| {name} | {label} | {s['requests']} | {s['answered']} / {s['stale']} / {s['superseded']} | "
                         f"{s['answered_p50']} / {s['answered_p90']} / {s['answered_p99']} / {s['answered_max']} | "
                         f"{s['all_p50']} / {s['all_p90']} / {s['all_p99']} / {s['all_max']} | {s['reuse']} | "
                         f"{s['cold']} | {s['typing_cold']} | {s['ahead_prefills']} / {s['ahead_tokens']} / "
                         f"{s['ahead_ms']} | {s['edit_similarity']} | {s['exact_match']} |")
    lines += ["", "Requests answered in both runs with the same completion: " + "; ".join(
        f"{name} {r['same_completion']} of {r['answered_in_both']}" for name, r in results.items()) + ".", "",
        "The off run's cold requests while typing (window moves), and the same requests with the warm-up ahead "
        "(latency ms, prompt tokens, reused, status):", ""]
    for name, r in results.items():
        for a, b in zip(r["typing_cold_off"], r["same_requests_on"]):
            lines.append(f"- {name}: off {a['latency_ms']:.0f} ms, {a['prompt_tokens']} / {a['reused_tokens']}, "
                         f"{a['status']}; on {b['latency_ms']:.0f} ms, {b['prompt_tokens']} / {b['reused_tokens']}, "
                         f"{b['status']}")
    write_results(args.out, lines, results)


if __name__ == "__main__":
    main()
