"""Do an exits folder's thresholds hold on another dtype's states?  (issue #9)

    python bench/exit_dtype.py EXITS_DIR [--batches 3] [--bounds 0.02,0.05] [--out bench/results/exit_dtype]

Collects the validation split's FIM-middle positions (exit_train's calibration set) once per
dtype (float32, then bfloat16), and per exit reports the agreement with the full model and, at
each calibrated softmax bound, the share of tokens whose margin passes the stored threshold and
how often those tokens disagree.  exit_train calibrates on whatever dtype it is given (fp32 on an
AVX2-only CPU, where PyTorch's bf16 products are slow); the engine serves bf16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, write_results  # noqa: E402
from exit_cost import margins  # noqa: E402

from codecomplete.model.loader import load_model  # noqa: E402


def measure(folder: Path, dtype: str, batches: int, bounds: list[str]) -> tuple[int, dict]:
    conf, agree, ex = margins(load_model("default", device="cpu", dtype=dtype), folder, batches)
    res: dict = {}
    for n in ex.layers:
        row: dict = {"agree": round(float(agree[n].float().mean()), 4)}
        for b in bounds:
            thr = ex.thresholds.get(f"softmax@{b}", {}).get(n)
            if thr is not None:
                take = conf[n] >= thr
                row[b] = {"rate": round(float(take.float().mean()), 4),
                          "disagree": round(float((~agree[n][take]).float().mean()) if take.any() else 0.0, 4)}
        res[n] = row
    return len(conf[ex.layers[0]]), res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exits", type=Path)
    ap.add_argument("--batches", type=int, default=3, help="validation batches of 4 x 512 (bf16 is slow here)")
    ap.add_argument("--bounds", default="0.02,0.05")
    ap.add_argument("--out", default=str(RESULTS / "exit_dtype"))
    args = ap.parse_args()
    bounds = args.bounds.split(",")
    data = {dt: measure(args.exits, dt, args.batches, bounds) for dt in ("float32", "bfloat16")}
    n = data["float32"][0]
    lines = [header("Exit thresholds across dtypes"), "",
             f"Exits: `{args.exits}`; {n} validation positions (FIM middles), the same in both dtypes.", "",
             "| exit | agree fp32 / bf16 | "
             + " | ".join(f"@{b}: exit rate fp32 / bf16 | @{b}: disagreement fp32 / bf16" for b in bounds) + " |",
             "|---|---|" + "---|---|" * len(bounds)]
    f32, b16 = data["float32"][1], data["bfloat16"][1]
    for layer in f32:
        a, b = f32[layer], b16[layer]
        cells = [f"{a['agree']:.3f} / {b['agree']:.3f}"]
        for bd in bounds:
            if bd in a and bd in b:
                cells += [f"{a[bd]['rate']:.3f} / {b[bd]['rate']:.3f}",
                          f"{a[bd]['disagree']:.3f} / {b[bd]['disagree']:.3f}"]
            else:
                cells += ["-", "-"]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    write_results(args.out, lines, {k: {"positions": v[0], "exits": v[1]} for k, v in data.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
