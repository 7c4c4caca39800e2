"""Retrieval speculation (issue #8) in FastCoder's repository-level setup.

    python bench/speculation.py --repos DIR[,DIR...] [--model smollm2-135m] [--functions 10]
                                [--max-new 64] [--tune] [--out bench/results/speculation]

Each ``--repos`` entry is a git directory (``fetch`` brings them to /work/.mirror; the
code is never committed): its HEAD is extracted, Python functions are held out (a
fixed hash order; a *tune* split and a disjoint *test* split), and for each:

* context = the file up to the function's first body statement (signature and
  docstring included), at most 2,048 tokens; the body is generated greedily for
  ``--max-new`` tokens (end-of-text ignored, so every method makes the same tokens);
* datastore = every Python file of the repository with *all* held-out bodies cut out
  (suffix arrays, ``indexer.suffix``), plus the common datastore (the standard library);
* the verified cache lives for one repository's run, as in the daemon.

Methods: autoregressive greedy (our engine), FastCoder as built here (all sources),
ablations (one source at a time, no cache, no retrieval timing), a REST-style baseline
(common datastore only, no cache), and transformers' prompt-lookup decoding next to
transformers' own greedy decoding.  Reports decode ms/token, speedup over our
autoregressive decoding, tokens per forward pass (average acceptance length), and
whether every output equals the autoregressive one.  ``--tune`` runs the parameter
grid on the tune split instead and writes ``..._tuning.md``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from codecomplete.indexer.common import build_common, common_dir, load_common  # noqa: E402
from codecomplete.indexer.suffix import DraftIndex, Match, lookup, width_for  # noqa: E402
from codecomplete.indexer.tokens import TokenizerInfo  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings, ExitSettings, SpecSettings  # noqa: E402
from codecomplete.model.early_exit import load_exits  # noqa: E402
from codecomplete.model.engine import ExitRuntime, _Vocab, default_exits_path, generate  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402
from codecomplete.model.speculate import Drafter  # noqa: E402

WORK = Path(__file__).resolve().parent / ".work" / "speculation"


def checkout(git_dir: Path) -> tuple[str, Path]:
    name = git_dir.parent.name if git_dir.name == "repo" else git_dir.name
    out = WORK / name
    if not out.is_dir():
        out.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(git_dir), "archive", "HEAD"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return name, out


def held_out(root: Path, n_test: int, n_tune: int) -> tuple[dict[str, str], list[dict], list[dict]]:
    """Files (path -> text) and two disjoint samples of functions to generate."""
    files, funcs = {}, []
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 500_000:
            continue
        rel = path.relative_to(root).as_posix()
        files[rel] = text
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        starts = np.cumsum([0] + [len(x) for x in lines])
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if (isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                    and isinstance(body[0].value.value, str)):
                body = body[1:]  # the docstring stays in the context
            if not body:
                continue
            first, last = body[0].lineno, node.end_lineno
            if not 3 <= last - first + 1 <= 40:
                continue
            a, b = int(starts[first - 1]), int(starts[last])
            key = hashlib.sha256(f"{rel}:{node.name}:{first}".encode()).hexdigest()
            funcs.append({"path": rel, "name": node.name, "start": a, "end": b, "key": key})
    funcs.sort(key=lambda f: f["key"])
    chosen, used = [], set()
    for f in funcs:  # at most one function per file, so removals never overlap
        if f["path"] not in used:
            chosen.append(f)
            used.add(f["path"])
    return files, chosen[:n_test], chosen[n_test:n_test + n_tune]


class Datastore:
    """The repository without the held-out bodies, and the common datastore."""

    def __init__(self, files: dict[str, str], removed: list[dict], tok: TokenizerInfo):
        cut = {f["path"]: f for f in removed}
        docs = []
        for rel, text in files.items():
            if rel in cut:
                f = cut[rel]
                text = text[:f["start"]] + text[f["end"]:]
            docs.append((rel, text))
        ids = tok.encode_batch([t for _, t in docs])
        self.repo = DraftIndex.from_documents([(r, i) for (r, _), i in zip(docs, ids)], width_for(tok.vocab_size))
        self.tokens = int(sum(len(i) for i in ids))
        folder = common_dir(tok)
        if load_common(tok, folder) is None:
            build_common(tok, folder)
        self.common = load_common(tok, folder)

    def retrieve(self, context: list[int], **kw) -> list[Match]:
        out = []
        m = self.repo.lookup(context, **kw)
        if m:
            out.append(m)
        if self.common is not None:
            m = lookup([self.common], context, **kw)
            if m:
                out.append(Match(m.length, m.occurrences, m.continuations, "common"))
        return out


def _window_hashes(ids, width: int) -> np.ndarray:
    """A hash of every ``width``-token window of ``ids`` (uint64, polynomial, wrapping)."""
    a = np.asarray(ids, dtype=np.uint64)
    if len(a) < width:
        return np.empty(0, dtype=np.uint64)
    powers = np.full(width, 1_000_003, dtype=np.uint64) ** np.arange(width, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (np.lib.stride_tricks.sliding_window_view(a, width) * powers).sum(axis=1, dtype=np.uint64)


def filtered_common(tok: TokenizerInfo, roots: list[Path], repos: list[dict], folder: Path,
                    held_window: int = 32, repo_window: int = 16, repo_share: float = 0.1):
    """A common datastore from the .py files under ``roots`` (e.g. a site-packages), without any
    file that overlaps the benchmark's repositories: one that holds a ``held_window``-token
    stretch of a held-out function (test or tune), or whose ``repo_window``-token windows are
    more than ``repo_share`` found in a repository (an installed or vendored copy).  Built into
    ``folder`` once (its meta says what was dropped) and loaded from there after."""
    from codecomplete.indexer.common import MAX_FILE_BYTES, save_common
    from codecomplete.indexer.files import SourceError, read_source
    from codecomplete.indexer.suffix import Segment

    if (folder / "meta.json").is_file():
        return load_common(tok, folder), json.loads((folder / "meta.json").read_text())
    held, repo = [], []
    for r in repos:
        for f in r["test"] + r["tune"]:
            held.append(_window_hashes(tok.encode_batch([r["texts"][f["path"]][f["start"]:f["end"]]])[0],
                                       held_window))
        repo.append(_window_hashes(np.concatenate([np.asarray(i) for i in tok.encode_batch(list(r["texts"].values()))]),
                                   repo_window))
    held_set, repo_set = np.unique(np.concatenate(held)), np.unique(np.concatenate(repo))
    paths = sorted(p for root in roots for p in Path(root).rglob("*.py") if "__pycache__" not in p.parts)
    texts, names = [], []
    for p in paths:
        try:
            texts.append(read_source(p, MAX_FILE_BYTES))
            names.append(str(p))
        except SourceError:
            continue
    def found(w: np.ndarray, table: np.ndarray) -> np.ndarray:  # w's members in the sorted table
        at = np.minimum(np.searchsorted(table, w), len(table) - 1)
        return table[at] == w

    kept, dropped = [], {"held_out_stretch": 0, "repository_copy": 0}
    for i in range(0, len(texts), 256):
        for name, ids in zip(names[i:i + 256], tok.encode_batch(texts[i:i + 256])):
            if len(ids) == 0:
                continue
            if found(_window_hashes(ids, held_window), held_set).any():
                dropped["held_out_stretch"] += 1
                continue
            w = _window_hashes(ids, repo_window)
            if len(w) and found(w, repo_set).mean() > repo_share:
                dropped["repository_copy"] += 1
                continue
            kept.append((name, np.asarray(ids)))
    seg = Segment.build(kept, width_for(tok.vocab_size))
    meta = {"tokenizer": tok.id, "tokenizer_name": tok.name, "sources": [str(r) for r in roots],
            "files": len(kept), "tokens": int(seg.tokens), "dropped": dropped,
            "rule": f"dropped: a file holding a {held_window}-token stretch of a held-out function, or with more "
                    f"than {repo_share:.0%} of its {repo_window}-token windows in a repository"}
    save_common(seg, folder, meta)
    return load_common(tok, folder), json.loads((folder / "meta.json").read_text())


def methods(best: SpecSettings) -> dict[str, SpecSettings | None]:
    return {
        "autoregressive": None,
        "FastCoder (ours: own tokens + repository + common + cache)": best,
        "without the request's own tokens (FastCoder's sources)": replace(best, use_live=False),
        "own tokens only (prompt lookup in the engine)": replace(best, use_repository=False, use_common=False,
                                                                 use_cache=False),
        "repository only": replace(best, use_common=False, use_cache=False, use_live=False),
        "common only, no cache (REST-style)": replace(best, use_repository=False, use_cache=False, use_live=False),
        "repository + common, no cache": replace(best, use_cache=False, use_live=False),
        "cache only": replace(best, use_repository=False, use_common=False, use_live=False),
        "no retrieval timing (skip tokens, missing table off)": replace(best, skip_tokens=False, missing_table=False),
    }


EXIT_METHODS = {  # --lossless-exit, --lossy-exit: issue #9's early exit on these tasks (models with exit heads)
    "lossless": {"lossless early exit alone (early-layer drafts, no retrieval)": None,
                 "FastCoder + lossless early exit (early-layer drafts where retrieval has none)": "best"},
    "lossy": {"early exit at the 0.02 bound alone (lossy)": None,
              "FastCoder + early exit at the 0.02 bound (lossy: exits where retrieval has no draft)": "best"},
}


def _row(c, drafter, before: float) -> dict:
    return {"ids": c.token_ids, "decode_ms": c.timings.get("decode_ms", 0.0), "n": c.generated_tokens,
            "passes": c.forward_passes, "spec_steps": c.spec_steps, "accepted": c.accepted_tokens,
            "draft_ms": (drafter.stats["draft_ms"] - before) if drafter else 0.0}


def run_engine(lm, settings: EngineSettings, tasks: list[dict], store: Datastore | None,
               spec: SpecSettings | None, vocab, max_new: int, paired: bool = False, exits=None):
    """Each task generated with ``spec`` (None: autoregressive).  ``paired``: each task is also
    generated autoregressively right before (this machine's speed drifts by 10-20 % within
    minutes, so a speedup is only fair between runs made next to each other); returns
    (autoregressive rows, rows)."""
    drafter = Drafter(spec, store.retrieve if store else None, vocab.texts) if spec else None
    out, plain = [], []
    for t in tasks:
        req = CompletionRequest(t["context"], "", mode="multi", max_tokens=max_new, max_lines=100000,
                                time_budget_ms=600000, ignore_eos=True)
        with torch.inference_mode():
            if paired:
                plain.append(_row(generate(lm, req, settings, vocab, None, None, None), None, 0.0))
            before = drafter.stats["draft_ms"] if drafter else 0.0
            out.append(_row(generate(lm, req, settings, vocab, None, None, drafter, exits), drafter, before))
    return (plain, out) if paired else out


def summarize(rows: list[dict], reference: list[dict] | None) -> dict:
    n = sum(r["n"] for r in rows)
    ms = sum(r["decode_ms"] for r in rows)
    passes = sum(r["passes"] for r in rows)
    steps = sum(r["spec_steps"] for r in rows)
    res = {"tokens": n, "ms_per_token": round(ms / max(1, n), 2),
           "draft_share": round(sum(r["draft_ms"] for r in rows) / max(1e-9, ms), 3),
           "tokens_per_pass": round(n / max(1, passes), 3),
           "acceptance_length": round(1 + sum(r["accepted"] for r in rows) / steps, 3) if steps else None}
    if reference is not None:
        res["identical"] = sum(a["ids"] == b["ids"] for a, b in zip(rows, reference))
        res["tasks"] = len(rows)
    return res


def hf_peers(lm, tasks: list[dict], max_new: int, dtype) -> dict:
    """transformers' greedy decoding and its prompt-lookup decoding, same prompts."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(lm.path, dtype=dtype, local_files_only=True).eval()
    res = {}
    for name, extra in (("transformers greedy", {}), ("transformers prompt lookup (10)", {"prompt_lookup_num_tokens": 10})):
        ms, n, outs = 0.0, 0, []
        for t in tasks:
            ids = torch.tensor([t["prompt_ids"]])
            kw = dict(do_sample=False, pad_token_id=lm.tokenizer.eos_token_id, **extra)
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
                t1 = time.perf_counter()
                gen = hf.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, **kw)
                t2 = time.perf_counter()
            ms += ((t2 - t1) - (t1 - t0)) * 1000  # minus a prefill + one token
            n += gen.shape[1] - ids.shape[1] - 1
            outs.append(gen[0, ids.shape[1]:].tolist())
        res[name] = {"tokens": n, "ms_per_token": round(ms / max(1, n), 2), "outputs": outs}
    return res


def task_args(ap: argparse.ArgumentParser) -> None:
    """The options that choose the repositories, the held-out functions and their length
    (shared with bench/spec_ceiling.py, which must pick the same test split)."""
    ap.add_argument("--repos", required=True, help="comma-separated git directories")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "int8"], help="the layers' matrices (model.weights)")
    ap.add_argument("--functions", type=int, default=10, help="test functions per repository")
    ap.add_argument("--tune-functions", type=int, default=4, help="tune functions per repository (the datastores "
                    "leave out test and tune functions both)")
    ap.add_argument("--max-new", type=int, default=64)


def load_repos(args, lm, tok: TokenizerInfo) -> list[dict]:
    """Each ``--repos`` entry (``task_args``) checked out, with its held-out functions, each with its
    context (the file before it, at most 2,048 tokens), and its datastore without them."""
    repos = []
    for g in args.repos.split(","):
        name, root = checkout(Path(g))
        files, test, tune = held_out(root, args.functions, args.tune_functions)
        store = Datastore(files, test + tune, tok)
        for f in test + tune:
            ctx_ids = lm.tokenizer.encode(files[f["path"]][:f["start"]], add_special_tokens=False)[-2048:]
            f["context"] = lm.tokenizer.decode(ctx_ids)
        repos.append({"name": name, "files": len(files), "tokens": store.tokens, "test": test, "tune": tune,
                      "store": store, "texts": files})
        print(f"{name}: {len(files)} files, {store.tokens} datastore tokens, {len(test)} test + {len(tune)} tune "
              "functions", file=sys.stderr)
    return repos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task_args(ap)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tune", action="store_true", help="run the parameter grid on the tune split")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-fp32-check", action="store_true", help="skip the fp32 run that checks identical outputs")
    ap.add_argument("--methods", default="", help="comma-separated words; only the methods whose names hold one "
                    "(autoregressive always runs)")
    ap.add_argument("--lossless-exit", action="store_true", help="add lossless early exit (issue #9) alone and "
                    "beside retrieval speculation")
    ap.add_argument("--lossy-exit", action="store_true", help="add early exit at the 0.02 bound alone and beside "
                    "retrieval speculation")
    ap.add_argument("--corrected-repository", default="", metavar="PREDS_DIR",
                    help="repository drafts cut where the model's own prediction over the repository leaves its text "
                         "(bench/spec_preference.py; the predictions kept in PREDS_DIR): not the daemon's drafts")
    ap.add_argument("--common-corpus", default="", metavar="DIR[,DIR]",
                    help="the common datastore from the .py files under these folders (e.g. a site-packages) instead "
                         "of the standard library, less any file that overlaps the repositories (filtered_common): "
                         "not the daemon's datastore")
    ap.add_argument("--out", default=str(RESULTS / "speculation"))
    args = ap.parse_args()
    lm = load_model(args.model, dtype=args.dtype, weights=args.weights)
    settings = EngineSettings(model=args.model, max_prefix_tokens=2048, weights=args.weights)
    vocab = _Vocab(lm.tokenizer)
    tok = TokenizerInfo(lm.tokenizer, lm.name)
    repos = load_repos(args, lm, tok)
    if args.corrected_repository:
        from spec_preference import corrected_repositories

        corrected_repositories(lm, repos, Path(args.corrected_repository))
    if args.common_corpus:
        roots = [Path(d) for d in args.common_corpus.split(",")]
        key = hashlib.sha1(json.dumps([tok.id, [str(r) for r in roots],
                                       [[f["key"] for f in r["test"] + r["tune"]] for r in repos]]).encode())
        common, meta = filtered_common(tok, roots, repos, WORK / f"common-{key.hexdigest()[:12]}")
        args.common_meta = meta
        print(f"common corpus: {meta}", file=sys.stderr)
        for r in repos:
            r["store"].common = common
    out = Path(args.out)
    if args.tune:
        tune_grid(lm, settings, repos, vocab, args, out)
        return
    results: dict[str, dict] = {}
    per_repo: dict[str, dict] = {}
    best = SpecSettings()
    reference: dict[str, list] = {}
    warm = repos[0]["test"][:1]  # first calls build kernels and the token texts: not timed
    run_engine(lm, settings, warm, repos[0]["store"], None, vocab, 8)
    run_engine(lm, settings, warm, repos[0]["store"], best, vocab, 8)
    chosen = {label: (spec, None) for label, spec in methods(best).items()}
    kinds = [k for k, on in (("lossless", args.lossless_exit), ("lossy", args.lossy_exit)) if on]
    if kinds:
        home = default_exits_path(lm)
        if home is None:
            raise SystemExit(f"--{kinds[0]}-exit: {lm.name} has no exit heads")
        exit_heads = load_exits(home, lm.model)
    for kind in kinds:
        rt = ExitRuntime.build(exit_heads, ExitSettings(enabled=True, lossless=kind == "lossless"))
        chosen |= {label: (best if spec == "best" else None, rt) for label, spec in EXIT_METHODS[kind].items()}
    words = [w.strip().lower() for w in args.methods.split(",") if w.strip()]
    chosen = {label: m for label, m in chosen.items()
              if label == "autoregressive" or not words or any(w in label.lower() for w in words)}
    for label, (spec, exits) in chosen.items():
        # this machine's speed drifts by 10-20 % within minutes: each method's speedup is taken
        # against autoregressive runs of the same tasks, each made right before the task's run
        rows_all, plain_all = [], []
        for r in repos:
            if spec is None and exits is None:
                rows = run_engine(lm, settings, r["test"], r["store"], spec, vocab, args.max_new)
            else:
                plain, rows = run_engine(lm, settings, r["test"], r["store"], spec, vocab, args.max_new, paired=True,
                                         exits=exits)
                plain_all += plain
            if spec is None and exits is None:  # the autoregressive reference
                reference[r["name"]] = rows
            per_repo.setdefault(label, {})[r["name"]] = summarize(rows, reference.get(r["name"]))
            rows_all += rows
            print(f"{label} / {r['name']}: {per_repo[label][r['name']]}", file=sys.stderr)
        ref_all = [x for r in repos for x in reference[r["name"]]]
        results[label] = summarize(rows_all, ref_all)
        paired = summarize(plain_all or rows_all, None)["ms_per_token"]
        results[label]["autoregressive_ms_before"] = paired
        results[label]["speedup"] = round(paired / results[label]["ms_per_token"], 3)
    base = results["autoregressive"]["ms_per_token"]
    peers = {}
    if not args.no_peers:
        tasks = [dict(t, prompt_ids=_prompt_ids(lm, settings, t)) for r in repos for t in r["test"]]
        peers = hf_peers(lm, tasks, args.max_new, lm.dtype)
        hf_base = peers["transformers greedy"]["ms_per_token"]
        # our outputs start with the token healing regenerated; transformers' prompts are
        # not healed, so each peer is checked against transformers' own greedy output
        ref_all = peers["transformers greedy"]["outputs"]
        for name, p in peers.items():
            p["speedup_vs_own_greedy"] = round(hf_base / p["ms_per_token"], 3)
            p["speedup_vs_our_autoregressive"] = round(base / p["ms_per_token"], 3)
            p["identical_to_greedy"] = sum(a == b for a, b in zip(p["outputs"], ref_all))
        for p in peers.values():
            p.pop("outputs")
    exact = None
    if not args.no_fp32_check and lm.dtype != torch.float32:
        # the same check in fp32 (the PyTorch linear path for the weights, the native attention):
        # the outputs must be identical there too
        lm32 = load_model(args.model, dtype="float32")
        v32 = _Vocab(lm32.tokenizer)
        same = total = 0
        for r in repos:
            a = run_engine(lm32, settings, r["test"], r["store"], None, v32, args.max_new)
            b = run_engine(lm32, settings, r["test"], r["store"], best, v32, args.max_new)
            same += sum(x["ids"] == y["ids"] for x, y in zip(a, b))
            total += len(a)
        exact = (same, total)
    write(out, args, lm, repos, results, per_repo, peers, best, exact)


def _prompt_ids(lm, settings, task) -> list[int]:
    from codecomplete.model.engine import plan_prompt

    req = CompletionRequest(task["context"], "", mode="multi")
    return plan_prompt(lm, req, replace(settings, token_healing=False), None, None).ids


def tune_grid(lm, settings, repos, vocab, args, out: Path) -> None:
    """Coordinate search on the tune split, one group of parameters at a time (the tree's
    size first: on a CPU a wide verification pass is not free).  This machine's speed drifts
    by 10-20 % within minutes, so each configuration's speedup is taken against an
    autoregressive run of each task made right before the task's run."""
    ref = {r["name"]: run_engine(lm, settings, r["tune"], r["store"], None, vocab, args.max_new) for r in repos}
    base = summarize([x for v in ref.values() for x in v], None)["ms_per_token"]
    stages = [{"max_nodes": [3, 4, 8, 12]},
              {"live_chain": [0, 4, 8]},
              {"depth": [8, 12, 16]},
              {"top_k": [4, 8], "ab": [(1.0, 0.5), (1.0, 0.1)]},
              {"delta": [0.5, 1.0, 3.0]},
              {"p": [0.5, 1.0], "tau": [8, 64]}]
    best = {"max_nodes": 8, "depth": 8, "top_k": 4, "ab": (1.0, 0.1), "delta": 1.0, "live_chain": 0, "p": 1.0,
            "tau": 8}
    rows = []
    for stage in stages:
        scored = []
        for values in itertools.product(*stage.values()):
            cfg = dict(best, **dict(zip(stage.keys(), values)))
            spec = SpecSettings(max_nodes=cfg["max_nodes"], depth=cfg["depth"], top_k=cfg["top_k"],
                                alpha=cfg["ab"][0], beta=cfg["ab"][1], delta=cfg["delta"], live_chain=cfg["live_chain"],
                                p=cfg["p"], tau=cfg["tau"])
            plain, got = [], []
            for r in repos:
                a, b = run_engine(lm, settings, r["tune"], r["store"], spec, vocab, args.max_new, paired=True)
                plain += a
                got += b
            res = summarize(got, [x for r in repos for x in ref[r["name"]]])
            res["autoregressive_ms"] = summarize(plain, None)["ms_per_token"]
            res["speedup"] = round(res["autoregressive_ms"] / res["ms_per_token"], 3)
            scored.append((cfg, res))
            rows.append((cfg, res))
            print(cfg, res, file=sys.stderr)
        best = max(scored, key=lambda x: x[1]["speedup"])[0]
    lines = [header("Retrieval speculation: parameter search on the tune split"),
             f"Model {lm.name} ({str(lm.dtype).removeprefix('torch.')}); tune functions: "
             f"{sum(len(r['tune']) for r in repos)} from {', '.join(r['name'] for r in repos)} (disjoint from "
             f"the test functions); {args.max_new} tokens each; autoregressive {base} ms/token at the start.  One "
             "group of parameters at a time, in this order, each stage keeping the best of the previous ones; "
             "each speedup is against autoregressive runs of the same tasks, each right before the task's run.", "",
             "| max_nodes | depth | top_k | alpha | beta | delta | live_chain | p | tau | ms/token | speedup | "
             "tokens/pass | acceptance | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, r in rows:
        lines.append(f"| {cfg['max_nodes']} | {cfg['depth']} | {cfg['top_k']} | {cfg['ab'][0]} | {cfg['ab'][1]} | "
                     f"{cfg['delta']} | {cfg['live_chain']} | {cfg['p']} | {cfg['tau']} | {r['ms_per_token']} | "
                     f"{r['speedup']} | "
                     f"{r['tokens_per_pass']} | {r['acceptance_length']} | {r['identical']}/{r['tasks']} |")
    lines += ["", f"Chosen: {best}"]
    Path(str(out) + "_tuning.md").write_text("\n".join(lines) + "\n")
    Path(str(out) + "_tuning.json").write_text(json.dumps({"rows": rows, "best": best}, indent=1))
    print("\n".join(lines))


def write(out: Path, args, lm, repos, results, per_repo, peers, best: SpecSettings, exact) -> None:
    lines = [header("Retrieval speculation (FastCoder setup)"),
             f"Model {lm.name} ({str(lm.dtype).removeprefix('torch.')}, layer weights {lm.model.weights}), greedy, "
             f"{args.max_new} tokens per held-out function (end-of-text ignored), batch 1.",
             "Repositories (HEAD, code not committed): " + "; ".join(
                 f"{r['name']} ({r['files']} files, {r['tokens']:,} datastore tokens, {len(r['test'])} test functions)"
                 for r in repos) + ".",
             f"Settings (the defaults; tuned on a disjoint split of the default model, "
             f"speculation_default_tuning.md): {best}.",
             *(["**Repository drafts corrected by the model's own predictions over the repository** "
                "(`--corrected-repository`, bench/spec_preference.py): an experiment, not the daemon's drafts."]
               if args.corrected_repository else []),
             *([f"**Common datastore from {args.common_corpus}** (`--common-corpus`, an experiment, not the daemon's "
                f"datastore): {args.common_meta['files']:,} files, {args.common_meta['tokens']:,} tokens; "
                f"{args.common_meta['rule']} ({args.common_meta['dropped']})."]
               if args.common_corpus else []), "",
             "Speedup: against autoregressive runs of the same tasks, each made right before the task's run with "
             "the method (their ms/token in the second column; this machine's speed drifts by 10-20 % within "
             "minutes).", "",
             "| method | ms/token | autoregressive ms/token (paired) | speedup | tokens/pass | acceptance length | "
             "drafting share of decode | identical to greedy |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['ms_per_token']} | {r['autoregressive_ms_before']} | {r['speedup']} | "
                     f"{r['tokens_per_pass']} | "
                     f"{r['acceptance_length'] if r['acceptance_length'] is not None else '-'} | "
                     f"{r['draft_share']:.1%} | "
                     f"{r['identical']}/{r['tasks']} |")
    if exact:
        lines += ["", f"Lossless check in float32 (same tasks, FastCoder vs autoregressive): {exact[0]}/{exact[1]} "
                  "outputs identical.  In bfloat16 (the table's column) the native kernels give every row of a "
                  "verification pass the bits a one-token step gives it (tests/test_native.py), so a differing "
                  "bf16 output would be a bug."]
    if peers:
        lines += ["", "Peers, same prompts and model (transformers' own forward, bf16/fp32 as the engine):", "",
                  "| method | ms/token | speedup vs its own greedy | speedup vs our autoregressive | identical to its greedy |",
                  "|---|---|---|---|---|"]
        for name, p in peers.items():
            lines.append(f"| {name} | {p['ms_per_token']} | {p['speedup_vs_own_greedy']} | "
                         f"{p['speedup_vs_our_autoregressive']} | {p['identical_to_greedy']}/{sum(len(r['test']) for r in repos)} |")
    lines += ["", "Per repository (ms/token, tokens/pass):", "", "| method | " + " | ".join(r["name"] for r in repos) + " |",
              "|---|" + "---|" * len(repos)]
    for label, d in per_repo.items():
        lines.append(f"| {label} | " + " | ".join(f"{d[r['name']]['ms_per_token']}, {d[r['name']]['tokens_per_pass']}"
                                                 for r in repos) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"results": results, "per_repo": per_repo, "peers": peers,
                                                    "settings": str(best), "fp32_identical": exact}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
