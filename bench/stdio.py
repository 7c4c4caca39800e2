"""The daemon's stdio reader: how long a burst of keystrokes' didChange holds the event loop.

    python bench/stdio.py [--changes 2000] [--sizes 1,50] [--rounds 2] [--model default]

The real daemon (model loaded, then a 2 s pause) gets one document of SIZE KB; then CHANGES
one-character ``didChange`` notifications are sent at once and a ``codecomplete/stats``
request after them; the time until its answer, over CHANGES, is the cost of one change.  Two
readers, alternated in each round: ``chunked`` (the daemon as shipped: ``ChunkReader``, one
worker-thread hand-off per chunk and one event-loop turn per message) and ``pygls`` (the
daemon with pygls's own reader: ``CodecompleteServer._start_io_async`` removed, so the class
inherits pygls's, three hand-offs per message).  Writes ``bench/results/stdio.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, write_results  # noqa: E402

from lsprotocol import types as T  # noqa: E402
from pygls.lsp.client import LanguageClient  # noqa: E402

from codecomplete.lsp.server import plain  # noqa: E402

READERS = {
    "chunked": "from codecomplete.daemon.cli import main; main()",
    "pygls": ("from codecomplete.lsp.server import CodecompleteServer; del CodecompleteServer._start_io_async; "
              "from codecomplete.daemon.cli import main; main()"),
}
LINE = "    value = compute(alpha, beta, gamma)  # a comment here\n"


async def one(reader: str, model: str, changes: int, size_kb: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        client = LanguageClient("bench-stdio", "1")
        await client.start_io(sys.executable, "-c", READERS[reader], "--repo", str(repo), "--model", model)
        try:
            await client.initialize_async(T.InitializeParams(capabilities=T.ClientCapabilities(),
                                                             root_uri=repo.as_uri()))
            client.initialized(T.InitializedParams())
            uri = (repo / "big.py").as_uri()
            text = "def f():\n" + LINE * max(1, size_kb * 1024 // len(LINE))
            client.text_document_did_open(T.DidOpenTextDocumentParams(
                T.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)))
            for _ in range(1200):
                stats = plain(await client.protocol.send_request_async("codecomplete/stats", {}))
                if stats["engine"].get("ready") or stats["engine"].get("load_error"):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(2)
            line = text.count("\n") // 2
            t0 = time.perf_counter()
            for i in range(changes):
                pos = T.Position(line, 4)
                client.text_document_did_change(T.DidChangeTextDocumentParams(
                    T.VersionedTextDocumentIdentifier(uri=uri, version=i + 2),
                    [T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text="x")]))
            await client.protocol.send_request_async("codecomplete/stats", {})
            return (time.perf_counter() - t0) * 1000 / changes
        finally:
            await client.shutdown_async(None)
            client.exit(None)
            await client.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=2000)
    ap.add_argument("--sizes", default="1,50", help="document sizes in KB, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=str(RESULTS / "stdio"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ms: dict[str, dict[int, list[float]]] = {r: {s: [] for s in sizes} for r in READERS}
    for k in range(args.rounds):
        for size in sizes:
            for reader in (list(READERS) if k % 2 == 0 else list(READERS)[::-1]):
                ms[reader][size].append(asyncio.run(one(reader, args.model, args.changes, size)))
                print(reader, size, round(ms[reader][size][-1], 3), file=sys.stderr)
    lines = [header("stdio: a burst of didChange through the daemon's reader"), "",
             f"Model `{args.model}` (loaded), one document, {args.changes} one-character `didChange` sent at "
             f"once, then a `codecomplete/stats` request; ms per change until its answer. {args.rounds} rounds, "
             "readers alternated; median (each round's value).", "",
             "| document | chunked (shipped) | pygls's reader | ratio |", "|---|---|---|---|"]
    for size in sizes:
        a, b = statistics.median(ms["chunked"][size]), statistics.median(ms["pygls"][size])
        lines.append(f"| {size} KB | {a:.3f} ({', '.join(f'{x:.3f}' for x in ms['chunked'][size])}) | "
                     f"{b:.3f} ({', '.join(f'{x:.3f}' for x in ms['pygls'][size])}) | {b / a:.2f}x |")
    write_results(args.out, lines, {"changes": args.changes, "ms_per_change": ms})


if __name__ == "__main__":
    main()
