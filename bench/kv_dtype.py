"""KV cache dtype A/B: fp32 vs bf16 KV on the same bf16 weights (the `engine.kv_dtype` setting).

Measures, interleaved over rounds so machine drift hits both alike: decode ms/token at
batch 1 (1k and 3k-token contexts) and batch 16 (3k each), a fresh 3k-token prefill and
a prefill of 2.4k tokens over 600 cached ones.  Random token ids: the cost of a forward
pass does not depend on which tokens it sees.  Writes bench/results/kv_dtype.md (+ .json).

    python bench/kv_dtype.py [--model smollm2-135m] [--rounds 3]
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
from common import RESULTS, decode_ms, header  # noqa: E402

from codecomplete.model.loader import load_model  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prefill_ms(model, ids: torch.Tensor, cached: int, new: int) -> float:
    c = model.new_cache(cached + new + 4)
    if cached:
        model(ids[:1, :cached], [c])
    t = time.perf_counter()
    model(ids[:1, cached:cached + new], [c])
    return (time.perf_counter() - t) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_dtype.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model(args.model)
    model = lm.model
    ids = torch.randint(100, min(40000, model.args.vocab_size - 1), (16, 3100))
    cases = {
        "decode, batch 1, 1k context (ms/token)": lambda: decode_ms(model, ids[:1, :1000], 16),
        "decode, batch 1, 3k context (ms/token)": lambda: decode_ms(model, ids[:1, :3000], 16),
        "decode, batch 16, 3k context each (ms/step)": lambda: decode_ms(model, ids[:, :3000], 4),
        "prefill, 3000 tokens (ms)": lambda: prefill_ms(model, ids, 0, 3000),
        "prefill, 2400 tokens over 600 cached (ms)": lambda: prefill_ms(model, ids, 600, 2400),
    }
    runs: dict[str, dict[str, list[float]]] = {name: {d: [] for d in DTYPES} for name in cases}
    for r in range(args.rounds):
        for dname, dt in DTYPES.items():
            model.kv_dtype = dt
            for name, fn in cases.items():
                with torch.no_grad():
                    runs[name][dname].append(round(fn(), 1))
        print(f"round {r + 1}/{args.rounds}: {json.dumps(runs)}", file=sys.stderr, flush=True)
    model.kv_dtype = None
    lines = [header("KV cache dtype: fp32 vs bf16"), "",
             f"Model {args.model}, weights {str(model.dtype).split('.')[-1]}, prepacked: {model.packed}; "
             f"medians of {args.rounds} interleaved rounds.", "",
             "| case | fp32 KV | bf16 KV | bf16 / fp32 |", "|---|---|---|---|"]
    for name, by in runs.items():
        a, b = statistics.median(by["float32"]), statistics.median(by["bfloat16"])
        lines.append(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    lines += ["", f"every round: `{json.dumps(runs)}`", ""]
    args.out.write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps({"model": args.model, "runs": runs}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
