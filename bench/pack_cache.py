"""Later starts with and without the packed weights' cache (model/packcache.py).

A later start (the converted checkpoint cached) of the real daemon, driven over stdio by a
real LSP client as bench/foundation.py drives it: process start -> initialize -> didOpen ->
the first inlineCompletion answered, and the model's load time the daemon reports
(``codecomplete/stats``).  Pairs of starts alternate between ``CODECOMPLETE_PACK_CACHE=0``
(the load reads and packs the linear weights) and the cache on (it reads the packed file),
on the same cache folder, so that the machine's drift falls on both alike.

The cache folder: ``--cache DIR`` (an existing one, e.g. the user's), else a new one that a
first start fills (it converts the model and writes the packed weights).  Writes
bench/results/pack_cache.md (+ .json).

    python bench/pack_cache.py [--model default] [--pairs 4] [--cache DIR] [--out PATH]
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


def start(repo: Path, file: Path, model: str, cache: Path, packed: bool) -> dict:
    env = {**os.environ, "CODECOMPLETE_CACHE_DIR": str(cache), "CODECOMPLETE_PACK_CACHE": "1" if packed else "0"}
    r = asyncio.run(lsp_session(repo, file, model, env))
    return {"cold_start_s": r["cold_start_s"], "initialize_s": r["initialize_s"],
            "load_s": r["engine"]["load_seconds"], "prepacked": r["engine"]["load_prepacked"], "text": r["text"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "pack_cache")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cc-pack-"))
    file = make_repo(work / "repo")
    repo = file.parent
    cache = args.cache or work / "cache"
    env = {**os.environ, "CODECOMPLETE_CACHE_DIR": str(cache)}
    if args.cache is None:  # a first start fills it; the common datastore built as a user's daemon builds it
        first = start(repo, file, args.model, cache, True)
        print(f"first start: {first['cold_start_s']:.2f} s", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "codecomplete.daemon", "index", "--repo", str(repo), "--common",
                    "--model", args.model, "--json"], capture_output=True, text=True, env=env, check=True)
    start(repo, file, args.model, cache, True)  # the packed weights written, whatever the cache held
    runs = {"off": [], "on": []}
    for i in range(args.pairs):
        for way in (("off", "on") if i % 2 == 0 else ("on", "off")):
            r = start(repo, file, args.model, cache, way == "on")
            runs[way].append(r)
            print(f"pair {i + 1} {way}: start {r['cold_start_s']:.2f} s, load {r['load_s']:.2f} s"
                  f"{' (packed weights)' if r['prepacked'] else ''}", file=sys.stderr)
    texts = {r["text"] for rs in runs.values() for r in rs}
    packed = sorted((cache / "packed").glob("*.pack"))

    def cell(way: str, key: str) -> str:
        xs = [r[key] for r in runs[way]]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    lines = [header("Later starts with and without the packed weights' cache"), "",
             f"Model {args.model}; {args.pairs} pairs of later starts, alternating which goes first; real LSP "
             "client over stdio (bench/foundation.py's session: the first 200 lines of textwrap.py, the first "
             "request at line 60). Seconds: median (range).", "",
             "| | cache off (`CODECOMPLETE_PACK_CACHE=0`) | cache on |", "|---|---|---|",
             "| process start to the first completion | "
             f"{cell('off', 'cold_start_s')} | {cell('on', 'cold_start_s')} |",
             f"| of which `initialize` | {cell('off', 'initialize_s')} | {cell('on', 'initialize_s')} |",
             f"| the model's load (daemon's stats) | {cell('off', 'load_s')} | {cell('on', 'load_s')} |", "",
             f"The first completion's text was the same in all {2 * args.pairs} starts: {len(texts) == 1}. "
             f"Loads that took the packed weights: {sum(r['prepacked'] for r in runs['on'])} of {args.pairs} with "
             f"the cache on, {sum(r['prepacked'] for r in runs['off'])} of {args.pairs} with it off.",
             f"Packed weights on disk: {', '.join(f'{p.name} ({p.stat().st_size >> 20} MB)' for p in packed)}.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps({"model": args.model, "runs": runs}, indent=1))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
