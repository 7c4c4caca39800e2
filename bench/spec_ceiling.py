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
passes as the replay.  The replay applies what the engine applies on this machine: the
row cap of a pass (``pass_rows``) and the datastores' shortest match
(``datastore_min_match``), both raised or lowered where passes are costly (AVX2).

Each row also carries an **oracle-rows** projection: the same passes priced at the rows each
accepts (the root and the accepted path), the bound for any policy that picks a pass's width
from its draft (bench/results/spec_priced_avx2.md: a learned one, tried and reverted, c6435f9).

Two more uses, both replayed the same way:

- ``--grid``: the row cap, shortest datastore match and tree size over a grid (the tune
  split: ``--split tune``), each priced by ``--pass-cost``: where the shipped settings sit
  among their neighbours on this machine.
- ``--recycle``: a fallback draft source tried and not shipped, after Token Recycling
  (Luo et al. 2024): where the engine has no draft, a chain from a successor table (each
  token -> the greedy token that last followed it in a verified row).  In the engine the
  table would also learn from rejected rows' greedy picks; the replay sees only the greedy
  path, so it understates that source slightly.

    python bench/spec_ceiling.py --repos A,B,C [--models default,smollm2-135m] [--functions 10]
                                 [--sizes 3,4,8,16,32,64] [--split test|tune] [--grid] [--recycle 1,3,7]
                                 [--pass-cost bench/results/pass_cost.json] [--reuse-outputs /tmp/outputs]
                                 [--out bench/results/spec_ceiling]
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools  # noqa: E402

from common import RESULTS, file_label, header  # noqa: E402
from speculation import load_repos, task_args  # noqa: E402

import torch  # noqa: E402

from codecomplete.indexer.tokens import TokenizerInfo  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings, SpecSettings  # noqa: E402
from codecomplete.model.engine import _Vocab, generate, plan_prompt  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402
from codecomplete.model.speculate import (Drafter, LiveIndex, Tree, build_tree, datastore_min_match,  # noqa: E402
                                          pass_rows)

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


class Successors:
    """``--recycle``'s table: token -> the greedy token that last followed it in a verified row."""

    def __init__(self):
        self.next: dict[int, int] = {}

    def learn(self, row_tokens: list[int], greedy: list[int]) -> None:
        for tok, nxt in zip(row_tokens, greedy):
            self.next[tok] = nxt

    def chain(self, t0: int, n: int) -> Tree:
        seq, tok = [], t0
        while len(seq) < n and tok in self.next:
            tok = self.next[tok]
            seq.append(tok)
        return build_tree([(tuple(seq), 1.0)], n, n) if seq else Tree()


def replay(tasks: list[dict], stores: dict, texts: list[str], spec: SpecSettings, cost: PassCost | None,
           rows: int | None, min_match: int, recycle: int = 0, live_for=None) -> dict:
    """Drafting replayed over the greedy outputs, one drafter per repository (as one engine per run):
    passes of at most ``rows`` rows (the root and the tree; None: any), datastore matches of ``min_match``
    tokens or more (the engine's ``pass_rows`` and ``datastore_min_match``); ``recycle`` > 0: where
    the drafter has nothing, a chain of up to that many tokens from ``Successors``; ``live_for`` (or
    None): a task's own-token index instead of a new ``LiveIndex``."""
    tokens = passes = spec_steps = accepted = nodes = recycled = recycled_acc = 0
    step_units = oracle_units = 0.0
    all_priced = True
    draft_ms = 0.0
    for name, store in stores.items():
        drafter = Drafter(spec, store.retrieve, texts)
        succ = Successors()
        for t in (t for t in tasks if t["repo"] == name):
            prompt, out = t["prompt"], t["out"]
            live = live_for(t) if live_for is not None else LiveIndex()
            i = 1  # the first token comes with the prefill
            while i < len(out):
                ctx = prompt + out[:i]
                # the engine's room: the token budget (also where a stop rule ended the output sooner)
                # and the pass's rows; a tree wider than the cap keeps its best nodes, as spec_step cuts it
                room = t["budget"] - i if rows is None else min(t["budget"] - i, rows - 1)
                tree = drafter.draft(ctx, limit=room, live=live, min_match=min_match)
                if rows is not None:
                    tree = tree.first(rows - 1)
                from_table = recycle > 0 and not len(tree) and room > 0
                if from_table:
                    tree = succ.chain(ctx[-1], min(recycle, room))
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
                    if from_table:
                        recycled += 1
                        recycled_acc += len(acc)
                path = [ctx[-1]] + acc  # the verified rows on the greedy path and what greedy picked after each
                succ.learn(path, out[i:i + len(path)])
                c = cost(1 + len(tree), len(ctx)) if cost else None
                if c is None:
                    all_priced = False
                else:
                    step_units += c
                    # an oracle row count: the pass cut to the rows it accepts (what no policy can beat)
                    oracle_units += cost(1 + len(acc), len(ctx))
                drafter.learn(ctx[-5:], acc)  # as spec_step: the last fed tokens and the root
                i += 1 + len(acc)
            drafter.learn_output(prompt, out)
            tokens += len(out)
        draft_ms += drafter.stats["draft_ms"]
    # the first token of each output comes with the prefill: per pass as the engine counts
    return {"tokens": tokens, "passes": passes, "tokens_per_pass": round(tokens / max(1, passes), 3),
            "acceptance_length": round(1 + accepted / spec_steps, 3) if spec_steps else None,
            "nodes_per_pass": round(nodes / max(1, passes), 2),
            "cpu_projection": round((tokens - len(tasks)) / step_units, 3) if all_priced and step_units else None,
            "oracle_rows_projection": round((tokens - len(tasks)) / oracle_units, 3) if all_priced and oracle_units
            else None,
            "draft_ms_per_pass": round(draft_ms / max(1, passes), 3),
            "drafted_share": round(spec_steps / max(1, passes), 3), "rows": rows, "min_match": min_match,
            "recycled_passes": recycled, "recycled_acceptance": round(recycled_acc / recycled, 3) if recycled else None}


def split_tasks(lm, settings: EngineSettings, vocab, repos: list[dict], split: str, max_new: int) -> list[dict]:
    """The held-out functions of ``split`` (``speculation.load_repos``' repositories) as requests with the
    engine's own prompt (healed where it heals) and token budget; no outputs yet."""
    tasks = []
    for repo in repos:
        for f in repo[split]:
            req = CompletionRequest(f["context"], "", mode="multi", max_tokens=max_new, max_lines=100000,
                                    time_budget_ms=600000, ignore_eos=True)
            plan = plan_prompt(lm, req, settings, vocab, None)
            tasks.append({"repo": repo["name"], "req": req, "prompt": plan.ids,
                          "budget": max_new + (1 if plan.healed else 0)})
    return tasks


def run_model(spec_name: str, args, cost: PassCost) -> dict:
    lm = load_model(spec_name, dtype=args.dtype)
    settings = EngineSettings(model=spec_name, max_prefix_tokens=2048, token_healing=False)
    vocab = _Vocab(lm.tokenizer)
    tok = TokenizerInfo(lm.tokenizer, lm.name)
    repos = load_repos(args, lm, tok)
    stores = {r["name"]: r["store"] for r in repos}
    tasks = split_tasks(lm, settings, vocab, repos, args.split, args.max_new)
    shipped = SpecSettings()
    check = {"outputs_identical": 0, "engine_passes": 0, "tasks": len(tasks)}
    saved = Path(f"{args.reuse_outputs}.{file_label(lm.name)}.{args.split}.json") if args.reuse_outputs else None
    prompts = hashlib.sha1(json.dumps([t["prompt"] for t in tasks]).encode()).hexdigest()  # the same tasks?
    kept = json.loads(saved.read_text()) if saved is not None and saved.exists() else {}
    if kept.get("prompts") == prompts:  # the greedy outputs and the engine check of an earlier run of these tasks
        for t, out in zip(tasks, kept["outputs"]):
            t["out"] = out
        check = kept["check"]
    for name in stores if "out" not in tasks[0] else ():
        drafter = Drafter(shipped, stores[name].retrieve, vocab.texts)
        for t in (t for t in tasks if t["repo"] == name):
            with torch.inference_mode():
                plain = generate(lm, t["req"], settings, vocab, None, None, None)
                spec = generate(lm, t["req"], settings, vocab, None, None, drafter)
            t["out"] = list(plain.token_ids)
            check["outputs_identical"] += t["out"] == list(spec.token_ids)
            check["engine_passes"] += spec.forward_passes
        print(f"{lm.name} / {name}: outputs", file=sys.stderr)
    if saved is not None and kept.get("prompts") != prompts:
        saved.write_text(json.dumps({"prompts": prompts, "outputs": [t["out"] for t in tasks], "check": check}))
    rows = {}
    engine_rows, engine_mm = pass_rows(shipped, lm.model), datastore_min_match(shipped, lm.model)
    shipped_row = replay(tasks, stores, vocab.texts, shipped, cost, engine_rows, engine_mm)
    check["replay_passes"] = shipped_row["passes"]
    rows[f"shipped ({shipped.max_nodes} nodes, top_k {shipped.top_k}, depth {shipped.depth}; here passes of "
         f"<= {engine_rows} rows, datastore matches >= {engine_mm})"] = shipped_row
    for n in args.recycle:
        rows[f"shipped + successor chains of <= {n} where it has no draft"] = replay(
            tasks, stores, vocab.texts, shipped, cost, engine_rows, engine_mm, recycle=n)
        print(f"{lm.name}: recycle {n} {rows[list(rows)[-1]]}", file=sys.stderr)
    if args.grid:
        for mm, r, n in itertools.product(args.grid_min_match, args.grid_rows, args.grid_nodes):
            if n <= r - 1:
                rows[f"grid: matches >= {mm}, <= {r} rows, {n} nodes"] = replay(
                    tasks, stores, vocab.texts, replace(shipped, max_nodes=n), cost, r, mm)
                print(f"{lm.name}: grid {mm} {r} {n} {rows[list(rows)[-1]]}", file=sys.stderr)
    # the sizes: trees of that many nodes with no row cap (the ceiling where rows are free)
    for n in args.sizes:
        rows[f"{n} nodes (top_k {WIDE['top_k']}, depth {WIDE['depth']})"] = replay(
            tasks, stores, vocab.texts, replace(shipped, max_nodes=n, **WIDE), cost, None, shipped.min_match)
        print(f"{lm.name}: {n} nodes {rows[list(rows)[-1]]}", file=sys.stderr)
    if args.sizes:
        big = max(args.sizes)
        for label, kw in (("own tokens only", dict(use_repository=False, use_common=False, use_cache=False)),
                          ("retrieval only (repository + common + cache)", dict(use_live=False)),
                          ("repository only", dict(use_live=False, use_common=False, use_cache=False))):
            spec = replace(shipped, max_nodes=big, **WIDE, **kw)
            rows[f"{big} nodes, {label}"] = replay(tasks, stores, vocab.texts, spec, cost, None, shipped.min_match)
    return {"model": lm.name, "dtype": str(lm.dtype).removeprefix("torch."), "tasks": len(tasks), "check": check,
            "rows": rows, "repos": {n: s.tokens for n, s in stores.items()}}


def write(out: Path, args, cost: PassCost, results: list[dict]) -> None:
    lines = [header("Retrieval speculation: tokens per pass by draft-tree size (drafting replayed)"),
             f"Held-out functions: the {args.split} split of bench/speculation.py "
             f"({args.functions if args.split == 'test' else args.tune_functions} per repository), "
             f"{args.max_new} greedy tokens each (end-of-text ignored, token healing off). Drafting is the engine's "
             "own `Drafter`, replayed over the greedy outputs without the model: a node is accepted when the greedy "
             "output follows it, as a verification pass would accept it.", "",
             "- **tokens/pass** is the speed-up where a pass of that many rows costs one step (a GPU at batch 1 is "
             "near that for tens of rows: an assumption, not measured here).",
             "- **CPU projection**: tokens over the passes' cost in one-token steps, from this CPU's measured "
             "forwards "
             f"({cost.source.relative_to(RESULTS.parent.parent)}: contexts {cost.contexts}, rows up to "
             f"{max(max(v) for v in cost.table.values())}); no Python work included; '-' past the measured rows.",
             "- **oracle rows**: the same passes each priced at the rows it accepts (the root and the accepted "
             "path): the bound for any policy that picks a pass's width from its draft.", ""]
    for res in results:
        c = res["check"]
        lines += [f"## {res['model']} ({res['dtype']})", "",
                  f"Check against the engine (shipped settings, same tasks): outputs identical "
                  f"{c['outputs_identical']}/{c['tasks']}; passes: engine {c['engine_passes']}, replay "
                  f"{c['replay_passes']}.", "",
                  "| draft tree | tokens/pass | acceptance length | draft nodes/pass | passes with a draft | "
                  "CPU projection | oracle rows: CPU projection | drafting ms/pass | "
                  "successor chains: passes, tokens accepted |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for label, r in res["rows"].items():
            chains = f"{r['recycled_passes']}, {r['recycled_acceptance']}" if r["recycled_passes"] else "-"
            lines.append(f"| {label} | {r['tokens_per_pass']} | {r['acceptance_length'] or '-'} | "
                         f"{r['nodes_per_pass']} | {r['drafted_share']} | {r['cpu_projection'] or '-'} | "
                         f"{r.get('oracle_rows_projection') or '-'} | "
                         f"{r['draft_ms_per_pass']} | {chains} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task_args(ap)  # as bench/speculation.py: the same test split
    ap.add_argument("--models", default="default,smollm2-135m")
    ap.add_argument("--sizes", default="3,4,8,16,32,64", help="tree sizes with no row cap ('' for none)")
    ap.add_argument("--split", default="test", choices=("test", "tune"))
    ap.add_argument("--recycle", default="", help="comma-separated chain lengths for the successor-table fallback")
    ap.add_argument("--grid", action="store_true", help="replay the grid below with the engine's row caps")
    ap.add_argument("--reuse-outputs", default="", help="a file prefix: keep the greedy outputs and the engine "
                    "check there and take them from there on the next run (same model, split and repositories)")
    ap.add_argument("--grid-min-match", default="2,3,4,6,8")
    ap.add_argument("--grid-rows", default="4,6,8")
    ap.add_argument("--grid-nodes", default="3,5,7")
    ap.add_argument("--pass-cost", default=str(RESULTS / "pass_cost.json"))
    ap.add_argument("--out", default=str(RESULTS / "spec_ceiling"))
    args = ap.parse_args()
    def ints(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    args.sizes, args.recycle = ints(args.sizes), ints(args.recycle)
    args.grid_min_match, args.grid_rows, args.grid_nodes = ints(args.grid_min_match), ints(args.grid_rows), \
        ints(args.grid_nodes)
    cost = PassCost(Path(args.pass_cost).resolve())
    results = [run_model(m.strip(), args, cost) for m in args.models.split(",") if m.strip()]
    write(Path(args.out), args, cost, results)


if __name__ == "__main__":
    main()
