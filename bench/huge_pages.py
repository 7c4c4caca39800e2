"""A model's packed weights on transparent huge pages against 4 KB pages (CPU, bf16, native kernels).

Every decode step streams all of a model's packed weights from memory (269 MB for SmolLM2-135M):
through 4 KB pages that is a TLB walk every 4 KB, and the hardware prefetchers stop at each
page's end.  ``Transformer.native_decode`` puts them in one buffer advised for huge pages
(``native.huge_views``).  This benchmark loads the model twice in one process, once with
CODECOMPLETE_HUGE_PAGES=0 (plain pages) and once without, checks that both give the same
logits, and times forwards of S rows (a decode step, or a verification pass's chain) after L
cached positions, the two models alternating within each round (this machine's speed drifts
within minutes); each cell is the median over rounds, the ratio the median of the per-round
ratios.  Also reports how much of the process's memory the kernel gave huge pages
(/proc/self/smaps_rollup, AnonHugePages) after each load.

    python bench/huge_pages.py [--model default] [--rows 1,4,8] [--contexts 16,1024] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, median_ms, native_model, ratio_in_rounds, write_results  # noqa: E402

import torch  # noqa: E402


def anon_huge_kb() -> int | None:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--contexts", default="16,1024")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(RESULTS / "huge_pages"))
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    models, huge_kb = {}, {}
    for name, env in (("plain pages", "0"), ("huge pages", "1")):
        os.environ["CODECOMPLETE_HUGE_PAGES"] = env
        models[name] = native_model(args.model)
        huge_kb[name] = anon_huge_kb()
    os.environ.pop("CODECOMPLETE_HUGE_PAGES")
    a = models["plain pages"].model.args
    torch.manual_seed(0)
    ids = torch.randint(0, a.vocab_size, (1, max(contexts) + max(rows)))
    cells: dict[str, list[float]] = {}
    with torch.inference_mode():
        caches = {}
        for name, lm in models.items():
            for L in contexts:
                c = lm.model.new_cache(L + max(rows) + 1)
                for i in range(0, L, 256):
                    lm.model(ids[:, i:min(L, i + 256)], [c])
                caches[name, L] = c
        outs = []
        for name, lm in models.items():
            c = caches[name, contexts[0]]
            outs.append(lm.model(ids[:, :max(rows)], [c], logits_for="all").float())
            c.length = contexts[0]
        if not torch.equal(outs[0], outs[1]):
            raise SystemExit("the two models' logits differ")

        def forward(name: str, L: int, s: int):
            lm, c, toks = models[name], caches[name, L], ids[:, L:L + s]

            def run():
                lm.model(toks, [c], logits_for="all" if s > 1 else "last")
                c.length = L
            return run

        for r in range(args.rounds):
            for L in contexts:
                for s in rows:
                    for name in models:
                        cells.setdefault(f"{name}/{L}/{s}", []).append(median_ms(forward(name, L, s), args.reps))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    lines = [header("Packed weights on huge pages against 4 KB pages"),
             f"Model {models['plain pages'].name} ({models['plain pages'].model.dtype}); the same model loaded twice "
             f"in one process, logits identical. Huge pages the kernel gave the process after each load "
             f"(AnonHugePages): {', '.join(f'{n} {kb} kB' for n, kb in huge_kb.items())}. Forwards of S rows (a "
             f"causal chain) after L cached positions; {args.rounds} rounds, the two alternating in each, "
             f"median of {args.reps} a cell; speed-up: median of the per-round ratios.", "",
             "| L | S | plain pages ms | huge pages ms | speed-up |", "|---|---|---|---|---|"]
    for L in contexts:
        for s in rows:
            p, h = cells[f"plain pages/{L}/{s}"], cells[f"huge pages/{L}/{s}"]
            ratio = ratio_in_rounds(p, h)
            lines.append(f"| {L} | {s} | {statistics.median(p):.2f} | {statistics.median(h):.2f} | {ratio:.3f}x |")
    lines.append("")
    write_results(args.out, lines, {"cells": cells, "anon_huge_kb": huge_kb})


if __name__ == "__main__":
    main()
