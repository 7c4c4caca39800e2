"""int8 layer weights against bf16: what a pass costs, on the real model.

``model.weights = "int8"`` (``native.pack_linear_q8``, linear.c's ``linear_q8``) stores the
layers' four matrices as int8 with one scale per output row: half the bytes a decode step
streams.  Here the default model is loaded twice in one process (bf16 and int8; the head is bf16
in both, its greedy int8 copy where built) and, interleaved over rounds (this machine's speed
drifts within minutes), timed on:

- a one-token greedy decode step (the engine's) with 256, 1,024 and 2,048 positions cached;
- a causal pass of 4, 8 and 16 rows after 1,024 positions (speculation's verification sizes);
- a prompt of 1,024 tokens prefilled from nothing (the native pieces of 256 rows).

Random token ids (the cost does not depend on them).  Also the native copies' bytes.  How close
the int8 model's completions are to bf16's is bench/infill.py's ``--weights`` (quality), and the
speculation and replay runs are listed in the results' notes; ``--compare`` puts two infill runs
side by side (scores, and how many completions are the same text).  Writes
bench/results/int8_weights.md (+ .json) or ``--out``.

    python bench/int8_weights.py [--rounds 7] [--out bench/results/int8_weights_avx2]
    python bench/int8_weights.py --compare BF16.json INT8.json --out bench/results/int8_weights_infill_avx2
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
from common import RESULTS, header, write_results  # noqa: E402


def compare(bf16_json: str, int8_json: str, out: str) -> None:
    """Two bench/infill.py runs of the same tasks (``--weights bf16`` and ``int8``): per set, the
    scores side by side and how many completions are the same text."""
    a, b = (json.loads(Path(p).read_text()) for p in (bf16_json, int8_json))
    if (a.get("weights"), b.get("weights")) != ("bfloat16", "int8"):
        sys.exit(f"expected a bf16 run then an int8 run, got {a.get('weights')} and {b.get('weights')}")
    lines = [header("int8 layer weights against bf16: HumanEval-Infilling completions"),
             f"Runs: `{bf16_json}` (bf16) and `{int8_json}` (int8), model {a['model']}, greedy, the same tasks.", "",
             "| set / format | tasks | pass@1 bf16 / int8 | EM bf16 / int8 | ES bf16 / int8 | same completion |",
             "|---|---|---|---|---|---|"]
    data = {"runs": [bf16_json, int8_json], "sets": {}}
    for key, ra in a["results"].items():
        rb = b["results"][key]
        ta, tb = a["texts"][key], b["texts"][key]
        same = sum(x == y for x, y in zip(ta, tb))
        lines.append(f"| {key} | {ra['n']} | {ra['pass@1']} / {rb['pass@1']} | {ra['em']} / {rb['em']} | "
                     f"{ra['es']} / {rb['es']} | {same}/{len(ta)} ({100 * same / max(1, len(ta)):.0f} %) |")
        data["sets"][key] = {"bf16": ra, "int8": rb, "same": same, "n": len(ta)}
    write_results(out, lines, data)


def main() -> None:
    from codecomplete.model.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compare", nargs=2, metavar=("BF16_JSON", "INT8_JSON"),
                    help="instead: compare two bench/infill.py runs (--weights bf16, then int8)")
    ap.add_argument("--out", default=str(RESULTS / "int8_weights"))
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare, args.out)
        return

    models = {}
    for w in ("bf16", "int8"):
        lm = load_model(args.model, weights=w)
        if lm.model.native_stack is None:
            sys.exit("needs a bf16 model on the native CPU path (dtype bf16, a C compiler)")
        models[w] = lm.model
    if models["int8"].weights != "int8":
        sys.exit(f"int8 weights did not load (weights: {models['int8'].weights})")
    g = torch.Generator().manual_seed(0)
    vocab = models["bf16"].args.vocab_size
    ctx = torch.randint(0, vocab, (1, 2048 + 16), generator=g)

    def step(model, positions: int, reps: int = 12) -> float:
        """ms of a one-token greedy step after ``positions`` cached (median of ``reps``)."""
        c = model.new_cache(positions + reps + 8)
        model(ctx[:, :positions], [c])
        base, times = c.length, []
        tok = torch.tensor([[7]])
        for _ in range(reps):
            c.length = base
            t = time.perf_counter()
            model(tok, [c], greedy=True)
            times.append((time.perf_counter() - t) * 1000)
        return statistics.median(times)

    def verify(model, rows: int, reps: int = 8) -> float:
        """ms of a causal pass of ``rows`` tokens after 1,024 cached, every row's logits."""
        c = model.new_cache(1024 + rows + 8)
        model(ctx[:, :1024], [c])
        base, times = c.length, []
        toks = ctx[:, 1024:1024 + rows]
        for _ in range(reps):
            c.length = base
            t = time.perf_counter()
            model(toks, [c], logits_for="all")
            times.append((time.perf_counter() - t) * 1000)
        return statistics.median(times)

    def prefill(model, n: int = 1024) -> float:
        c = model.new_cache(n + 8)
        t = time.perf_counter()
        model(ctx[:, :n], [c])
        return (time.perf_counter() - t) * 1000

    cells = [("decode step, 256 cached", lambda m: step(m, 256)),
             ("decode step, 1,024 cached", lambda m: step(m, 1024)),
             ("decode step, 2,048 cached", lambda m: step(m, 2048)),
             ("pass of 4 rows, 1,024 cached", lambda m: verify(m, 4)),
             ("pass of 8 rows, 1,024 cached", lambda m: verify(m, 8)),
             ("pass of 16 rows, 1,024 cached", lambda m: verify(m, 16)),
             ("prefill of 1,024 tokens", prefill)]
    times = {name: {w: [] for w in models} for name, _ in cells}
    with torch.inference_mode():
        for name, fn in cells:  # once untimed: caches and pages warm
            for m in models.values():
                fn(m)
        for r in range(args.rounds):
            for name, fn in cells:
                order = list(models.items()) if r % 2 == 0 else list(models.items())[::-1]
                for w, m in order:
                    times[name][w].append(fn(m))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)

    arena = {w: m.native_arena.numel() / 1e6 if m.native_arena is not None else None
             for w, m in models.items()}
    lines = [header("int8 layer weights against bf16 (model.weights)"),
             f"Model {args.model}; the layers' matrices bf16 or int8 (a scale per output row), the head bf16 in both "
             f"(its greedy int8 copy as built). Native copies: bf16 {arena['bf16']:.0f} MB, "
             f"int8 {arena['int8']:.0f} MB. "
             f"Median of {args.rounds} interleaved rounds (each cell's median over its repetitions), random tokens.",
             "", "| pass | bf16 ms | int8 ms | bf16 / int8 (median of rounds) |", "|---|---|---|---|"]
    data = {"model": args.model, "rounds": args.rounds, "arena_mb": arena, "cells": {}}
    for name, _ in cells:
        b, q = times[name]["bf16"], times[name]["int8"]
        ratio = statistics.median(x / y for x, y in zip(b, q))
        lines.append(f"| {name} | {statistics.median(b):.2f} | {statistics.median(q):.2f} | {ratio:.2f}x |")
        data["cells"][name] = {"bf16_ms": b, "int8_ms": q, "ratio": ratio}
    write_results(args.out, lines, data)


if __name__ == "__main__":
    main()
