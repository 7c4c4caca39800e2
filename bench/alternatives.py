"""What an invoked request's alternatives buy, and what they cost: HumanEval-Infilling
through the engine as the daemon serves it.

    python bench/alternatives.py [--model default] [--sets single,multi] [--limit 60] [--k 3,5]

Each task is a new editing session (the daemon's first request for a document: EFIM with
its last 8 lines after <M>, retrieval speculation on, as configured by default).  Per task:
a request while typing (one completion, ``cold``: nothing cached), the same request again
(``warm``: its prompt's KV in the store, as when the user asks at the position where the
last suggestion appeared), then for each K an invoked request with K completions (warm).

Quality: pass@1 of the first completion (greedy decoding's, identical in every row),
"any": the task passes with at least one of the completions offered (the user cycles to
it), EM likewise, the mean number of distinct completions offered, and where the first
passing one stands.  Cost: request latency, warm, K completions against one.  Writes
bench/results/alternatives.md/.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402
from infill import SETS, load, passes  # noqa: E402

from codecomplete.model.api import CompletionRequest, EngineSettings  # noqa: E402
from codecomplete.model import engine as engine_mod  # noqa: E402
from codecomplete.model.engine import Engine  # noqa: E402


def finished(middle: str) -> str:
    return middle if middle.endswith("\n") else middle + "\n"  # the canonical middles end their line


def run(engine: Engine, tasks: list[dict], mode: str, ks: list[int]) -> dict:
    rows = []
    for i, t in enumerate(tasks):
        key = f"{t['task_id']}-{i}"

        def ask(k: int) -> tuple[float, list[str]]:
            t0 = time.perf_counter()
            c = engine.complete(CompletionRequest(t["prompt"], t["suffix"], request_id=t["task_id"], session_key=key,
                                                  mode=mode, max_tokens=128, max_lines=40, time_budget_ms=60000,
                                                  alternatives=k))
            return (time.perf_counter() - t0) * 1000, c.texts if k > 1 else [c.text]

        cold_ms, first = ask(1)
        warm_ms, again = ask(1)
        assert again == first, "greedy decoding must not change when the prompt's KV is reused"
        row = {"cold_ms": cold_ms, "warm_ms": warm_ms, "first": first[0]}
        truth = t["canonical_solution"].strip()
        ok1 = passes(t, finished(first[0])) if "test" in t else None
        row["pass1"], row["em1"] = ok1, first[0].strip() == truth
        for k in ks:
            ms, texts = ask(k)
            if first[0].strip() and texts[0] != first[0]:
                raise AssertionError(f"{t['task_id']}: the first of {k} completions is not greedy decoding's")
            ranks = [j for j, x in enumerate(texts) if (passes(t, finished(x)) if x != first[0] else ok1)] \
                if "test" in t else []
            row[k] = {"ms": ms, "n": len(texts), "pass_rank": ranks[0] + 1 if ranks else None,
                      "em_any": any(x.strip() == truth for x in texts)}
        rows.append(row)
        sys.stderr.write(f"\r{i + 1}/{len(tasks)}")
    sys.stderr.write("\n")
    n = len(rows)

    def pct(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(p * len(xs)))], 1)

    out = {"n": n, "pass@1": round(100 * sum(bool(r["pass1"]) for r in rows) / n, 1),
           "em@1": round(100 * sum(r["em1"] for r in rows) / n, 1),
           "empty_first": sum(not r["first"].strip() for r in rows),
           "cold_ms": {"mean": round(statistics.mean(r["cold_ms"] for r in rows), 1),
                       "p50": pct([r["cold_ms"] for r in rows], 0.5)},
           "warm_ms": {"mean": round(statistics.mean(r["warm_ms"] for r in rows), 1),
                       "p50": pct([r["warm_ms"] for r in rows], 0.5), "p90": pct([r["warm_ms"] for r in rows], 0.9)},
           "k": {}}
    for k in ks:
        ms = [r[k]["ms"] for r in rows]
        ratio = [r[k]["ms"] / r["warm_ms"] for r in rows]
        ranks = [r[k]["pass_rank"] for r in rows if r[k]["pass_rank"]]
        out["k"][k] = {"pass_any": round(100 * len(ranks) / n, 1),
                       "em_any": round(100 * sum(r[k]["em_any"] for r in rows) / n, 1),
                       "mean_offered": round(statistics.mean(r[k]["n"] for r in rows), 2),
                       "passing_rank": {str(j): ranks.count(j) for j in sorted(set(ranks))},
                       "ms": {"mean": round(statistics.mean(ms), 1), "p50": pct(ms, 0.5), "p90": pct(ms, 0.9)},
                       "ms_over_warm_one": {"median": round(statistics.median(ratio), 2), "p90": pct(ratio, 0.9)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sets", default="single,multi")
    ap.add_argument("--limit", type=int, default=60)
    ap.add_argument("--k", default="3,5", help="completions per invoked request")
    ap.add_argument("--offset", type=int, default=0,
                    help="shift the evenly spaced sample by this many tasks (a tuning split apart from the table's)")
    ap.add_argument("--min-p", type=float, default=engine_mod.BRANCH_MIN_P, help="engine.BRANCH_MIN_P")
    ap.add_argument("--window", type=int, default=engine_mod.BRANCH_WINDOW, help="engine.BRANCH_WINDOW")
    ap.add_argument("--out", default=str(RESULTS / "alternatives"))
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    engine_mod.BRANCH_MIN_P, engine_mod.BRANCH_WINDOW = args.min_p, args.window
    engine = Engine(EngineSettings(model=args.model, dtype=args.dtype)).start()  # the daemon's defaults
    engine.ready.wait()
    st = engine.stats()
    if st["load_error"]:
        raise SystemExit(st["load_error"])
    results = {name: run(engine, load(name, args.limit, args.offset), SETS[name][1], ks)
               for name in args.sets.split(",")}
    engine.close()
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"model": st["model"], "dtype": st["dtype"], "results": results},
                                                   indent=2))
    lines = [header("Alternatives: what an invoked request's other completions buy and cost"),
             f"Model: {st['model']} ({st['dtype']}); the daemon's engine defaults (EFIM head8 prompt of a new "
             f"session, retrieval speculation, token healing); fixed evenly spaced samples of at most "
             f"{args.limit} HumanEval-Infilling tasks per set (offset {args.offset}); one request at a time; "
             f"forks where another token is at least {args.min_p} likely within the first {args.window} tokens.", "",
             "Quality: the first completion is greedy decoding's in every row (checked per task); "
             "\"any\" counts a task when at least one completion offered passes its tests (EM: matches).", "",
             "| set | K | tasks | pass@1 (first) | pass, any of K | EM@1 | EM, any of K | completions offered "
             "(mean) | first passing at rank |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | 1 | {r['n']} | {r['pass@1']} | {r['pass@1']} | {r['em@1']} | {r['em@1']} | 1 | |")
        for k, q in r["k"].items():
            lines.append(f"| {name} | {k} | {r['n']} | {r['pass@1']} | {q['pass_any']} | {r['em@1']} | "
                         f"{q['em_any']} | {q['mean_offered']} | {q['passing_rank']} |")
    lines += ["", "Cost: request latency in ms (one request at a time). Cold: a new session's request, nothing "
              "cached; warm: the same request again (its prompt's KV reused), which is what an invoked request "
              "at the suggestion's position finds.", "",
              "| set | cold, 1 (mean / p50) | warm, 1 (mean / p50 / p90) | K | warm, K (mean / p50 / p90) | "
              "K over 1, per task (median / p90) |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        for k, q in r["k"].items():
            cold, warm, ms, ratio = r["cold_ms"], r["warm_ms"], q["ms"], q["ms_over_warm_one"]
            lines.append(f"| {name} | {cold['mean']} / {cold['p50']} | "
                         f"{warm['mean']} / {warm['p50']} / {warm['p90']} | {k} | "
                         f"{ms['mean']} / {ms['p50']} / {ms['p90']} | {ratio['median']}x / {ratio['p90']}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
