"""Completion cache: what a request for text seen before costs, with and without the cache.

Real files from repositories you bring with ``fetch`` (their code is not committed). At
each of N cursors (a line typed up to a word boundary, the rest of the line not yet there)
a real LSP client (pygls, over stdio) plays what editors do around a pause:

1. ``first``: a request at the cursor (the model runs, the document's prompt warm or not);
2. ``typo``: a wrong letter typed, a request there;
3. ``back``: the letter deleted, a request at the cursor again (the same text as 1);
4. ``away``: the cursor moved to the end of the line above (same text), a request there;
5. ``return``: the cursor back, a request at the cursor (the same text as 1 and 3).

Two daemons, the same sequence: ``completion.cache_entries`` 256 (as shipped) and 0. All
requests are automatic (trigger kind Automatic, the daemon's 25 ms debounce applies to
requests that reach the model). Reports latency per step, how many requests the cache
answered, and whether a cached answer is the text the first request got.

Usage: python bench/cache.py --repos GIT1,GIT2,GIT3 [--cursors 10] [--model default]
(each a git directory, as ``fetch`` brings: its HEAD is extracted under bench/.work/)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lsprotocol import types as T
from pygls.lsp.client import LanguageClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402

STEPS = ("first", "typo", "back", "away", "return")


def cursors(repos: list[Path], per_repo: int, seed: int) -> list[tuple[str, str, int, int]]:
    """(name, document text, line, character): a file cut at a word boundary of one of its
    code lines (the rest of that line not typed yet)."""
    rng = random.Random(seed)
    out = []
    for repo in repos:
        files = sorted(p for p in repo.rglob("*.py") if ".git" not in p.parts and 2_000 < p.stat().st_size < 60_000)
        picked = 0
        while picked < per_repo and files:
            f = rng.choice(files)
            lines = f.read_text(errors="replace").split("\n")
            cands = [i for i, ln in enumerate(lines) if i > 20 and len(ln.strip()) > 24 and " " in ln.strip()
                     and not ln.strip().startswith(("#", '"', "'"))]
            if not cands:
                continue
            i = rng.choice(cands)
            ln = lines[i]
            spaces = [k + 1 for k, ch in enumerate(ln) if ch in " (." and len(ln) // 3 <= k < len(ln) - 4]
            if not spaces:
                continue
            col = rng.choice(spaces)
            lines[i] = ln[:col]
            out.append((f"{repo.name}/{f.relative_to(repo)}:{i + 1}", "\n".join(lines), i, col))
            picked += 1
    return out


async def play(model: str, repo: Path, entries: int, cases, work: Path) -> list[dict]:
    client = LanguageClient("bench-cache", "0")
    await client.start_io(sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo), "--model", model,
                          "--index-dir", str(work / f"index-{entries}"))
    await client.initialize_async(T.InitializeParams(
        capabilities=T.ClientCapabilities(text_document=T.TextDocumentClientCapabilities(
            inline_completion=T.InlineCompletionClientCapabilities())),
        root_uri=repo.as_uri(), initialization_options={"codecomplete": {"completion": {"cacheEntries": entries}}}))
    client.initialized(T.InitializedParams())
    for _ in range(600):  # the model loads before the clock starts
        eng = (await client.protocol.send_request_async("codecomplete/stats", {})).engine
        if eng.ready:
            break
        await asyncio.sleep(0.2)

    async def ask(uri: str, line: int, ch: int) -> tuple[float, str, str]:
        t0 = time.perf_counter()
        res = await client.text_document_inline_completion_async(T.InlineCompletionParams(
            context=T.InlineCompletionContext(T.InlineCompletionTriggerKind.Automatic),
            text_document=T.TextDocumentIdentifier(uri), position=T.Position(line, ch)))
        ms = (time.perf_counter() - t0) * 1000
        items = res.items if res else []
        recent = (await client.protocol.send_request_async("codecomplete/stats", {"recent": 1})).recent
        return ms, items[0].insert_text if items else "", recent[-1].prompt_kind if recent else ""

    def change(uri: str, version: int, line: int, a: int, b: int, text: str) -> None:
        client.text_document_did_change(T.DidChangeTextDocumentParams(
            T.VersionedTextDocumentIdentifier(uri=uri, version=version),
            [T.TextDocumentContentChangePartial(range=T.Range(T.Position(line, a), T.Position(line, b)), text=text)]))

    rows = []
    for k, (name, text, line, col) in enumerate(cases):
        uri = (repo / f"bench_cache_{k}.py").as_uri()
        client.text_document_did_open(T.DidOpenTextDocumentParams(T.TextDocumentItem(uri, "python", 1, text)))
        above = len(text.split("\n")[line - 1])
        r = {"case": name}
        r["first"] = await ask(uri, line, col)
        change(uri, 2, line, col, col, "q")
        r["typo"] = await ask(uri, line, col + 1)
        change(uri, 3, line, col, col + 1, "")
        r["back"] = await ask(uri, line, col)
        r["away"] = await ask(uri, line - 1, above)
        r["return"] = await ask(uri, line, col)
        client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(uri)))
        rows.append(r)
    stats = await client.protocol.send_request_async("codecomplete/stats", {})
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    rows.append({"counters": stats.counters._asdict()})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repos", required=True, help="comma-separated repository folders")
    ap.add_argument("--cursors", type=int, default=10, help="per repository")
    ap.add_argument("--model", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "cache")
    args = ap.parse_args()
    from speculation import checkout  # a git directory's HEAD, extracted once (not committed)

    repos = [checkout(Path(r).resolve())[1] for r in args.repos.split(",")]
    cases = cursors(repos, args.cursors, args.seed)
    work = Path(tempfile.mkdtemp(prefix="cc-bench-cache-"))
    repo = work / "repo"  # the daemon's workspace: the documents are opened as buffers
    repo.mkdir()
    runs = {}
    for entries in (256, 0, 256, 0):  # interleaved: the machine's speed drifts
        rows = asyncio.run(play(args.model, repo, entries, cases, work))
        runs.setdefault(entries, []).append(rows)
        print(f"cache_entries={entries}: done", file=sys.stderr)

    def table(entries: int) -> dict:
        reps = runs[entries]
        per = {s: [r[s][0] for rows in reps for r in rows[:-1]] for s in STEPS}
        kinds = {s: sum(r[s][2] == "cached" for rows in reps for r in rows[:-1]) for s in STEPS}
        same = {s: sum(r[s][1] == r["first"][1] for rows in reps for r in rows[:-1]) for s in ("back", "return")}
        return {"ms": {s: (statistics.median(v), statistics.mean(v)) for s, v in per.items()},
                "cached": kinds, "same_as_first": same, "n": len(per["first"]),
                "counters": [rows[-1]["counters"] for rows in reps]}

    on, off = table(256), table(0)
    lines = [header("Completion cache: requests for text seen before"), "",
             f"{len(cases)} cursors in real files ({', '.join(r.name for r in repos)}; code not committed), "
             f"each played twice per setting (4 daemons, settings interleaved); model `{args.model}`. "
             "Steps: first request at the cursor; a wrong letter typed and a request; the letter deleted and a "
             "request at the cursor (back); the cursor on the line above, a request (away); the cursor back, "
             "a request (return). Latency: the inlineCompletion round trip over stdio.", "",
             "| step | cache on: p50 / mean ms | cache off: p50 / mean ms | answered from the cache (on) |",
             "|---|---|---|---|"]
    for s in STEPS:
        a, b = on["ms"][s], off["ms"][s]
        lines.append(f"| {s} | {a[0]:.1f} / {a[1]:.1f} | {b[0]:.1f} / {b[1]:.1f} | {on['cached'][s]} of {on['n']} |")
    lines += ["", "Same first item as the first request (back, return): cache on "
              f"{on['same_as_first']['back']} and {on['same_as_first']['return']} of {on['n']}; cache off "
              f"{off['same_as_first']['back']} and {off['same_as_first']['return']} of {off['n']}.", "",
              f"Daemon counters, cache on: {[c.get('cached') for c in on['counters']]} cached; "
              f"cache off: {[c.get('cached') for c in off['counters']]}.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps({"on": on, "off": off, "cases": [c[0] for c in cases]}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
