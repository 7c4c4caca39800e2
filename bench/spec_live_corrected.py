"""The request's own-token drafts corrected by the model's own predictions over the prompt (issue #8), replayed.

The strongest draft source is the request's own tokens (prompt lookup: where the last tokens
occurred before in the prompt or the output, what followed them).  In the output, what followed
is the model's own greedy text; in the prompt it is the file as written, which the model may
not follow.  The prompt's prefill could also give the model's greedy token at every prompt
position (the head over every row instead of the last).  This measures, before building it,
what that would be worth: an own-token continuation from the prompt cut where the model's
prediction leaves the text, ending with the model's token (bench/spec_preference.py's cut, for
the prompt instead of the repository).

1. ``pred[p]``: the greedy token at prompt position p from the prompt before p (one prefill of
   the engine's own prompt, every row's logits); the output needs none.
2. Drafting replayed over the greedy outputs (bench/spec_ceiling.py's ``replay``: the engine's
   own ``Drafter``, no forward, the engine's row cap and datastore matches), with the own-token
   index ``LiveIndex`` as shipped (**shipped**) or with its prompt continuations cut
   (**corrected**).  The datastores, the cache and the settings are as shipped.

    python bench/spec_live_corrected.py --repos A,B,C [--models smollm2-135m,default] [--splits test,tune]
                                        [--out bench/results/spec_live_corrected]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import spec_ceiling as sc  # noqa: E402
from common import RESULTS, header, write_results  # noqa: E402
from speculation import load_repos, task_args  # noqa: E402

from codecomplete.indexer.tokens import TokenizerInfo  # noqa: E402
from codecomplete.model.api import EngineSettings, SpecSettings  # noqa: E402
from codecomplete.model.engine import _Vocab, generate  # noqa: E402
from codecomplete.model.loader import load_model  # noqa: E402
from codecomplete.model.sampling import greedy_tokens  # noqa: E402
from codecomplete.model.speculate import LiveIndex, datastore_min_match, pass_rows  # noqa: E402

PIECE = 256


def prompt_predictions(model, ids: list[int]) -> np.ndarray:
    """``out[p]``: the greedy token at position p from ``ids[:p]`` (-1 at p = 0): one prefill, every
    row's logits."""
    out = np.full(len(ids), -1, dtype=np.int64)
    cache = model.new_cache(len(ids) + 8)
    with torch.inference_mode():
        for a in range(0, len(ids), PIECE):
            logits = model(torch.tensor([ids[a:a + PIECE]]), [cache], logits_for="all")[0]
            for j, t in enumerate(greedy_tokens(logits)):
                if a + j + 1 < len(ids):
                    out[a + j + 1] = t
    return out


class CorrectedLive(LiveIndex):
    """``LiveIndex`` whose continuations are cut where ``pred`` (the model's greedy token at each
    prompt position) leaves the text, ending with ``pred``'s token; positions past ``pred`` (the
    output, the model's own tokens) are kept as they are."""

    def __init__(self, pred: np.ndarray, keep_text: bool = False):
        super().__init__()
        self.pred = pred.tolist()
        self.keep_text = keep_text  # the text's continuation too, beside the cut one

    def continuations(self, end: int, depth: int) -> list[tuple[int, ...]]:
        text = cont = self.seq[end:end + depth]
        for j, tok in enumerate(cont):
            p = end + j
            if p < len(self.pred) and 0 <= self.pred[p] != tok:
                cont = cont[:j] + [self.pred[p]]
                break
        return [tuple(text), tuple(cont)] if self.keep_text and cont is not text else [tuple(cont)]


def run_model(name: str, args) -> dict:
    lm = load_model(name, dtype=args.dtype)
    settings = EngineSettings(model=name, max_prefix_tokens=2048, token_healing=False)
    vocab, tok = _Vocab(lm.tokenizer), TokenizerInfo(lm.tokenizer, lm.name)
    repos = load_repos(args, lm, tok)
    stores = {r["name"]: r["store"] for r in repos}
    spec = SpecSettings()
    rows, mm = pass_rows(spec, lm.model), datastore_min_match(spec, lm.model)
    out = {"model": lm.name, "splits": {}}
    for split in args.splits:
        tasks = sc.split_tasks(lm, settings, vocab, repos, split, args.max_new)
        t0 = time.perf_counter()
        agree = known = 0
        for t in tasks:
            with torch.inference_mode():
                t["out"] = list(generate(lm, t["req"], settings, vocab, None, None, None).token_ids)
            t["pred"] = prompt_predictions(lm.model, t["prompt"])
            seen = t["pred"] >= 0
            agree += int((t["pred"][seen] == np.asarray(t["prompt"])[seen]).sum())
            known += int(seen.sum())
        res = {"shipped": sc.replay(tasks, stores, vocab.texts, spec, None, rows, mm),
               "corrected": sc.replay(tasks, stores, vocab.texts, spec, None, rows, mm,
                                      live_for=lambda t: CorrectedLive(t["pred"])),
               "text and corrected": sc.replay(tasks, stores, vocab.texts, spec, None, rows, mm,
                                               live_for=lambda t: CorrectedLive(t["pred"], keep_text=True))}
        out["splits"][split] = {"tasks": len(tasks), "rows": res, "prompt_agreement": round(agree / max(1, known), 3),
                                "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{lm.name} {split}: " + ", ".join(f"{k} {v['tokens_per_pass']}" for k, v in res.items()),
              file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task_args(ap)
    ap.add_argument("--models", default="smollm2-135m,default")
    ap.add_argument("--splits", default="test,tune")
    ap.add_argument("--out", default=str(RESULTS / "spec_live_corrected"))
    args = ap.parse_args()
    args.splits = [s for s in args.splits.split(",") if s]
    results = [run_model(m, args) for m in args.models.split(",")]
    lines = [header("Own-token drafts corrected by the model's predictions over the prompt (replayed)"), "",
             "Held-out functions of bench/speculation.py (its splits), 64 greedy tokens each, token healing off; "
             "drafting replayed with the engine's Drafter (bench/spec_ceiling.py's replay, shipped settings, the "
             "engine's row cap): the own-token index as shipped, and with its prompt continuations cut where the "
             "model's greedy prediction over the prompt leaves the text (ending with the model's token).", "",
             "| model | split | drafts | tokens/pass | acceptance length | draft nodes/pass | passes | "
             "model agrees with the prompt |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for split, d in res["splits"].items():
            for kind, r in d["rows"].items():
                lines.append(f"| {res['model']} | {split} ({d['tasks']} functions) | {kind} | {r['tokens_per_pass']} | "
                             f"{r['acceptance_length']} | {r['nodes_per_pass']} | {r['passes']} | "
                             f"{d['prompt_agreement']:.1%} |")
    write_results(Path(args.out), lines, {"results": results})


if __name__ == "__main__":
    main()
