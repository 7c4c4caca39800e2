"""Warm-up pieces: what a piece of N prompt rows costs, and so how long a request that arrives
during a warm-up or an idle-time ahead prefill waits for it.

A warm-up (``engine.warm``: the prompt a request would get, prefilled while the user types)
and the prefix window's ahead prefill (``warm_ahead``) check their cancel between pieces, so a
request that comes meanwhile waits for the piece in flight to end.  Here the same 256 new
prompt tokens on top of a cached context are run by ``warm`` in pieces of 32, 64, 128 and 256
rows (multiples of 32: the native prefill gives the same bits whatever the pieces), interleaved
over rounds (this machine's speed drifts within minutes); random token ids (the cost does not
depend on them).  Reported per size: ms per piece (the longest a request waits for it, half of
that on average) and the 256 tokens' total (the throughput that smaller pieces give up).
Writes bench/results/warm_pieces.md (+ .json) or ``--out``.

    python bench/warm_pieces.py [--model default] [--rounds 5] [--context 1000] [--sizes 32,64,128,256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, native_model, write_results  # noqa: E402


def main() -> None:
    from codecomplete.model.engine import warm
    from codecomplete.model.kvstore import KVStore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=1000, help="cached prompt tokens before the new ones")
    ap.add_argument("--new", type=int, default=256, help="new prompt tokens a warm-up runs")
    ap.add_argument("--sizes", default="32,64,128,256")
    ap.add_argument("--out", default=str(RESULTS / "warm_pieces"))
    args = ap.parse_args()
    lm = native_model(args.model)
    sizes = [int(x) for x in args.sizes.split(",")]
    torch.manual_seed(0)
    ids = torch.randint(100, lm.model.args.vocab_size, (args.context + args.new,)).tolist()
    cache = lm.model.new_cache(args.context)
    with torch.inference_mode():
        lm.model(torch.tensor([ids[:args.context]]), [cache], greedy=True)
    base_k, base_v = cache.k[:, :, :args.context].clone(), cache.v[:, :, :args.context].clone()
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(args.rounds + 1):  # round 0 warms every size up, not counted
        for n in sizes:
            store = KVStore(1 << 30)
            store.insert(ids[:args.context], base_k, base_v)
            t = time.perf_counter()
            with torch.inference_mode():
                ran, had = warm(lm, ids, store, threading.Event(), piece=n)
            ms = (time.perf_counter() - t) * 1000
            assert had == args.context and ran == args.new, (had, ran)
            if r:
                times[n].append(ms)
    rows = {}
    for n in sizes:
        total = statistics.median(times[n])
        pieces = -(-args.new // n)
        rows[n] = {"total_ms": round(total, 1), "piece_ms": round(total / pieces, 1),
                   "ms_per_row": round(total / args.new, 3), "runs_ms": [round(x, 1) for x in times[n]]}
    best = min(r["total_ms"] for r in rows.values())
    md = [header("Warm-up pieces: the wait a request meets, and the throughput given up"), "",
          f"Model {lm.name} (bfloat16, native prefill), {args.new} new prompt tokens "
          f"on {args.context} cached, run by `engine.warm` in pieces of each size; median of {args.rounds} "
          "interleaved rounds.", "",
          "| rows per piece | ms per piece (a request's longest wait) | total ms | ms per row | slower than the best |",
          "|---|---|---|---|---|"]
    for n, r in rows.items():
        md.append(f"| {n} | {r['piece_ms']} | {r['total_ms']} | {r['ms_per_row']} | "
                  f"{(r['total_ms'] / best - 1) * 100:.1f} % |")
    write_results(args.out, md, {"context": args.context, "new": args.new, "rounds": args.rounds, "sizes": rows})


if __name__ == "__main__":
    main()
