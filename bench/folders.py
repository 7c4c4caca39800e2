"""What a multi-root workspace costs: draft lookups and snippet searches over one folder's
index against the same over several folders' (indexer/folders.py).

The draft lookup runs in the speculative decoding passes that consult the repository, so
its time is paid per pass; the snippet search runs when the cursor enters a new block of
lines (with completion.context_snippets on).  Each folder is a
real repository (checkouts of repositories brought with ``fetch``, code never
committed), indexed with the default model's tokenizer.  Queries: positions at random
line starts of the first folder's Python files; the context is the file's text before the
position (the last 256 tokens for drafts).  Both setups answer the same queries, in
interleaved order.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, header  # noqa: E402

from codecomplete.indexer.folders import Folders  # noqa: E402
from codecomplete.indexer.index import RepoIndex  # noqa: E402

WORK = Path(__file__).resolve().parent / ".work" / "speculation"


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))]


def build(roots: list[Path], work: Path, tok) -> tuple[Folders, list[float]]:
    seconds = []

    def make(root: Path, primary: bool) -> RepoIndex:
        idx = RepoIndex(root, work / root.name, tokenizer=tok, watch=False)
        t0 = time.perf_counter()
        idx.build()
        seconds.append(time.perf_counter() - t0)
        return idx

    folders = Folders(make)
    for root in roots:
        folders.add(root)
    return folders, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repos", default=",".join(str(p) for p in sorted(WORK.glob("*")) if p.is_dir()),
                    help="comma-separated repository checkouts; the first is the one the queries come from")
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "folders"))
    args = ap.parse_args()
    roots = [Path(p).resolve() for p in args.repos.split(",") if p]
    if len(roots) < 2:
        sys.exit("needs two or more repository checkouts (--repos; bench/speculation.py makes three)")

    from codecomplete.model.loader import load_tokenizer

    tok = load_tokenizer("default")
    work = Path(tempfile.mkdtemp(prefix="ccbench-folders-"))
    one, _ = build(roots[:1], work / "one", tok)
    many, seconds = build(roots, work / "many", tok)

    rng = random.Random(args.seed)
    files = sorted(p for p in roots[0].rglob("*.py") if p.is_file())
    queries = []
    while len(queries) < args.queries:
        path = rng.choice(files)
        text = path.read_text(errors="replace")
        starts = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        if len(starts) < 10:
            continue
        offset = rng.choice(starts[5:])
        queries.append((path, text, offset, tok.encode(text[max(0, offset - 4000):offset]).tolist()[-256:]))

    times = {"one": {"lookup": [], "snippets": []}, "many": {"lookup": [], "snippets": []}}
    found = {name: {"drafts": 0, "matched": 0, "snippets": 0, "other_definitions": 0, "other_similar": 0}
             for name in times}
    longer = 0
    others = {r.name for r in roots[1:]}
    for path, text, offset, context in queries:
        lengths = {}
        order = (("one", one), ("many", many))
        for name, folders in order if rng.random() < 0.5 else order[::-1]:
            t0 = time.perf_counter()
            ms = folders.lookup(context, draft_len=12, top_k=8, min_len=2)
            times[name]["lookup"].append((time.perf_counter() - t0) * 1000)
            repo = [m for m in ms if m.source == "repository"]
            lengths[name] = repo[0].length if repo else 0
            found[name]["drafts"] += bool(repo)
            found[name]["matched"] += lengths[name]
            t0 = time.perf_counter()
            sn = folders.snippets(str(path), text, offset, limit=3, budget_ms=40)
            times[name]["snippets"].append((time.perf_counter() - t0) * 1000)
            found[name]["snippets"] += len(sn)
            for s in sn:
                if s.path.split("/", 1)[0] in others:
                    found[name]["other_similar" if s.reason == "similar" else "other_definitions"] += 1
        longer += lengths["many"] > lengths["one"]

    def summary(v: list[float]) -> dict:
        return {"p50": round(pct(v, 0.5), 3), "p90": round(pct(v, 0.9), 3), "p99": round(pct(v, 0.99), 3),
                "mean": round(statistics.mean(v), 3)}

    res = {"roots": [str(r) for r in roots], "queries": len(queries), "index_seconds": [round(s, 2) for s in seconds],
           "folders": [{"root": Path(st["root"]).name, "files": st["files_indexed"],
                        "draft_tokens": st["drafts"]["base_tokens"] + st["drafts"]["delta_tokens"],
                        "draft_mb": round(st["drafts"]["bytes"] / 2**20, 2)} for st in many.stats()],
           "times": {k: {kind: summary(v) for kind, v in d.items()} for k, d in times.items()},
           "found": found, "longer_match": longer}
    one.close()
    many.close()
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    rows = "\n".join(f"| {r['root']} | {r['files']} | {r['draft_tokens']:,} | {r['draft_mb']} | {s} |"
                     for r, s in zip(res["folders"], res["index_seconds"]))
    n = len(queries)

    def line(name: str, label: str) -> str:
        t, f = res["times"][name], res["found"][name]
        cells = [" / ".join(str(t[kind][q]) for q in ("p50", "p90", "p99")) for kind in ("lookup", "snippets")]
        other = "-" if name == "one" else f"{f['other_definitions']} / {f['other_similar']}"
        return (f"| {label} | {cells[0]} | {round(f['matched'] / n, 2)} | {cells[1]} | {f['snippets']} | {other} |")

    md = (header("Multi-root workspaces: lookups over several folders' indexes") + f"""
{__doc__.strip()}

Folders (indexed cold, one after another, watcher off):

| folder | files | draft tokens | draft index MiB | index seconds |
|---|---|---|---|---|
{rows}

{n} queries from {res['folders'][0]['root']}; times in ms, p50 / p90 / p99:

| setup | draft lookup | mean tokens matched | snippet search (limit 3, budget 40 ms) | snippets | \
from other folders (definitions / similar) |
|---|---|---|---|---|---|
{line("one", "first folder only")}
{line("many", f"all {len(roots)} folders")}

With all folders, {longer} of {n} lookups matched a longer context suffix than with the first folder alone.
""")
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
