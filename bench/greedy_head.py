"""The greedy head: decode steps that compute exact logits only where the greedy choice can be.

A bf16 model's native step (``native.decode_stack``) with ``greedy=True`` reads an int8 copy of
the head (half its bytes), bounds each vocabulary row's error, and computes exact logits only
for the rows that could hold the maximum (model/native/linear.c).  This measures, on the same
model, interleaved over rounds (this machine's speed drifts within minutes):

1. one native step of S rows (1-16: decode steps and verification passes) after L cached
   positions, with the full head and with the greedy head (its int8 bounds on AVX512-VNNI, and on
   AMX's int8 tiles where granted);
2. real decoding: greedy generation of ``--tokens`` tokens from prompts cut out of this
   repository's own files, with and without it (ms/token, identical outputs), and how many
   vocabulary rows each step computed exactly.

Writes bench/results/greedy_head.md (+ .json).

    python bench/greedy_head.py [--model default] [--rounds 7] [--prompts 8] [--tokens 64]
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
from common import RESULTS, header, native_model  # noqa: E402

from codecomplete.model import native  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


MODES = ("full", "vpdpbusd", "tiles")  # the whole bf16 head; the greedy head's int8 bounds on AVX512-VNNI or AMX
AVX2_MODES = ("full", "vpmaddwd")  # an AVX2 build: the bounds on vpmaddwd (linear.c)


def step_ms(model, prompt: list[int], lengths: list[int], rows: list[int], rounds: int, modes: tuple[str, ...],
            reps: int = 10) -> dict:
    """Median ms of one native step of S rows after L cached positions, for each way to compute
    the head: the first L tokens of ``prompt`` cached, the S after them as the step's rows (real
    text: its states are as confident as decoding's, and the greedy head's exact rows as few)."""
    out: dict[str, list[float]] = {}
    before = native.amx_greedy_head()
    with torch.inference_mode():
        for n in lengths:
            cache = model.new_cache(n + 80)
            model(torch.tensor([prompt[:n]]), [cache])
            for s in rows:
                tok = torch.tensor([prompt[n:n + s]])
                cos, sin = model.rope(torch.arange(n, n + s).view(1, s))
                x = model.embed(tok)
                for r in range(rounds + 1):  # round 0 warms up, not counted
                    for mode in modes:
                        if mode != "full":
                            native.amx_greedy_head(mode == "tiles")
                        cache.reserve(s)
                        caches = native.StepCaches([cache])
                        t = time.perf_counter()
                        for _ in range(reps):
                            native.decode_stack(model.native_stack, x, cos, sin, caches, None,
                                                logits="last" if s == 1 else "all", greedy=mode != "full")
                        if r:
                            out.setdefault(f"{n}/{s}/{mode}", []).append((time.perf_counter() - t) / reps * 1000)
    native.amx_greedy_head(before)
    return {k: statistics.median(v) for k, v in out.items()}


def prompts(tok, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: the start of this repository's Python files."""
    files = sorted(p for d in ("model", "lsp", "daemon", "indexer") for p in (ROOT / d).glob("*.py"))
    out = []
    for p in files:
        ids = tok.encode(p.read_text(), add_special_tokens=False)
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            break
    return out


def generate(model, prompt: list[int], n: int, greedy: bool, kept: list[int] | None) -> tuple[list[int], float]:
    """Greedy decoding of n tokens (the engine's loop without its rules): tokens and ms/token."""
    cache = model.new_cache(len(prompt) + n + 2)
    out = []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), [cache], greedy=greedy)
        t = time.perf_counter()
        for _ in range(n):
            if kept is not None:
                kept.append(int(torch.isfinite(logits[0]).sum()))
            out.append(int(logits[0].float().argmax()))
            logits = model(torch.tensor([[out[-1]]]), [cache], greedy=greedy)
        ms = (time.perf_counter() - t) * 1000 / n
    return out, ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--rows", default="1,2,3,4,5,8,13,16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "greedy_head"))
    args = ap.parse_args()
    lm = native_model(args.model)
    model = lm.model
    if model.native_stack.qhead is None:
        sys.exit("the greedy head needs AVX2 + FMA or AVX512-VNNI and AVX512-BF16")
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    if native.linear_bf16_path() == 1:
        modes = AVX2_MODES
    else:
        modes = MODES if model.native_stack.amx and native.amx_greedy_head() else MODES[:2]
    long = prompts(lm.tokenizer, 1, max(lengths) + max(rows))
    if not long:
        sys.exit(f"no file of this repository has {max(lengths) + max(rows)} tokens")
    steps = step_ms(model, long[0], lengths, rows, args.rounds, modes)
    print("steps done", file=sys.stderr)
    ps = prompts(lm.tokenizer, args.prompts, args.prompt_tokens)
    gen: dict[bool, list[float]] = {True: [], False: []}
    kept: list[int] = []
    identical = 0
    generate(model, ps[0], 4, True, None)  # warm-up
    for p in ps:
        a, ms_on = generate(model, p, args.tokens, True, kept)
        b, ms_off = generate(model, p, args.tokens, False, None)
        gen[True].append(ms_on)
        gen[False].append(ms_off)
        identical += a == b
    kept.sort()
    res = {"steps_ms": steps, "generation_ms_per_token": {str(k): v for k, v in gen.items()},
           "identical": [identical, len(ps)], "rows_computed": kept, "vocab": model.args.vocab_size,
           "greedy_head_rows": native.greedy_head_rows(model.native_stack), "modes": list(modes)}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    ratio = [off / on for on, off in zip(gen[True], gen[False])]
    q = lambda f: kept[min(len(kept) - 1, int(f * len(kept)))]  # noqa: E731
    lines = [header("Greedy head: exact logits only where the greedy choice can be"),
             f"Model {lm.name} ({str(lm.dtype).removeprefix('torch.')}), vocabulary {model.args.vocab_size}; "
             "the head is "
             f"{model.args.vocab_size * model.args.dim * 2 / 1e6:.1f} MB in bf16, its int8 copy half that. "
             f"{args.rounds} interleaved rounds, medians. `decode_stack` uses the greedy head for at most "
             f"{native.greedy_head_rows(model.native_stack)} logit rows here (`native.greedy_head_rows`); in the "
             "first table it is forced at every size. The greedy head bounds every logit with the int8 copy on "
             "AVX512-VNNI (vpdpbusd) or, from 4 rows where the tiles are granted, on AMX's int8 tiles (tiles); "
             "an AVX2 build (no AVX512-BF16) on vpmaddwd.", "",
             "## One native step (every layer and the head), ms; the step's rows are the next tokens of a file, "
             "after its first L", "",
             "| L | S | " + " | ".join(modes) + " | full / best greedy |", "|---|---|" + "---|" * (len(modes) + 1)]
    for n in lengths:
        for s in rows:
            t = {m: steps[f"{n}/{s}/{m}"] for m in modes}
            lines.append(f"| {n} | {s} | " + " | ".join(f"{t[m]:.2f}" for m in modes)
                         + f" | {t['full'] / min(t[m] for m in modes[1:]):.2f}x |")
    lines += ["", f"## Greedy decoding, {len(ps)} prompts of {args.prompt_tokens} tokens (the start of this "
                  f"repository's Python files), {args.tokens} tokens each", "",
              "| | ms/token (mean of prompts) | speed-up (median of per-prompt ratios) |", "|---|---|---|",
              f"| full head | {statistics.mean(gen[False]):.2f} | 1.0x |",
              f"| greedy head | {statistics.mean(gen[True]):.2f} | {statistics.median(ratio):.3f}x "
              f"({min(ratio):.3f}-{max(ratio):.3f}) |", "",
              f"Outputs identical: {identical}/{len(ps)}.", "",
              f"Vocabulary rows computed exactly per step ({len(kept)} steps): median {q(0.5)}, p90 {q(0.9)}, "
              f"p99 {q(0.99)}, max {kept[-1]} of {model.args.vocab_size} (in groups of "
              f"{16 if native.linear_bf16_path() == 1 or model.native_stack.amx else 4}: the bf16 kernel's "
              "panels, tiles or groups).", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
