"""Which exits are worth their checks?  (issue #9)

    python bench/exit_cost.py EXITS_DIR [EXITS_DIR ...] [--bounds 0.02,0.05,0.1] [--batches 10]
        [--check 1.55] [--head 8] [--fill 3.5,0.08] [--out bench/results/exit_cost]

exit_train keeps an exit at a bound when its threshold lets at least ``min_rate`` of the
validation tokens leave there, but every token that reaches an exit pays its check, and a token
that leaves pays the KV filling of the skipped layers.  This replays the engine's lossy policy
(a token leaves at the first exit whose softmax margin passes its threshold; after the last
layer a confident margin skips the full head) on the validation split's FIM-middle positions
(fp32 states; bench/exit_dtype.py found the thresholds hold on bf16 ones) for every subset of
each folder's calibrated exits, with a cost per token in layers:

    layers run + checks x CHECK + (left early: FILL_A + FILL_B x layers skipped; else the full
    head, HEAD, unless the last layer's check skipped it)

CHECK, HEAD and FILL default to this AVX2 EPYC's measurements (docs/decisions.md, fifth session:
a check 0.48 ms, a layer ~0.31 ms, the head ~8 layers of products, a token leaving at 8 / 16 / 24
costing 0.39 / 0.58 / 0.78 of a step).  Reports, per folder and bound, the calibrated set's cost
and disagreement and the cheapest subset's.  A projection on the calibration data, not a speed
measurement: bench/early_exit.py measures (its ``MEASURE@BOUND:20+24+30`` configs run a subset).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, write_results  # noqa: E402

from codecomplete.model.early_exit import load_exits  # noqa: E402
from codecomplete.model.exit_train import ExitCost, collect, replay  # noqa: E402
from codecomplete.model.exit_train import margins as exit_margins  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402


def margins(lm, folder: Path, batches: int) -> tuple[dict, dict, object]:
    """Per exit (and the last layer's check): the softmax margin and whether the exit's token is
    the full model's, at each validation position (exit_train's ``margins`` on ``collect``'s
    states, as calibration computes them)."""
    ex = load_exits(folder, lm.model)
    ex.to(dtype=lm.model.dtype).eval()
    val = collect(lm, batches, ex.layers, "validation", 1, final=bool(ex.final))
    conf, agree = exit_margins(lm.model, ex, val, "softmax", ex.layers + ([ex.final] if ex.final else []))
    return conf, agree, ex


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exits", type=Path, nargs="+")
    ap.add_argument("--bounds", default="0.02,0.05,0.1")
    ap.add_argument("--batches", type=int, default=10, help="validation batches of 4 x 512")
    ap.add_argument("--check", type=float, default=1.55, help="a check's cost in layers")
    ap.add_argument("--head", type=float, default=8.0, help="the full head's cost in layers")
    ap.add_argument("--fill", default="3.5,0.08", help="a token leaving early: A + B x skipped layers")
    ap.add_argument("--out", default=str(RESULTS / "exit_cost"))
    args = ap.parse_args()
    fill = tuple(float(x) for x in args.fill.split(","))
    model_cost = ExitCost(args.check, args.head, *fill)
    lm = load_model("default", device="cpu", dtype="float32")
    n_layers = lm.model.args.n_layers
    full = n_layers + args.head
    lines = [header("Which exits are worth their checks"), "",
             f"Cost model (layers): a check {args.check}, the full head {args.head}, leaving early {fill[0]} + "
             f"{fill[1]} x skipped layers; the full model costs {full:g}. Projected speed-up = {full:g} / mean cost.",
             "",
             "| exits | bound | set | exits checked | mean cost | projected speed-up "
             "| tokens left early with another token | mean layers run |", "|---|---|---|---|---|---|---|---|"]
    data: dict = {}
    for folder in args.exits:
        conf, agree, ex = margins(lm, folder, args.batches)
        data[str(folder)] = {"positions": len(next(iter(conf.values()))), "bounds": {}}
        for bound in args.bounds.split(","):
            thr = ex.thresholds.get(f"softmax@{bound}", {})
            exits = tuple(n for n in ex.layers if n in thr)
            final = ex.final if ex.final in thr else 0
            rows = {}
            for k in range(len(exits) + 1):
                for sub in itertools.combinations(exits, k):
                    for fin in ((final, 0) if final else (0,)):
                        t = {n: thr[n] for n in sub} | ({fin: thr[fin]} if fin else {})
                        rows[(sub, fin)] = replay(conf, agree, t, n_layers, fin, model_cost)
            calibrated = rows[(exits, final)]
            best_key = min(rows, key=lambda k: rows[k][0])
            data[str(folder)]["bounds"][bound] = {"calibrated": [list(exits), final, *calibrated],
                                                  "cheapest": [list(best_key[0]), best_key[1], *rows[best_key]]}
            for label, (sub, fin), (cost, wrong, depth) in (("calibrated", (exits, final), calibrated),
                                                            ("cheapest", best_key, rows[best_key])):
                checked = "+".join(str(n) for n in sub + ((fin,) if fin else ())) or "none"
                name = folder.name if folder.name != "exits" else folder.parent.name
                lines.append(f"| {name} | {bound} | {label} | {checked} | {cost:.2f} | {full / cost:.3f}x | "
                             f"{wrong:.4f} | {depth:.2f} |")
    write_results(args.out, lines, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
