"""How many tokens per pass retrieval drafts could give with larger trees (issue #8).

bench/speculation.py measures the engine as shipped: 3-node draft trees, because on this
CPU a wider verification pass is not free (bench/results/pass_cost.md).  This benchmark
separates the two factors of speculation's speed-up, ``tokens per pass / (pass cost / step
cost)``, by replaying drafting without the model:

1. Each held-out function (the same test split as bench/speculation.py) is decoded
   greedily by the engine (no speculation, token healing off, 64 tokens, end-of-text
   ignored).
2. The engine's own ``Drafter`` then drafts at every step as the engine would (same
   sources, verified cache, own-token index, learning), and the accepted path is the tree
   path that the greedy output follows: exactly what a verification pass would accept,
   because the output is greedy decoding's.  No forward runs; the tree size is free.
3. For each tree size this gives tokens per pass and acceptance length, which are the
   speed-up on hardware where a pass of that many rows costs one step (a GPU at batch 1,
   an assumption stated, not measured here), and a projection for this CPU from the
   measured pass costs in bench/results/pass_cost.json (rows up to 17; Python work not
   included).

The replay is checked against the engine itself: with the shipped settings, the engine's
speculative run of the same tasks must give the same outputs and the same number of
passes as the replay.

    python bench/spec_ceiling.py --repos A,B,C [--models default,smollm2-135m] [--functions 10]
                                 [--sizes 3,4,8,16,32,64] [--out bench/results/spec_ceiling]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402
from speculation import load_repos, task_args  # noqa: E402

import torch  # noqa: E402

from codecomplete.indexer.tokens import TokenizerInfo  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings, SpecSettings  # noqa: E402
from codecomplete.model.engine import _Vocab, generate, plan_prompt  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402
from codecomplete.model.speculate import Drafter, LiveIndex  # noqa: E402

WIDE = dict(top_k=32, depth=16)  # trees past the shipped size: more continuations and deeper ones to choose from


class PassCost:
    """A forward of S rows after L cached positions, in one-token steps at the same L: the
    median over rounds of the within-round ratio (bench/results/pass_cost.json), linear in S
    between measured rows, the nearest measured L.  None past the largest measured S."""

    def __init__(self, path: Path):
        cells = json.loads(path.read_text())["cells"]
        self.table: dict[int, dict[int, float]] = {}
        for key, vals in cells.items():
            kind, ctx, rows = key.split("/")
            if kind != "forward":
                continue
            one = cells[f"forward/{ctx}/1"]
            self.table.setdefault(int(ctx), {})[int(rows)] = statistics.median(v / o for v, o in zip(vals, one))
        self.contexts = sorted(self.table)
        self.source = path

    def __call__(self, rows: int, cached: int) -> float | None:
        i = bisect.bisect_left(self.contexts, cached)
        near = min(self.contexts[max(0, i - 1):i + 1], key=lambda c: abs(c - cached))
        by_rows = self.table[near]
        ks = sorted(by_rows)
        if rows in by_rows:
            return by_rows[rows]
        for a, b in zip(ks, ks[1:]):
            if a < rows < b:
                return by_rows[a] + (by_rows[b] - by_rows[a]) * (rows - a) / (b - a)
        return None


def replay(tasks: list[dict], stores: dict, texts: list[str], spec: SpecSettings, cost: PassCost | None) -> dict:
    """Drafting replayed over the greedy outputs, one drafter per repository (as one engine per run)."""
    tokens = passes = spec_steps = accepted = nodes = 0
    step_units = 0.0
    priced = True
    draft_ms = 0.0
    for name, store in stores.items():
        drafter = Drafter(spec, store.retrieve, texts)
        for t in (t for t in tasks if t["repo"] == name):
            prompt, out = t["prompt"], t["out"]
            live = LiveIndex()
            i = 1  # the first token comes with the prefill
            while i < len(out):
                ctx = prompt + out[:i]
                # the engine's room: the token budget, also where a stop rule ended the output sooner
                tree = drafter.draft(ctx, limit=t["budget"] - i, live=live)
                kids = tree.children()
                row, acc = 0, []
                while i + len(acc) < len(out):
                    nxt = kids[row].get(out[i + len(acc)])
                    if nxt is None:
                        break
                    acc.append(out[i + len(acc)])
                    row = nxt
                passes += 1
                nodes += len(tree)
                if len(tree):
                    spec_steps += 1
                    accepted += len(acc)
                c = cost(1 + len(tree), len(ctx)) if cost else None
                if c is None:
                    priced = False
                else:
                    step_units += c
                drafter.learn(ctx[-5:], acc)  # as spec_step: the last fed tokens and the root
                i += 1 + len(acc)
            drafter.learn_output(prompt, out)
            tokens += len(out)
        draft_ms += drafter.stats["draft_ms"]
    # the first token of each output comes with the prefill: per pass as the engine counts
    return {"tokens": tokens, "passes": passes, "tokens_per_pass": round(tokens / max(1, passes), 3),
            "acceptance_length": round(1 + accepted / spec_steps, 3) if spec_steps else None,
            "nodes_per_pass": round(nodes / max(1, passes), 2),
            "cpu_projection": round((tokens - len(tasks)) / step_units, 3) if priced and step_units else None,
            "draft_ms_per_pass": round(draft_ms / max(1, passes), 3)}


def run_model(spec_name: str, args, cost: PassCost) -> dict:
    lm = load_model(spec_name, dtype=args.dtype)
    settings = EngineSettings(model=spec_name, max_prefix_tokens=2048, token_healing=False)
    vocab = _Vocab(lm.tokenizer)
    tok = TokenizerInfo(lm.tokenizer, lm.name)
    stores, tasks = {}, []
    for repo in load_repos(args, lm, tok):
        name = repo["name"]
        stores[name] = repo["store"]
        for f in repo["test"]:
            req = CompletionRequest(f["context"], "", mode="multi", max_tokens=args.max_new, max_lines=100000,
                                    time_budget_ms=600000, ignore_eos=True)
            plan = plan_prompt(lm, req, settings, vocab, None)  # the engine's own prompt (healed where it heals)
            tasks.append({"repo": name, "req": req, "prompt": plan.ids,
                          "budget": args.max_new + (1 if plan.healed else 0)})  # the engine's token budget
    shipped = SpecSettings()
    check = {"outputs_identical": 0, "engine_passes": 0, "tasks": len(tasks)}
    for name in stores:
        drafter = Drafter(shipped, stores[name].retrieve, vocab.texts)
        for t in (t for t in tasks if t["repo"] == name):
            with torch.inference_mode():
                plain = generate(lm, t["req"], settings, vocab, None, None, None)
                spec = generate(lm, t["req"], settings, vocab, None, None, drafter)
            t["out"] = list(plain.token_ids)
            check["outputs_identical"] += t["out"] == list(spec.token_ids)
            check["engine_passes"] += spec.forward_passes
        print(f"{lm.name} / {name}: outputs", file=sys.stderr)
    rows = {}
    shipped_row = replay(tasks, stores, vocab.texts, shipped, cost)
    check["replay_passes"] = shipped_row["passes"]
    rows[f"shipped ({shipped.max_nodes} nodes, top_k {shipped.top_k}, depth {shipped.depth})"] = shipped_row
    for n in args.sizes:
        rows[f"{n} nodes (top_k {WIDE['top_k']}, depth {WIDE['depth']})"] = replay(
            tasks, stores, vocab.texts, replace(shipped, max_nodes=n, **WIDE), cost)
        print(f"{lm.name}: {n} nodes {rows[list(rows)[-1]]}", file=sys.stderr)
    big = max(args.sizes)
    for label, kw in (("own tokens only", dict(use_repository=False, use_common=False, use_cache=False)),
                      ("retrieval only (repository + common + cache)", dict(use_live=False)),
                      ("repository only", dict(use_live=False, use_common=False, use_cache=False))):
        spec = replace(shipped, max_nodes=big, **WIDE, **kw)
        rows[f"{big} nodes, {label}"] = replay(tasks, stores, vocab.texts, spec, cost)
    return {"model": lm.name, "dtype": str(lm.dtype).removeprefix("torch."), "tasks": len(tasks), "check": check,
            "rows": rows, "repos": {n: s.tokens for n, s in stores.items()}}


def write(out: Path, args, cost: PassCost, results: list[dict]) -> None:
    lines = [header("Retrieval speculation: tokens per pass by draft-tree size (drafting replayed)"),
             f"Held-out functions: the test split of bench/speculation.py ({args.functions} per repository), "
             f"{args.max_new} greedy tokens each (end-of-text ignored, token healing off). Drafting is the engine's "
             "own `Drafter`, replayed over the greedy outputs without the model: a node is accepted when the greedy "
             "output follows it, as a verification pass would accept it.", "",
             "- **tokens/pass** is the speed-up where a pass of that many rows costs one step (a GPU at batch 1 is "
             "near that for tens of rows: an assumption, not measured here).",
             "- **CPU projection**: tokens over the passes' cost in one-token steps, from this CPU's measured "
             "forwards "
             f"({cost.source.relative_to(RESULTS.parent.parent)}: contexts {cost.contexts}, rows up to "
             f"{max(max(v) for v in cost.table.values())}); no Python work included; '-' past the measured rows.", ""]
    for res in results:
        c = res["check"]
        lines += [f"## {res['model']} ({res['dtype']})", "",
                  f"Check against the engine (shipped settings, same tasks): outputs identical "
                  f"{c['outputs_identical']}/{c['tasks']}; passes: engine {c['engine_passes']}, replay "
                  f"{c['replay_passes']}.", "",
                  "| draft tree | tokens/pass | acceptance length | draft nodes/pass | CPU projection | "
                  "drafting ms/pass |",
                  "|---|---|---|---|---|---|"]
        for label, r in res["rows"].items():
            lines.append(f"| {label} | {r['tokens_per_pass']} | {r['acceptance_length'] or '-'} | "
                         f"{r['nodes_per_pass']} | {r['cpu_projection'] or '-'} | {r['draft_ms_per_pass']} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task_args(ap)  # as bench/speculation.py: the same test split
    ap.add_argument("--models", default="default,smollm2-135m")
    ap.add_argument("--sizes", default="3,4,8,16,32,64")
    ap.add_argument("--pass-cost", default=str(RESULTS / "pass_cost.json"))
    ap.add_argument("--out", default=str(RESULTS / "spec_ceiling"))
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    cost = PassCost(Path(args.pass_cost))
    results = [run_model(m.strip(), args, cost) for m in args.models.split(",") if m.strip()]
    write(Path(args.out), args, cost, results)


if __name__ == "__main__":
    main()
