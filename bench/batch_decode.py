"""Batched decode steps of this checkout's native kernels against an earlier revision's.

Builds the native library of ``--old`` beside this checkout's (``common.build_revision``) and
times the default model's one-token decode step at each batch size (every sequence with its own
cache of ``--context`` random prompt tokens), the two libraries taking turns within each round
(this machine's memory bandwidth drifts within minutes).  The model and its packed weights are
this checkout's; only the kernels differ, so the revisions must share the weights' layout and
the structures model/native/__init__.py hands the library (``Stack``, ``StepCaches``).
Writes bench/results/batch_decode.md (+ .json).

    python bench/batch_decode.py [--old 4b689b6] [--batches 1,4,8,16] [--context 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, build_revision, decode_ms, header, native_model, ratio_in_rounds, write_results  # noqa: E402

from codecomplete.model import native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--old", default="4b689b6")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "batch_decode"))
    args = ap.parse_args()
    lm = native_model(args.model)
    new = native._lib
    tmp = tempfile.TemporaryDirectory()
    old = build_revision(args.old, Path(tmp.name))
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    cells: dict[tuple, list[float]] = {}
    try:
        with torch.inference_mode():
            for r in range(args.rounds):
                for b in batches:
                    prompts = torch.randint(0, lm.model.args.vocab_size, (b, args.context))
                    for name, lib in (("old", old), ("new", new)):
                        native._lib = lib
                        cells.setdefault((name, b), []).append(decode_ms(lm.model, prompts, args.steps, warm=2))
                print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        native._lib = new
        tmp.cleanup()
    lines = [header("Batched decode steps: this checkout's kernels against an earlier revision's"), "",
             f"Model {lm.name} ({str(lm.dtype).removeprefix('torch.')}); one-token decode steps, each sequence "
             f"with its own cache of {args.context} prompt tokens; {args.steps} timed steps after 2 untimed, "
             f"{args.rounds} rounds, the two libraries alternating in each; medians; speed-up = median of "
             f"per-round ratios. Old: the native kernels of {args.old}.", "",
             "| batch | old ms/step | new ms/step | speed-up | new tokens/s |", "|---|---|---|---|---|"]
    for b in batches:
        o, n = statistics.median(cells[("old", b)]), statistics.median(cells[("new", b)])
        lines.append(f"| {b} | {o:.2f} | {n:.2f} | {ratio_in_rounds(cells[('old', b)], cells[('new', b)]):.2f}x | "
                     f"{1000 * b / n:.0f} |")
    write_results(args.out, lines, {"model": lm.name, "old": args.old, "context": args.context,
                                    "cells": {f"{k}/{b}": v for (k, b), v in cells.items()}})


if __name__ == "__main__":
    main()
