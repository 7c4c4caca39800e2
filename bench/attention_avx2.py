"""This checkout's native attention against an earlier revision's, on the default model (issue #8).

Builds the native library of an earlier revision (``--old``) beside this checkout's and swaps the
two in turn as the library every native call goes through (``native._lib``), so both run the
same Python, the same weights and the same caches.  For each cache length L and S new rows (a
draft chain under its tree mask, as ``speculate.verify`` runs it; S = 1 is the one-token step)
it times, both libraries alternating within each round (this machine's memory bandwidth drifts
within minutes):

* attention alone: ``decode_attention`` over every layer, S rows;
* the whole forward of S rows (what a verification pass or a step costs).

Each cell: the median over rounds of the per-round median; ratios are taken within a round.
Also checks that both libraries' attention outputs agree within fp32 rounding, and refuses a
revision whose linear kernel packs weights otherwise (linear.c must be the same).  Writes
bench/results/attention_avx2.md (+ .json).

    python bench/attention_avx2.py --old b47cd65 [--rows 1,4,8,16] [--contexts 16,1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, build_revision, header, median_ms, native_model, ratio_in_rounds  # noqa: E402
from pass_cost import chain_mask  # noqa: E402

from codecomplete.model import native  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--old", required=True, help="git revision whose native library is the baseline")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--contexts", default="16,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "attention_avx2"))
    args = ap.parse_args()
    same = subprocess.run(["git", "diff", "--quiet", args.old, "--", "model/native/linear.c"], cwd=ROOT)
    if same.returncode:
        raise SystemExit(f"{args.old}'s linear.c differs from this checkout's: its kernel may pack weights otherwise")
    tmp = tempfile.TemporaryDirectory()
    old = build_revision(args.old, Path(tmp.name))
    lm = native_model(args.model)
    new = native._lib
    model, a = lm.model, lm.model.args
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = sorted({1, *(int(x) for x in args.rows.split(","))})
    libs = {"old": old, "new": new}
    torch.manual_seed(0)

    caches = {}
    with torch.inference_mode():
        for L in contexts:
            c = model.new_cache(L + max(rows) + 1)
            for i in range(0, L, 256):
                model(torch.randint(0, a.vocab_size, (1, min(256, L - i))), [c])
            caches[L] = c

        def inputs(L: int, s: int):
            q = torch.randn(1, a.n_heads, s, a.head_dim).to(torch.bfloat16)
            k = torch.randn(1, a.n_kv_heads, s, a.head_dim).to(torch.bfloat16)
            v = torch.randn(1, a.n_kv_heads, s, a.head_dim).to(torch.bfloat16)
            return q, k, v, [chain_mask(L, s)] if s > 1 else None

        # agreement: attention outputs in fp32 (the model's bf16 rounding would hide differences)
        worst = 0.0
        for L in contexts:
            for s in rows:
                q, k, v, mask = inputs(L, s)
                outs = []
                for lib in libs.values():
                    native._lib = lib
                    outs.append(native.decode_attention(q.float(), k, v, [caches[L]], 0, mask).float())
                native._lib = new
                worst = max(worst, ((outs[0] - outs[1]).abs().max() / outs[0].abs().max()).item())
        if worst > 1e-5:
            raise SystemExit(f"the two libraries' attention differs by {worst:.3g} of the largest output")

        def attention(L: int, s: int):
            c = caches[L]
            q, k, v, mask = inputs(L, s)

            def run():
                for layer in range(a.n_layers):
                    native.decode_attention(q, k, v, [c], layer, mask)
            return run

        def forward(L: int, s: int):
            c, toks = caches[L], torch.randint(0, a.vocab_size, (1, s))
            mask = [chain_mask(L, s)] if s > 1 else None

            def run():
                model(toks, [c], masks=mask, logits_for="all" if s > 1 else "last")
                c.length = L
            return run

        cells: dict[tuple, list[float]] = {}
        try:
            for r in range(args.rounds):
                for L in contexts:
                    for s in rows:
                        for kind, make in (("attention", attention), ("forward", forward)):
                            for name, lib in libs.items():
                                native._lib = lib
                                cells.setdefault((kind, name, L, s), []).append(median_ms(make(L, s), args.reps))
                print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
        finally:
            native._lib = new
    tmp.cleanup()

    def cell(kind, name, L, s):
        return statistics.median(cells[(kind, name, L, s)])

    def speedup(kind, L, s):
        return ratio_in_rounds(cells[(kind, "old", L, s)], cells[(kind, "new", L, s)])

    def step_ratio(name, L, s):
        return ratio_in_rounds(cells[("forward", name, L, s)], cells[("forward", name, L, 1)])

    result = {"model": lm.name, "old": args.old, "rounds": args.rounds, "worst_relative_difference": worst,
              "cells": {f"{k}/{n}/{L}/{s}": v for (k, n, L, s), v in cells.items()}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [header("Native attention against an earlier revision's"), "",
             f"Model {lm.name} ({lm.dtype}), {a.n_layers} layers, {a.n_heads} query / {a.n_kv_heads} KV heads of "
             f"{a.head_dim}. Old: the native library of {args.old}; new: this checkout's (same linear kernel). "
             f"S rows (a draft chain under its mask; S = 1 a one-token step) after L cached positions. "
             f"{args.rounds} rounds, both libraries alternating in each; medians; ratios within a round. Attention "
             f"outputs of the two agree within {worst:.2g} of the largest (fp32).", "",
             "| L | S | attention old ms | new ms | speed-up | forward old ms | new ms | speed-up | "
             "forward / step old | new |", "|---|---|---|---|---|---|---|---|---|---|"]
    for L in contexts:
        for s in rows:
            lines.append(f"| {L} | {s} | {cell('attention', 'old', L, s):.2f} | {cell('attention', 'new', L, s):.2f} | "
                         f"{speedup('attention', L, s):.2f}x | {cell('forward', 'old', L, s):.2f} | "
                         f"{cell('forward', 'new', L, s):.2f} | {speedup('forward', L, s):.2f}x | "
                         f"{step_ratio('old', L, s):.2f}x | {step_ratio('new', L, s):.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
