"""Where a decode pass spends its time outside the native kernels: retrieval speculation's
passes and autoregressive steps, on bench/speculation.py's held-out functions.

    python bench/pass_overhead.py --repos DIR[,DIR...] [--model default] [--functions 10]
                                  [--out bench/results/pass_overhead]

Each test function is generated autoregressively, then with retrieval speculation at the
defaults (the same tasks, datastores and 64 tokens as bench/speculation.py).  Timers around
the native call (``decode_stack``), ``Transformer.forward``, drafting and ``decode_step`` split
each pass into: the native call; the Python of the forward around it (embeddings, rotary
angles, the call's arguments); drafting (retrieval, the request's own tokens, the tree); the
rest of the step (the verification's inputs, greedy picks, acceptance, the accepted tokens'
stop checks and detokenizing); and the engine's loop outside the step.  Prefill is not in
any of them.  Writes ``--out``.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402

import torch  # noqa: E402

import speculation as spec_bench  # noqa: E402
from codecomplete.indexer.tokens import TokenizerInfo  # noqa: E402
from codecomplete.model import engine, native  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings, SpecSettings  # noqa: E402
from codecomplete.model.engine import _Vocab, generate  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402
from codecomplete.model.speculate import Drafter  # noqa: E402
from codecomplete.model.transformer import Transformer  # noqa: E402


class Timers:
    """perf_counter sums of the parts of decode steps (nothing counts outside ``decode_step``)."""

    def __init__(self):
        self.on = False
        self.inside = False  # in a timed forward
        self.ms = {"step": 0.0, "native": 0.0, "forward": 0.0}
        self.calls = 0

    def install(self) -> None:
        lib_call, forward, step = native._lib.decode_stack, Transformer.forward, engine.decode_step
        t = self

        def timed_native(*a):
            t0 = time.perf_counter()
            try:
                return lib_call(*a)
            finally:
                if t.on:
                    t.ms["native"] += (time.perf_counter() - t0) * 1000

        def timed_forward(model, *a, **k):
            if not t.on or t.inside:  # a prompt's pieces call forward again: time the outer call only
                return forward(model, *a, **k)
            t.inside = True
            t0 = time.perf_counter()
            try:
                return forward(model, *a, **k)
            finally:
                t.inside = False
                t.ms["forward"] += (time.perf_counter() - t0) * 1000
                t.calls += 1

        def timed_step(*a, **k):
            t.on = True
            t0 = time.perf_counter()
            try:
                return step(*a, **k)
            finally:
                t.ms["step"] += (time.perf_counter() - t0) * 1000
                t.on = False

        native._lib.decode_stack = timed_native
        Transformer.forward = timed_forward
        engine.decode_step = timed_step  # generate looks it up in the module at each step

    def take(self) -> tuple[dict, int]:
        out, calls = dict(self.ms), self.calls
        self.ms = dict.fromkeys(self.ms, 0.0)
        self.calls = 0
        return out, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    spec_bench.task_args(ap)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=str(RESULTS / "pass_overhead"))
    args = ap.parse_args()
    lm = load_model(args.model, dtype="auto")
    if lm.model.native_stack is None:
        sys.exit("needs a bf16 model on the native CPU path (dtype bf16, a C compiler)")
    settings = EngineSettings(model=args.model, max_prefix_tokens=2048)
    vocab = _Vocab(lm.tokenizer)
    tok = TokenizerInfo(lm.tokenizer, lm.name)
    jobs = [(r["store"], r["test"]) for r in spec_bench.load_repos(args, lm, tok)]
    best = SpecSettings()
    spec_bench.run_engine(lm, settings, jobs[0][1][:1], jobs[0][0], best, vocab, 8)  # builds, warms
    timers = Timers()
    timers.install()
    sums = {m: {"decode_ms": 0.0, "draft_ms": 0.0, "n": 0, "passes": 0, "step": 0.0, "native": 0.0,
                "forward": 0.0, "forward_calls": 0} for m in ("autoregressive", "speculation")}
    outputs = {m: [] for m in sums}
    for store, test in jobs:
        drafter = Drafter(best, store.retrieve, vocab.texts)  # one per repository, as in speculation.py
        for t in test:  # each task autoregressively, then with speculation, next to each other
            req = CompletionRequest(t["context"], "", mode="multi", max_tokens=args.max_new, max_lines=100000,
                                    time_budget_ms=600000, ignore_eos=True)
            for method, d in (("autoregressive", None), ("speculation", drafter)):
                before = d.stats["draft_ms"] if d else 0.0
                timers.take()
                c = generate(lm, req, settings, vocab, None, None, d)
                ms, calls = timers.take()
                acc = sums[method]
                acc["decode_ms"] += c.timings.get("decode_ms", 0.0)
                acc["draft_ms"] += (d.stats["draft_ms"] - before) if d else 0.0
                acc["n"] += c.generated_tokens
                acc["passes"] += c.forward_passes
                for k, v in ms.items():
                    acc[k] += v
                acc["forward_calls"] += calls
                outputs[method].append(c.token_ids)
    res = {}
    for method, a in sums.items():
        p = max(1, a["passes"])
        python_fwd = a["forward"] - a["native"]
        rest = a["step"] - a["forward"] - a["draft_ms"]
        outside = a["decode_ms"] - a["step"]
        res[method] = {
            "tokens": a["n"], "passes": a["passes"], "ms_per_token": round(a["decode_ms"] / max(1, a["n"]), 3),
            "tokens_per_pass": round(a["n"] / p, 3), "ms_per_pass": round(a["decode_ms"] / p, 3),
            "native_ms_per_pass": round(a["native"] / p, 3),
            "python_in_forward_ms_per_pass": round(python_fwd / p, 3),
            "drafting_ms_per_pass": round(a["draft_ms"] / p, 3),
            "rest_of_step_ms_per_pass": round(rest / p, 3),
            "outside_step_ms_per_pass": round(outside / p, 3),
            "python_share": round((a["decode_ms"] - a["native"]) / max(1e-9, a["decode_ms"]), 3),
            "forward_calls_per_pass": round(a["forward_calls"] / p, 3),
        }
    same = sum(x == y for x, y in zip(outputs["autoregressive"], outputs["speculation"]))
    speedup = round(res["autoregressive"]["ms_per_token"] / res["speculation"]["ms_per_token"], 3)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"results": res, "identical": same,
                                                     "tasks": len(outputs["speculation"]), "speedup": speedup},
                                                    indent=2))
    cols = [("ms/token", "ms_per_token"), ("tokens/pass", "tokens_per_pass"), ("ms/pass", "ms_per_pass"),
            ("native call", "native_ms_per_pass"), ("Python in forward", "python_in_forward_ms_per_pass"),
            ("drafting", "drafting_ms_per_pass"), ("rest of the step", "rest_of_step_ms_per_pass"),
            ("engine loop outside the step", "outside_step_ms_per_pass"), ("outside the native call", "python_share")]
    n = len(outputs["speculation"])
    lines = [header("Decode pass overhead outside the native kernels"), "",
             f"Model {lm.name} ({lm.dtype}), greedy, {args.max_new} tokens per held-out function "
             f"(bench/speculation.py's test split, {n} functions), batch 1; each task autoregressively, "
             f"then with retrieval speculation at the defaults. Per pass (a verification pass or a plain step), in ms:",
             "", "| method | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for method, r in res.items():
        vals = [f"{r[k]:.1%}" if k == "python_share" else str(r[k]) for _, k in cols]
        lines.append(f"| {method} | " + " | ".join(vals) + " |")
    lines += ["", f"Speed-up of speculation in this run: {speedup}x; outputs identical: {same}/{n}.",
              "", "## Notes (written after the run)", ""]
    md = out.with_suffix(".md")
    notes = ""
    if md.exists() and "## Notes (written after the run)" in md.read_text():
        notes = md.read_text().split("## Notes (written after the run)", 1)[1].lstrip("\n")
    md.write_text("\n".join(lines) + notes)
    print("\n".join(lines))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
