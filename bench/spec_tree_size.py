"""Retrieval speculation's draft-tree size in the engine, sizes interleaved per task (issue #8).

bench/speculation.py's parameter grid searches one group of parameters at a time, and the
tree's size comes first, before the own-token chains (``live_chain``) are chosen; this
benchmark checks the size with every other setting as shipped.  For each held-out function of
the chosen split (bench/speculation.py's tune or test functions), and for each tree size in
turn, the engine decodes it autoregressively and then with speculation right after (this
machine's speed drifts by 10-20 % within minutes, so each speed-up is against the run right
before it).  One drafter per repository and size, as one engine per run.

    python bench/spec_tree_size.py --repos A,B,C [--model default] [--split tune] [--sizes 3,4,6,8]

``--variants 'max_nodes=3;live_chain=0'`` compares any settings the same way (each over the shipped
ones; an empty one is the shipped settings).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402
from speculation import _row, _Vocab, load_repos, summarize, task_args  # noqa: E402

import torch  # noqa: E402

from codecomplete.indexer.tokens import TokenizerInfo  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings, SpecSettings  # noqa: E402
from codecomplete.model.engine import generate  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402
from codecomplete.model.speculate import Drafter  # noqa: E402


def _value(default, text: str):
    """``text`` as the type of the setting's default."""
    if isinstance(default, bool):
        return text.strip().lower() in ("1", "true", "yes", "on")
    return type(default)(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task_args(ap)
    ap.add_argument("--model", default="default")
    ap.add_argument("--split", choices=("tune", "test"), default="tune")
    ap.add_argument("--sizes", default="3,4,6,8")
    ap.add_argument("--variants", default="", help="instead of sizes: settings to compare, ';'-separated, each "
                    "'name=value,...' over the shipped settings ('' for them): e.g. 'max_nodes=3;repo_chain=8'")
    ap.add_argument("--out", default=str(RESULTS / "spec_tree_size"))
    args = ap.parse_args()
    shipped = SpecSettings()
    if args.variants:
        variants = {}
        for v in args.variants.split(";"):
            pairs = (p.split("=") for p in v.split(",") if p)
            kw = {k.strip(): _value(getattr(shipped, k.strip()), x) for k, x in pairs}
            variants[v.strip() or "shipped"] = replace(shipped, **kw)
    else:
        variants = {f"max_nodes={n}" + (" (shipped)" if n == shipped.max_nodes else ""): replace(shipped, max_nodes=n)
                    for n in (int(x) for x in args.sizes.split(","))}
    sizes = list(variants)
    lm = load_model(args.model, dtype=args.dtype)
    settings = EngineSettings(model=args.model, max_prefix_tokens=2048)
    vocab = _Vocab(lm.tokenizer)
    tok = TokenizerInfo(lm.tokenizer, lm.name)
    res = {n: ([], []) for n in sizes}
    names = []
    for repo in load_repos(args, lm, tok):
        names.append(repo["name"])
        store, tasks = repo["store"], repo[args.split]
        drafters = {n: Drafter(variants[n], store.retrieve, vocab.texts) for n in sizes}
        warm = CompletionRequest(tasks[0]["context"], "", mode="multi", max_tokens=8, max_lines=100000,
                                 time_budget_ms=600000, ignore_eos=True)
        with torch.inference_mode():  # first calls build kernels and token texts: not timed
            generate(lm, warm, settings, vocab, None, None, Drafter(shipped, store.retrieve, vocab.texts))
        for t in tasks:
            req = CompletionRequest(t["context"], "", mode="multi", max_tokens=args.max_new, max_lines=100000,
                                    time_budget_ms=600000, ignore_eos=True)
            for n in sizes:
                with torch.inference_mode():
                    res[n][0].append(_row(generate(lm, req, settings, vocab, None, None, None), None, 0.0))
                    before = drafters[n].stats["draft_ms"]
                    res[n][1].append(_row(generate(lm, req, settings, vocab, None, None, drafters[n]), drafters[n],
                                          before))
            print(f"{repo['name']}: {t['path']}", file=sys.stderr)
    table = {}
    for n, (plain, got) in res.items():
        p, s = summarize(plain, None), summarize(got, plain)
        table[n] = {"autoregressive_ms": p["ms_per_token"], **s,
                    "speedup": round(p["ms_per_token"] / s["ms_per_token"], 3)}
    lines = [header("Retrieval speculation: the draft tree's size, sizes interleaved per task"), "",
             f"Model {lm.name} ({str(lm.dtype).removeprefix('torch.')}); the {args.split} split of "
             f"bench/speculation.py ({len(res[sizes[0]][0])} functions from {', '.join(names)}), {args.max_new} "
             f"greedy tokens each (end-of-text ignored); every other setting as shipped ({shipped}). Each speed-up "
             "is against autoregressive runs of the same tasks, each right before the task's run.", "",
             "| settings | autoregressive ms/token | ms/token | speed-up | tokens/pass | acceptance length | "
             "identical to greedy |", "|---|---|---|---|---|---|---|"]
    for n, r in table.items():
        lines.append(f"| {n} | {r['autoregressive_ms']} | "
                     f"{r['ms_per_token']} | {r['speedup']} | {r['tokens_per_pass']} | {r['acceptance_length']} | "
                     f"{r['identical']}/{r['tasks']} |")
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(table, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
