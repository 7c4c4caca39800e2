"""What early exit could buy on this machine with better exits: measured ceilings (issue #9).

    python bench/early_exit_ceiling.py [--model default] [--layers 8,12,16,20,24]
        [--agree 0.6,0.8,0.9,1.0] [--tokens 48] [--repeats 8] [--out bench/results/early_exit_ceiling]

The early-exit benchmark measures the exits the project has; this one asks how good they
would have to be, by running the engine's own decode paths with the choice of the exit
taken over by an oracle that knows the full model's greedy output (a reference decode of
the same prompts made first).  The work of every round is the real one (early layers,
exit checks, KV filling, verification passes); only which token is drafted or kept changes.

- ``lossy@E``: every token leaves at layer E (threshold ~0 there). Its cost per token
  relative to the full model, c(E), is what a lossy exit at E saves on the tokens it takes;
  ``checks``: the shipped exits' softmax checks at every exit, never exiting (the price of
  asking).  A lossy mode where a share f of tokens exits at E runs at about
  1 / (f c(E) + (1 - f) c(checks)) of the full model's time per token.
- ``oracle@E:A``: lossless self-speculation drafting from layer E (the engine's
  ``self_spec``, its exit check included), where each draft agrees with the full model with
  probability A, independently per position, and drafting stops before the first
  disagreement (a perfect confidence measure: the best case for agreement A);
  ``oracle@E:A:miss`` drafts the disagreeing token too (then stops), as a confident but wrong
  exit would; ``:kN`` allows N drafts per verification (default 4, the engine's).
  The outputs must still equal the reference (the verification is real): counted.
- ``lossless@E``: the real lossless mode with the exits the model has, for comparison.

Speed-ups are medians over interleaved rounds of per-round ratios to ``full`` (this
machine's speed drifts within minutes).  Exits at layers without a trained adapter (8 and
12 for the default model) use a zero adapter: the same cost as a trained one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, ratio_in_rounds  # noqa: E402
from early_exit import decode, load_with_exits, speed_prompts  # noqa: E402

import torch  # noqa: E402

from codecomplete.model.api import ExitSettings  # noqa: E402
from codecomplete.model.early_exit import Exits  # noqa: E402
from codecomplete.model.engine import ExitRuntime  # noqa: E402


def widen(exits: Exits, layers: list[int], model) -> Exits:
    """``exits`` with exit points at ``layers`` too (zero adapters where none was trained)."""
    all_layers = sorted(set(exits.layers) | set(layers))
    out = Exits(model.args.dim, all_layers, exits.subset.clone()).to(device=model.device, dtype=model.dtype).eval()
    with torch.no_grad():
        for n in exits.layers:
            out.adapters[out.index(n)].weight.copy_(exits.adapters[exits.index(n)].weight)
    out.trained, out.final, out.thresholds = True, exits.final, dict(exits.thresholds)
    return out


def oracle(refs: dict, agree: float, miss: bool, seed: int, vocab: int):
    """(request, draft index) -> the reference token while a fixed draw per position says the
    exit agrees; at the first disagreement None, or with ``miss`` a wrong token (then None)."""
    draws = {key: [random.Random(f"{seed}/{i}/{p}").random() for p in range(len(r))]
             for i, (key, r) in enumerate(sorted(refs.items()))}

    def pick(lv, j: int) -> int | None:
        key = (lv.request.prefix, lv.request.suffix)
        ref, d, n = refs[key], draws[key], len(lv.generated)  # the next token is ref[n]
        if n + j >= len(ref) or any(d[n + i] >= agree for i in range(j)):  # past a wrong draft
            return None
        if d[n + j] < agree:
            return ref[n + j]
        return (ref[n + j] + 1) % vocab if miss else None

    return pick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--exits", default="", help="exit heads folder (default: stored with the model)")
    ap.add_argument("--layers", default="8,12,16,20,24")
    ap.add_argument("--agree", default="0.6,0.8,0.9,1.0")
    ap.add_argument("--extra", default="oracle@16:0.8:miss,oracle@20:0.9:miss,oracle@12:1.0:k8,oracle@16:1.0:k8",
                    help="more configs")
    ap.add_argument("--real", default="16,20,24", help="real lossless modes from these exits")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "early_exit_ceiling"))
    args = ap.parse_args()
    lm, path, shipped = load_with_exits(args.model, args.dtype, args.exits)
    layers = [int(x) for x in args.layers.split(",") if x.strip()]
    exits = widen(shipped, layers, lm.model)
    prompts = speed_prompts(args.seed)
    refs: dict = {}
    decode(lm, None, prompts[:2], 8, 1)  # warm-up
    decode(lm, None, prompts, args.tokens, 1, outputs=refs)

    configs: dict[str, ExitRuntime | None] = {"full": None}
    configs["checks"] = ExitRuntime.build(shipped, ExitSettings(enabled=True, threshold=2.0, max_batch=1))
    for e in layers:
        configs[f"lossy@{e}"] = ExitRuntime.build(exits, ExitSettings(enabled=True, threshold=1e-9, layers=str(e)))
    names = [f"oracle@{e}:{a}" for e in layers for a in args.agree.split(",")]
    names += [x for x in args.extra.split(",") if x.strip()]
    for name in names:
        e, a, *opts = name.removeprefix("oracle@").split(":")
        k = next((int(o[1:]) for o in opts if o.startswith("k")), 4)
        rt = ExitRuntime.build(exits, ExitSettings(enabled=True, lossless=True, draft_layer=int(e), draft_bound=0,
                                                   draft_tokens=k))
        rt.oracle = oracle(refs, float(a), "miss" in opts, args.seed, lm.model.args.vocab_size)
        configs[name] = rt
    for e in [int(x) for x in args.real.split(",") if x.strip()]:
        configs[f"lossless@{e}"] = ExitRuntime.build(shipped, ExitSettings(enabled=True, lossless=True, draft_layer=e))

    runs: dict[str, list[dict]] = {k: [] for k in configs}
    same: dict[str, list[int]] = {k: [0, 0] for k in configs}
    for name, rt in configs.items():
        decode(lm, rt, prompts[:1], 8, 1)  # warm-up
    for r in range(args.repeats):
        pair = [prompts[(2 * r) % len(prompts)], prompts[(2 * r + 1) % len(prompts)]]
        for name, rt in configs.items():
            outs: dict = {}
            runs[name].append(decode(lm, rt, pair, args.tokens, 1, outputs=outs))
            if not name.startswith("lossy"):
                same[name][0] += sum(outs[p] == refs[p] for p in pair)
                same[name][1] += len(pair)
        print(f"round {r + 1}/{args.repeats}", {k: v[-1]["tokens_per_s"] for k, v in runs.items()}, file=sys.stderr)

    n_layers = lm.model.args.n_layers
    res: dict[str, dict] = {}
    for name, rs in runs.items():
        tokens = sum(x["tokens"] for x in rs)
        passes, layers_run = sum(x["passes"] for x in rs), sum(x["layers"] for x in rs)
        row = {"tokens_per_s": round(tokens / sum(x["seconds"] for x in rs), 2),
               "speedup": round(ratio_in_rounds([x["tokens_per_s"] for x in rs],
                                                [x["tokens_per_s"] for x in runs["full"]]), 3),
               "cost": round(ratio_in_rounds([1 / x["tokens_per_s"] for x in rs],
                                             [1 / x["tokens_per_s"] for x in runs["full"]]), 3),
               "tokens_per_pass": round(tokens / passes, 3), "layers_per_token": round(layers_run / tokens, 2)}
        cfg = configs[name]
        if cfg is not None and cfg.lossless:
            drafted = (layers_run - passes * n_layers) / cfg.draft_layer
            acc = sum(x["accepted"] for x in rs)
            row.update(drafted_per_pass=round(drafted / passes, 3), accepted_share=round(acc / max(1, drafted), 3))
        if same[name][1]:
            row["identical"] = f"{same[name][0]}/{same[name][1]}"
        res[name] = row

    agree = {int(k.split("/")[1]): v["agree"] for k, v in shipped.meta.get("calibration", {}).items()
             if k.startswith("softmax/")}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"model": lm.name, "exits": str(path), "results": res,
                                                    "exit_agreement": agree}, indent=1))
    lines = [header("Early exit: what better exits could buy (measured ceilings)"),
             f"Model: {lm.name} ({str(lm.dtype).removeprefix('torch.')}), {n_layers} layers; greedy decoding of "
             f"{args.tokens} tokens (EOS ignored, prefill excluded) from {len(prompts)} HumanEval-Infilling prompts, "
             f"2 a round, {args.repeats} interleaved rounds; speed-up and cost = medians of per-round ratios to full. "
             f"Shipped exits at {shipped.layers} (agreement with the full model on validation positions: "
             f"{', '.join(f'{k}: {v}' for k, v in sorted(agree.items()))}).",
             "", "| config | speed-up | cost per token (full = 1) | tokens/s | tokens per pass | layers per token | "
             "drafts per pass | drafts accepted | identical to full |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        lines.append(f"| {name} | {r['speedup']}x | {r['cost']} | {r['tokens_per_s']} | {r['tokens_per_pass']} | "
                     f"{r['layers_per_token']} | {r.get('drafted_per_pass', '-')} | {r.get('accepted_share', '-')} | "
                     f"{r.get('identical', '-')} |")
    c_chk = res["checks"]["cost"]
    lines += ["", "Lossy ceiling from the costs above: speed-up when a share f of tokens exits at E (and is right) "
              "and the rest run every layer with the checks, 1 / (f c(E) + (1 - f) c(checks)):", "",
              "| exit E | c(E) | f = 0.25 | f = 0.5 | f = 0.75 | f = 1 |", "|---|---|---|---|---|---|"]
    for e in layers:
        c = res[f"lossy@{e}"]["cost"]
        cells = [f"{1 / (f * c + (1 - f) * c_chk):.2f}x" for f in (0.25, 0.5, 0.75, 1.0)]
        lines.append(f"| {e} | {c} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
