"""What a verification pass costs next to a decode step, and where the difference goes (issue #8).

Retrieval speculation pays off by ``tokens per pass / (pass cost / step cost)``.  This
benchmark measures the second factor on the engine's own bf16 path: a forward of S new rows
(a draft chain under its tree mask, logits of every row, as ``speculate.verify`` runs it)
after a cache of L positions, against the one-token step (S = 1) at the same L, and splits
it into its two big parts measured alone:

* the linear layers and the head (``linear_bf16`` over every weight matrix, S rows);
* attention over the cache (``decode_attention`` over every layer, S rows per sequence).

Interleaved rounds (this machine's memory bandwidth drifts by up to 2x within minutes and
moves a memory-bound step but not a compute-bound pass); each cell is the median over
rounds of the per-round median, and each ratio is taken within a round.  Random token ids
and random caches: the cost does not depend on the values.  Writes
bench/results/pass_cost.md (+ .json).

    python bench/pass_cost.py [--model default] [--rounds 5] [--contexts 16,512,1024,2048] [--rows 1,2,3,5,9,13,17]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, median_ms, native_model, ratio_in_rounds  # noqa: E402

from codecomplete.model import native  # noqa: E402


def chain_mask(cached: int, s: int) -> torch.Tensor:
    """A draft chain's tree mask: every row sees the cache, the root and the rows before it."""
    mask = torch.ones(s, cached + s, dtype=torch.bool)
    mask[:, cached:] = torch.tril(torch.ones(s, s, dtype=torch.bool))
    return mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--contexts", default="16,512,1024,2048")
    ap.add_argument("--rows", default="1,2,3,5,9,13,17")
    ap.add_argument("--out", default=str(RESULTS / "pass_cost"))
    args = ap.parse_args()
    lm = native_model(args.model)
    model = lm.model
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = sorted({1, *(int(x) for x in args.rows.split(","))})  # ratios are to the one-row step
    vocab, a = model.args.vocab_size, model.args
    torch.manual_seed(0)
    mats = [(lin.native_weight, lin.out_features, lin.in_features)
            for b in model.layers for lin in (b.attn.wqkv, b.attn.wo, b.mlp.w13, b.mlp.w2)]
    mats.append((model.head.native_weight, model.head.out_features, model.head.in_features))
    macs = sum(n * k for _, n, k in mats)
    weight_mb = sum(w.numel() * w.element_size() for w, _, _ in mats) / 1e6

    def linear_all(s: int):
        xs = {k: torch.randn(s, k).to(torch.bfloat16) for k in {k for _, _, k in mats}}
        ys = [torch.empty(s, n, dtype=torch.bfloat16) for _, n, _ in mats]

        def run():
            for (w, n, k), y in zip(mats, ys):
                fn = native._lib.linear_bf16_amx if native.amx_layout(w) else native._lib.linear_bf16
                fn(s, n, k, xs[k].data_ptr(), w.data_ptr(), None, y.data_ptr())
        return run

    caches = {}
    with torch.inference_mode():
        for L in contexts:
            c = model.new_cache(L + max(rows) + 1)
            for i in range(0, L, 256):
                model(torch.randint(0, vocab, (1, min(256, L - i))), [c])
            caches[L] = c

        def forward(L: int, s: int):
            c, toks = caches[L], torch.randint(0, vocab, (1, s))
            mask = [chain_mask(L, s)] if s > 1 else None

            def run():
                model(toks, [c], masks=mask, logits_for="all" if s > 1 else "last")
                c.length = L
            return run

        def attention(L: int, s: int):
            c = caches[L]
            q = torch.randn(1, a.n_heads, s, a.head_dim).to(torch.bfloat16)
            k = torch.randn(1, a.n_kv_heads, s, a.head_dim).to(torch.bfloat16)
            v = torch.randn(1, a.n_kv_heads, s, a.head_dim).to(torch.bfloat16)
            mask = [chain_mask(L, s)] if s > 1 else None

            def run():
                for layer in range(a.n_layers):
                    native.decode_attention(q, k, v, [c], layer, mask)
            return run

        cells: dict[tuple, list[float]] = {}
        for r in range(args.rounds):
            for s in rows:
                cells.setdefault(("linear", 0, s), []).append(median_ms(linear_all(s), args.reps))
            for L in contexts:
                for s in rows:
                    cells.setdefault(("forward", L, s), []).append(median_ms(forward(L, s), args.reps))
                    cells.setdefault(("attention", L, s), []).append(median_ms(attention(L, s), args.reps))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)

    def cell(kind, L, s):
        return statistics.median(cells[(kind, L, s)])

    def ratio(kind, L, s):
        return ratio_in_rounds(cells[(kind, L, s)], cells[(kind, L, 1)])

    result = {"model": lm.name, "dtype": str(lm.dtype), "rounds": args.rounds, "weights_mb": round(weight_mb, 1),
              "macs_per_row": macs, "cells": {f"{k}/{L}/{s}": v for (k, L, s), v in cells.items()}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [header("Verification pass cost vs a decode step"), "",
             f"Model {lm.name} ({lm.dtype}), {a.n_layers} layers, {a.n_heads} query / {a.n_kv_heads} KV heads of "
             f"{a.head_dim}; {weight_mb:.0f} MB of linear weights and head, {macs / 1e6:.0f}M MACs per row. "
             f"{args.rounds} interleaved rounds of {args.reps} repetitions; medians; ratios within a round.", "",
             "## Whole forward: S rows (a draft chain under its mask, every row's logits) after L cached positions",
             "", "| L \\ S | " + " | ".join(str(s) for s in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for L in contexts:
        lines.append(f"| {L} | " + " | ".join(f"{cell('forward', L, s):.2f} ms ({ratio('forward', L, s):.2f}x)"
                                              for s in rows) + " |")
    lines += ["", "## Linear layers and head alone (S rows; no attention)", "",
              "| S | ms | ratio to 1 row | weights streamed | dot products |", "|---|---|---|---|---|"]
    for s in rows:
        ms = cell("linear", 0, s)
        lines.append(f"| {s} | {ms:.2f} | {ratio('linear', 0, s):.2f}x | {weight_mb / ms:.0f} GB/s | "
                     f"{s * macs / ms / 1e6:.0f} GMAC/s |")
    lines += ["", "## Attention alone (every layer, S rows; includes ~15-25 us of Python per layer call)", "",
              "| L \\ S | " + " | ".join(str(s) for s in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for L in contexts:
        ms = [cell("attention", L, s) for s in rows]
        lines.append(f"| {L} | " + " | ".join(f"{t:.2f} ms (+{t - ms[0]:.2f})" for t in ms) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
