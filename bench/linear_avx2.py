"""The AVX2 bf16 linear kernel against the one it replaced, on the default model's own weights.

Builds the native library of an earlier revision (``--old``, default 4a68aab: the dot-product
AVX2 kernel over the [N/4][K/32][4][32] layout; a later one packs for the panels) beside this
checkout's (the GEMM-form kernel over panels of 16 rows, linear.c), packs every weight matrix
and the head for each, and times
S input rows through all of them (what a forward of S rows costs the linear layers), both
kernels alternating within each round (this machine's memory bandwidth drifts within minutes).
Each cell: the median over rounds of the per-round median; the ratio is taken within a round.
Also checks that both kernels' outputs agree within a bf16 rounding on every matrix.  Meant for
``linear_bf16_path() == 1`` (AVX2 + FMA without AVX512-BF16); on an AVX512-BF16 CPU without AMX
(path 2) it compares the dot-product kernels of two revisions, whose layout is the same (``--old
4b689b6``: before the multi-row prefetch into L2).  Writes bench/results/linear_avx2.md (+ .json).

    python bench/linear_avx2.py [--old 4a68aab] [--rows 1,2,3,4,5,6,8,9,12,16,17,32,64,256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, build_revision, header, median_ms, native_model, ratio_in_rounds  # noqa: E402

from codecomplete.model import native  # noqa: E402


def build_old(rev: str, out_dir: Path) -> tuple[ctypes.CDLL, bool]:
    """The native library of ``rev`` (build_revision) and whether its AVX2 kernel reads the panel
    layout (from 6f756bd on) rather than the dot-product kernel's."""
    lib = build_revision(rev, out_dir)
    return lib, b"LINEAR_PANELS" in (out_dir / "linear.c").read_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--old", default="4a68aab")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,9,12,16,17,32,64,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(RESULTS / "linear_avx2"))
    args = ap.parse_args()
    path = native.linear_bf16_path()
    if path not in (1, 2) or native.amx():
        raise SystemExit(f"this build's bf16 linear path is {path} (amx {native.amx()}), "
                         "not AVX2 (1) or AVX512-BF16 (2)")
    tmp = tempfile.TemporaryDirectory()
    old, old_panels = build_old(args.old, Path(tmp.name))
    old_panels = old_panels and path == 1  # an AVX512-BF16 build never reads panels
    if old.linear_bf16_path() != path:
        raise SystemExit(f"the old build does not run path {path} here")
    lm = native_model(args.model)
    model = lm.model
    lins = [lin for b in model.layers for lin in (b.attn.wqkv, b.attn.wo, b.mlp.w13, b.mlp.w2)] + [model.head]
    mats = [(lin.out_features, lin.in_features, lin.native_weight,
             native.pack_linear(lin.weight, path=1 if old_panels else 0)) for lin in lins]
    macs = sum(n * k for n, k, _, _ in mats)
    weight_mb = sum(n * k * 2 for n, k, _, _ in mats) / 1e6
    rows = sorted({1, *(int(x) for x in args.rows.split(","))})
    torch.manual_seed(0)

    # agreement: both within a bf16 rounding of the fp32 product, on every matrix (8 rows)
    worst = 0.0
    for (n, k, new_w, old_w), lin in zip(mats, lins):
        x = torch.randn(8, k).to(torch.bfloat16)
        want = x.float() @ lin.weight.float().T
        y_old = torch.empty(8, n, dtype=torch.bfloat16)
        old.linear_bf16(8, n, k, x.data_ptr(), old_w.data_ptr(), None, y_old.data_ptr())
        y_new = native.linear(x, new_w, None, n)
        for y in (y_old, y_new):
            worst = max(worst, ((y.float() - want).abs().max() / want.abs().max()).item())
    if worst > 2 ** -7:
        raise SystemExit(f"a kernel is off by {worst:.3g} of the largest output")

    # the same layout (both dot-product builds): do the two kernels give the same bits at every S?
    same_bits = None
    if not old_panels and path == 2:
        same_bits = True
        for s in rows:
            for (n, k, new_w, old_w) in mats:
                x = torch.randn(s, k).to(torch.bfloat16)
                y_old, y_new = torch.empty(s, n, dtype=torch.bfloat16), torch.empty(s, n, dtype=torch.bfloat16)
                old.linear_bf16(s, n, k, x.data_ptr(), old_w.data_ptr(), None, y_old.data_ptr())
                native._lib.linear_bf16(s, n, k, x.data_ptr(), new_w.data_ptr(), None, y_new.data_ptr())
                same_bits = same_bits and torch.equal(y_old.view(torch.int16), y_new.view(torch.int16))

    def runner(lib, idx: int, s: int):
        xs = {k: torch.randn(s, k).to(torch.bfloat16) for k in {k for _, k, _, _ in mats}}
        ys = [torch.empty(s, n, dtype=torch.bfloat16) for n, _, _, _ in mats]

        def run():
            for (n, k, *ws), y in zip(mats, ys):
                lib.linear_bf16(s, n, k, xs[k].data_ptr(), ws[idx].data_ptr(), None, y.data_ptr())
        return run

    cells: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for s in rows:
            reps = args.reps if s <= 64 else max(2, args.reps // 3)
            for name, lib, idx in (("old", old, 1), ("new", native._lib, 0)):
                cells.setdefault((name, s), []).append(median_ms(runner(lib, idx, s), reps))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    tmp.cleanup()

    def cell(name, s):
        return statistics.median(cells[(name, s)])

    def speedup(s):
        return ratio_in_rounds(cells[("old", s)], cells[("new", s)])

    def step_ratio(name, s):
        return ratio_in_rounds(cells[(name, s)], cells[(name, 1)])

    result = {"model": lm.name, "old": args.old, "rounds": args.rounds, "weights_mb": round(weight_mb, 1),
              "macs_per_row": macs, "worst_relative_error": worst, "same_bits": same_bits,
              "cells": {f"{name}/{s}": v for (name, s), v in cells.items()}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    kind = "AVX2" if path == 1 else "AVX512-BF16"
    layout = "panels [N/16][K][8][2]" if path == 1 else "dot products, [N/4][K/32][4][32]"
    lines = [header(f"The {kind} bf16 linear kernel against an earlier revision's"), "",
             f"Model {lm.name}: every linear layer and the head ({weight_mb:.0f} MB of bf16 weights, "
             f"{macs / 1e6:.0f}M MACs per row), S input rows through all of them, from memory. Old: the kernel of "
             f"{args.old} ({'panels' if old_panels else 'dot products, [N/4][K/32][4][32]'}); new: this checkout's "
             f"(linear.c, {layout}). "
             f"{args.rounds} rounds, both kernels alternating in each; medians; ratios within a round. Both within "
             f"{worst:.2g} of the largest output of an fp32 product on every matrix (8 rows)."
             + ("" if same_bits is None else
                f" Same bits as the old kernel on every matrix at every S: {'yes' if same_bits else 'NO'}."), "",
             "| S | old ms | new ms | speed-up | old / 1-row step | new / 1-row step | new GMAC/s |",
             "|---|---|---|---|---|---|---|"]
    for s in rows:
        lines.append(f"| {s} | {cell('old', s):.2f} | {cell('new', s):.2f} | {speedup(s):.2f}x | "
                     f"{step_ratio('old', s):.2f}x | {step_ratio('new', s):.2f}x | "
                     f"{s * macs / cell('new', s) / 1e6:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
