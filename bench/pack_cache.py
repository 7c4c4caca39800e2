"""Later starts with and without the packed weights' cache (model/packcache.py).

A later start (the converted checkpoint cached) of the real daemon, driven over stdio by a
real LSP client as bench/foundation.py drives it: process start -> initialize -> didOpen ->
the first inlineCompletion answered, and the model's load time the daemon reports
(``codecomplete/stats``).  Pairs of starts alternate between ``CODECOMPLETE_PACK_CACHE=0``
(the load reads and packs the linear weights), the cache on without its read-ahead
(``CODECOMPLETE_PACK_PREFETCH=0``: the load reads the packed file after torch's import) and the
cache on (the daemon reads the file ahead, beside torch's import: model/pack_prefetch.py), on the
same cache folder, so that the machine's drift falls on all alike.

The cache folder: ``--cache DIR`` (an existing one, e.g. the user's), else a new one that a
first start fills (it converts the model and writes the packed weights).  Writes
bench/results/pack_cache.md (+ .json).

    python bench/pack_cache.py [--model default] [--rounds 4] [--cache DIR] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402
from foundation import lsp_session, make_repo  # noqa: E402


WAYS = {"off": {"CODECOMPLETE_PACK_CACHE": "0"}, "no read-ahead": {"CODECOMPLETE_PACK_PREFETCH": "0"}, "on": {}}


def start(repo: Path, file: Path, model: str, cache: Path, way: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECOMPLETE_PACK_")}
    env.update(CODECOMPLETE_CACHE_DIR=str(cache), **WAYS[way])
    r = asyncio.run(lsp_session(repo, file, model, env))
    e = r["engine"]
    return {"cold_start_s": r["cold_start_s"], "initialize_s": r["initialize_s"], "load_s": e["load_seconds"],
            "prepacked": e["load_prepacked"], "read_ahead": e["load_read_ahead"], "text": r["text"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "pack_cache")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cc-pack-"))
    file = make_repo(work / "repo")
    repo = file.parent
    cache = args.cache or work / "cache"
    env = {**os.environ, "CODECOMPLETE_CACHE_DIR": str(cache)}
    if args.cache is None:  # a first start fills it; the common datastore built as a user's daemon builds it
        first = start(repo, file, args.model, cache, "on")
        print(f"first start: {first['cold_start_s']:.2f} s", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "codecomplete.daemon", "index", "--repo", str(repo), "--common",
                    "--model", args.model, "--json"], capture_output=True, text=True, env=env, check=True)
    start(repo, file, args.model, cache, "on")  # the packed weights written, whatever the cache held
    start(repo, file, args.model, cache, "on")  # and the hint of which file these settings read
    runs = {way: [] for way in WAYS}
    order = list(WAYS)
    for i in range(args.rounds):
        for way in order[i % 3:] + order[:i % 3]:
            r = start(repo, file, args.model, cache, way)
            runs[way].append(r)
            print(f"round {i + 1} {way}: start {r['cold_start_s']:.2f} s, load {r['load_s']:.2f} s"
                  f"{' (packed weights' if r['prepacked'] else ''}{', read ahead' if r['read_ahead'] else ''}"
                  f"{')' if r['prepacked'] else ''}", file=sys.stderr)
    texts = {r["text"] for rs in runs.values() for r in rs}
    packed = sorted((cache / "packed").glob("*.pack"))

    def cell(way: str, key: str) -> str:
        xs = [r[key] for r in runs[way]]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    n = args.rounds
    lines = [header("Later starts with and without the packed weights' cache"), "",
             f"Model {args.model}; {n} rounds of three later starts, rotating which goes first; real LSP "
             "client over stdio (bench/foundation.py's session: the first 200 lines of textwrap.py, the first "
             "request at line 60). Seconds: median (range).", "",
             "| | cache off (`CODECOMPLETE_PACK_CACHE=0`) | cache on, no read-ahead "
             "(`CODECOMPLETE_PACK_PREFETCH=0`) | cache on (as shipped) |", "|---|---|---|---|"]
    for label, key in (("process start to the first completion", "cold_start_s"),
                       ("of which `initialize`", "initialize_s"), ("the model's load (daemon's stats)", "load_s")):
        lines.append(f"| {label} | " + " | ".join(cell(way, key) for way in WAYS) + " |")
    lines += ["", f"The first completion's text was the same in all {3 * n} starts: {len(texts) == 1}. Loads that "
              "took the packed weights: " + ", ".join(f"{way} {sum(r['prepacked'] for r in runs[way])} of {n}"
                                                      for way in WAYS)
              + "; read ahead: " + ", ".join(f"{way} {sum(r['read_ahead'] for r in runs[way])} of {n}" for way in WAYS)
              + ".",
              f"Packed weights on disk: {', '.join(f'{p.name} ({p.stat().st_size >> 20} MB)' for p in packed)}.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps({"model": args.model, "runs": runs}, indent=1))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
