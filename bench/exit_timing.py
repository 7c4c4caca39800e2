"""The lossy early exit's cost model, measured on this machine and engine (issue #9).

    python bench/exit_timing.py [--exits DIR [DIR ...]] [--exit-layers 16,20,24,27] [--tokens 32]
        [--rounds 6] [--out bench/results/exit_timing]

``exit_train --policy joint`` picks thresholds with a cost per token in layers (``--cost
CHECK,HEAD,FILL_A,FILL_B``): a check at an exit, the full head (with everything else a step
does besides the layers), and leaving early (FILL_A + FILL_B x the layers skipped).  The joint
search is only as good as those numbers, and they were last measured several engine changes ago.
This measures them on the engine as it stands, by timing forced policies through the engine's
own decode path (``decode_step`` at batch 1, ``--tokens`` tokens, end-of-text ignored, prefill
excluded), interleaved in rounds (this machine's speed drifts: each config is taken against the
full model's step of the same round, in that round's layer time, and the median over rounds kept):

- ``full``: every layer and the full head;
- ``check@E``: the exit at E checked and never confident (threshold 2), so full + one check;
- ``leave@E``: always confident at E (threshold 0): E layers, a check, the KV filling of the rest;
- ``skip``: the check after the last layer always confident: every layer, no full head;

and a layer's own time from the native stack alone (``decode_stack`` over 10, 20 and 30 layers at
one position).  Then, in layers: CHECK = check@E - full; HEAD = full - 30 layers; leave@E = E + CHECK
+ FILL_A + FILL_B (30 - E) fitted by least squares over E.  One row per exits folder (its
adapters set a check's cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, write_results  # noqa: E402
from early_exit import decode, speed_prompts  # noqa: E402

import torch  # noqa: E402

from codecomplete.model import native  # noqa: E402
from codecomplete.model.early_exit import ExitPolicy, load_exits  # noqa: E402
from codecomplete.model.engine import ExitRuntime, default_exits_path  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402


def layer_ms(lm, reps: int = 100) -> tuple[float, dict]:
    """One layer's time (ms) at batch 1: the slope of the native stack's time over 10, 20 and 30
    layers for one token at position ~400 (the cache length restored after every call)."""
    model = lm.model
    stack = model.native_stack
    if stack is None:
        raise SystemExit("the model does not run through the native stack (a bf16 CPU model is needed)")
    cache = model.new_cache(512)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, 400)), [cache])
        cache.reserve(1)
        x0 = model.embed(torch.tensor([[5]]))
        cos, sin = model.rope(torch.tensor([[cache.length]]))
        times = {}
        for n in (10, 20, 30, 10, 20, 30):
            for _ in range(20):
                native.decode_stack(stack, x0, cos, sin, native.StepCaches([cache]), None, logits=None, layers=(0, n))
            t0 = time.perf_counter()
            for _ in range(reps):
                native.decode_stack(stack, x0, cos, sin, native.StepCaches([cache]), None, logits=None, layers=(0, n))
            times.setdefault(n, []).append((time.perf_counter() - t0) / reps * 1e3)
    med = {n: statistics.median(v) for n, v in times.items()}
    slope = (med[30] - med[10]) / 20
    return slope, {str(n): round(v, 4) for n, v in med.items()}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--exits", nargs="*", default=[], help="exit heads folders (default: the model's own)")
    ap.add_argument("--exit-layers", default="16,20,24,27")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2, help="prompts a round per config")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=str(RESULTS / "exit_timing"))
    args = ap.parse_args()
    lm = load_model(args.model)
    n_layers = lm.model.args.n_layers
    folders = [Path(p) for p in args.exits] or [default_exits_path(lm)]
    exits = {str(f): load_exits(f, lm.model) for f in folders}
    layers = [int(x) for x in args.exit_layers.split(",")]
    prompts = speed_prompts(0)

    configs: dict[str, ExitRuntime | None] = {"full": None}
    for name, ex in exits.items():
        use = [e for e in layers if e in ex.layers]
        for e in use:
            configs[f"{name}|check@{e}"] = ExitRuntime(ex, ExitPolicy("softmax", {e: 2.0}))
            configs[f"{name}|leave@{e}"] = ExitRuntime(ex, ExitPolicy("softmax", {e: 0.0}))
        if ex.final == n_layers:
            configs[f"{name}|skip"] = ExitRuntime(ex, ExitPolicy("softmax", {n_layers: 0.0}))
    per_token: dict[str, list[float]] = {}
    layer_runs, stack_runs = [], []
    for r in range(args.rounds):
        group = [prompts[(args.prompts * r + i) % len(prompts)] for i in range(args.prompts)]
        for name, rt in configs.items():
            got = decode(lm, rt, group, args.tokens, 1)
            per_token.setdefault(name, []).append(1000 * got["seconds"] / got["tokens"])
        slope, stack = layer_ms(lm)
        layer_runs.append(slope)
        stack_runs.append(stack)
        print(f"round {r + 1}/{args.rounds}: layer {layer_runs[-1]:.3f} ms, full {per_token['full'][-1]:.2f} ms/token",
              file=sys.stderr)
    lay = statistics.median(layer_runs)
    stack_ms = {n: round(statistics.median(r[n] for r in stack_runs), 4) for n in stack_runs[0]}
    ms = {k: statistics.median(v) for k, v in per_token.items()}
    full = ms["full"]
    head = statistics.median(f / lr - n_layers for f, lr in zip(per_token["full"], layer_runs))

    def layers_over_full(name: str) -> float:
        """The config's extra time over the full step of the same round, in that round's layers
        (paired: the machine's drift between rounds cancels), median over rounds."""
        return statistics.median((c - f) / lr for c, f, lr in zip(per_token[name], per_token["full"], layer_runs))

    rows, data = [], {"layer_ms": round(lay, 4), "stack_ms": stack_ms, "full_ms": round(full, 3),
                      "head_layers": round(head, 2), "per_token_ms": {k: round(v, 3) for k, v in ms.items()},
                      "rounds": args.rounds, "tokens": args.tokens, "folders": {}}
    for name, ex in exits.items():
        use = [e for e in layers if f"{name}|check@{e}" in ms]
        checks = [layers_over_full(f"{name}|check@{e}") for e in use]
        check = statistics.mean(checks)
        # leave@E in layers = E + check + fill_a + fill_b (n - E): fit (leave - E - check) on (n - E)
        xs = [n_layers - e for e in use]
        ys = [layers_over_full(f"{name}|leave@{e}") + n_layers + head - e - check for e in use]
        fill_b, fill_a = fit_line(xs, ys)
        skip = ms.get(f"{name}|skip")
        rec = {"adapter": ex.adapter_kind, "check_layers": round(check, 2),
               "check_by_exit": {str(e): round(c, 2) for e, c in zip(use, checks)},
               "fill_a": round(fill_a, 2), "fill_b": round(fill_b, 3),
               "leave_step_share": {str(e): round(ms[f"{name}|leave@{e}"] / full, 3) for e in use},
               "skip_step_share": round(skip / full, 3) if skip else None,
               "cost": f"{check:.2f},{head:.1f},{fill_a:.2f},{fill_b:.2f}"}
        data["folders"][name] = rec
        per_exit = ", ".join(f"{e}: {c:.2f}" for e, c in zip(use, checks))
        rows.append(f"| {name} ({ex.adapter_kind}) | {rec['check_layers']} ({per_exit}) "
                    f"| {rec['fill_a']} + {rec['fill_b']} x skipped | "
                    f"{', '.join(f'{e}: {v}' for e, v in rec['leave_step_share'].items())} | {rec['skip_step_share']} "
                    f"| `--cost {rec['cost']}` |")
    lines = [header("Early exit's cost model, measured"), "",
             f"Batch 1, {args.tokens} tokens a request (end-of-text ignored, prefill excluded), {args.prompts} "
             f"prompts a config in each of {args.rounds} interleaved rounds; medians over rounds.", "",
             f"- a layer: {lay:.3f} ms (native stack over 10 / 20 / 30 layers: "
             f"{stack_ms['10']} / {stack_ms['20']} / {stack_ms['30']} ms)",
             f"- full step: {full:.2f} ms a token = {n_layers} layers + HEAD {head:.1f} layers (the head and "
             "everything else a step does)", "",
             "| exits | CHECK, layers (per exit) | leaving early, layers | a token leaving at E, share of a full step "
             "| head skipped after the last layer, share | exit_train |",
             "|---|---|---|---|---|---|", *rows]
    write_results(args.out, lines, data)


if __name__ == "__main__":
    main()
