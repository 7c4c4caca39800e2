"""Repository drafts corrected by the model's own predictions over the repository (issue #8), replayed.

A hypothesis for SmolLM2-135M's short drafts, measured before building it into the daemon:
where the model's greedy output follows a context that also occurs in the repository, the
repository's continuation is drafted, and it is wrong where the model would write the code
otherwise than the repository does.  If the model's own greedy prediction at every position of
the repository's text were known (one prefill of the repository, done once), a repository
continuation could stop where the model disagrees with the text, and end with the model's token
instead ("corrected"), the text's token being one the model would not have written there.

1. Each document of each repository's datastore (bench/speculation.py's: the repository without
   the held-out functions) is prefilled in windows of 1,024 positions, each after the 1,024 before
   it, and the greedy token at every position is kept: ``pred[p]`` is the model's choice of the
   token at p from the document before p.  (``--preds DIR`` keeps them there between runs.)
2. The greedy outputs of the held-out functions and the replay of drafting are
   bench/spec_ceiling.py's (the engine's own ``Drafter``, no forward; a node is accepted when the
   greedy output follows it), with the repository source re-implemented: the longest context
   suffix (up to 16 tokens) and up to 256 of its occurrences, as ``indexer.suffix.lookup`` does.
   - **text**: the continuations as the repository has them; must equal the shipped replay.
   - **corrected**: each occurrence's continuation cut at the first position where ``pred``
     differs from the text, ending with ``pred``'s token there.
   The common datastore, the cache and the request's own tokens are as shipped.

    python bench/spec_preference.py --repos A,B,C [--models smollm2-135m] [--splits test,tune]
                                    [--tune-functions 4] [--preds /tmp/preds] [--out bench/results/spec_preference]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import spec_ceiling as sc  # noqa: E402
from common import RESULTS, file_label, header, write_results  # noqa: E402
from speculation import load_repos, task_args  # noqa: E402

from codecomplete.indexer.suffix import MAX_DRAFT, MAX_QUERY, Continuation, Match, encode, lookup  # noqa: E402
from codecomplete.indexer.tokens import TokenizerInfo  # noqa: E402
from codecomplete.model.api import EngineSettings, SpecSettings  # noqa: E402
from codecomplete.model.engine import _Vocab, generate  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402
from codecomplete.model.sampling import greedy_tokens  # noqa: E402
from codecomplete.model.speculate import datastore_min_match, pass_rows  # noqa: E402

WINDOW = 1024


def predictions(model, ids: list[int]) -> np.ndarray:
    """``out[p]``: the greedy token at position p from ``ids[:p]`` (at most 1,024 positions back
    beyond the window); -1 at p = 0."""
    n = len(ids)
    out = np.full(n, -1, dtype=np.int64)
    for s in range(0, n, WINDOW):
        cache = model.new_cache(2 * WINDOW + 8)
        with torch.inference_mode():
            for a in range(max(0, s - WINDOW), s, 256):
                model(torch.tensor([ids[a:min(s, a + 256)]]), [cache], logits_for="last")
            for a in range(s, min(n, s + WINDOW), 256):
                b = min(n, s + WINDOW, a + 256)
                for j, t in enumerate(greedy_tokens(model(torch.tensor([ids[a:b]]), [cache], logits_for="all")[0])):
                    if a + j + 1 < n:
                        out[a + j + 1] = t
    return out


def segment_predictions(model, seg, cache_file: Path | None) -> np.ndarray:
    digest = hashlib.sha1(bytes(seg.buf)).hexdigest()[:16]
    if cache_file is not None and cache_file.exists():
        kept = np.load(cache_file, allow_pickle=False)
        if str(kept["digest"]) == digest:
            return kept["pred"]
    pred = np.full(len(seg.tok), -1, dtype=np.int64)
    for i in range(len(seg.keys)):
        ids = seg.doc_ids(i).tolist()
        if ids:
            st = int(seg.starts[i])
            pred[st:st + len(ids)] = predictions(model, ids)
    if cache_file is not None:
        np.savez(cache_file, pred=pred, digest=np.array(digest))
    return pred


def corrected_retrieve(store, pred: np.ndarray, corrected: bool):
    """``store.retrieve`` with its repository match re-implemented (one base segment, no dead
    documents: bench/speculation.py's datastore), its continuations cut where ``pred`` disagrees."""
    seg = store.repo.segments()[0]
    tok, sentinel = seg.tok, seg.sentinel

    def retrieve(context, draft_len=8, top_k=8, min_len=2):
        out = []
        if store.common is not None:  # the common datastore as Datastore.retrieve asks it
            m = lookup([store.common], context, draft_len=draft_len, top_k=top_k, min_len=min_len)
            if m:
                out.append(Match(m.length, m.occurrences, m.continuations, "common"))
        tail = list(context[-MAX_QUERY:])
        found, a, b = None, min_len, len(tail)
        while a <= b:  # the longest matched length: occurrence is monotone in it (suffix.lookup's search)
            mid = (a + b) // 2
            lo, hi = seg.find(encode(tail[-mid:], seg.width))
            if hi > lo:
                found, a = (mid, lo, hi), mid + 1
            else:
                b = mid - 1
        if found is None:
            return out
        length, lo, hi = found
        pos = seg.positions(lo, hi, 256)
        idx = pos[:, None] + length + np.arange(max(1, min(draft_len, MAX_DRAFT)))[None, :]
        rows, guess = tok[idx].astype(np.int64), pred[idx]
        ended = np.maximum.accumulate(rows == sentinel, axis=1)
        if corrected:  # from the first position where the model leaves the text: its token, then nothing
            left = (guess >= 0) & (guess != rows) & ~ended
            seen = np.cumsum(left, axis=1)
            turn = left & (seen == 1)  # the first place the model leaves the text
            rows = np.where(turn, guess, rows)
            ended |= (seen >= 1) & ~turn
        rows[ended] = -1
        counts: Counter = Counter()
        for row in map(tuple, rows.tolist()):
            seq = tuple(t for t in row if t >= 0)
            if seq:
                counts[seq] += 1
        if counts:
            out.insert(0, Match(length, hi - lo, [Continuation(s, c) for s, c in counts.most_common(top_k)],
                                "repository"))
        return out
    return retrieve


def repository_predictions(lm, repos: list[dict], preds: Path | None) -> dict[str, np.ndarray]:
    """Per repository (``speculation.load_repos``), ``segment_predictions`` of its datastore, kept in
    the folder ``preds`` (None: not kept)."""
    if preds is not None:
        preds.mkdir(parents=True, exist_ok=True)
    return {r["name"]: segment_predictions(
        lm.model, r["store"].repo.segments()[0],
        preds / f"{file_label(lm.name)}.{r['name']}.npz" if preds is not None else None) for r in repos}


def corrected_repositories(lm, repos: list[dict], preds: Path) -> None:
    """Each repository's store drafting corrected continuations (bench/speculation.py's
    ``--corrected-repository``), the predictions kept in ``preds``."""
    for r, pred in zip(repos, repository_predictions(lm, repos, preds).values()):
        r["store"].retrieve = corrected_retrieve(r["store"], pred, True)


def run_model(name: str, args) -> dict:
    lm = load_model(name, dtype=args.dtype)
    settings = EngineSettings(model=name, max_prefix_tokens=2048, token_healing=False)
    vocab, tok = _Vocab(lm.tokenizer), TokenizerInfo(lm.tokenizer, lm.name)
    repos = load_repos(args, lm, tok)
    stores = {r["name"]: r["store"] for r in repos}
    t0 = time.perf_counter()
    preds = repository_predictions(lm, repos, Path(args.preds) if args.preds else None)
    pred_s = time.perf_counter() - t0
    spec = SpecSettings()
    rows, mm = pass_rows(spec, lm.model), datastore_min_match(spec, lm.model)
    agreement = {}
    for n, p in preds.items():
        known = p >= 0  # a document's first position has no prediction
        agreement[n] = round(float(np.mean(p[known] == stores[n].repo.segments()[0].tok[known].astype(np.int64))), 3)
    out = {"model": lm.name, "prediction_seconds": round(pred_s, 1),
           "repository_tokens": {n: s.tokens for n, s in stores.items()}, "agreement": agreement, "splits": {}}
    for split in args.splits:
        tasks = sc.split_tasks(lm, settings, vocab, repos, split, args.max_new)
        for t in tasks:
            with torch.inference_mode():
                t["out"] = list(generate(lm, t["req"], settings, vocab, None, None, None).token_ids)
        res = {"shipped": sc.replay(tasks, stores, vocab.texts, spec, None, rows, mm)}
        shipped = {n: s.retrieve for n, s in stores.items()}
        try:
            for kind in ("text", "corrected"):
                for n, s in stores.items():
                    s.retrieve = corrected_retrieve(s, preds[n], kind == "corrected")
                res[kind] = sc.replay(tasks, stores, vocab.texts, spec, None, rows, mm)
        finally:
            for n, s in stores.items():
                s.retrieve = shipped[n]
        out["splits"][split] = {"tasks": len(tasks), "rows": res}
        print(f"{lm.name} {split}: " + ", ".join(f"{k} {v['tokens_per_pass']}" for k, v in res.items()),
              file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task_args(ap)
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--splits", default="test,tune")
    ap.add_argument("--preds", default="", help="a folder keeping the repositories' predictions between runs")
    ap.add_argument("--out", default=str(RESULTS / "spec_preference"))
    args = ap.parse_args()
    args.splits = [s for s in args.splits.split(",") if s]
    if args.preds:
        Path(args.preds).mkdir(parents=True, exist_ok=True)
    results = [run_model(m.strip(), args) for m in args.models.split(",") if m.strip()]
    lines = [header("Repository drafts corrected by the model's own predictions (replayed)"), "",
             f"Held-out functions of bench/speculation.py ({args.functions} test, {args.tune_functions} tune per "
             f"repository), {args.max_new} greedy tokens each (end-of-text ignored, token healing off); drafting "
             "replayed with the engine's `Drafter` at the shipped settings (bench/spec_ceiling.py). **text**: the "
             "repository source re-implemented (must equal **shipped**); **corrected**: each repository continuation "
             "cut where the model's greedy prediction over the repository's own text differs from the text, ending "
             "with the model's token.", ""]
    for res in results:
        lines += [f"## {res['model']}", "",
                  f"Predictions over {sum(res['repository_tokens'].values()):,} repository tokens in "
                  f"{res['prediction_seconds']} s (this machine, both cores); the model's greedy token equals the "
                  f"text at {', '.join(f'{n} {a:.1%}' for n, a in res['agreement'].items())} of positions.", "",
                  "| split | drafts | tokens/pass | acceptance length | draft nodes/pass | passes |",
                  "|---|---|---|---|---|---|"]
        for split, s in res["splits"].items():
            for kind, r in s["rows"].items():
                lines.append(f"| {split} ({s['tasks']} functions) | {kind} | {r['tokens_per_pass']} | "
                             f"{r['acceptance_length']} | {r['nodes_per_pass']} | {r['passes']} |")
        lines.append("")
    write_results(args.out, lines, results)


if __name__ == "__main__":
    main()
