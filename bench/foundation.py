"""Foundation benchmark: cold start and `complete` latency on a 200-line file.

* cold start: spawn `codecomplete-daemon --repo DIR` and drive it over stdio with a
  real LSP client (pygls): process start -> initialize -> didOpen -> the first
  inlineCompletion answered.  Measured with the converted checkpoint cached (the usual
  case) and once with an empty cache (the first start after install converts the GGUF).
* warm requests: further inlineCompletion requests at other cursors in the same
  daemon (p50/p90).
* `complete`: the CLI end to end (process wall time) and the engine's own timings.

Writes bench/results/foundation.md.  Usage: python bench/foundation.py [--model default]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from lsprotocol import types as T
from pygls.lsp.client import LanguageClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402

CURSORS = [(60, None), (101, None), (150, None), (190, None), (120, 8)]


def make_repo(root: Path) -> Path:
    """A repository with one real 200-line Python file (the stdlib's textwrap.py)."""
    src = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    lines = src.read_text().splitlines(keepends=True)[:200]
    root.mkdir(parents=True, exist_ok=True)
    (root / "wrap.py").write_text("".join(lines))
    return root / "wrap.py"


def cursor(text: str, line: int, col: int | None) -> T.Position:
    row = text.splitlines()[line - 1]
    return T.Position(line - 1, len(row) if col is None else col)


async def lsp_session(repo: Path, file: Path, model: str, env: dict) -> dict:
    t0 = time.perf_counter()
    client = LanguageClient("bench", "0")
    await client.start_io(sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo),
                          "--model", model, env=env)
    # invoked requests (no debounce), one completion each as before alternatives existed
    await client.initialize_async(T.InitializeParams(
        capabilities=T.ClientCapabilities(), root_uri=repo.as_uri(),
        initialization_options={"codecomplete": {"completion": {"alternatives": 1}}}))
    client.initialized(T.InitializedParams())
    t_init = time.perf_counter()
    text = file.read_text()
    uri = file.as_uri()
    client.text_document_did_open(T.DidOpenTextDocumentParams(T.TextDocumentItem(uri, "python", 1, text)))
    latencies, first = [], None
    for i, (line, col) in enumerate(CURSORS):
        ts = time.perf_counter()
        res = await client.text_document_inline_completion_async(T.InlineCompletionParams(
            context=T.InlineCompletionContext(T.InlineCompletionTriggerKind.Invoked),
            text_document=T.TextDocumentIdentifier(uri), position=cursor(text, line, col)))
        te = time.perf_counter()
        if i == 0:
            first = {"cold_start_s": te - t0, "initialize_s": t_init - t0,
                     "text": res.items[0].insert_text if res and res.items else ""}
        else:
            latencies.append((te - ts) * 1000)
    stats = await client.protocol.send_request_async("codecomplete/stats", {})
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    return {**first, "warm_ms": latencies, "engine": stats.engine._asdict()}


def run_complete(repo: Path, model: str, line: int, env: dict) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "codecomplete.daemon", "complete", "--repo", str(repo),
                          f"wrap.py:{line}", "--json", "--model", model],
                         capture_output=True, text=True, env=env, check=True)
    data = json.loads(out.stdout)
    data["wall_s"] = time.perf_counter() - t0
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "foundation.md")
    args = ap.parse_args()
    import os

    base_env = dict(os.environ)
    work = Path(tempfile.mkdtemp(prefix="cc-bench-"))
    file = make_repo(work / "repo")
    repo = file.parent

    fresh_env = {**base_env, "CODECOMPLETE_CACHE_DIR": str(work / "fresh-cache")}
    first_ever = asyncio.run(lsp_session(repo, file, args.model, fresh_env))
    print(f"first start (empty cache): {first_ever['cold_start_s']:.2f} s", file=sys.stderr)
    # The first start builds the common datastore in the background after the model loads; a
    # daemon that lives a few seconds may exit before it is done, and the next start would build
    # it again.  A user's daemon lives long enough: the later starts are measured with it built.
    subprocess.run([sys.executable, "-m", "codecomplete.daemon", "index", "--repo", str(repo), "--common",
                    "--model", args.model, "--json"], capture_output=True, text=True, env=fresh_env, check=True)
    warm_env = {**base_env, "CODECOMPLETE_CACHE_DIR": str(work / "fresh-cache")}
    sessions = [asyncio.run(lsp_session(repo, file, args.model, warm_env)) for _ in range(args.runs)]
    for s in sessions:
        print(f"cold start: {s['cold_start_s']:.2f} s", file=sys.stderr)
    completes = [run_complete(repo, args.model, line, warm_env) for line, _ in CURSORS[:3]]

    cold = [s["cold_start_s"] for s in sessions]
    warm = sorted(x for s in sessions for x in s["warm_ms"])
    eng = sessions[-1]["engine"]
    lines = [header("Foundation: cold start and completion latency"), "",
             f"Model: {eng['model']} ({eng['dtype']} on {eng['device']}, template {eng['template']}). "
             f"File: the first 200 lines of CPython's textwrap.py; cursors at the end of lines "
             f"{', '.join(str(c[0]) for c in CURSORS)} (line 120 mid-line).", "",
             "## Cold start (process start to first completion, real LSP client over stdio)", "",
             "| case | seconds |", "|---|---|",
             f"| first start after install (GGUF converted and cached) | {first_ever['cold_start_s']:.2f} |"]
    notes = ["", "The later starts find the common datastore built (`index --common` after the first start: a "
             "user's first daemon builds it in the background once the model has loaded)."]
    lines += [f"| start {i + 1}, checkpoint cached | {c:.2f} |" for i, c in enumerate(cold)]
    lines += notes
    lines += ["", f"Of which the `initialize` round trip: {statistics.median(s['initialize_s'] for s in sessions):.2f} s "
              "(the model loads on the engine thread meanwhile).", "",
              "## Warm requests in a running daemon (inlineCompletion round trip)", "",
              f"- n = {len(warm)}, p50 = {statistics.median(warm):.0f} ms, "
              f"p90 = {warm[int(0.9 * (len(warm) - 1))]:.0f} ms, max = {warm[-1]:.0f} ms",
              f"- engine decode rate: {eng['decode_tokens_per_s']} tokens/s", "",
              "## `codecomplete-daemon complete wrap.py:LINE --json`", "",
              "| line | process wall s | prompt tokens | generated | prefill ms | decode ms | engine total ms | stop | text |",
              "|---|---|---|---|---|---|---|---|---|"]
    for line_no, c in zip((c[0] for c in CURSORS), completes):
        t = c["timings_ms"]
        lines.append(f"| {line_no} | {c['wall_s']:.2f} | {c['prompt_tokens']} | {c['generated_tokens']} | "
                     f"{t.get('prefill_ms', 0):.0f} | {t.get('decode_ms', 0):.0f} | {t['total_ms']:.0f} | "
                     f"{c['stop_reason']} | `{c['text'][:40]!r}` |")
    lines += ["", "The process wall time includes Python and torch start-up and the model load; "
              "the engine columns are the completion itself.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
