"""Prefill of a fresh prompt: a bf16 model's native pieces against PyTorch's whole-prompt path.

A prompt longer than one native step (``native.STACK_ROWS`` rows) runs in pieces of that size
through the native kernels (``Transformer.native_prefill``: on by default, except on a CPU with
AMX where our matrices or attention are kept off its tiles, as measured here); off, the whole
prompt goes through PyTorch (oneDNN linear layers, scaled_dot_product_attention).  Both are
timed on the same model, interleaved over rounds (this machine's speed drifts within
minutes); random token ids (the cost does not depend on them).  The prompt sizes are the
daemon's window (1,024 prefix + 256 suffix tokens) and the benchmarks' 2,048.  Writes
bench/results/prefill.md (+ .json).

    python bench/prefill.py [--model default] [--rounds 5] [--lengths 256,512,1280,2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, native_model  # noqa: E402



def prefill_ms(model, ids: torch.Tensor) -> float:
    cache = model.new_cache(ids.shape[1] + 1)
    t = time.perf_counter()
    with torch.inference_mode():
        model(ids, [cache])
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lengths", default="256,512,1280,2048")
    ap.add_argument("--out", default=str(RESULTS / "prefill"))
    args = ap.parse_args()
    lm = native_model(args.model)
    model = lm.model
    model.pack(True)  # PyTorch's path as it runs where it serves prompts: on oneDNN's prepacked copy
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.manual_seed(0)
    prompts = {n: torch.randint(0, model.args.vocab_size, (1, n)) for n in lengths}
    times: dict[str, list[float]] = {}
    default = model.native_prefill
    for r in range(args.rounds + 1):  # round 0 warms both paths up, not counted
        for n in lengths:
            for pieces in (True, False):
                model.native_prefill = pieces
                ms = prefill_ms(model, prompts[n])
                if r:
                    times.setdefault(f"{n}/{'native' if pieces else 'torch'}", []).append(ms)
        print(f"round {r}/{args.rounds}", file=sys.stderr)
    model.native_prefill = default
    rows = []
    for n in lengths:
        nat, tor = times[f"{n}/native"], times[f"{n}/torch"]
        rows.append({"tokens": n, "native_ms": round(statistics.median(nat), 1),
                     "torch_ms": round(statistics.median(tor), 1),
                     "speedup": round(statistics.median(t / a for a, t in zip(nat, tor)), 3),
                     "speedup_range": [round(min(t / a for a, t in zip(nat, tor)), 3),
                                       round(max(t / a for a, t in zip(nat, tor)), 3)]})
    Path(args.out).with_suffix(".json").write_text(json.dumps({"model": lm.name, "rounds": args.rounds, "rows": rows,
                                                               "times": times}, indent=1))
    lines = [header("Prefill: native pieces vs PyTorch's whole-prompt path"), "",
             f"Model {lm.name} ({lm.dtype}); a fresh prompt of random ids into an empty cache; {args.rounds} "
             "interleaved rounds after one warm-up; medians, speed-up = median of per-round ratios.", "",
             "| prompt tokens | native pieces (ms) | PyTorch whole prompt (ms) | speed-up (range) | native tokens/s |",
             "|---|---|---|---|---|"]
    for row in rows:
        lo, hi = row["speedup_range"]
        lines.append(f"| {row['tokens']} | {row['native_ms']} | {row['torch_ms']} | {row['speedup']}x ({lo}-{hi}) | "
                     f"{row['tokens'] / row['native_ms'] * 1000:.0f} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
