"""``codecomplete-daemon replay``: play editing sessions through the real daemon.

For each scheme a fresh daemon is spawned and driven over stdio by a real LSP client
(pygls).  N users type at once, each with their own copies of the documents.  Timing is
honoured (``--speed 1``), scaled (``--speed 4``: four times faster) or compressed
(``--speed 0``: no waiting, but each request is awaited before typing on).  Per
request: latency, whether it was answered, dropped as stale (the user typed on) or
superseded, the reused prompt tokens (from the daemon's per-request records), and the
completion; per session: acceptance (the completion is a prefix of what was typed next),
exact match and edit similarity against the ground truth, and characters saved.

Schemes map to engine settings: ``baseline`` = no KV reuse and no EFIM, ``fim`` = KV
reuse with PSM prompts, ``efim`` = KV reuse with EFIM prompts; in these every request runs
the model (``completion.type_through`` and ``type_along`` off, ``completion.cache_entries`` 0).
``efim-through`` is the daemon as shipped: typing the start of the last completion answers with
its rest without the model (counted as "typed through"), a request for text an earlier request
saw gets that request's completion (counted as "cached"), and typing what a completion still
being made has written keeps its run for the next request (counted as "followed").  With a prefix-only model
``fim`` and ``efim`` build the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..indexer.files import language_of
from .notebooks import NotebookView
from .sessions import Session, SessionError, apply_change, read_sessions, utf16_offset

log = logging.getLogger(__name__)

# every request reaches the model: the schemes measure the engine
ENGINE_ONLY = {"typeThrough": False, "typeAlong": False, "cacheEntries": 0}
SCHEMES = {
    "baseline": {"engine": {"kvBudgetMb": 0, "efim": False}, "completion": ENGINE_ONLY},
    "fim": {"engine": {"efim": False}, "completion": ENGINE_ONLY},
    "efim": {"engine": {"efim": True}, "completion": ENGINE_ONLY},
    # EFIM without retrieval speculation (on by default in the other schemes): what it adds
    "efim-nospec": {"engine": {"efim": True}, "speculation": {"enabled": False}, "completion": ENGINE_ONLY},
    # EFIM with repository snippets at the prompt's head (completion.context_snippets, off by default)
    "efim-context": {"engine": {"efim": True}, "completion": {**ENGINE_ONLY, "contextSnippets": 4}},
    # the daemon as shipped: EFIM, and typing through a completion answers with its rest, a
    # request for text an earlier request saw with that request's completion (the cache)
    "efim-through": {"engine": {"efim": True}},
}


@dataclass
class RequestResult:
    user: int
    session: int
    ordinal: int  # the request's number within its session (its "round")
    uri: str
    line: int
    character: int
    truth_line: str
    truth_hunk: str
    status: str = "pending"  # answered | empty | stale | superseded | error
    latency_ms: float = 0.0
    completion: str = ""
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_kind: str = ""
    generated_tokens: int = 0
    queue_ms: float = 0.0  # the engine's share of latency_ms: waiting, prefill, decode
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    # ms from the request to the user's next edit in the session (None: no edit after it); from
    # PAUSE_MS on the user waits there, where a suggestion matters (``at_pauses``)
    pause_ms: float | None = None
    accepted: bool = False
    exact: bool = False
    edit_similarity: float = 0.0
    chars_saved: int = 0
    lines_shown: int = 0  # the completion's non-blank lines
    lines_right: int = 0  # of those, the ones equal (stripped) to what was typed at that line
    cell: str = ""  # --as-notebooks: the cell asked at, and the line there
    cell_line: int = 0


def levenshtein(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    return 1.0 - levenshtein(a, b) / max(len(a), len(b))


def score(r: RequestResult) -> None:
    """Acceptance, exact match, edit similarity and characters saved of one answer."""
    comp = r.completion
    if not comp.strip():
        return
    first = comp.split("\n")[0]
    r.accepted = r.truth_hunk.startswith(comp.rstrip()) or ("\n" not in comp.rstrip()
                                                           and r.truth_line.startswith(first.rstrip())
                                                           and bool(first.strip()))
    r.exact = first.strip() == r.truth_line.strip()
    r.edit_similarity = edit_similarity(first.strip(), r.truth_line.strip())
    r.chars_saved = len(comp.rstrip()) if r.truth_hunk.startswith(comp.rstrip()) else (
        len(first.rstrip()) if r.accepted else 0)
    r.lines_shown, r.lines_right = lines_right(comp, r.truth_hunk)


PAUSE_MS = 250  # a request followed by this long without an edit is one the user waits at (the
# sessions' shortest pause at a word boundary)


def pauses_after_requests(session: Session) -> dict[int, float | None]:
    """For each of the session's requests, by its index in ``session.events``: the milliseconds
    to the next edit (a ``change`` event) after it, None when there is none."""
    out: dict[int, float | None] = {}
    waiting: list[int] = []  # requests whose next edit is still to come
    for i, e in enumerate(session.events):
        if e["type"] == "request":
            waiting.append(i)
        elif e["type"] == "change":
            for j in waiting:
                out[j] = e["t"] - session.events[j]["t"]
            waiting = []
    out.update(dict.fromkeys(waiting))
    return out


def at_pauses(reqs: list[dict]) -> dict:
    """The requests the user waited at (``pause_ms`` >= PAUSE_MS: the typing stopped there):
    how many, answered with a completion, accepted (what was typed next starts with it), the
    characters the accepted ones saved, and the answered ones' latency."""
    waited = [r for r in reqs if r.get("pause_ms") is not None and r["pause_ms"] >= PAUSE_MS]
    shown = [r for r in waited if r["status"] == "answered" and r["completion"].strip()]
    lat = [r["latency_ms"] for r in waited if r["status"] == "answered"]
    return {"requests": len(waited), "shown": len(shown), "accepted": sum(r["accepted"] for r in waited),
            "chars_saved": sum(r.get("chars_saved") or 0 for r in waited),
            "latency_ms": {"p50": pct(lat, 0.5), "p90": pct(lat, 0.9), "p99": pct(lat, 0.99),
                           "max": round(max(lat), 1) if lat else None}}


def lines_right(completion: str, typed: str) -> tuple[int, int]:
    """A multi-line completion line by line (acceptance sees only whether all of it is
    right): its non-blank lines, and how many equal (stripped) the typed line at their place."""
    shown, truth = completion.rstrip().split("\n"), typed.split("\n")
    body = [i for i, line in enumerate(shown) if line.strip()]
    return len(body), sum(1 for i in body if i < len(truth) and shown[i].strip() == truth[i].strip())


@dataclass
class UserState:
    docs: dict = field(default_factory=dict)  # uri -> text
    versions: dict = field(default_factory=dict)  # uri -> version
    last_request: dict = field(default_factory=dict)  # uri -> RequestResult in flight
    notebooks: dict = field(default_factory=dict)  # uri -> NotebookView (--as-notebooks)
    merges: int = 0  # edits that joined notebook cells (those of closed notebooks; see cells_merged)

    def cells_merged(self) -> int:
        return self.merges + sum(view.merges for view in self.notebooks.values())


def remap(uri: str, header: dict, root: Path, user: int) -> str:
    """A session's uri under the replay root, in the user's own folder (user 0: none)."""
    base = Path(header.get("repo") or "/").as_uri() if header.get("repo") else ""
    rel = uri[len(base):].lstrip("/") if base and uri.startswith(base) else uri.rsplit("/", 1)[-1]
    return (root / (f"user{user}/" if user else "") / rel).as_uri()


async def drive_user(client, user: int, sessions: list[Session], root: Path, speed: float,
                     results: list, max_requests: int, tick, notebooks: bool = False,
                     state: UserState | None = None) -> None:
    """One user typing ``sessions``; with ``notebooks`` each document is synced as a notebook
    of code cells (daemon/notebooks.py), every event sent to the cell it falls in."""
    from lsprotocol import types as T

    st = state if state is not None else UserState()
    start = time.monotonic()
    offset = 0.0
    inflight: list = []
    for si, session in enumerate(sessions):
        ordinal = 0
        pauses = pauses_after_requests(session)
        last_t = 0.0
        mine: list = []  # this session's request tasks (real time)
        for ei, e in enumerate(session.events):
            if speed > 0:
                due = start + (offset + e["t"]) / 1000 / speed
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            last_t = e["t"]  # (also where the next session starts from, a second later)
            if max_requests and ordinal >= max_requests and all(t.done() for t in mine):
                # the quota's requests are answered or dropped by this event's time: nothing
                # from here is measured (until then, the typing is what makes a request stale)
                break
            uri = remap(e["uri"], session.header, root, user)
            kind = e["type"]
            view = st.notebooks.get(uri)
            if kind == "open":
                st.docs[uri] = e["text"]
                st.versions[uri] = 1
                language = e.get("languageId") or language_of(uri.split("?", 1)[0])
                if notebooks:
                    view = st.notebooks[uri] = NotebookView.open(uri, e["text"], language)
                    client.notebook_document_did_open(view.open_params())
                    continue
                client.text_document_did_open(T.DidOpenTextDocumentParams(T.TextDocumentItem(
                    uri=uri, language_id=language, version=1, text=e["text"])))
            elif kind == "change" and uri in st.docs:
                st.versions[uri] += 1
                changes = []
                for ch in e["changes"]:
                    st.docs[uri] = apply_change(st.docs[uri], ch)
                    if view is not None:
                        client.notebook_document_did_change(view.change(ch))
                        continue
                    r = ch.get("range")
                    if r is None:
                        changes.append(T.TextDocumentContentChangeWholeDocument(text=ch["text"]))
                    else:
                        changes.append(T.TextDocumentContentChangePartial(range=T.Range(
                            T.Position(r["start"]["line"], r["start"]["character"]),
                            T.Position(r["end"]["line"], r["end"]["character"])), text=ch["text"]))
                if changes:
                    client.text_document_did_change(T.DidChangeTextDocumentParams(
                        T.VersionedTextDocumentIdentifier(uri=uri, version=st.versions[uri]), changes))
            elif kind == "request" and uri in st.docs and (not max_requests or ordinal < max_requests):
                res = RequestResult(user, si, ordinal, uri, e["line"], e["character"],
                                    e.get("truth_line", ""), e.get("truth_hunk", e.get("truth_line", "")),
                                    pause_ms=pauses[ei])
                ordinal += 1
                results.append(res)
                text = st.docs[uri]
                off = utf16_offset(text, e["line"], e["character"])
                typed = text[text.rfind("\n", 0, off) + 1:off]
                trigger = (T.InlineCompletionTriggerKind.Invoked if e.get("trigger") == "invoked"
                           else T.InlineCompletionTriggerKind.Automatic)
                where, line = view.at(e["line"]) if view is not None else (uri, e["line"])  # a notebook: its cell
                if view is not None:
                    res.cell, res.cell_line = where, line
                params = T.InlineCompletionParams(context=T.InlineCompletionContext(trigger_kind=trigger),
                                                  text_document=T.TextDocumentIdentifier(uri=where),
                                                  position=T.Position(line, e["character"]))
                prev = st.last_request.get(uri)
                if prev is not None and prev.status == "pending":
                    prev.status = "superseded"
                st.last_request[uri] = res
                task = asyncio.create_task(_request(client, params, res, typed, st, uri, tick))
                if speed > 0:
                    inflight.append(task)
                    mine.append(task)
                    # the task sends the request (and notes the document's version) at its first
                    # step: let it run now, or a replay behind schedule (no sleep before the next
                    # event) sent the next change first and measured the request as stale
                    await asyncio.sleep(0)
                else:
                    await task
                    if max_requests and ordinal >= max_requests:
                        # compressed: the session's quota is answered, and the rest of its events
                        # would reach the daemon as one burst that the next session's first
                        # request waits behind (seconds for a long session); each session opens
                        # its own documents, so nothing after this point is needed
                        break
            elif kind == "cursor" and uri in st.docs:  # the plugins' report of where the cursor rests
                where, line = view.at(e["line"]) if view is not None else (uri, e["line"])
                client.protocol.notify("codecomplete/didMoveCursor", {
                    "textDocument": {"uri": where}, "position": {"line": line, "character": e["character"]}})
            elif kind == "close" and uri in st.docs:
                if view is not None:
                    client.notebook_document_did_close(view.close_params())
                    st.merges += st.notebooks.pop(uri).merges
                else:
                    client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(uri=uri)))
                del st.docs[uri]
            elif kind == "save" and uri in st.docs and view is None:
                client.text_document_did_save(T.DidSaveTextDocumentParams(T.TextDocumentIdentifier(uri=uri)))
        offset += last_t + 1000
    if inflight:
        await asyncio.gather(*inflight)


async def _request(client, params, res: RequestResult, typed: str, st: UserState, uri: str, tick) -> None:
    version = st.versions.get(uri)
    t0 = time.perf_counter()
    try:
        result = await client.text_document_inline_completion_async(params)
    except Exception as exc:  # an error response: counted, the replay goes on
        res.status, res.completion = "error", str(exc)[:200]
        tick()
        return
    res.latency_ms = (time.perf_counter() - t0) * 1000
    items = list(getattr(result, "items", None) or (result if isinstance(result, list) else []))
    if items:
        insert = items[0].insert_text if isinstance(items[0].insert_text, str) else items[0].insert_text.value
        res.completion = insert[len(typed):] if insert.startswith(typed) else insert
        res.status = "answered"
        score(res)
    elif res.status != "superseded":
        res.status = "stale" if st.versions.get(uri) != version else "empty"
    tick()


async def replay_scheme(sessions: list[Session], root: Path, scheme: str, *, users: int, speed: float,
                        model: str, dtype: str | None, max_requests: int, work: Path, tick,
                        extra_settings: dict | None = None, device: str | None = None,
                        notebooks: bool = False) -> dict:
    from lsprotocol import types as T
    from pygls.lsp.client import LanguageClient

    settings = json.loads(json.dumps(SCHEMES[scheme]))
    for k, v in (extra_settings or {}).items():
        settings.setdefault(k, {}).update(v)
    client = LanguageClient("codecomplete-replay", "1")
    args = ["-m", "codecomplete.daemon", "--repo", str(root), "--model", model,
            "--index-dir", str(work / f"index-{scheme}"), "--log-file", str(work / f"daemon-{scheme}.log")]
    if dtype:
        args += ["--dtype", dtype]
    if device:
        args += ["--device", device]
    await client.start_io(sys.executable, *args)
    await client.initialize_async(T.InitializeParams(
        capabilities=T.ClientCapabilities(text_document=T.TextDocumentClientCapabilities(
            inline_completion=T.InlineCompletionClientCapabilities()),
            notebook_document=T.NotebookDocumentClientCapabilities(
                synchronization=T.NotebookDocumentSyncClientCapabilities()) if notebooks else None),
        root_uri=root.as_uri(), initialization_options={"codecomplete": settings},
        client_info=T.ClientInfo(name="codecomplete-replay")))
    client.initialized(T.InitializedParams())
    for _ in range(1200):  # the model loads (and the index scans) before the clock starts
        stats = await client.protocol.send_request_async("codecomplete/stats", {})
        eng = _plain(stats).get("engine") or {}
        if eng.get("ready") or eng.get("load_error"):
            break
        await asyncio.sleep(0.1)
    if eng.get("load_error"):
        raise RuntimeError(f"the daemon could not load {model}: {eng['load_error']}")
    results: list[RequestResult] = []
    states = [UserState() for _ in range(users)]
    t0 = time.perf_counter()
    await asyncio.gather(*(drive_user(client, u, sessions, root, speed, results, max_requests, tick,
                                      notebooks=notebooks, state=states[u]) for u in range(users)))
    wall = time.perf_counter() - t0
    stats = _plain(await client.protocol.send_request_async("codecomplete/stats", {"recent": True}))
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    _join_recent(results, stats.get("recent") or [])
    run = {"scheme": scheme, "wall_seconds": round(wall, 2)}
    if notebooks:
        run["notebook_cells_merged"] = sum(st.cells_merged() for st in states)
    return {**run, "requests": [r.__dict__ for r in results],
            "daemon": {"counters": stats.get("counters"), "engine": {k: v for k, v in (stats.get("engine") or {}).items()
                                                                      if k not in ("kv_store",)}}}


def _plain(value):
    from codecomplete.lsp.server import plain

    return plain(value)


def _join_recent(results: list[RequestResult], recent: list[dict]) -> None:
    """The daemon's per-request records (reused tokens, prompt kind), matched in order."""
    queues: dict = {}
    for rec in recent:
        queues.setdefault((rec["uri"], rec["line"], rec["character"]), []).append(rec)
    for r in results:
        q = queues.get((r.cell, r.cell_line, r.character) if r.cell else (r.uri, r.line, r.character))
        if q:
            rec = q.pop(0)
            r.prompt_tokens, r.reused_tokens, r.prompt_kind = rec["prompt_tokens"], rec["reused_tokens"], rec["prompt_kind"]
            for k in ("generated_tokens", "queue_ms", "prefill_ms", "decode_ms"):
                setattr(r, k, rec.get(k, 0))


# -- report ----------------------------------------------------------------------------

def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(p * len(v)))], 1)


def summarize(run: dict) -> dict:
    reqs = run["requests"]
    answered = [r for r in reqs if r["status"] == "answered"]
    served = [r for r in reqs if r["status"] in ("answered", "empty")]
    lat = [r["latency_ms"] for r in served]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    reused = sum(r["reused_tokens"] for r in reqs)
    by_round: dict = {}
    for r in reqs:
        if r["prompt_tokens"]:
            b = by_round.setdefault(r["ordinal"], [0, 0])
            b[0] += r["reused_tokens"]
            b[1] += r["prompt_tokens"]
    n = len(reqs) or 1
    eng = (run.get("daemon") or {}).get("engine") or {}
    gen, passes = eng.get("generated_tokens") or 0, eng.get("decode_passes") or 0
    return {
        "scheme": run["scheme"], "requests": len(reqs),
        "status": {s: sum(r["status"] == s for r in reqs) for s in ("answered", "empty", "stale", "superseded", "error")},
        "latency_ms": {"p50": pct(lat, 0.5), "p90": pct(lat, 0.9), "p99": pct(lat, 0.99),
                       "mean": round(sum(lat) / len(lat), 1) if lat else None},
        "acceptance": round(sum(r["accepted"] for r in reqs) / n, 4),
        "acceptance_of_answered": round(sum(r["accepted"] for r in answered) / len(answered), 4) if answered else None,
        "exact_match": round(sum(r["exact"] for r in reqs) / n, 4),
        "edit_similarity": round(sum(r["edit_similarity"] for r in answered) / len(answered), 4) if answered else None,
        "chars_saved": sum(r["chars_saved"] for r in reqs),
        "lines_shown": sum(r.get("lines_shown", 0) for r in reqs),
        "lines_right": sum(r.get("lines_right", 0) for r in reqs),
        "typed_through": sum(r.get("prompt_kind") == "typed-through" for r in reqs),
        "cached": sum(r.get("prompt_kind") == "cached" for r in reqs),
        # answered from a run an earlier request started, which the user typed along (completion.type_along)
        "followed": sum(r.get("prompt_kind") == "followed" for r in reqs),
        # requests whose prompt opened with repository snippets (completion.context_snippets)
        "with_context": ((run.get("daemon") or {}).get("counters") or {}).get("with_context"),
        "chars_typed_after_requests": sum(len(r["truth_line"]) for r in reqs),
        "reuse_rate": round(reused / prompt, 4) if prompt else None,
        "reuse_by_round": {k: round(v[0] / v[1], 4) for k, v in sorted(by_round.items())},
        "wall_seconds": run["wall_seconds"],
        # the daemon's own counters over the run: decode time per generated token (requests
        # batched together share it) and tokens per decode pass (speculation's gain in passes)
        "decode_ms_per_token": round(eng["decode_ms"] / gen, 2) if gen and eng.get("decode_ms") else None,
        "tokens_per_pass": round(gen / passes, 3) if passes else None,
        "speculation": eng.get("speculation"),
        # where the served requests' time went, in all and in their slowest tenth (what sets p90)
        "time_split": time_split(served),
        "time_split_slowest_tenth": time_split(sorted(served, key=lambda r: r["latency_ms"])
                                               [-max(1, len(served) // 10):]),
        "at_pauses": at_pauses(reqs),
    }


def time_split(reqs: list[dict]) -> dict:
    """Mean milliseconds a request spent queued in the engine, prefilling, decoding, and
    elsewhere (the LSP round trip, retrieval, planning), over ``reqs``."""
    if not reqs:
        return {}
    n = len(reqs)
    parts = {k: sum(r.get(f"{k}_ms", 0.0) for r in reqs) / n for k in ("queue", "prefill", "decode")}
    parts["other"] = max(0.0, sum(r["latency_ms"] for r in reqs) / n - sum(parts.values()))
    return {"requests": n, **{k: round(v, 1) for k, v in parts.items()},
            "generated_tokens": round(sum(r.get("generated_tokens", 0) for r in reqs) / n, 1)}


def _dash(value) -> str:
    return "-" if value is None else str(value)


def write_report(out: Path, runs: list[dict], meta: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in runs]
    report = {"meta": meta, "summary": summaries, "runs": runs}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plots = _plots(out, runs, summaries)
    lines = ["# Replay report\n", f"- sessions: {meta['sessions']} ({', '.join(meta['files'])}); "
             f"users: {meta['users']}; speed: {meta['speed']}; model: {meta['model']}",
             f"- command: `{meta['command']}`", f"- machine: {meta.get('machine', '')}\n",
             "| scheme | requests | answered | stale | superseded | empty | latency p50 / p90 / p99 ms | "
             "acceptance | exact match | edit sim. | chars saved | lines right / shown | reuse | decode ms/token | "
             "tokens/pass | typed through | cached | followed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        st, lat = s["status"], s["latency_ms"]
        lines.append(f"| {s['scheme']} | {s['requests']} | {st['answered']} | {st['stale']} | {st['superseded']} | "
                     f"{st['empty']} | {lat['p50']} / {lat['p90']} / {lat['p99']} | {s['acceptance']:.3f} | "
                     f"{s['exact_match']:.3f} | {_dash(s['edit_similarity'])} | "
                     f"{s['chars_saved']} of {s['chars_typed_after_requests']} | "
                     f"{s['lines_right']} / {s['lines_shown']} | {_dash(s['reuse_rate'])} | "
                     f"{_dash(s.get('decode_ms_per_token'))} | {_dash(s.get('tokens_per_pass'))} | "
                     f"{s.get('typed_through', 0)} | {s.get('cached', 0)} | {s.get('followed', 0)} |")
    lines += ["", "Where the time went (mean ms a served request spent queued in the engine / prefilling / "
              "decoding / elsewhere, and its mean generated tokens): all served requests, then their slowest "
              "tenth.", "",
              "| scheme | all: queue / prefill / decode / other, tokens | slowest tenth: queue / prefill / decode / "
              "other, tokens |", "|---|---|---|"]
    for s in summaries:
        cells = [" / ".join(str(t[k]) for k in ("queue", "prefill", "decode", "other")) + f", {t['generated_tokens']}"
                 if t else "-" for t in (s["time_split"], s["time_split_slowest_tenth"])]
        lines.append(f"| {s['scheme']} | {cells[0]} | {cells[1]} |")
    lines += ["", f"At pauses (requests after which the user typed nothing for {PAUSE_MS} ms or more: the "
              "suggestions a user waits for): how many, answered with a completion, accepted, and the answered "
              "ones' latency.", "", "| scheme | requests | shown | accepted | chars saved | "
              "latency p50 / p90 / p99 / max ms |", "|---|---|---|---|---|---|"]
    for s in summaries:
        p = s.get("at_pauses") or {}
        if p:
            lat = p["latency_ms"]
            lines.append(f"| {s['scheme']} | {p['requests']} | {p['shown']} | {p['accepted']} | "
                         f"{_dash(p.get('chars_saved'))} | " + " / ".join(_dash(lat.get(k)) for k in
                                                                    ("p50", "p90", "p99", "max")) + " |")
    lines += ["", "Latency counts requests the daemon answered (with or without items); stale and "
              "superseded requests were dropped because the user typed on. Typed through: answered with "
              "the rest of the last completion, without the model (only where `completion.type_through` is on: "
              "the efim-through scheme). Cached: answered with the completion an earlier request got for the "
              "same text (`completion.cache_entries`; also only in efim-through). Followed: answered with the "
              "rest of a completion still being made for an earlier request when the user typed on along it, or "
              "started at the pause before the request came (`completion.type_along`, `completion.start_ahead`; "
              "only in efim-through). Lines right / shown: the "
              "completions' non-blank lines, and those equal (stripped) to what the user typed at that line.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return report


def _plots(out: Path, runs: list[dict], summaries: list[dict]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots")
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        lat = sorted(r["latency_ms"] for r in run["requests"] if r["status"] in ("answered", "empty"))
        if lat:
            ax.step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=run["scheme"])
    paths.append(_save(plt, fig, ax, out / "latency_cdf.png", "latency (ms)", "fraction of requests",
                       "Latency CDF per scheme"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        rounds = s["reuse_by_round"]
        if rounds:
            ax.plot(list(rounds), list(rounds.values()), marker=".", label=s["scheme"])
    ax.set_ylim(0, 1)
    paths.append(_save(plt, fig, ax, out / "reuse_per_round.png", "request number within the session",
                       "prompt tokens reused", "KV reuse per round"))
    return paths


def _save(plt, fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def materialize(sessions: list[Session], work: Path) -> Path:
    """The repository at the first session's parent commit (git archive), or an empty
    folder when the sessions do not name a git repository."""
    root = work / "repo"
    root.mkdir(parents=True, exist_ok=True)
    h = sessions[0].header
    commit = h.get("parent") or h.get("commit")
    if h.get("repo") and commit and Path(h["repo"]).is_dir():
        archive = subprocess.run(["git", "-C", h["repo"], "archive", commit], capture_output=True)
        if archive.returncode == 0:
            subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def parse_settings(items: list[str]) -> dict:
    """``["completion.contextSnippets=4", ...]`` -> ``{"completion": {"contextSnippets": 4}}``."""
    from .config import parse_set

    def camel(name: str) -> str:  # as the schemes spell keys
        return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), name)

    return {section: {camel(name): value for name, value in table.items()}
            for section, table in parse_set(items, section=True).items()}


def replay(argv: list[str]) -> int:
    from codecomplete.indexer.progress import Progress

    p = argparse.ArgumentParser(prog="codecomplete-daemon replay",
                                description="Play editing sessions through the real daemon and report.")
    p.add_argument("sessions", nargs="+", type=Path, help="session files (JSONL, format v1)")
    p.add_argument("--repo", type=Path, help="the repository the daemon indexes (default: the sessions' "
                                             "repository at its parent commit)")
    p.add_argument("--users", type=int, default=1, help="users typing at once")
    p.add_argument("--speed", type=float, default=1.0, help="1 = recorded timing, 4 = four times faster, "
                                                            "0 = compressed (await each request)")
    p.add_argument("--scheme", default="efim", help="comma-separated: " + ", ".join(SCHEMES))
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="the daemon's device (default: its own, auto)")
    p.add_argument("--max-requests", type=int, default=0,
                   help="per session (0: all); a session ends once that many are answered or dropped")
    p.add_argument("--max-sessions", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("replay-report"))
    p.add_argument("--as-notebooks", action="store_true",
                   help="sync each document as a Jupyter notebook of code cells (its top-level paragraphs), "
                        "as VS Code does, every edit and request in the cell it falls in")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a daemon setting for every scheme, over the scheme's own (repeatable; "
                        "e.g. completion.contextSnippets=4; VALUE is read as JSON, else as a string)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    schemes = [s.strip() for s in args.scheme.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or args.users < 1 or args.speed < 0:
        print(f"codecomplete-daemon replay: unknown scheme {bad}" if bad else
              "codecomplete-daemon replay: --users >= 1 and --speed >= 0", file=sys.stderr)
        return 2
    try:
        sessions = [s for f in args.sessions for s in read_sessions(f)]
    except (OSError, SessionError) as exc:
        print(f"codecomplete-daemon replay: {exc}", file=sys.stderr)
        return 2
    if args.max_sessions:
        sessions = sessions[:args.max_sessions]
    try:
        extra = parse_settings(args.set)
    except ValueError as exc:
        print(f"codecomplete-daemon replay: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="codecomplete-replay-"))
    root = args.repo.resolve() if args.repo else materialize(sessions, work)
    total = sum(min(len(s.requests), args.max_requests or 10**9) for s in sessions) * args.users * len(schemes)
    runs = []
    try:
        with Progress("replay", enabled=sys.stderr.isatty(), unit="requests") as bar:
            done = [0]

            def tick():
                done[0] += 1
                bar.update(done[0], total)

            for scheme in schemes:
                runs.append(asyncio.run(replay_scheme(
                    sessions, root, scheme, users=args.users, speed=args.speed, model=args.model,
                    dtype=args.dtype, device=args.device, max_requests=args.max_requests, work=work, tick=tick,
                    extra_settings=extra, notebooks=args.as_notebooks)))
    except RuntimeError as exc:
        print(f"codecomplete-daemon replay: {exc}", file=sys.stderr)
        return 1
    finally:
        logs = args.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for f in work.glob("daemon-*.log"):
            shutil.copy(f, logs / f.name)
        shutil.rmtree(work, ignore_errors=True)
    from ..machine import describe

    meta = {"sessions": len(sessions), "files": [str(f) for f in args.sessions], "users": args.users,
            "speed": args.speed, "model": args.model, "schemes": schemes, "as_notebooks": args.as_notebooks,
            "command": "codecomplete-daemon replay " + " ".join(argv),
            "machine": describe() + (f"; the daemon on --device {args.device}" if args.device else "")}
    report = write_report(args.out, runs, meta)
    for s in report["summary"]:
        lat = s["latency_ms"]
        print(f"{s['scheme']}: {s['requests']} requests, answered {s['status']['answered']}, "
              f"p50 {lat['p50']} ms, p90 {lat['p90']} ms, acceptance {s['acceptance']:.3f}, reuse {s['reuse_rate']}")
    print(f"report: {args.out / 'report.md'}")
    return 0
