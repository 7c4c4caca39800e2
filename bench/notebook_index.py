"""Jupyter notebooks in the repository index: as their JSON (before) or as their code cells.

A notebook file is mostly outputs (base64 images, tables) and JSON around its code: each code
line sits in a string with its line break escaped (``"    x = f(a)\\n",``).  Indexed as text, a
notebook's code gives drafts that break at every line end, its outputs fill the draft index, and
a notebook over ``index.max_file_bytes`` or with long output lines is not indexed at all.  Since
the thirty-first session the index holds a notebook's code cells instead
(``indexer.files.notebook_code``).  This benchmark indexes each repository's tree at HEAD
twice with the default model's tokenizer (RepoIndex: real SQLite files, no watcher):

- ``json``: as before (``indexer.files.is_notebook`` made to answer False: the notebook read as
  text under the plain size limit and the minified-file rule), and
- ``code``: as shipped,

and reports the notebooks indexed and skipped (by reason), the draft index's tokens and the
seconds to index.  Then drafts: each notebook in turn is held out (the draft index rebuilt from
every other file, as ``index.lookup`` searches it), and its code cells are walked as retrieval
speculation would draft them, with an oracle model (the next tokens are the notebook's own):
at each position the longest suffix match of the last 64 tokens gives up to 8 continuations of
8 tokens, the longest agreement of one with the true next tokens is accepted, and the walk moves
on by that plus the one token a pass always yields.  Tokens per pass is then what the
repository's other notebooks could give a cell's completion at most, at the engine's shortest
match (2 tokens) and at the 8 it asks for on AVX2-only CPUs (``datastore_min_match``).

    python bench/notebook_index.py --repos GIT1[,GIT2] [--max-tokens 3000] [--out bench/results/notebook_index]

(each a git directory, as ``fetch`` brings; the trees are not committed)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, write_results  # noqa: E402

MODES = ("json", "code")
MIN_LENS = (2, 8)
DRAFT_LEN = 8
CONTEXT = 64


def tree_at_head(git: Path, out: Path) -> tuple[Path, list[str]]:
    """The files of HEAD under ``out``, and the paths left out: a mirror may lack its largest
    blobs (``fetch``), so each blob is read on its own."""
    out.mkdir(parents=True)
    listing = subprocess.run(["git", "-C", str(git), "ls-tree", "-r", "-z", "HEAD"], capture_output=True,
                             check=True).stdout.decode().split("\0")
    missing = []
    for entry in filter(None, listing):
        meta, path = entry.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind != "blob" or mode == "120000":
            continue
        blob = subprocess.run(["git", "-C", str(git), "cat-file", "blob", sha], capture_output=True)
        if blob.returncode != 0:
            missing.append(path)
            continue
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_bytes(blob.stdout)
    return out, missing


def index_tree(root: Path, work: Path, tok, mode: str) -> tuple[dict, list]:
    """The index of ``root`` in ``mode``: its stats and every file's token ids."""
    import numpy as np

    from codecomplete.indexer import files, index
    from codecomplete.indexer.tokens import blob_to_ids

    real = files.is_notebook
    if mode == "json":  # notebooks read as any text file, as before
        files.is_notebook = index.is_notebook = lambda path: False
    try:
        t0 = time.perf_counter()
        idx = index.RepoIndex(root, work / f"idx-{mode}", tokenizer=tok, watch=False).start()
        if not (idx.tokens_ready.wait(1800) and idx.wait_idle(1800)):
            raise SystemExit(f"indexing {root} ({mode}) did not finish")
        seconds = time.perf_counter() - t0
        s = idx.stats()
        docs = [(p, np.asarray(blob_to_ids(b))) for p, b in idx.store.all_tokens(tok.id)]
        idx.close()
    finally:
        files.is_notebook = index.is_notebook = real
    notebooks = [p for p, _ in docs if p.lower().endswith(".ipynb")]
    return {"seconds": round(seconds, 1), "files_indexed": len(docs), "notebooks_indexed": len(notebooks),
            "skipped": s["skipped"], "draft_tokens": int(sum(len(d) for _, d in docs)),
            "notebook_tokens": int(sum(len(d) for p, d in docs if p.lower().endswith(".ipynb")))}, docs


def walk(segments, ids: list[int], min_len: int) -> tuple[int, int, int]:
    """(tokens, passes, passes with a draft) over ``ids`` with an oracle model."""
    from codecomplete.indexer.suffix import lookup

    i, passes, drafted = 1, 0, 0
    while i < len(ids):
        m = lookup(segments, ids[max(0, i - CONTEXT):i], min_len=min_len, draft_len=DRAFT_LEN) if segments else None
        best = 0
        if m:
            truth = ids[i:i + DRAFT_LEN]
            for c in m.continuations:
                n = 0
                for a, b in zip(c.tokens, truth):
                    if int(a) != b:
                        break
                    n += 1
                best = max(best, n)
            drafted += 1
        passes += 1
        i += min(best, len(ids) - i - 1) + 1
    return len(ids) - 1, passes, drafted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repos", required=True, help="comma-separated git directories")
    ap.add_argument("--max-tokens", type=int, default=3000, help="of each held-out notebook's code (its start)")
    ap.add_argument("--out", default=str(RESULTS / "notebook_index"))
    args = ap.parse_args()

    from codecomplete.indexer.files import SourceError, notebook_code
    from codecomplete.indexer.suffix import DraftIndex, width_for
    from codecomplete.model.loader import load_tokenizer

    tok = load_tokenizer()
    width = width_for(tok.vocab_size)
    data = {"repos": []}
    lines = [header("Jupyter notebooks in the repository index: their JSON or their code cells"), ""]
    for git in [Path(r) for r in args.repos.split(",") if r]:
        with tempfile.TemporaryDirectory(prefix="nbindex-") as tmp:
            root, missing = tree_at_head(git, Path(tmp) / "tree")
            head = subprocess.run(["git", "-C", str(git), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
            truths = {}
            for path in sorted(root.rglob("*.ipynb")):
                try:
                    code, _ = notebook_code(path.read_text(encoding="utf-8"), path.name)
                except (SourceError, UnicodeDecodeError, OSError):
                    continue
                ids = [int(t) for t in tok.encode(code)][:args.max_tokens]
                if len(ids) > 16:
                    truths[path.relative_to(root).as_posix()] = ids
            repo = {"repo": str(git), "head": head, "notebooks": len(truths), "missing_blobs": missing, "modes": {}}
            for mode in MODES:
                stats, docs = index_tree(root, Path(tmp), tok, mode)
                walks = {n: [0, 0, 0] for n in MIN_LENS}
                for held, ids in truths.items():
                    segments = DraftIndex.from_documents([(p, d) for p, d in docs if p != held], width).segments()
                    for n in MIN_LENS:
                        for k, v in enumerate(walk(segments, ids, n)):
                            walks[n][k] += v
                stats["walks"] = {str(n): {"tokens": t, "passes": p, "drafted_passes": d,
                                           "tokens_per_pass": round(t / max(p, 1), 3)}
                                  for n, (t, p, d) in walks.items()}
                repo["modes"][mode] = stats
                print(git.name, mode, stats, file=sys.stderr)
            data["repos"].append(repo)
    lines += ["Held-out notebooks' code walked with an oracle model: tokens per pass = (tokens) / (passes), "
              f"each pass taking the longest agreement of up to 8 drafted continuations of {DRAFT_LEN} tokens "
              f"(the last {CONTEXT} tokens matched, at least 2 or 8 of them).", "",
              "| repository (HEAD) | notebooks | index as | notebooks indexed | skipped | draft tokens "
              "(of them notebooks') | index s | tokens/pass, match >= 2 | drafted passes | tokens/pass, "
              "match >= 8 | drafted passes |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for repo in data["repos"]:
        for mode, s in repo["modes"].items():
            w2, w8 = s["walks"]["2"], s["walks"]["8"]
            skipped = ", ".join(f"{k} {v}" for k, v in sorted(s["skipped"].items())) or "-"
            lines.append(f"| {Path(repo['repo']).parent.name} ({repo['head']}) | {repo['notebooks']} | {mode} | "
                         f"{s['notebooks_indexed']} | {skipped} | {s['draft_tokens']:,} ({s['notebook_tokens']:,}) | "
                         f"{s['seconds']} | {w2['tokens_per_pass']} | {w2['drafted_passes']} of {w2['passes']} | "
                         f"{w8['tokens_per_pass']} | {w8['drafted_passes']} of {w8['passes']} |")
    for repo in data["repos"]:
        if repo["missing_blobs"]:
            lines += ["", f"{Path(repo['repo']).parent.name}: not in the mirror (left out of both indexes): "
                          + ", ".join(repo["missing_blobs"])]
    lines += ["", "Notebooks above the plain size limit (1 MB) or with long output lines (minified-file rule) "
              "are not indexed as JSON; as code a notebook's file may be 16x the limit, its code within it."]
    write_results(args.out, lines, data)


if __name__ == "__main__":
    main()
