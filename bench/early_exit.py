"""Early exit against the full model: decode speed, exit rates, output quality.

    python bench/early_exit.py [--model default] [--exits DIR] [--tasks 40] [--tokens 48]
        [--configs full,softmax@0.02,classifier@0.05,lossless@24] [--out bench/results/early_exit]

Configs: ``full``; ``MEASURE@BOUND`` (softmax, cosine or classifier confidence with the
thresholds calibrated for that token-disagreement bound); ``lossless@LAYER``
(self-speculation drafting from that exit); ``CONFIG~DIR``: that config on the exits in DIR
instead of ``--exits``, timed in the same rounds (two exit folders compared paired).

Speed: greedy decoding of ``--tokens`` tokens (EOS ignored) from HumanEval-Infilling
prompts, at batch 1 (two prompts a round) and at the ``--batches`` sizes (16 by default; one
batch every third round), through the engine's own decode functions (``step``, ``exit_step``,
``self_spec_step``).  ``--stop``: as served instead, each request ends at end-of-text or its
stop rules (mode auto, at most ``--tokens`` tokens; eight prompts a round), so the tokens timed
are the ones a user would get, not the ones past a completion's natural end.  The batch rows force the exits (the daemon's ``max_batch`` = 1 decodes a
larger batch without them; lossless mode's batches take plain steps); decode
tokens/s, per-token latency, mean layers run per token, the exit rate per layer and how
often the last layer's check skipped the full vocabulary head.
Quality: HumanEval single-line infilling through the engine (EFIM prompts for FIM
models, as bench/infill.py), pass@1, EM and ES against the truth, and how often the
output is identical to the full model's (with ES between the two).  The exits are the
calibrated ones stored with the model (``--exits`` overrides); ``batch_rule`` "each" and
"all" are both measured at batch 16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import infill  # noqa: E402
from common import RESULTS, header  # noqa: E402

import torch  # noqa: E402

from codecomplete.daemon.replay import edit_similarity  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings, ExitSettings, SpecSettings  # noqa: E402
from codecomplete.model.early_exit import ExitsError, load_exits  # noqa: E402
from codecomplete.model.engine import (Engine, ExitRuntime, advance, decode_step,  # noqa: E402
                                       default_exits_path, plan_prompt, start)
from codecomplete.model.loader import load_model  # noqa: E402

def settings_for(name: str, path: str) -> ExitSettings | None:
    """``full``; ``MEASURE@BOUND`` (lossy early exit with thresholds calibrated for that
    token disagreement; ``MEASURE@BOUND:24+30`` only at those exits); ``lossless@LAYER`` (self-speculation drafting at that exit
    while it is confident at the default ``draft_bound``; ``lossless@LAYER:BOUND`` at that bound, 0: always;
    ``lossless@LAYER:BOUND:N`` at most N drafts)."""
    if name == "full":
        return None
    kind, _, arg = name.partition("@")
    if kind == "lossless":
        layer, _, bound = arg.partition(":")
        bound, _, drafts = bound.partition(":")
        extra = {"draft_bound": float(bound)} if bound else {}
        if drafts:
            extra["draft_tokens"] = int(drafts)
        return ExitSettings(enabled=True, lossless=True, draft_layer=int(layer or 0), path=path, **extra)
    arg, _, layers = arg.partition(":")  # MEASURE@BOUND:L1+L2 uses only those exits
    return ExitSettings(enabled=True, measure=kind, bound=float(arg or 0.02), path=path,
                        layers=layers.replace("+", ","), batch_rule="each",  # "b16-all" rows: rule "all"
                        max_batch=1024)  # the batch rows measure the exits (the daemon's max_batch = 1 skips them)


def load_with_exits(model: str, dtype: str, exits_dir: str):
    """(loaded model, exit heads folder, Exits): ``exits_dir`` or the heads stored with the model."""
    lm = load_model(model, dtype=dtype)
    path = exits_dir or default_exits_path(lm)
    if path is None:
        raise SystemExit("no exit heads: pass --exits (python -m codecomplete.model.exit_train)")
    return lm, path, load_exits(path, lm.model)


def speed_prompts(seed: int) -> list[tuple[str, str]]:
    """The speed runs' (prefix, suffix) pairs: 16 HumanEval-Infilling multi-line prompts, shuffled."""
    prompts = [(t["prompt"][-2000:], t["suffix"][:600]) for t in infill.load("multi", 16)]
    random.Random(seed).shuffle(prompts)
    return prompts


def decode(lm, rt: ExitRuntime | None, prompts: list[tuple[str, str]], tokens: int, batch: int,
           outputs: dict | None = None, stop: bool = False) -> dict:
    """Time decoding only (prefill excluded); layers per token and exit layers.  ``outputs``:
    filled with (prefix, suffix) -> the generated token ids.  ``stop``: requests end as served
    (end-of-text, stop rules) instead of after exactly ``tokens`` tokens."""
    settings = EngineSettings(token_healing=False)
    decoded, secs, layers, passes, accepted = 0, 0.0, 0, 0, 0
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    ran_hist: dict[int, int] = {}
    if rt is not None:
        rt.exits.head_skips = 0
    with torch.inference_mode():
        for group in groups:
            lives = []
            for prefix, suffix in group:
                req = (CompletionRequest(prefix, suffix, mode="auto", max_tokens=tokens, time_budget_ms=10**9)
                       if stop else CompletionRequest(prefix, suffix, mode="multi", max_tokens=tokens, max_lines=1000,
                                                      ignore_eos=True, time_budget_ms=10**9))
                lives.append(start(lm, req, plan_prompt(lm, req, settings, None, None), None))
            t0 = time.perf_counter()
            going = [lv for lv in lives if advance(lm, lv, None)]
            while going:
                before = [(lv, lv.layers) for lv in going]
                going = decode_step(lm, going, None, rt)
                if rt is not None and not rt.lossless:  # one pass per request: layers run = where it exited
                    for lv, b in before:
                        ran_hist[lv.layers - b] = ran_hist.get(lv.layers - b, 0) + 1
                going = [lv for lv in going if advance(lm, lv, None)]
            secs += time.perf_counter() - t0
            if outputs is not None:
                outputs.update({(lv.request.prefix, lv.request.suffix): list(lv.generated) for lv in lives})
            # the tokens the decode passes made: the first comes from the prefill; an
            # end-of-text token ends a request without joining ``generated``
            decoded += sum(len(lv.generated) - 1 + (lv.result.stop_reason == "eos") for lv in lives if lv.generated)
            layers += sum(lv.layers for lv in lives)
            passes += sum(lv.passes for lv in lives)
            accepted += sum(lv.accepted for lv in lives)
    steps = sum(ran_hist.values())
    return {"tokens": decoded, "seconds": round(secs, 3), "tokens_per_s": round(decoded / max(secs, 1e-9), 2),
            "layers": layers, "passes": passes, "accepted": accepted,
            "ms_per_token": round(1000 * secs / max(1, decoded) * min(batch, len(prompts)), 2),
            "mean_layers": round(layers / max(1, passes), 2), "tokens_per_pass": round(decoded / max(1, passes), 3),
            "exit_rate": {str(k): round(v / steps, 3) for k, v in sorted(ran_hist.items())} if steps else {},
            "head_skipped": round(rt.exits.head_skips / steps, 3) if steps else 0.0}


def quality(model: str, dtype: str, es: ExitSettings | None, tasks: list[dict], fmt: str, seed: int) -> tuple[dict, list[str]]:
    settings = EngineSettings(model=model, dtype=dtype, inc_bound=100000, head_lines=0,
                              speculation=SpecSettings(enabled=False),
                              early_exit=es or ExitSettings())
    engine = Engine(settings).start()
    engine.ready.wait()
    outs: list[str] = []
    try:
        res = infill.run(engine, tasks, "single", fmt, seed, outputs=outs)
        st = engine.stats()
        if st["early_exit"]["error"]:
            raise SystemExit(st["early_exit"]["error"])
        res["mean_layers"] = st["early_exit"]["mean_layers"]
    finally:
        engine.close()
    return res, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--exits", default="", help="exit heads folder (default: stored with the model)")
    ap.add_argument("--configs", default="full,softmax@0.02,cosine@0.02,classifier@0.02,classifier@0.05,"
                    "classifier@0.1,lossless@24")
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=12, help="speed rounds (paired with the full model's)")
    ap.add_argument("--batches", default="16", help="batch sizes measured besides 1 (every third round)")
    ap.add_argument("--no-quality", action="store_true", help="speed only")
    ap.add_argument("--stop", action="store_true", help="speed runs end as served: end-of-text and stop rules "
                    "(mode auto), eight prompts a round at batch 1")
    ap.add_argument("--out", default=str(RESULTS / "early_exit"))
    args = ap.parse_args()
    lm, path, exits = load_with_exits(args.model, args.dtype, args.exits)
    fmt = "efim" if lm.template.template is not None else "fim"
    tasks = infill.load("single", args.tasks)
    prompts = speed_prompts(args.seed)
    configs = args.configs.split(",")
    speed, qual = {}, {}
    full_outs: list[str] = []
    runtimes: dict[str, tuple] = {}
    folders = {str(path): exits}
    for name in configs:
        base, _, other = name.partition("~")  # CONFIG~DIR: that config on another exits folder, in the same rounds
        try:
            if other and other not in folders:
                folders[other] = load_exits(other, lm.model)
            folder = folders[other or str(path)]
            es = settings_for(base, other or str(path))
            rt = None if es is None else ExitRuntime.build(folder, es)
        except ExitsError as exc:
            print(f"{name}: {exc}; skipped", file=sys.stderr)
            continue
        if rt is not None and not rt.lossless and not rt.policy.thresholds:
            print(f"{name}: no calibrated threshold at any exit; skipped", file=sys.stderr)
            continue
        rt_all = (ExitRuntime.build(folder, dataclasses.replace(es, batch_rule="all"))
                  if rt is not None and not rt.lossless else None)
        runtimes[name] = (es, rt, rt_all)
    # speed: the configs take turns in short rounds (2 prompts at batch 1; one batch of 16
    # every third round); a config's speed-up is the median over rounds of its speed over
    # the full model's in the same round: this machine's speed drifts by 10-30 % within
    # minutes, which paired rounds cancel
    runs: dict[str, list[dict]] = {}
    for name, (es, rt, rt_all) in runtimes.items():
        decode(lm, rt, prompts[:2], 8, 1, stop=args.stop)  # warm-up: otherwise the first timed config pays for it
        decode(lm, rt, prompts, 8, 16, stop=args.stop)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    for r in range(args.repeats):
        per = 8 if args.stop else 2
        pair = [prompts[(per * r + i) % len(prompts)] for i in range(per)]
        for name, (es, rt, rt_all) in runtimes.items():
            runs.setdefault(f"{name}/b1", []).append(decode(lm, rt, pair, args.tokens, 1, stop=args.stop))
            if r % 3 == 0 and (rt is None or not rt.lossless or r == 0):  # lossless: plain batched steps
                for b in batches:
                    group = [prompts[(r * b + i) % len(prompts)] for i in range(b)]
                    runs.setdefault(f"{name}/b{b}", []).append(decode(lm, rt, group, args.tokens, b, stop=args.stop))
                    if rt_all is not None:
                        runs.setdefault(f"{name}/b{b}-all", []).append(decode(lm, rt_all, group, args.tokens, b,
                                                                               stop=args.stop))
        print(f"round {r + 1}/{args.repeats}", {k: v[-1]["tokens_per_s"] for k, v in runs.items()}, file=sys.stderr)
    for key, rs in runs.items():
        b = key.rsplit("/", 1)[1]
        ref = runs[f"full/{b.removesuffix('-all')}"] if "full" in runtimes else None
        ratios = sorted(x["tokens_per_s"] / f["tokens_per_s"] for x, f in zip(rs, ref)) if ref else []
        tokens, secs = sum(x["tokens"] for x in rs), sum(x["seconds"] for x in rs)
        hist: dict[str, float] = {}
        for x in rs:
            for k, v in x["exit_rate"].items():
                hist[k] = hist.get(k, 0.0) + v / len(rs)
        speed[key] = {"tokens": tokens, "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 2),
                      "ms_per_token": round(1000 * secs / tokens * int(b[1:].removesuffix("-all")), 2),
                      "mean_layers": round(sum(x["mean_layers"] for x in rs) / len(rs), 2),
                      "tokens_per_pass": round(sum(x["tokens_per_pass"] for x in rs) / len(rs), 3),
                      "exit_rate": {k: round(v, 3) for k, v in hist.items()},
                      "head_skipped": round(sum(x["head_skipped"] for x in rs) / len(rs), 3),
                      "speedup": round(ratios[len(ratios) // 2], 3) if ratios else None,
                      "speedup_range": [round(ratios[0], 3), round(ratios[-1], 3)] if ratios else None,
                      "rounds": len(rs)}
    for name, (es, rt, rt_all) in runtimes.items():
        if args.no_quality:
            break
        res, outs = quality(args.model, args.dtype, es, tasks, fmt, args.seed)
        if name == "full":
            full_outs = outs
        elif full_outs:
            res["identical_to_full"] = round(100 * sum(a == b for a, b in zip(outs, full_outs)) / len(outs), 1)
            res["es_to_full"] = round(sum(100 * edit_similarity(a, b) for a, b in zip(outs, full_outs)) / len(outs), 1)
        qual[name] = res
        print(name, json.dumps(res), file=sys.stderr)
    meta = json.loads((Path(path) / "exits.json").read_text())
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"model": lm.name, "exits": str(path), "speed": speed,
                                                    "quality": qual, "exits_meta": meta}, indent=1))
    ends = (f"as served: end-of-text and stop rules, at most {args.tokens} tokens" if args.stop
            else f"EOS ignored, {args.tokens} tokens")
    lines = [header("Early exit"),
             f"Model: {lm.name} ({str(lm.dtype).removeprefix('torch.')}), {lm.model.args.n_layers} layers; "
             f"exits at layers {exits.layers} ({'trained adapters + classifiers' if exits.trained else 'untrained: logit lens'})"
             f"{f' and a softmax check after the last layer ({exits.final}) that can skip the full head' if exits.final else ''}, "
             f"vocabulary subset {len(exits.subset)}; thresholds calibrated for token disagreement bounds "
             f"{meta.get('bounds', '?')} on {meta.get('positions_val', '?')} validation positions "
             f"(`{meta.get('command', '')}`).",
             "", f"## Decode speed ({ends}; prefill excluded; {args.repeats} interleaved rounds, "
             "speed-up = median of per-round ratios to full)", "",
             "| config | batch | tokens/s | ms/token (per sequence) | speed-up (range) | layers/pass | tokens/pass | layers run (share of steps) | full head skipped after the last layer |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, r in speed.items():
        name, b = key.rsplit("/", 1)
        rng_ = r.get("speedup_range") or ["-", "-"]
        lines.append(f"| {name} | {b[1:]} | {r['tokens_per_s']} | {r['ms_per_token']} | "
                     f"{r['speedup']}x ({rng_[0]}-{rng_[1]}, {r['rounds']} rounds) | {r['mean_layers']} | {r['tokens_per_pass']} | "
                     f"{r['exit_rate'] or '-'} | {r.get('head_skipped', '-') if r['exit_rate'] else '-'} |")
    if qual:
        lines += ["", f"## Quality: HumanEval single-line infilling ({len(tasks)} tasks, {fmt} prompts, greedy)", "",
                  "| config | pass@1 | EM | ES | identical to full | ES to full | mean layers/token |",
                  "|---|---|---|---|---|---|---|"]
    for name, r in qual.items():
        lines.append(f"| {name} | {r['pass@1']} | {r['em']} | {r['es']} | {r.get('identical_to_full', '-')} | "
                     f"{r.get('es_to_full', '-')} | {r.get('mean_layers')} |")
    bounds = meta.get("bounds", [])
    lines += ["", "Calibration on validation positions: per exit, how often its top token is the full "
              "model's, and per bound the threshold and the share of tokens that would exit there "
              "(exits taking less than min_rate are not used"
              + ("; with --policy joint these are not the thresholds served, see below" if meta.get("joint") else "")
              + "):",
              "",
              "| measure/exit | agree | " + " | ".join(f"threshold, exit rate @{b:g}" for b in bounds) + " |",
              "|---|---|" + "---|" * len(bounds)]
    for k, v in meta.get("calibration", {}).items():
        cells = []
        for b in bounds:
            c = v.get(f"@{b:g}", {})
            cells.append(f"{c.get('threshold')}, {c.get('exit_rate')}{'' if c.get('used') else ' (unused)'}")
        lines.append(f"| {k} | {v['agree']} | " + " | ".join(cells) + " |")
    if meta.get("joint"):
        lines += ["", f"Thresholds served (`--policy joint`, cost model {meta.get('cost')}): per bound, the exits and "
                  "thresholds chosen together so that, over all validation tokens, the share leaving with another "
                  "token stays within the bound, and their projection; then the per-exit thresholds' projection "
                  "(not served):", "",
                  "| measure@bound | thresholds | tokens left with another token | mean layers run | projected "
                  "speed-up | per-exit: exits, wrong share, projected speed-up |", "|---|---|---|---|---|---|"]
        for key, j in meta["joint"].items():
            pe = j["per_exit"]
            lines.append(f"| {key} | {j['thresholds'] or 'none'} | {j['wrong']} | {j['mean_layers']} | "
                         f"{j['projected_speedup']}x | {pe['exits']}, {pe['wrong']}, {pe['projected_speedup']}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
