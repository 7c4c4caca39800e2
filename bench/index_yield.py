"""Completions while a large repository is indexed for the first time: background indexing that
yields to the engine (``index.yield_ms``, default 500) against indexing that does not (0).

A user opens a large repository the daemon has not seen (or switches to a branch that changes
most files): the index's first scan reads, chunks and tokenizes every file on a thread of its own
while the user asks for completions.  The indexer runs at nice 10, but on two cores it shares a
core with one of the engine's OpenMP threads, and those wait for each other at every barrier of
a pass.  With ``yield_ms`` > 0 the indexer waits while a completion is computed.

Each run: a fresh index folder; the daemon started on the repository (the real CLI over stdio,
a pygls client), the first completion timed from process start, then four more at other places
(the cursors of bench/foundation.py), then how long the index took to hold the whole repository
(tokens and draft index).  Modes alternate run by run (this machine's speed drifts).  The
repository is a copy of this Python's standard library (``--source``) with foundation's 200-line
file in it; nothing is committed.  Writes bench/results/index_yield.md (+ .json).

    python bench/index_yield.py [--runs 2] [--source DIR] [--out bench/results/index_yield]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from lsprotocol import types as T
from pygls.lsp.client import LanguageClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402
from foundation import CURSORS, cursor, make_repo  # noqa: E402


async def session(repo: Path, file: Path, index_dir: Path, yield_ms: int, model: str) -> dict:
    t0 = time.perf_counter()
    client = LanguageClient("bench", "0")
    await client.start_io(sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo), "--model", model,
                          "--index-dir", str(index_dir))
    await client.initialize_async(T.InitializeParams(
        capabilities=T.ClientCapabilities(), root_uri=repo.as_uri(),
        initialization_options={"codecomplete": {"completion": {"alternatives": 1},
                                                 "index": {"yield_ms": yield_ms}}}))
    client.initialized(T.InitializedParams())
    text = file.read_text()
    uri = file.as_uri()
    client.text_document_did_open(T.DidOpenTextDocumentParams(T.TextDocumentItem(uri, "python", 1, text)))
    first, later = None, []
    for i, (line, col) in enumerate(CURSORS):
        ts = time.perf_counter()
        await client.text_document_inline_completion_async(T.InlineCompletionParams(
            context=T.InlineCompletionContext(T.InlineCompletionTriggerKind.Invoked),
            text_document=T.TextDocumentIdentifier(uri), position=cursor(text, line, col)))
        te = time.perf_counter()
        if i == 0:
            first = te - t0
        else:
            later.append((te - ts) * 1000)
    stats = await client.protocol.send_request_async("codecomplete/stats", {})
    engine = stats.engine._asdict()
    while True:  # the index: every file's tokens and the draft index
        got = (await client.protocol.send_request_async("codecomplete/stats", {})).index
        index = got._asdict() if got is not None else {}
        if index.get("drafts") or time.perf_counter() - t0 > 600:
            break
        await asyncio.sleep(0.25)
    indexed_s = time.perf_counter() - t0
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    return {"yield_ms": yield_ms, "first_completion_s": round(first, 3), "later_ms": [round(x, 1) for x in later],
            "prefill_ms": round(engine["prefill_ms"], 1), "decode_ms": round(engine["decode_ms"], 1),
            "prompt_tokens": engine["prompt_tokens"], "generated_tokens": engine["generated_tokens"],
            "index_ready_s": round(indexed_s, 2), "index_files": index.get("files_indexed"),
            "yields": index.get("yields"), "yield_wait_ms": index.get("yield_ms")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="runs per mode")
    ap.add_argument("--source", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=str(RESULTS / "index_yield"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cc-index-yield-"))
    try:
        repo = work / "repo"
        shutil.copytree(args.source, repo, ignore=shutil.ignore_patterns("__pycache__", "site-packages", "*.so"))
        file = make_repo(repo)  # wrap.py at the top
        files = sum(1 for _ in repo.rglob("*.py"))
        runs = []
        for r in range(args.runs):
            for mode in (0, 500) if r % 2 == 0 else (500, 0):
                idx = work / f"index-{r}-{mode}"
                res = asyncio.run(session(repo, file, idx, mode, args.model))
                shutil.rmtree(idx, ignore_errors=True)
                print(json.dumps(res), file=sys.stderr)
                runs.append(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(mode: int, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["yield_ms"] == mode)

    def med_later(mode: int) -> float:
        return statistics.median(x for r in runs if r["yield_ms"] == mode for x in r["later_ms"])

    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"runs": runs, "files": files}, indent=1))
    lines = [header("Completions during a first index of a large repository"), "",
             f"Repository: a copy of {args.source} ({files} .py files, site-packages left out) with "
             "foundation's 200-line file; a fresh index folder each run; model "
             f"`{args.model}`. {args.runs} runs per mode, alternating. Medians.", "",
             "| index.yield_ms | first completion from process start (s) | later requests (ms, median of 4 a run) | "
             "engine prefill ms (5 requests) | engine decode ms | index complete after (s) | waits | waited (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in (0, 500):
        lines.append(f"| {mode} | {med(mode, 'first_completion_s'):.2f} | {med_later(mode):.0f} | "
                     f"{med(mode, 'prefill_ms'):.0f} | {med(mode, 'decode_ms'):.0f} | "
                     f"{med(mode, 'index_ready_s'):.1f} | "
                     f"{med(mode, 'yields'):.0f} | {med(mode, 'yield_wait_ms'):.0f} |")
    lines += ["", "Per run:", "", "| yield_ms | first s | later ms | prefill ms | decode ms | index s |",
              "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['yield_ms']} | {r['first_completion_s']} | {', '.join(str(x) for x in r['later_ms'])} | "
                     f"{r['prefill_ms']} | {r['decode_ms']} | {r['index_ready_s']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
