"""Which weight dtype serves fastest on this CPU: bf16 (the native kernels) against fp32.

``dtype = "auto"`` picks bf16 on CPUs whose native kernels run bf16 products on SIMD (AVX2 + FMA,
AVX512-BF16, AMX) and fp32 elsewhere (model/loader.py ``resolve_dtype``).  This benchmark measures
that choice on the embedded default model, in interleaved rounds (medians):

* the linear layers and head alone: S rows over every weight matrix, bf16 through
  ``native.linear`` against fp32 through oneDNN's prepacked kernel (what an fp32 model runs);
* a decode step (batch 1) after 16 and 1,024 cached tokens, each model as ``load_model`` serves it;
* a prefill of 256 and 1,024 tokens.

    python bench/dtype.py [--rounds 3] [--out bench/results/dtype_avx2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, decode_ms, header, median_ms  # noqa: E402

from codecomplete.model import native  # noqa: E402
from codecomplete.model.loader import load_model, resolve_dtype  # noqa: E402
from codecomplete.model.transformer import Linear, can_pack  # noqa: E402


def timed(fn, reps: int = 3) -> float:
    """``median_ms`` after one untimed call."""
    fn()
    return median_ms(fn, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,2,4,9,16")
    ap.add_argument("--out", default=str(RESULTS / "dtype"))
    args = ap.parse_args()
    models = {d: load_model("default", dtype=d) for d in ("float32", "bfloat16")}
    bf = models["bfloat16"].model
    if bf.native_stack is None:
        sys.exit("needs the native kernels (a C compiler)")
    path = {2: "AVX512-BF16", 1: "AVX2 + FMA", 0: "portable loop"}[native.linear_bf16_path()]
    mats = [m for m in bf.modules() if isinstance(m, Linear)]
    packed_bf = [native.pack_linear(m.weight) for m in mats]
    fp32_packs = can_pack(torch.device("cpu"), torch.float32)
    w32 = [torch.ops.mkldnn._reorder_linear_weight(m.weight.float(), None) if fp32_packs else m.weight.float()
           for m in mats]
    rows = [int(r) for r in args.rows.split(",")]
    res: dict[str, list[float]] = {}
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(args.rounds):
            for s in rows:
                xs = {m.in_features: torch.randn(s, m.in_features) for m in mats}

                def lin_bf16():
                    for m, p in zip(mats, packed_bf):
                        native.linear(xs[m.in_features].bfloat16(), p, None, m.out_features)

                def lin_fp32():
                    for m, w in zip(mats, w32):
                        x = xs[m.in_features]
                        if fp32_packs:
                            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                        else:
                            torch.nn.functional.linear(x, w)

                res.setdefault(f"linear/bfloat16/{s}", []).append(timed(lin_bf16))
                res.setdefault(f"linear/float32/{s}", []).append(timed(lin_fp32))
            for ctx in (16, 1024):
                prompt = torch.randint(100, 40000, (1, ctx))
                for d, lm in models.items():
                    res.setdefault(f"decode/{d}/{ctx}", []).append(decode_ms(lm.model, prompt, 24, warm=2))
            for n in (256, 1024):
                prompt = torch.randint(100, 40000, (1, n))
                for d, lm in models.items():
                    def prefill(lm=lm, prompt=prompt, n=n):
                        lm.model(prompt, [lm.model.new_cache(n + 8)])
                    res.setdefault(f"prefill/{d}/{n}", []).append(timed(prefill, reps=1))
    med = {k: round(statistics.median(v), 2) for k, v in res.items()}
    lines = [header("Weight dtype on this CPU: bf16 (native kernels) against fp32"),
             f"Model {models['bfloat16'].name}; bf16 linear path: {path}; fp32 linear: "
             f"{'oneDNN prepacked' if fp32_packs else 'PyTorch'}; {args.rounds} interleaved rounds, medians "
             f"(ms); `dtype = \"auto\"` picks {str(resolve_dtype('auto', torch.device('cpu'))).removeprefix('torch.')} "
             "here.", "",
             "| measure | bf16 | fp32 | fp32 / bf16 |", "|---|---|---|---|"]
    for kind, keys in (("linear layers + head, rows", rows), ("decode step, cached tokens", (16, 1024)),
                       ("prefill, tokens", (256, 1024))):
        part = kind.split(",")[0].split()[0]
        for k in keys:
            b, f = med[f"{part}/bfloat16/{k}"], med[f"{part}/float32/{k}"]
            lines.append(f"| {kind} {k} | {b} | {f} | {f / b:.2f}x |")
    lines.append("")
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"rounds": res, "medians": med, "bf16_path": path}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
