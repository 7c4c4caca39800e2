"""Completions while other processes use the cores: fixed threads against the thread governor.

Each daemon here is a process with its own ``Engine`` on the default model (the daemon's
settings, speculation on), asking for completions of HumanEval-Infilling single-line tasks
(32 tokens each, end-of-text ignored) one after another for ``--seconds``.  Scenarios: alone;
two daemons at once (two editor windows); one daemon beside a busy loop (a build, a test run);
beside a process busy half of every 20 ms.  Arms: ``model.adaptive_threads`` off (every pass
takes all threads, as before) and on.  Processes start measuring together after their models
load and a first completion.  Reports completions done, latency per completion (median, p90) and
decode ms per token, per daemon.

    python bench/contention.py [--seconds 20] [--out bench/results/contention]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, write_results  # noqa: E402
from infill import load  # noqa: E402

SPIN = "import time\nwhile True: pass\n"
DUTY = ("import time\nwhile True:\n    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < 0.01: pass\n    time.sleep(0.01)\n")


def worker(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from codecomplete.model.api import CompletionRequest, EngineSettings
    from codecomplete.model.engine import Engine

    tasks = load("single", 0)[args.offset::7]
    engine = Engine(EngineSettings(adaptive_threads=bool(args.adaptive))).start()

    def ask(i: int):
        t = tasks[i % len(tasks)]
        return engine.complete(CompletionRequest(t["prompt"], t["suffix"], max_tokens=32, ignore_eos=True,
                                                 mode="multi", max_lines=100, time_budget_ms=60000))

    ask(len(tasks) - 1)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    rows, i, start = [], 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        t = time.perf_counter()
        c = ask(i)
        rows.append({"ms": (time.perf_counter() - t) * 1000, "tokens": c.generated_tokens,
                     "decode_ms": c.timings.get("decode_ms", 0.0), "prefill_ms": c.timings.get("prefill_ms", 0.0)})
        i += 1
    threads = engine.stats()["threads"]
    engine.close()
    print(json.dumps({"rows": rows, "threads": threads}), flush=True)


def run(scenario: str, adaptive: bool, seconds: float) -> dict:
    daemons = 2 if scenario == "two daemons" else 1
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--adaptive", str(int(adaptive)),
                               "--seconds", str(seconds), "--offset", str(k)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for k in range(daemons)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    load = {"busy loop": SPIN, "half-busy": DUTY}.get(scenario)
    neighbour = subprocess.Popen([sys.executable, "-c", load]) if load else None
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.wait()
    if neighbour is not None:
        neighbour.kill()
        neighbour.wait()
    per = []
    for o in outs:
        ms = sorted(r["ms"] for r in o["rows"])
        tokens = sum(r["tokens"] for r in o["rows"])
        per.append({"completions": len(ms), "p50_ms": round(statistics.median(ms), 1),
                    "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 1),
                    "decode_ms_per_token": round(sum(r["decode_ms"] for r in o["rows"]) / max(1, tokens), 2),
                    "threads": o["threads"]})
    return {"scenario": scenario, "adaptive": adaptive, "daemons": per}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--scenarios", default="alone,two daemons,busy loop,half-busy")
    ap.add_argument("--out", default=str(RESULTS / "contention"))
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--adaptive", type=int, default=1)
    ap.add_argument("--offset", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    results = []
    for scenario in args.scenarios.split(","):
        for adaptive in (False, True):
            r = run(scenario, adaptive, args.seconds)
            results.append(r)
            print(json.dumps(r), flush=True)
    lines = [header("Completions while other processes use the cores"), "",
             f"Model `default` (the daemon's settings, speculation on), {args.seconds:g} s per run; each "
             "daemon a process with its own engine asking for HumanEval-Infilling single-line tasks one "
             "after another (32 tokens, end-of-text ignored). `fixed`: every pass takes all threads "
             "(`model.adaptive_threads = false`, as before); `adaptive`: the thread governor. Threads: "
             "the count the governor ended at, and how often it changed.", "",
             "| scenario | arm | daemon | completions | latency p50 / p90 ms | decode ms/token | threads (changes) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for k, d in enumerate(r["daemons"]):
            t = d["threads"]
            th = f"{t['threads']} of {t['limit']} ({t['changes']})" if t else "-"
            lines.append(f"| {r['scenario']} | {'adaptive' if r['adaptive'] else 'fixed'} | {k + 1} | "
                         f"{d['completions']} | {d['p50_ms']} / {d['p90_ms']} | {d['decode_ms_per_token']} | {th} |")
    write_results(args.out, lines, results)


if __name__ == "__main__":
    main()
