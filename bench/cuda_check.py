"""Does the engine run on CUDA, with the same outputs by every exact path?  (for a lent GPU)

    python bench/cuda_check.py [--model default] [--device cuda] [--tasks 24] [--tokens 48]

The project keeps device and dtype as configuration so that the CPU code runs on CUDA too.
This loads the model on ``--device`` through the daemon's engine and completes FIM holes cut
from this repository's own source files (multi-line, greedy, EOS ignored so every run
decodes the same number of tokens) with each exact path:

- ``plain``: one token per step (speculation and early exit off), one request at a time;
- ``speculation``: retrieval speculation (the request's own tokens and the verified cache;
  no repository index here), one request at a time;
- ``batched``: all requests submitted at once (batched decode, speculation on);
- ``lossless``: early exit as self-speculation (exact by construction), one at a time;
- ``lossy``: early exit at the calibrated 2 % bound: only that it runs, and how often its
  output equals plain decoding.

Every exact path's outputs are compared with ``plain`` token for token.  A path that
raises is recorded with its error, and the others still run.  Writes
bench/results/cuda_check.{json,md} (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from concurrent.futures import wait
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import machine  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings, ExitSettings, SpecSettings  # noqa: E402
from codecomplete.model.engine import Engine  # noqa: E402


def holes(n: int, seed: int) -> list[tuple[str, str]]:
    """(prefix, suffix) pairs: a random line of this repository's Python files and what follows it."""
    rng = random.Random(seed)
    files = sorted(p for d in ("model", "daemon", "lsp", "indexer") for p in (ROOT / d).glob("*.py"))
    out = []
    while len(out) < n:
        text = rng.choice(files).read_text()
        lines = text.splitlines(keepends=True)
        if len(lines) < 40:
            continue
        i = rng.randrange(20, len(lines) - 10)
        if not lines[i].strip():
            continue
        cut = sum(len(x) for x in lines[:i])
        col = len(lines[i]) - len(lines[i].lstrip())
        prefix = text[max(0, cut + col - 3000):cut + col]
        suffix = text[cut + len(lines[i]):][:1000]
        out.append((prefix, suffix))
    return out


def run(settings: EngineSettings, cases, tokens: int, together: bool = False) -> dict:
    engine = Engine(settings).start()
    engine.ready.wait()
    try:
        if engine.stats().get("load_error"):
            raise RuntimeError(engine.stats()["load_error"])
        reqs = [CompletionRequest(p, s, request_id=str(i), mode="multi", max_tokens=tokens, max_lines=1000,
                                  time_budget_ms=600000, ignore_eos=True) for i, (p, s) in enumerate(cases)]
        engine.complete(CompletionRequest(cases[0][0], cases[0][1], mode="multi", max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        if together:
            futs = [engine.submit(r) for r in reqs]
            wait(futs)
            outs = [f.result() for f in futs]
        else:
            outs = [engine.complete(r) for r in reqs]
        secs = time.perf_counter() - t0
        st = engine.stats()
    finally:
        engine.close()
    if settings.early_exit.enabled and st["early_exit"]["error"]:  # it decoded without early exit: not this path
        raise RuntimeError(f"early exit off: {st['early_exit']['error']}")
    errors = [o.error for o in outs if o.error]
    gen = sum(o.generated_tokens for o in outs)
    return {"ids": [o.token_ids for o in outs], "errors": errors[:3], "error_count": len(errors),
            "generated": gen, "seconds": round(secs, 3), "ms_per_token": round(1000 * secs / max(1, gen), 2),
            "spec_steps": sum(o.spec_steps for o in outs), "accepted": sum(o.accepted_tokens for o in outs),
            "passes": sum(o.forward_passes for o in outs), "early_exit": st.get("early_exit")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tasks", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cuda_check")
    args = ap.parse_args()
    cases = holes(args.tasks, args.seed)
    base = dict(model=args.model, device=args.device, dtype=args.dtype)
    configs = {
        "plain": (EngineSettings(**base, speculation=SpecSettings(enabled=False)), False),
        "speculation": (EngineSettings(**base), False),
        "batched": (EngineSettings(**base), True),
        "lossless": (EngineSettings(**base, speculation=SpecSettings(enabled=False),
                                    early_exit=ExitSettings(enabled=True, lossless=True)), False),
        "lossy": (EngineSettings(**base, speculation=SpecSettings(enabled=False),
                                 early_exit=ExitSettings(enabled=True, bound=0.02)), False),
    }
    results: dict[str, dict] = {}
    for name, (settings, together) in configs.items():
        t0 = time.perf_counter()
        try:
            results[name] = run(settings, cases, args.tokens, together)
        except Exception as exc:  # recorded; the other paths still run
            results[name] = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(name, {k: v for k, v in results[name].items() if k != "ids"}, file=sys.stderr, flush=True)
    ref = results["plain"].get("ids")
    for name, res in results.items():
        if ref is not None and "ids" in res:
            res["identical_to_plain"] = sum(a == b for a, b in zip(res["ids"], ref))
    on_gpu = args.device.startswith("cuda") and torch.cuda.is_available()
    dev = {"device": args.device, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if on_gpu else None}
    report = {"command": "python bench/cuda_check.py " + " ".join(sys.argv[1:]), "machine": machine(), **dev,
              "tasks": len(cases), "tokens": args.tokens, "settings": asdict(configs["plain"][0]),
              "results": {k: {kk: vv for kk, vv in v.items() if kk != "ids"} for k, v in results.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    rows = ["| path | identical to plain | ms/token | generated | passes | accepted drafts | errors |",
            "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "exception" in r:
            rows.append(f"| {name} | - | - | - | - | - | {r['exception'][:200]} |")
        else:
            rows.append(f"| {name} | {r.get('identical_to_plain', '-')}/{len(cases)} | {r['ms_per_token']} | "
                        f"{r['generated']} | {r['passes']} | {r['accepted']} | {r['error_count']} |")
    md = ["# CUDA check", "", f"- command: `{report['command']}`",
          f"- machine: {report['machine']}; GPU: {dev['gpu']}, torch {dev['torch']}",
          f"- {len(cases)} FIM holes from this repository's source, {args.tokens} tokens each (EOS ignored), greedy",
          "", *rows, ""]
    args.out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
