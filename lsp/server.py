"""The language server: documents, inline completions, cancellation, telemetry.

Handlers are thin: they find the document, convert the position at the edge, hand a
``CompletionRequest`` to the engine (which runs on its own thread) and convert the
``Completion`` back into ``InlineCompletionItem``s.  Scheduling rules:

* the newest ``textDocument/inlineCompletion`` for a document supersedes older ones:
  they stop at the engine's next decode step and answer an empty list;
* an edit to a document makes its in-flight request stale in the same way;
* ``$/cancelRequest`` stops the request the same way and answers RequestCancelled;
* automatic triggers wait until the document has been quiet ``debounce_ms`` (since its last
  change or automatic request; an editor that asks late has waited part of it), so a burst of
  keystrokes costs one generation.
No torch here: the engine is any object with ``submit``, ``configure`` and ``stats``.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import json
import logging
import math
import re
import statistics
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer
from pygls.uris import to_fs_path

from codecomplete import __version__
from codecomplete.daemon.config import Config, as_dict, editor_settings, engine_settings, merge
from codecomplete.indexer.files import SourceError, join_cells, language_of, read_source
from codecomplete.indexer.folders import Folders
from codecomplete.model.api import Completion, CompletionRequest
from codecomplete.model.stops import CompletionShape, agrees, open_pairs, rewrites_rest, word_char

from .cache import CompletionCache
from .documents import PositionError, cursor_at, encoding_name, offset_at, position_at
from .protocol import RobustProtocol
from .workspace import LspWorkspace, lsp_workspace

log = logging.getLogger(__name__)

ACCEPT_COMMAND = "codecomplete.accept"
STATS_REQUEST = "codecomplete/stats"
RETRIEVE_REQUEST = "codecomplete/retrieve"
CURSOR_NOTIFICATION = "codecomplete/didMoveCursor"  # the plugins: where the cursor rests (a warm-up there)
SHOWN = "codecomplete/didShowCompletion"
ACCEPTED = "codecomplete/didAcceptCompletion"
REJECTED = "codecomplete/didRejectCompletion"
COPILOT_SHOWN = "textDocument/didShowCompletion"
COPILOT_PARTIAL = "textDocument/didPartiallyAcceptCompletion"


@dataclass(eq=False)
class Run:
    """One engine run for a cursor: its request, the text around the cursor it was made for,
    and once submitted the engine's answer.  ``doc``: the document's own text before and after
    the cursor (no notebook cells, no selected menu item) where the user may type along the run
    (``completion.type_along``), else None."""

    request: CompletionRequest
    prefix: str
    suffix: str
    doc: tuple[str, str] | None = None
    waiter: asyncio.Future | None = None  # the engine's completion, once submitted
    key: Any = None  # its completion-cache key and the cache's generation when it started
    generation: int = 0


@dataclass
class Pending:
    """A completion request in flight for one document, and the run it waits for (its own, or
    one it took over)."""

    run: Run
    uri: str
    superseded: bool = False
    stale: bool = False
    # set when the request is to answer nothing while its run goes on (the user typed along it,
    # or a newer request took it over)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def request(self) -> CompletionRequest:
        return self.run.request


@dataclass
class Answer:
    """A completion to offer at a cursor, before it is shaped into items."""

    rid: str
    uri: str
    text: str  # the document
    cursor: Any  # documents.Cursor
    completion: Completion
    encoding: str
    selected: tuple[int, int, str] | None  # the menu's selected item: (start, end, text) offsets
    covers: int = 0  # characters after the cursor the items replace (brackets the editor closed)


@dataclass
class Shown:
    """The last completion the engine answered for a document, where it was asked: what
    the user types next may follow it (typing through the suggestion)."""

    prefix: str
    suffix: str
    completion: Completion


@dataclass
class Counters:
    requests: int = 0
    completions: int = 0  # answered with at least one item
    typed_through: int = 0  # of them, answered from the last completion without the model
    followed: int = 0  # of them, answered from a run an earlier request started, typed along since
    cached: int = 0  # requests answered from the completion cache (with or without items)
    empty: int = 0
    cancelled: int = 0
    superseded: int = 0
    stale: int = 0
    errors: int = 0
    server_errors: int = 0  # handlers that raised (pygls's report_server_error), invalid params included
    shown: int = 0
    accepted: int = 0
    accepted_alternatives: int = 0  # of them, an item after the first (an invoked request's others)
    alternatives: int = 0  # items offered after the first
    partially_accepted: int = 0
    rejected: int = 0
    with_context: int = 0  # requests whose prompt opened with repository snippets
    disabled: int = 0  # of the empty ones, in a language or file completions are off for
    warmups: int = 0  # prefills at an edit ahead of a request (completion.warm_ms)
    started_ahead: int = 0  # runs started at a pause before the editor asked (completion.start_ahead)
    first_lines: int = 0  # of the completions, answered with a run's whole lines so far (completion.first_lines_ms)
    inside_word: int = 0  # of the empty ones, asked while typing inside a word (nothing fits there)
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=2000))

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "latencies_ms"}
        lat = sorted(self.latencies_ms)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))], 2) if lat else None

        d["latency_ms"] = {"n": len(lat), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
                           "mean": round(sum(lat) / len(lat), 2) if lat else None}
        return d


ECHO_CHARS = 1000  # an inline item repeats at most this much of the typed line (see _echo_start)
AFTER_CHARS = 200  # an inline item's command carries the line after the cursor up to this long (_line_after)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def without_lone_surrogates(text: str) -> str:
    """``text`` with every unpaired surrogate (JSON's ``\\ud800``; a paired one is decoded
    to its code point) replaced by U+FFFD."""
    if text.isascii() or not _LONE_SURROGATE.search(text):
        return text
    return _LONE_SURROGATE.sub("\ufffd", text)


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: str) -> None:
    """Answer a connection's first request (its initialize) with an error, then close."""
    try:
        length = 0
        while (line := await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        first = json.loads(await asyncio.wait_for(reader.readexactly(length), 10)) if length else {}
        if isinstance(first, dict) and first.get("id") is not None:
            body = json.dumps({"jsonrpc": "2.0", "id": first["id"],
                               "error": {"code": -32803, "message": message}}).encode()  # RequestFailed
            writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
    except (asyncio.TimeoutError, ConnectionError, ValueError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


class CodecompleteServer(LanguageServer):
    def __init__(self, engine, config: Config, repo: Path | None = None,
                 cli_settings: dict | None = None):
        # Notebooks (Jupyter in VS Code) are synced as notebooks, so a cell's completion
        # sees the code cells around it in their order (see _notebook_context).
        super().__init__("codecomplete-daemon", __version__, protocol_cls=RobustProtocol,
                         text_document_sync_kind=types.TextDocumentSyncKind.Incremental,
                         notebook_document_sync=types.NotebookDocumentSyncOptions(
                             notebook_selector=[types.NotebookDocumentFilterWithNotebook(notebook="*")]))
        self.engine = engine
        self.config = config
        self.startup_config = config  # what a new TCP client starts from
        self.repo = repo
        self.cli_settings = cli_settings or {}
        self.counters = Counters()
        self.pending: dict[str, Pending] = {}
        # uri -> the run the user typed along after its request went stale: the next request there
        # takes its completion's rest (completion.type_along)
        self.following: dict[str, Run] = {}
        self.issued: OrderedDict[str, dict] = OrderedDict()  # completion id -> info
        self._ids = itertools.count(1)
        self._told_unavailable = False
        self._told_slow_path = False  # _tell_slow_path
        # the RepoIndex of each workspace folder, once known; the repository's is the primary
        self.folders = Folders(self._make_index, config.index.max_folders)
        self._contexts: dict[str, tuple[int, str]] = {}  # uri -> (line block, rendered snippets)
        self.shown: dict[str, Shown] = {}  # uri -> the last completion answered there
        self.cache = CompletionCache(config.completion.cache_entries)  # completions by the text they were made for
        self.recent: deque = deque(maxlen=4096)  # per-request records for the replay harness
        self._warm_line: dict[str, int] = {}  # uri -> the line of its last request or warm-up
        self._start_timer: asyncio.TimerHandle | None = None  # a run started ahead (completion.start_ahead)
        self._changed_at: dict[str, float] = {}  # uri -> perf_counter() of its last didChange
        self._asked_at: dict[str, float] = {}  # uri -> perf_counter() of its last automatic request to the model
        self._waits: deque[float] = deque(maxlen=8)  # ms from a document's last change to an automatic request
        self._warm_timer: asyncio.TimerHandle | None = None
        self._warming: CompletionRequest | None = None  # the warm-up the engine may be running
        self._cursor_before_open: tuple[str, int, int] | None = None  # didMoveCursor ahead of didOpen

    # -- stdio: messages read in chunks ------------------------------------------------
    def _start_io_async(self, stdin=None, stdout=None) -> None:
        """pygls's stdio loop (``start_io``) with a reader that takes whatever the pipe holds
        at once (``ChunkReader``): pygls's own reader hands every header line and every body
        to a worker thread, three hand-offs a message; a burst of 2,000 keystrokes' ``didChange``
        cost 0.81-1.01 ms each with it, 0.46 ms with this one (docs/decisions.md)."""
        import sys

        from pygls.io_ import StdoutWriter, run_async

        self._stop_event = threading.Event()
        self.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        reader = ChunkReader(stdin or sys.stdin.buffer, self.thread_pool)
        try:
            asyncio.run(run_async(stop_event=self._stop_event, reader=reader, protocol=self.protocol,
                                  logger=log, error_handler=self.report_server_error))
        except BrokenPipeError:
            log.error("Connection to the client is lost! Shutting down the server.")
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self.shutdown()

    # -- TCP: one client at a time, the daemon outlives each ----------------------------
    def serve_tcp(self, host: str, port: int) -> None:
        """Listen on ``host:port`` until the process is stopped.  pygls's own TCP server
        stops for good when its first client disconnects; here the next client (an editor
        restarted, a second window later) finds the model loaded and the index warm.  A
        client that connects while another is served (for 3 s more) gets an error answer
        to its first request and is closed."""
        from pygls.io_ import run_async

        self.protocol.keep_serving = True
        busy = asyncio.Lock()  # bound to the loop on first use

        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("peername")
            try:  # a client that reconnects at once may find its old connection not yet closed
                await asyncio.wait_for(busy.acquire(), 3)
            except asyncio.TimeoutError:
                await _refuse(reader, writer, "codecomplete-daemon serves another client on this port")
                log.warning("refused a second client %s while one is served", peer)
                return
            try:
                log.info("client connected from %s", peer)
                self.protocol.reset_connection()
                self.protocol.set_writer(writer)
                try:
                    await run_async(stop_event=threading.Event(), reader=reader, protocol=self.protocol,
                                    logger=log, error_handler=self.report_server_error)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    log.info("client %s dropped: %s", peer, exc)
                finally:
                    self.end_connection()
                    writer.close()
                    # the next client brings its own folders (closing waits for each worker)
                    await asyncio.to_thread(self.folders.close_secondary)
                log.info("client %s gone; listening on %s:%s", peer, host, port)
            finally:
                busy.release()

        async def main() -> None:
            listener = await asyncio.start_server(connection, host, port)
            log.info("listening on %s", ", ".join(str(s.getsockname()) for s in listener.sockets))
            async with listener:
                await listener.serve_forever()

        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            pass

    def end_connection(self) -> None:
        """Forget what the client that left had open: its requests stop, its settings are
        undone, its buffers no longer overlay the index (the files on disk count again)."""
        for pending in list(self.pending.values()):
            pending.stale = True
            pending.request.cancel.set()
        self.pending.clear()
        for run in self.following.values():  # runs its user typed along: nobody is left to answer
            run.request.cancel.set()
        self.following.clear()
        if self._start_timer is not None:
            self._start_timer.cancel()
            self._start_timer = None
        self._waits.clear()  # the next client may ask otherwise
        self._changed_at.clear()
        self._asked_at.clear()
        self._contexts.clear()
        self.shown.clear()
        self.cache.clear()
        if self.config != self.startup_config:  # its settings were its own
            self.config = self.startup_config
            self.engine.configure(engine_settings(self.config))
        for uri in self._open_file_uris():
            self.overlay(uri, closed=True)

    # -- the repository index ----------------------------------------------------------
    @property
    def index(self):
        """The repository's RepoIndex (the first folder's), or None."""
        return self.folders.primary

    def start_index(self, folders: list[Path] = ()) -> None:
        """Index the repository, and the client's other workspace folders when
        ``index.workspace_folders`` is on."""
        cfg = self.config.index
        if not cfg.enabled:
            return
        if self.index is None:
            if self.repo is None:
                return
            if not Path(self.repo).is_dir():
                log.warning("repository %s is not a directory; no index", self.repo)
                return
            if self.folders.add(Path(self.repo)) is None:
                return
            if hasattr(self.engine, "set_retriever"):  # drafts for retrieval speculation
                self.engine.set_retriever(self.folders.lookup)
            listeners = getattr(self.engine, "on_load", None)
            if listeners is not None:
                listeners.append(self._tokenizer_loaded)
            lm = getattr(self.engine, "lm", None)
            if lm is not None:
                self._tokenizer_loaded(lm)
        if cfg.workspace_folders:
            for folder in folders:
                self.folders.add(folder)

    def _make_index(self, root: Path, primary: bool):
        from codecomplete.indexer.index import RepoIndex, default_index_dir

        cfg = self.config.index
        index_dir = Path(self.config.index_dir).expanduser() if self.config.index_dir else None
        if index_dir is not None and not primary:  # a configured folder holds the repository's index
            index_dir = index_dir / "folders" / default_index_dir(root).name
        index = RepoIndex(root, index_dir, max_file_bytes=cfg.max_file_bytes, watch=cfg.watch,
                          debounce_ms=cfg.debounce_ms, want_common=cfg.common and primary,
                          max_files=cfg.max_files, max_draft_tokens=cfg.max_draft_tokens,
                          foreground=getattr(self.engine, "busy", None), yield_ms=cfg.yield_ms).start()
        log.info("indexing %s into %s", root, index.db_path)
        return index

    def change_folders(self, added: list[Path], removed: list[Path]) -> None:
        """workspace/didChangeWorkspaceFolders: index the new folders, close the removed
        ones' indexes; open buffers move to the index of the folder that now holds them."""
        if not self.config.index.enabled or not self.config.index.workspace_folders:
            return
        before = {uri: self.folders.for_path(to_fs_path(uri)) for uri in self._open_file_uris()}
        for folder in removed:
            self.folders.remove(folder)
        if self.index is None and self.repo is None:  # no repository yet: the first folder is it
            self.repo = next((f for f in added if f.is_dir()), None)
        self.start_index(added)
        for uri, old in before.items():
            path = to_fs_path(uri)
            new = self.folders.for_path(path)
            if new is not old:
                if old is not None and old in self.folders.all():
                    old.close_overlay(path)
                self.overlay(uri)

    async def watch_through_client(self) -> None:
        """Ask the editor to report file changes too (workspace/didChangeWatchedFiles),
        when it can register watchers dynamically.  Our own watcher misses changes where
        inotify does not reach (WSL's /mnt drives, network file systems, the inotify watch
        limit); the editor watches those its own way.  Reports are hints: the index
        re-reads only what changed, and a change it has already seen costs a stat."""
        cfg = self.config.index
        caps = self.client_capabilities
        ws = caps.workspace if caps is not None else None
        watched = ws.did_change_watched_files if ws is not None else None
        if not (cfg.enabled and cfg.watch and watched is not None and watched.dynamic_registration):
            return
        options = types.DidChangeWatchedFilesRegistrationOptions(
            watchers=[types.FileSystemWatcher(glob_pattern="**/*")])
        registration = types.Registration(id="codecomplete/watch", method=types.WORKSPACE_DID_CHANGE_WATCHED_FILES,
                                          register_options=options)
        try:  # a client that never answers must not hold up start-up
            await asyncio.wait_for(self.client_register_capability_async(
                types.RegistrationParams(registrations=[registration])), 10)
        except Exception as exc:  # declined, or no answer: our watcher alone
            log.info("the client watches no files for us: %r", exc)

    def files_changed(self, uris: list[str]) -> None:
        """The editor saw these files change on disk."""
        for uri in uris:
            if not uri.startswith("file:"):
                continue
            path = to_fs_path(uri)
            index = self.folders.for_path(path) if path else None
            if index is not None and index.notify(path):
                index.stats_.client_events += 1

    def forget(self, uri: str) -> None:
        """A document was closed: its request stops, what was kept for it goes."""
        self._supersede(uri, superseded=False)
        self.pending.pop(uri, None)
        self._contexts.pop(uri, None)
        self.shown.pop(uri, None)
        self._warm_line.pop(uri, None)
        self._changed_at.pop(uri, None)
        self._asked_at.pop(uri, None)
        self.cache.drop(uri)
        self.overlay(uri, closed=True)

    def _open_file_uris(self) -> list[str]:
        try:  # list() copies at once: change_folders runs on a thread beside the event loop
            uris = list(self.workspace.text_documents)
        except RuntimeError:  # never initialized
            return []
        return [uri for uri in uris if uri.startswith("file:")]

    def _tokenizer_loaded(self, lm) -> None:
        from codecomplete.indexer.tokens import TokenizerInfo

        self.folders.set_tokenizer(TokenizerInfo(lm.tokenizer, lm.name))

    def overlay(self, uri: str, closed: bool = False) -> None:
        """Keep the view of an open buffer current in the index of its folder."""
        self._overlay_at(uri, closed, lambda: self.open_text(uri))

    def overlay_notebook(self, notebook_uri: str, closed: bool = False) -> None:
        """Keep the index's view of an open notebook current: what it holds of the notebook's
        file is its code cells (indexer.files.notebook_code), so the open notebook's code cells,
        joined the same way, stand for it until it closes."""
        def code() -> str | None:
            ws = self.workspace
            notebook = ws.get_notebook_document(notebook_uri=notebook_uri)
            if notebook is None:
                return None
            docs = [ws.text_documents.get(unquote(cell.document)) for cell in notebook.cells
                    if cell.kind == types.NotebookCellKind.Code]
            return join_cells(without_lone_surrogates(doc.source) for doc in docs if doc is not None)

        self._overlay_at(notebook_uri, closed, code)

    def _overlay_at(self, uri: str, closed: bool, text) -> None:
        """The index's overlay of the file at ``uri``: dropped when ``closed``, else ``text()``
        (None: nothing to overlay) unless it is over ``index.max_file_bytes``."""
        if not uri.startswith("file:"):
            return
        path = to_fs_path(uri)
        index = self.folders.for_path(path) if path else None
        if index is None:
            return
        if closed:
            index.close_overlay(path)
            return
        got = text()
        if got is not None and len(got) <= self.config.index.max_file_bytes:
            index.overlay(path, got)

    def open_text(self, uri: str) -> str | None:
        """Text of an open document (None when it is not open), lone surrogates replaced.

        pygls keys its documents by the percent-decoded uri, and clients encode paths
        (VS Code sends ``my%20dir`` and ``c%3A``), so a lookup by the uri as sent would
        miss every buffer whose path has a space, or any buffer on Windows, and read the
        file from disk instead.  JSON can carry an unpaired surrogate (``"\\ud800"``),
        which no tokenizer takes; it becomes U+FFFD, one code unit in UTF-16 as it was,
        so positions still match the client's."""
        docs = self.workspace.text_documents
        doc = docs.get(unquote(uri))
        if doc is None:
            return None
        return without_lone_surrogates(doc.source)

    def retrieve(self, params: Any) -> dict:
        """Snippets and draft continuations at a position (a debugging aid, and what
        the completion path consumes)."""
        params = plain(params)
        try:
            uri = params["textDocument"]["uri"]
            line, character = params["position"]["line"], params["position"]["character"]
            if not (isinstance(uri, str) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                 for v in (line, character))):
                raise TypeError("uri must be a string, line and character integers >= 0")
        except (KeyError, TypeError, IndexError) as exc:
            raise JsonRpcInvalidParams(f"{RETRIEVE_REQUEST} wants textDocument.uri and position: {exc}") from exc
        try:
            limit = min(50, max(1, int(params.get("limit") or 3)))
            draft_len = min(64, max(1, int(params.get("draftLength") or 8)))
        except (TypeError, ValueError) as exc:
            raise JsonRpcInvalidParams(f"{RETRIEVE_REQUEST}: limit and draftLength must be integers") from exc
        text = self.document_text(uri)
        encoding = self.workspace.position_encoding or "utf-16"
        try:
            cursor = cursor_at(text, line, character, encoding)
        except PositionError as exc:
            raise JsonRpcInvalidParams(f"position out of range in {uri}: {exc}") from exc
        out: dict = {"ready": False, "snippets": [], "drafts": []}
        path = to_fs_path(uri) if uri.startswith("file:") else uri
        index = self.folders.for_path(path)
        if index is None:
            return out
        out["ready"] = index.ready.is_set()
        for sn in self.folders.snippets(path, text, cursor.offset, limit=limit,
                                        budget_ms=self.config.index.snippet_budget_ms):
            out["snippets"].append({"path": sn.path, "startLine": sn.start_line, "endLine": sn.end_line,
                                    "text": sn.text, "reason": sn.reason, "score": round(sn.score, 3)})
        tok = index.tokenizer
        if tok is not None:
            context = tok.encode(cursor.prefix[-2000:]).tolist()
            # Token healing: the last token may be a fragment of what the repository
            # spells as one token (" " before "handle"): look up without it and keep the
            # continuations that start with its text.
            tail = tok.backend.decode(context[-1:]) if len(context) > 1 else ""
            for m in self.folders.lookup(context[:-1] if tail else context, draft_len=draft_len + 1):
                conts = []
                for c in m.continuations:
                    text = tok.backend.decode(list(c.tokens))
                    if text.startswith(tail) and len(text) > len(tail):
                        conts.append({"text": text[len(tail):], "tokens": list(c.tokens), "count": c.count})
                if conts:
                    out["drafts"].append({"source": m.source, "matched": m.length,
                                          "occurrences": m.occurrences, "continuations": conts})
        return out

    # -- start-up progress ---------------------------------------------------------------
    async def report_startup(self, poll_s: float = 0.2) -> None:
        """Work-done progress ($/progress) while the model loads and the first index scan
        runs, for clients that support it (VS Code's status bar, Neovim's LspProgress):
        the user sees why the first completions are late, and a failed model load ends its
        progress with the reason."""
        caps = self.client_capabilities
        if not (caps is not None and caps.window is not None and caps.window.work_done_progress):
            return
        jobs = [self._progress("codecomplete/model", "codecomplete: loading model", self._model_state, poll_s)]
        if self.index is not None:
            jobs.append(self._progress("codecomplete/index", "codecomplete: indexing", self._index_state, poll_s))
        await asyncio.gather(*jobs)

    def _model_state(self) -> tuple[bool, str]:
        stats = self.engine.stats()
        if stats.get("load_error"):
            return True, f"model unavailable: {stats['load_error']}"
        if stats.get("ready"):
            return True, f"{stats.get('model') or 'model'} ready ({stats.get('load_seconds') or 0:.1f} s)"
        return False, str(stats.get("loading") or "loading the weights")

    def _index_state(self) -> tuple[bool, str]:
        indexes = self.folders.all()
        files = sum(st["files_indexed"] + st["files_unchanged"] for st in (i.stats() for i in indexes))
        failed = [i.failed for i in indexes if i.failed]
        if failed:
            return True, f"index unavailable: {failed[0]}"
        if all(i.ready.is_set() for i in indexes):
            return True, f"{files} files indexed" + (f" in {len(indexes)} folders" if len(indexes) > 1 else "")
        return False, f"{files} files"

    async def _progress(self, token: str, title: str, state, poll_s: float) -> None:
        done, message = state()
        if done:
            return  # nothing to wait for
        try:
            await self.work_done_progress.create_async(token)
        except Exception as exc:  # the client declined: no progress, nothing else changes
            log.debug("work-done progress %s not created: %s", token, exc)
            return
        self.work_done_progress.begin(token, types.WorkDoneProgressBegin(title=title, message=message or None))
        while not done:
            await asyncio.sleep(poll_s)
            done, now = state()
            if not done and now != message:
                message = now
                self.work_done_progress.report(token, types.WorkDoneProgressReport(message=now))
        self.work_done_progress.end(token, types.WorkDoneProgressEnd(message=now))

    # -- configuration ---------------------------------------------------------------
    def apply_settings(self, options: Any, source: str) -> list[str]:
        warnings: list[str] = []
        cfg = merge(self.config, editor_settings(options), source, warnings)
        if self.cli_settings:  # command-line flags stay strongest
            cfg = merge(cfg, self.cli_settings, "command line", [])
        self.config = cfg
        self.engine.configure(engine_settings(cfg))
        self.shown.clear()  # completions made under the old settings
        self.cache.clear()
        self.cache.resize(cfg.completion.cache_entries)
        for index in self.folders.all():  # the rest of [index] applies to indexes made from now on
            index.yield_ms = cfg.index.yield_ms
        for w in warnings:
            log.warning("%s", w)
            self.window_log_message(types.LogMessageParams(types.MessageType.Warning, w))
        return warnings

    # -- completions -----------------------------------------------------------------
    def _disabled_for(self, uri: str) -> str | None:
        """Why completions are off in ``uri`` (completion.disabled_languages or
        disabled_paths), or None.  The language is the one the editor opened the document
        with, and the one its file name implies; a notebook cell's path is its notebook's."""
        cfg = self.config.completion
        path = to_fs_path(uri) if uri.startswith("file:") else None
        if uri.startswith("vscode-notebook-cell:"):  # vscode-notebook-cell:/dir/nb.ipynb#cell
            path = to_fs_path("file:" + uri.split(":", 1)[1].split("#", 1)[0]) or None
        doc = self.workspace.text_documents.get(unquote(uri))
        languages = {x.lower() for x in ((doc.language_id if doc else None), language_of(path or uri)) if x}
        off = languages & {x.lower() for x in cfg.disabled_languages}
        if off:
            return f"language {sorted(off)[0]}"
        if path and cfg.disabled_paths:
            spec = self._path_spec(cfg.disabled_paths)
            index = self.folders.for_path(path)
            roots = [index.root] if index is not None else []
            if self.repo is not None:
                roots.append(Path(self.repo))
            real = Path(path).resolve()
            # relative to the folder holding it; a file in none: its whole path ("**/.env")
            names = [real.relative_to(r.resolve()).as_posix() for r in roots if real.is_relative_to(r.resolve())]
            names = names or [real.as_posix().lstrip("/")]
            if any(spec.match_file(name) for name in names):
                return "its path (completion.disabled_paths)"
        return None

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _path_spec(patterns: tuple[str, ...]):
        import pathspec

        return pathspec.PathSpec.from_lines("gitwildmatch", patterns)

    def document_text(self, uri: str) -> str:
        """Text of an open document, else of the file on disk."""
        text = self.open_text(uri)
        if text is not None:
            return text
        path = to_fs_path(uri) if uri.startswith("file:") else None
        if path is None:
            raise JsonRpcInvalidParams(f"unknown document {uri}: not open and not a file uri")
        try:
            return read_source(path, self.config.completion.max_document_bytes)
        except SourceError as exc:
            raise JsonRpcInvalidParams(f"cannot complete in {uri}: {exc}") from exc

    async def inline_completion(self, params: types.InlineCompletionParams) -> types.InlineCompletionList:
        """Answer one request; a failure inside is an empty result and a log line."""
        automatic = params.context.trigger_kind == types.InlineCompletionTriggerKind.Automatic
        if automatic:
            self._note_wait(params.text_document.uri)
        # "Invoked: triggered explicitly by a user gesture" (LSP 3.18): offer others too
        alternatives = 1 if automatic else self.config.completion.alternatives
        got = await self._guarded(params.text_document.uri, params.position, automatic,
                                  params.context.selected_completion_info, alternatives)
        if got is None:
            return types.InlineCompletionList(items=[])
        return types.InlineCompletionList(items=self._items(got))

    async def completion(self, params: types.CompletionParams) -> types.CompletionList:
        """``textDocument/completion``: the same completion as one menu item, for clients
        without inline completions (``completion.lsp_completion``).  Incomplete, so the
        client asks again as the user types on.  No alternatives: a menu's "Invoked" is
        also "triggered by typing an identifier" (LSP), not a request for more."""
        setting = self.config.completion.lsp_completion
        if setting == "never" or (setting == "auto" and self.client_has_inline):
            return types.CompletionList(is_incomplete=False, items=[])
        ctx = params.context
        automatic = ctx is not None and ctx.trigger_kind != types.CompletionTriggerKind.Invoked
        got = await self._guarded(params.text_document.uri, params.position, automatic, typing=True)
        if got is None:
            return types.CompletionList(is_incomplete=True, items=[])
        return types.CompletionList(is_incomplete=True, items=self._menu_items(got))

    @property
    def client_has_inline(self) -> bool:
        caps = self.client_capabilities
        td = caps.text_document if caps is not None else None
        return td is not None and td.inline_completion is not None

    async def _guarded(self, uri: str, position: types.Position, automatic: bool,
                       selected: types.SelectedCompletionInfo | None = None, alternatives: int = 1,
                       typing: bool | None = None) -> Answer | None:
        try:
            return await self._complete(uri, position, automatic, selected, alternatives, typing)
        except (JsonRpcException, asyncio.CancelledError):
            raise
        except Exception:
            self.counters.errors += 1
            log.exception("completion failed for %s", uri)
            self._count_empty()
            return None

    async def _complete(self, uri: str, position: types.Position, automatic: bool,
                        selected_info: types.SelectedCompletionInfo | None = None,
                        alternatives: int = 1, typing: bool | None = None) -> Answer | None:
        """One completion at ``position`` (``alternatives`` > 1: with up to that many - 1
        others), or None when there is nothing to offer (counted and logged).
        ``selected_info``: the item selected in the editor's completion menu (VS Code sends
        it while the menu is open); the completion then continues the text as if that item
        were inserted, so that the editor can show both together.  ``typing`` (default:
        ``automatic``): the request came with a keystroke, not a gesture; then a cursor inside
        a word (``pri|nt``) gets nothing unless ``completion.inside_word``: text inserted there
        splits the word, and the model's usual answer (a new line from ``pri``) leaves the
        word's rest after it."""
        started = time.perf_counter()
        self.counters.requests += 1
        cfg = self.config.completion
        text = self.document_text(uri)
        if not cfg.enabled:
            return self._count_empty()
        off = self._completions_off(uri)
        if off is not None:
            log.debug("%s: completions are off for %s", uri, off)
            self.counters.disabled += 1
            return self._count_empty()
        if len(text) > cfg.max_document_bytes:
            log.info("%s: %d characters, over max_document_bytes; no completion", uri, len(text))
            return self._count_empty()
        encoding = self.workspace.position_encoding or "utf-16"
        try:
            cursor = cursor_at(text, position.line, position.character, encoding)
        except PositionError as exc:
            raise JsonRpcInvalidParams(f"position out of range in {uri}: {exc}") from exc
        selected = self._selected(text, cursor, selected_info, encoding)
        if ((automatic if typing is None else typing) and not cfg.inside_word and selected is None
                and _inside_word(text, cursor.offset)):
            log.debug("%s:%d:%d: inside a word; no completion while typing", uri, position.line, position.character)
            self.counters.inside_word += 1
            return self._count_empty()
        prefix, suffix = cursor.prefix, cursor.suffix
        if selected is not None:
            a, b, item = selected
            prefix, suffix = text[:a] + item, text[b:]
        before, after = self._notebook_context(uri)
        prefix, suffix = before + prefix, suffix + after

        rid = f"c{next(self._ids)}"
        through = self._typed_through(uri, prefix, suffix) if cfg.type_through and alternatives == 1 else None
        if through is not None and not (through[1] and selected is not None):
            self._supersede(uri, superseded=True)  # older requests were for text typed since
            self.counters.typed_through += 1
            self._record(rid, uri, position, through[0], "answered", started)
            return self._answer(rid, uri, text, cursor, position, through[0], encoding, selected, started,
                                covers=through[1])
        context = await self._context(uri, text, cursor) if cfg.context_snippets and self.index else ""
        self.counters.with_context += bool(context)

        def key(n: int):  # n: completions asked for
            return self._cache_key(uri, prefix, suffix, context, n)

        generation = self.cache.generation
        hit = self.cache.get(key(alternatives))
        if hit is not None:
            self._supersede(uri, superseded=True)  # older requests were for other text
            self.counters.cached += 1
            if hit.texts:
                self.shown[uri] = Shown(prefix, suffix, hit)
            self._record(rid, uri, position, hit, "answered", started)
            return self._answer(rid, uri, text, cursor, position, hit, encoding, selected, started)
        along = cfg.type_along and alternatives == 1 and selected is None
        run = self._run_to_follow(uri, prefix, suffix) if along else None
        if run is not None:
            followed = await self._follow(rid, uri, position, run, prefix, suffix, started)
            if followed is None:  # dropped or cancelled meanwhile
                return None
            if followed is not False:
                self.counters.followed += 1
                return self._answer(rid, uri, text, cursor, position, followed[0], encoding, selected, started,
                                    covers=followed[1])
            # the run ended before what was typed since: a run of this request's own
        request = self._engine_request(rid, uri, prefix, suffix, context, alternatives=alternatives)
        run = Run(request, prefix, suffix, (cursor.prefix, cursor.suffix) if along else None,
                  key=key(alternatives), generation=generation)
        pending = Pending(run, uri)
        self._supersede(uri, superseded=True)
        self._stop_warming()
        self._warm_line[uri] = position.line
        self.pending[uri] = pending
        early = cfg.first_lines_ms / 1000 if along else 0.0
        debounce = self._debounce_left(uri, cfg.debounce_ms / 1000) if automatic else 0.0
        completion = await self._wait(rid, pending, debounce, early_s=early, started=started)
        if completion is None:  # stopped before it ran, or released (its run goes on for the text typed since)
            return self._dropped(pending) if run.waiter is None else self._handed_on(rid, position, pending, started)
        if completion.stop_reason == FIRST_LINES:  # the run goes on in following; the next request takes its rest
            self.counters.first_lines += 1
            self._record(rid, uri, position, completion, "answered", started)
            return self._answer(rid, uri, text, cursor, position, completion, encoding, selected, started)
        self._record(rid, uri, position, completion, "stale" if pending.stale else "superseded" if pending.superseded
                     else "cancelled" if completion.cancelled else "answered", started)
        if pending.superseded or pending.stale or completion.cancelled:
            return self._dropped(pending)
        if completion.error:
            self._report_failure(rid, completion)
            return self._count_empty()
        self._tell_slow_path()
        if completion.texts:
            self.shown[uri] = Shown(prefix, suffix, completion)
        if self.cache.put(key(alternatives), completion, generation) and alternatives > 1:
            # its first completion is greedy decoding's, what a request while typing gets
            self.cache.put(key(1), replace(completion, alternatives=[]), generation)
        return self._answer(rid, uri, text, cursor, position, completion, encoding, selected, started)

    def _cache_key(self, uri: str, prefix: str, suffix: str, context: str, n: int):
        """The completion cache's key for ``n`` completions of this text under the settings."""
        cfg = self.config.completion
        return self.cache.key(uri, prefix, suffix, context, (cfg.mode, cfg.max_tokens, cfg.max_lines,
                                                             cfg.time_budget_ms, n))

    # -- typing along a run in flight ---------------------------------------------------
    # While a request's run is being decoded, the user may type what its completion starts with
    # (a multi-line completion takes ~0.6 s on a CPU; keystrokes come every ~0.1 s).  Instead of
    # dropping the run at each keystroke and starting over, the run goes on as long as what was
    # typed agrees with what it has written so far (checked at each edit here and after each of
    # its tokens by the engine, CompletionRequest.typed), and the next request at the cursor
    # takes its completion's rest, as typing through a shown completion does (Copilot's and
    # Continue's clients reuse an in-flight completion the same way).

    def _run_to_follow(self, uri: str, prefix: str, suffix: str) -> Run | None:
        """The document's run that a request for ``prefix``/``suffix`` may take over: the run the
        user typed along (``following``), or the one in flight for an earlier request, when this
        request's text is its cursor's grown by text (perhaps none) that agrees with its output
        so far."""
        run = self._live_run(uri)
        grown = text_along(run.prefix, run.suffix, prefix, suffix) if run is not None else None
        return run if grown is not None and reaches_past(run, grown[0]) else None

    def _live_run(self, uri: str) -> Run | None:
        """The document's run that the user may type along: its request's in flight, or the one
        typed along already (``following``); None when there is none, it may not be followed
        (``Run.doc``), it is not submitted yet or it was stopped."""
        pending = self.pending.get(uri)
        run = pending.run if pending is not None else self.following.get(uri)
        if run is None or run.doc is None or run.waiter is None or run.request.cancel.is_set():
            return None
        return run

    async def _follow(self, rid: str, uri: str, position: types.Position, run: Run, prefix: str, suffix: str,
                      started: float) -> tuple[Completion, int] | bool | None:
        """Take ``run`` over for this request: its completion's rest after the text typed since
        (the rest and the characters after the cursor it replaces); None when this request was
        dropped or cancelled meanwhile; False when the run's completion does not reach past
        what was typed (the request then runs the model itself)."""
        self.following.pop(uri, None)
        old = self.pending.get(uri)
        if old is not None:
            old.superseded = True
            old.released.set()  # answers nothing; its run goes on for this request
        pending = Pending(run, uri)
        self.pending[uri] = pending
        self._stop_warming()
        self._warm_line[uri] = position.line
        completion = await self._wait(rid, pending)
        if completion is None or pending.stale or pending.superseded:
            return self._handed_on(rid, position, pending, started)
        if completion.error or completion.cancelled:
            return False
        if run.key is not None:
            self.cache.put(run.key, completion, run.generation)
        shown = Shown(run.prefix, run.suffix, completion)
        rest = rest_along(shown, prefix, suffix)
        if rest is None:
            log.debug("[%s] the run of %s ended before the text typed since", rid, run.request.request_id)
            return False
        self.shown[uri] = shown
        rest = (replace(rest[0], prompt_kind="followed"), rest[1])
        log.info("[%s] followed the run of %s", rid, run.request.request_id)
        self._record(rid, uri, position, rest[0], "answered", started)
        return rest

    async def _wait(self, rid: str, pending: Pending, debounce_s: float = 0.0, early_s: float = 0.0,
                    started: float = 0.0) -> Completion | None:
        """The completion of the pending request's run, submitted to the engine after
        ``debounce_s`` unless it is stopped by then (or already running); None when it was
        stopped before it ran, or once the request is released (its run goes on for the text
        typed since, or for a newer request).  The request leaves ``pending`` when this ends;
        cancelled by the client, it stops its run unless the user typed along it since (the
        next request is to take it over).  ``early_s`` (> 0, ``completion.first_lines_ms``): a
        run still going that long after ``started`` answers with its whole lines so far as soon
        as it has one (a completion with stop reason ``FIRST_LINES``), and goes on in
        ``following`` for the next request at the cursor."""
        run, uri = pending.run, pending.uri
        released = line = None
        try:
            if run.waiter is None:
                if debounce_s:
                    await asyncio.sleep(debounce_s)
                if run.request.cancel.is_set():
                    return None
                if early_s > 0 and run.doc is not None and CompletionShape.at_cursor(
                        run.request.prefix, run.request.suffix, run.request.mode).multiline:
                    # the engine's thread tells of each new line break (no polling: on a 2-core
                    # machine each wake-up takes a core from the run's threads)
                    line = asyncio.Event()
                    run.request.on_line = functools.partial(_set_from_thread, asyncio.get_running_loop(), line)
                run.waiter = asyncio.wrap_future(self.engine.submit(run.request))
            released = asyncio.ensure_future(pending.released.wait())
            waiting = {run.waiter, released}
            if line is not None:
                timeout = max(0.0, started + early_s - time.perf_counter())
                done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                while not done:
                    line.clear()  # before reading the text: a line break written from here on sets it again
                    lines = first_lines(run.request.progress)
                    if lines:
                        self.following[uri] = run  # typing along it (accepting the lines) keeps it going
                        run.waiter.add_done_callback(lambda _f, run=run: self._keep_done(run))
                        return answered_so_far(lines, run.request)
                    signal = asyncio.ensure_future(line.wait())
                    try:
                        done, _ = await asyncio.wait(waiting | {signal}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        signal.cancel()
                    done -= {signal}
            else:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            if self.following.get(uri) is not run:
                run.request.cancel.set()
            self.counters.cancelled += 1
            log.info("[%s] cancelled by the client", rid)
            raise
        finally:
            if released is not None:
                released.cancel()
            if line is not None:
                run.request.on_line = None
            if self.pending.get(uri) is pending:
                del self.pending[uri]
        return None if pending.released.is_set() else run.waiter.result()

    def _keep_done(self, run: Run) -> None:
        """A run answered early (``first_lines_ms``) finished: its whole completion goes into the
        completion cache, for a request at its cursor again (the lines shown were only its start)."""
        done = finished(run)
        if done is not None and run.key is not None:
            self.cache.put(run.key, done, run.generation)

    def _handed_on(self, rid: str, position: types.Position, pending: Pending, started: float) -> None:
        """A request dropped while its run goes on (for the text typed since, or for a newer
        request): recorded and counted as stale or superseded; it answers nothing."""
        self._record(rid, pending.uri, position, Completion("", "handed on"),
                     "stale" if pending.stale else "superseded", started)
        return self._dropped(pending)

    def typed_along(self, uri: str) -> bool:
        """After an edit: whether the document's run goes on (the edit typed text that agrees with
        what the run has written so far, at its cursor).  Its request then answers nothing (its
        cursor is gone) and the run waits in ``following`` for the next request."""
        run = self._live_run(uri) if self.config.completion.type_along else None
        if run is None:
            return False
        text = self.open_text(uri)
        typed = typed_between(text, *run.doc) if text is not None else None
        if typed is None or not reaches_past(run, typed):
            return False
        pending = self.pending.get(uri)
        run.request.typed = typed  # the engine stops the run once its output departs from it
        self.following[uri] = run
        if pending is not None:
            pending.stale = True
            pending.released.set()
        return True

    def _completions_off(self, uri: str) -> str | None:
        """Why completions are off for ``uri`` (a disabled language or path), or None."""
        cfg = self.config.completion
        return self._disabled_for(uri) if cfg.disabled_languages or cfg.disabled_paths else None

    def _engine_request(self, rid: str, uri: str, prefix: str, suffix: str, context: str,
                        **extra) -> CompletionRequest:
        """The engine's request for text around a cursor under the settings: a completion's and a
        warm-up's alike, so that a warm-up plans the very prompt the request after it plans."""
        cfg = self.config.completion
        return CompletionRequest(prefix=prefix, suffix=suffix, request_id=rid, mode=cfg.mode,
                                 max_tokens=cfg.max_tokens, max_lines=cfg.max_lines,
                                 time_budget_ms=cfg.time_budget_ms, session_key=uri, context=context, **extra)

    # -- edits -----------------------------------------------------------------------------
    def changed(self, params: types.DidChangeTextDocumentParams) -> None:
        """A didChange, applied to the workspace's copy already: the document's request in
        flight goes stale (its run goes on if the user typed along it), the index's view of the
        buffer follows, a warm-up is scheduled."""
        uri = params.text_document.uri
        workspace = self.workspace
        if isinstance(workspace, LspWorkspace) and not workspace.is_open(uri):
            return  # ignored (and logged) by the workspace: not a buffer to overlay
        self._changed_at[uri] = time.perf_counter()
        if not self.typed_along(uri):
            self._supersede(uri, superseded=False)
        self.overlay(uri)
        self.edited(uri, params)

    def notebook_changed(self, params: types.DidChangeNotebookDocumentParams) -> None:
        """A notebookDocument/didChange, applied to the workspace already.  The cells are each
        other's context (``_notebook_context``), so any change to the cells stops every cell's
        request in flight and any run typed along (as an edit elsewhere in a text document
        does), except the run of the one cell a keystroke alone edited, when the user typed
        along it (``typed_along``).  An edit to one cell's text is then that cell's keystroke
        (``edited``: a warm-up there, a run started at the pause), as in a text document.  Cells
        the change removes are forgotten; the index's view of the notebook follows
        (``overlay_notebook``).  A metadata-only change does nothing."""
        cells = params.change.cells
        if cells is None:
            return
        edited = [text.document.uri for text in cells.text_content or []]
        if not edited and cells.structure is None:
            return  # a cell's kind or metadata (cells.data): not the text the prompts read
        notebook = self.workspace.get_notebook_document(notebook_uri=params.notebook_document.uri)
        stale = edited + [cell.document for cell in notebook.cells] if notebook is not None else edited
        removed = [doc.uri for doc in cells.structure.did_close or []] if cells.structure is not None else []
        one = edited[0] if cells.structure is None and len(edited) == 1 else None
        if one is not None:
            self._changed_at[one] = time.perf_counter()
        kept = one if one is not None and self.typed_along(one) else None
        for uri in dict.fromkeys(stale + removed):
            if unquote(uri) != unquote(kept or ""):
                self._supersede(uri, superseded=False)
        for uri in removed:
            self.forget(uri)
        self.overlay_notebook(params.notebook_document.uri)
        if one is not None:
            text = cells.text_content[0]
            self.edited(one, types.DidChangeTextDocumentParams(text.document, list(text.changes)))

    # -- warm-ups: the prompt at the user's edit prefilled before the request ----------
    def edited(self, uri: str, params: types.DidChangeTextDocumentParams) -> None:
        """After a didChange: schedule a warm-up at the last change's end (where the user's
        cursor is), found from the change alone (no read of the document per keystroke)."""
        change = params.content_changes[-1] if params.content_changes else None
        if not isinstance(change, types.TextDocumentContentChangePartial):
            return
        # the text before the last change's start is as the change found it: its end is the
        # start moved by the inserted text's line breaks and the units of its last line
        lines, units = position_at(change.text, len(change.text), self.workspace.position_encoding or "utf-16")
        start = change.range.start
        line, character = start.line + lines, (start.character if not lines else 0) + units
        self._schedule_warm(uri, params.text_document.version, line, character)
        self._schedule_start(uri, params.text_document.version, line, character)

    def cursor_moved(self, params: Any) -> None:
        """``codecomplete/didMoveCursor`` {textDocument: {uri}, position} (the editor plugins send
        it once the cursor rests somewhere): a warm-up there, as after an edit, so that the first
        keystroke's request after navigating finds its prompt prefilled."""
        p = plain(params)
        try:
            uri, pos = p["textDocument"]["uri"], p["position"]
            line, character = int(pos["line"]), int(pos["character"])
        except (KeyError, TypeError, ValueError):
            log.warning("codecomplete/didMoveCursor without textDocument.uri and position: ignored")
            return
        if not isinstance(uri, str):
            return
        if line < 0 or character < 0:
            return
        doc = self.workspace.text_documents.get(unquote(uri))
        if doc is None:  # its didOpen may still be on the way: the warm-up waits for it
            self._cursor_before_open = (unquote(uri), line, character)
            return
        self._schedule_warm(uri, doc.version, line, character)

    def opened(self, uri: str) -> None:
        """A document opened: the warm-up a cursor asked for before it was open (the last such)."""
        pending, self._cursor_before_open = self._cursor_before_open, None
        doc = self.workspace.text_documents.get(unquote(uri))
        if pending is not None and doc is not None and pending[0] == unquote(uri):
            self._schedule_warm(uri, doc.version, pending[1], pending[2])

    def _schedule_warm(self, uri: str, version: int | None, line: int, character: int) -> None:
        """A warm-up at (line, character) ``completion.warm_ms`` from now, unless warm-ups are
        off or the document's last request or warm-up was on that line."""
        delay = self.config.completion.warm_ms
        if not delay or not self.config.completion.enabled or self._warm_line.get(uri) == line:
            return
        if self._warm_timer is not None:
            self._warm_timer.cancel()
        loop = asyncio.get_running_loop()
        self._warm_timer = loop.call_later(delay / 1000, lambda: asyncio.ensure_future(
            self._warm(uri, version, types.Position(line, character))))

    def _running_along(self) -> bool:
        """Whether a run typed along (or started ahead) is still being made."""
        return any(not run.waiter.done() for run in self.following.values() if run.waiter is not None)

    def _debounce_left(self, uri: str, debounce_s: float) -> float:
        """What is left of ``debounce_s`` of quiet in ``uri`` for an automatic request now: quiet
        since the document's last change or automatic request to the model, whichever is later.
        An editor that asks some time after a keystroke (VS Code's own debounce, Neovim's idle
        wait, 30 ms in the replays) has waited that long already; a burst of requests without
        edits (the cursor moved line by line) still waits after each; a document with no change
        seen waits it all."""
        now = time.perf_counter()
        last = max(self._changed_at.get(uri, now), self._asked_at.get(uri, -math.inf))
        self._asked_at[uri] = now
        return max(0.0, debounce_s - (now - last))

    # -- runs started ahead: the completion begun at a pause, before the editor asks -----
    def _note_wait(self, uri: str) -> None:
        """An automatic request for ``uri``: how long after the document's last change it came
        (under a second: a request while typing, not after a jump or a long read)."""
        at = self._changed_at.get(uri)
        if at is not None and (ms := (time.perf_counter() - at) * 1000) < 1000:
            self._waits.append(ms)

    def starts_ahead(self) -> bool:
        """Whether a pause in the typing starts the completion there (``completion.start_ahead``;
        "auto": the editor's automatic requests come at least 50 ms later than the start would)."""
        cfg = self.config.completion
        if cfg.start_ahead != "auto":
            return cfg.start_ahead == "always"
        return len(self._waits) >= 3 and statistics.median(self._waits) >= cfg.start_ms + 50

    def _schedule_start(self, uri: str, version: int | None, line: int, character: int) -> None:
        """After an edit: a run started at (line, character) ``completion.start_ms`` from now,
        where ``starts_ahead``; the next edit (or a request) comes first as a rule."""
        if self._start_timer is not None:
            self._start_timer.cancel()
            self._start_timer = None
        cfg = self.config.completion
        if not (cfg.enabled and cfg.type_along) or not self.starts_ahead():
            return
        loop = asyncio.get_running_loop()
        self._start_timer = loop.call_later(cfg.start_ms / 1000, lambda: asyncio.ensure_future(
            self._start_ahead(uri, version, types.Position(line, character))))

    async def _start_ahead(self, uri: str, version: int | None, position: types.Position) -> None:
        """Start the completion a request at ``position`` would run, unless the document changed
        since, a request or run is there already, or the request would be answered without the
        model (typed through, cached) or get nothing (inside a word, completions off).  The run
        waits in ``following``, as one typed along does: typing along it keeps it going, a request
        at its text takes it over, any other edit stops it."""
        self._start_timer = None
        cfg = self.config.completion
        doc = self.workspace.text_documents.get(unquote(uri))

        def moved_on() -> bool:
            return doc is None or doc.version != version or uri in self.pending or self._live_run(uri) is not None

        if moved_on():
            return
        got = await self._text_at(uri, position, "run started ahead")
        if got is None:
            return
        text, cursor, prefix, suffix, context = got
        if not cfg.inside_word and _inside_word(text, cursor.offset):
            return
        if cfg.type_through and self._typed_through(uri, prefix, suffix) is not None:
            return
        key = self._cache_key(uri, prefix, suffix, context, 1)
        if moved_on() or key in self.cache:
            return
        request = self._engine_request(f"a{next(self._ids)}", uri, prefix, suffix, context)
        run = Run(request, prefix, suffix, (cursor.prefix, cursor.suffix), key=key, generation=self.cache.generation)
        self._stop_warming()
        self._warm_line[uri] = position.line  # the run prefills there
        run.waiter = asyncio.wrap_future(self.engine.submit(request))
        self.following[uri] = run
        self.counters.started_ahead += 1
        log.debug("[%s] started ahead at %s:%d:%d", request.request_id, uri, position.line, position.character)

    async def _text_at(self, uri: str, position: types.Position, what: str):
        """For work ahead of the editor's request (``what``: a warm-up, a run started ahead): the
        document's text, the cursor at ``position``, the prompt's text before and after it (a
        notebook's other cells included) and the repository snippets, as the request would have
        them; None where it would get no completion (an oversized document, completions off) or
        the cursor is gone."""
        cfg = self.config.completion
        text = self.open_text(uri)
        if text is None or len(text) > cfg.max_document_bytes or self._completions_off(uri):
            return None
        try:
            cursor = cursor_at(text, position.line, position.character, self.workspace.position_encoding or "utf-16")
            before, after = self._notebook_context(uri)
            context = await self._context(uri, text, cursor) if cfg.context_snippets and self.index else ""
        except PositionError as exc:  # a cursor the document no longer has
            log.debug("no %s at %s: %s", what, uri, exc)
            return None
        except Exception:  # a courtesy: never a reason to fail an edit
            log.exception("%s at %s failed", what, uri)
            return None
        return text, cursor, before + cursor.prefix, cursor.suffix + after, context

    def _stop_warming(self) -> None:
        if self._warm_timer is not None:
            self._warm_timer.cancel()
            self._warm_timer = None
        if self._warming is not None:
            self._warming.cancel.set()

    async def _warm(self, uri: str, version: int, position: types.Position) -> None:
        """The warm-up itself, unless the document changed again or a request is in flight."""
        self._warm_timer = None
        doc = self.workspace.text_documents.get(unquote(uri))
        if self.pending or self._running_along() or doc is None or doc.version != version \
                or self._warm_line.get(uri) == position.line:
            return  # a request came, or the user typed on: its edit schedules again; or asked there since
        got = await self._text_at(uri, position, "warm-up")
        if got is None or self.pending or self._running_along() or doc.version != version:
            return
        _, _, prefix, suffix, context = got
        request = self._engine_request(f"w{next(self._ids)}", uri, prefix, suffix, context, warm=True)
        self._warm_line[uri] = position.line
        if self._warming is not None:  # the user moved on: the engine stops it at its next piece
            self._warming.cancel.set()
        self._warming = request
        self.counters.warmups += 1
        try:
            await asyncio.wrap_future(self.engine.submit(request))
        except Exception:
            log.exception("warm-up at %s failed", uri)
        finally:
            if self._warming is request:
                self._warming = None

    def _notebook_context(self, uri: str) -> tuple[str, str]:
        """For a notebook cell: the code cells of its language before it and after it, in
        the notebook's order, each followed (before) or preceded (after) by a blank line;
        the model completes the cell as part of one file.  ("", "") for other documents."""
        ws = self.workspace
        notebook = ws.get_notebook_document(cell_uri=uri)
        if notebook is None:
            return "", ""
        own = ws.text_documents.get(unquote(uri))
        language = own.language_id if own is not None else None
        before, after, seen = [], [], False
        for cell in notebook.cells:
            if unquote(cell.document) == unquote(uri):
                seen = True
                continue
            doc = ws.text_documents.get(unquote(cell.document))
            if cell.kind != types.NotebookCellKind.Code or doc is None or (
                    language and doc.language_id and doc.language_id != language):
                continue
            (after if seen else before).append(without_lone_surrogates(doc.source).rstrip("\n"))
        if not seen:
            return "", ""
        return "".join(t + "\n\n" for t in before), "".join("\n\n" + t for t in after)

    def _typed_through(self, uri: str, prefix: str, suffix: str) -> tuple[Completion, int] | None:
        """The rest of the document's last completion when the user has typed its start
        since (the text before the cursor grown by a prefix of the completion, the same text
        after it) and something is left: the suggestion stays as typed through, at no
        model cost, as Copilot's and Tabby's clients keep it.  After an invoked request, the
        same for its alternatives (the one the user cycled to and types out).  The text after
        the cursor may have grown by the closers of brackets and quotes the typed text left
        open (``foo(|)``: an editor that closes pairs put them there): the rest then replaces
        them, so accepting it gives the text the completion would have given.  Returns the
        rest and how many characters after the cursor it replaces; None otherwise."""
        shown = self.shown.get(uri)
        if shown is None or len(prefix) <= len(shown.prefix):
            return None
        return rest_along(shown, prefix, suffix)

    def _record(self, rid: str, uri: str, position: types.Position, completion: Completion, status: str,
                started: float) -> None:
        """The request's record for the replay harness (``codecomplete/stats`` with recent)."""
        self.recent.append({"id": rid, "uri": uri, "line": position.line, "character": position.character,
                            "prompt_tokens": completion.prompt_tokens, "reused_tokens": completion.reused_tokens,
                            "prompt_kind": completion.prompt_kind, "stop_reason": completion.stop_reason,
                            "generated_tokens": completion.generated_tokens,
                            # where the engine's time went (0 where nothing ran: cached, typed through)
                            **{k: round(completion.timings.get(k, 0.0), 2)
                               for k in ("queue_ms", "prefill_ms", "decode_ms")},
                            "status": status, "latency_ms": round((time.perf_counter() - started) * 1000, 2)})

    def _answer(self, rid: str, uri: str, text: str, cursor, position: types.Position, completion: Completion,
                encoding: str, selected, started: float, covers: int = 0) -> Answer | None:
        """A completion that is to be offered: counted, logged and remembered for telemetry."""
        latency = (time.perf_counter() - started) * 1000
        through = completion.prompt_kind == "typed-through"
        self.counters.latencies_ms.append(latency)
        log.info("[%s] %s:%d:%d %.0f ms (%s%s) -> %r", rid, Path(to_fs_path(uri) or uri).name,
                 position.line + 1, position.character + 1, latency,
                 completion.stop_reason, ", typed through" if through else "", completion.text[:60])
        if completion.alternatives:
            log.info("[%s] alternatives: %s", rid, [a.text[:40] for a in completion.alternatives])
        texts = completion.texts
        if not texts:
            self._count_empty()
            return None
        self.counters.completions += 1
        self.counters.alternatives += len(texts) - 1
        for i, item in enumerate(texts):
            self.issued[_item_id(rid, i)] = {"uri": uri, "chars": len(item), "at": time.time(), "rank": i}
        while len(self.issued) > 512:
            self.issued.popitem(last=False)
        return Answer(rid, uri, text, cursor, completion, encoding, selected, covers)

    @staticmethod
    def _selected(text: str, cursor, info: types.SelectedCompletionInfo | None,
                  encoding: str) -> tuple[int, int, str] | None:
        """The menu's selected item as (start, end, text) offsets in ``text`` when it
        replaces a range of the cursor's line around the cursor with one line of text;
        None otherwise (then it is ignored)."""
        if info is None or "\n" in info.text or "\r" in info.text:
            return None
        try:
            a = offset_at(text, info.range.start.line, info.range.start.character, encoding)
            b = offset_at(text, info.range.end.line, info.range.end.character, encoding)
        except PositionError:
            return None
        if not cursor.line_start <= a <= cursor.offset <= b <= cursor.line_end:
            return None
        return a, b, info.text

    async def _context(self, uri: str, text: str, cursor) -> str:
        """Rendered snippets for the prompt's head.  Sticky per document and block of
        lines: while the cursor stays in a block the context is the same text, so the
        prompt's head (and its KV) does not change with every keystroke."""
        cfg = self.config.completion
        block = text.count("\n", 0, cursor.line_start) // 16
        cached = self._contexts.get(uri)
        if cached is not None and cached[0] == block:
            return cached[1]
        path = to_fs_path(uri) if uri.startswith("file:") else uri
        try:
            found = await asyncio.to_thread(self.folders.snippets, path, text, cursor.offset,
                                            limit=cfg.context_snippets,
                                            budget_ms=self.config.index.snippet_budget_ms)
        except Exception:
            log.exception("snippet retrieval failed")
            return ""
        from codecomplete.indexer.snippets import render_context

        context = render_context(found, language_of(path), cfg.context_tokens * 3)
        self._contexts[uri] = (block, context)
        return context

    def _items(self, ans: Answer) -> list:
        """An item per completion (the greedy one, then any alternatives) whose range
        starts at the beginning of the cursor's line and whose text repeats what is typed
        there (Copilot's convention): clients filter it as the user keeps typing, and
        Neovim and VS Code both draw it from there.  With a selected menu item: that item's
        range, its text and the completion (inline items "must extend the text of the
        selected item and use the same range", LSP 3.18)."""
        items = []
        for i, completion in enumerate(ans.completion.texts):
            if ans.selected is not None:
                a, b, item = ans.selected
                insert, rng, end = item + completion, _range(ans.text, a, b, ans.encoding), b
            else:
                insert, rng, end = self._edit(ans, completion, self._echo_start(ans))
            command = self._accept_command(_item_id(ans.rid, i), ans.uri, self._line_after(ans, end))
            items.append(types.InlineCompletionItem(insert_text=insert, range=rng, command=command))
        return items

    @staticmethod
    def _line_after(ans: Answer, end: int) -> dict:
        """The cursor's line after the cursor as it was for this answer, split at the item's
        range end: the code the item replaces (``replaces``) and what follows it (``after``).
        A client whose item is older than its last keystrokes (Neovim's own client asks 200 ms
        after them) tells from them whether the text after the cursor has since grown by the
        closers of what was typed (an editor that closes pairs), which the item then replaces
        as a typed-through answer's range does (editors/nvim, ghost.lua).  Empty when more
        than AFTER_CHARS follow."""
        text, cursor = ans.text, ans.cursor
        if not cursor.offset <= end <= cursor.line_end or cursor.line_end - end > AFTER_CHARS:
            return {}
        return {"replaces": text[cursor.offset:end], "after": text[end:cursor.line_end]}

    @staticmethod
    def _echo_start(ans: Answer) -> int:
        """Where an inline item's range starts: the line's start, or on a line whose typed
        part is longer than ECHO_CHARS (minified code) the word's start, or the cursor, so
        that an answer does not repeat a line of 100 kB on every keystroke."""
        text, cursor = ans.text, ans.cursor
        if cursor.offset - cursor.line_start <= ECHO_CHARS:
            return cursor.line_start
        floor = max(cursor.line_start, cursor.offset - ECHO_CHARS)
        word = _word_start(text, cursor.offset, floor)
        return word if word > floor else cursor.offset

    def _menu_items(self, ans: Answer) -> list:
        """A completion-menu item per completion (the greedy one first, preselected) that
        replaces the word being typed (clients filter menu items by it) with that word and
        the completion, inserted as is (no re-indenting); the label is its first line, the
        documentation the whole text."""
        return [self._menu_item(ans, completion, i) for i, completion in enumerate(ans.completion.texts)]

    def _menu_item(self, ans: Answer, completion: str, i: int) -> types.CompletionItem:
        text, cursor, uri = ans.text, ans.cursor, ans.uri
        insert, rng, _ = self._edit(ans, completion, _word_start(text, cursor.offset, cursor.line_start))
        lines = insert.split("\n")
        label = lines[0].strip() or insert.strip().split("\n")[0]
        if len(label) > 80:
            label = label[:79] + "\u2026"
        more = len(lines) - 1
        lang = language_of(to_fs_path(uri) if uri.startswith("file:") else uri) or ""
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", insert)), default=0))
        return types.CompletionItem(
            label=label, kind=types.CompletionItemKind.Text, preselect=i == 0, sort_text=str(i),
            filter_text=insert, detail="codecomplete" + (f" (+{more} line{'s' if more > 1 else ''})" if more else ""),
            documentation=(types.MarkupContent(types.MarkupKind.Markdown, f"{fence}{lang}\n{insert}\n{fence}")
                           if self._client_reads_markdown() else insert),
            text_edit=types.TextEdit(rng, insert), insert_text_format=types.InsertTextFormat.PlainText,
            insert_text_mode=types.InsertTextMode.AsIs, command=self._accept_command(_item_id(ans.rid, i), uri))

    def _client_reads_markdown(self) -> bool:
        caps = self.client_capabilities
        try:
            formats = caps.text_document.completion.completion_item.documentation_format
        except AttributeError:
            return False
        return types.MarkupKind.Markdown in (formats or [])

    @staticmethod
    def _edit(ans: Answer, completion: str, start: int) -> tuple[str, types.Range, int]:
        """The text from ``start`` (at or before the cursor, on its line) through
        ``completion``, the range it replaces and that range's end offset: up to the cursor,
        or to the line's end when the completion rewrote what follows the cursor there, or
        over the closers an editor put after the cursor (``ans.covers``, typing through)."""
        text, cursor = ans.text, ans.cursor
        insert = text[start:cursor.offset] + completion
        end = cursor.offset + ans.covers
        rest_of_line = text[cursor.offset:cursor.line_end]
        if rewrites_rest(completion, rest_of_line, text[cursor.line_start:cursor.offset]):
            end = cursor.line_end
        return insert, _range(text, start, end, ans.encoding), end

    @staticmethod
    def _accept_command(rid: str, uri: str, line_after: dict | None = None) -> types.Command:
        return types.Command(title="Accept completion", command=ACCEPT_COMMAND,
                             arguments=[{"completionId": rid, "uri": uri, **(line_after or {})}])

    def _supersede(self, uri: str, superseded: bool) -> None:
        run = self.following.pop(uri, None)
        if run is not None:
            run.request.cancel.set()
        old = self.pending.get(uri)
        if old is not None:
            if superseded:
                old.superseded = True
            else:
                old.stale = True
            old.request.cancel.set()

    def _dropped(self, pending: Pending) -> None:
        if pending.stale:
            self.counters.stale += 1
        else:
            self.counters.superseded += 1
        log.info("[%s] dropped: %s", pending.request.request_id,
                 "document changed" if pending.stale else "superseded")
        self._count_empty()

    def _count_empty(self) -> None:
        self.counters.empty += 1

    def _report_failure(self, rid: str, completion: Completion) -> None:
        self.counters.errors += 1
        log.warning("[%s] no completion: %s (%s)", rid, completion.stop_reason, completion.error)
        if completion.stop_reason == "model_unavailable" and not self._told_unavailable:
            self._told_unavailable = True
            self.window_show_message(types.ShowMessageParams(
                types.MessageType.Error, f"codecomplete: model unavailable: {completion.error}"))

    def _tell_slow_path(self) -> None:
        """Once, at the first completion the model computed: where a CPU model runs without the
        native kernels for a reason the user can fix (no C compiler, a failed build), say so in the
        editor.  Without them the daemon still serves, on PyTorch's path: 2.6-3.0x slower a decoded
        token and 1.1-1.4x a prefill on an AVX-512 CPU (docs/decisions.md), and a log line is easy
        to miss."""
        if self._told_slow_path:
            return
        self._told_slow_path = True
        stats = getattr(self.engine, "stats", None)
        native = (stats() if stats else {}).get("native") or {}
        why = native.get("problem")
        if why:
            why = " ".join(why.split())
            why = why if len(why) <= 300 else why[:300] + "..."
            log.warning("native CPU kernels unavailable: %s", why)
            self.window_show_message(types.ShowMessageParams(types.MessageType.Warning, (
                f"codecomplete: the native CPU kernels are unavailable ({why}), so completions run on "
                "PyTorch's slower path (decoding about 3x slower). A C compiler with OpenMP (gcc on PATH, "
                "or CC set to one) builds them; restart the daemon after installing it.")))

    # -- telemetry ---------------------------------------------------------------------
    def record_event(self, kind: str, params: Any) -> None:
        cid = completion_id_of(params)
        setattr(self.counters, kind, getattr(self.counters, kind) + 1)
        info = self.issued.get(cid) if cid else None
        if kind == "accepted" and info is not None and info["rank"] > 0:
            self.counters.accepted_alternatives += 1
        log.info("completion %s %s%s", cid or "?", kind, "" if info else " (unknown id)")

    def stats(self, recent: bool = False, config: bool = False) -> dict:
        """``recent``: the last requests' records too; ``config``: the settings in force, after
        every source (defaults, files, the editor's, the command line's ``--set`` and flags)."""
        extra = {"recent": list(self.recent)} if recent else {}
        if config:
            extra["config"] = as_dict(self.config)
        return {**extra, "version": __version__, "counters": self.counters.as_dict(),
                "engine": self.engine.stats(), "index": self.index.stats() if self.index else None,
                "folders": self.folders.stats(), "open_documents": len(self.workspace.text_documents),
                "completion_cache": len(self.cache),
                "position_encoding": encoding_name(self.workspace.position_encoding),
                # off while the daemon starts, then on with the start's objects frozen (daemon/startgc.py)
                "gc": {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}}

    def report_server_error(self, error: Exception, source) -> None:
        if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
            self.protocol.send_parse_error(str(error))
            return
        self.counters.server_errors += 1
        log.error("server error (%s): %s", getattr(source, "__name__", source), error)


def text_along(prefix0: str, suffix0: str, prefix: str, suffix: str) -> tuple[str, int] | None:
    """The text typed at a cursor that had ``prefix0`` before it and ``suffix0`` after it, now
    that it has ``prefix`` and ``suffix`` (line breaks as ``\\n``: a CRLF buffer's typed break
    matches a completion's), and how many characters the text after it grew by: the closers of
    brackets and quotes the typed text left open, which an editor that closes pairs put there.
    None when the text around the cursor changed otherwise."""
    if len(prefix) < len(prefix0) or not prefix.startswith(prefix0) or not suffix.endswith(suffix0):
        return None
    typed = prefix[len(prefix0):].replace("\r\n", "\n")
    covers = len(suffix) - len(suffix0)
    if covers and not open_pairs(typed).startswith(suffix[:covers]):
        return None
    return typed, covers


def rest_along(shown: Shown, prefix: str, suffix: str) -> tuple[Completion, int] | None:
    """The rest of ``shown``'s completion (or of an alternative) after the text typed at its
    cursor since, when that text is its start and something is left, and the characters after the
    cursor the rest replaces (``text_along``); None otherwise."""
    grown = text_along(shown.prefix, shown.suffix, prefix, suffix)
    if grown is None:
        return None
    typed, covers = grown
    for c in [shown.completion, *shown.completion.alternatives]:
        if c.text.startswith(typed) and c.text[len(typed):].strip():
            return Completion(c.text[len(typed):], c.stop_reason, multiline=c.multiline,
                              prompt_kind="typed-through"), covers  # no prompt, no tokens: nothing ran
    return None


CLOSERS_READ = 32  # typed_between reads at most this many characters at an edit's end as closers


def typed_between(text: str, before: str, after: str) -> str | None:
    """What was typed at a cursor that had ``before`` and ``after`` around it, now that the
    document is ``text`` (line breaks as ``\\n``); None when it changed elsewhere.  The cursor's
    place is not in an edit: the end of the new text is read as the closers an editor that closes
    pairs put after it wherever it can be (``foo()`` -> ``foo(``), which the completion's own
    ``)`` agrees with either way."""
    if len(text) < len(before) + len(after) or not text.startswith(before) or not text.endswith(after):
        return None
    middle = text[len(before):len(text) - len(after)]
    for k in range(min(len(middle), CLOSERS_READ), 0, -1):
        if open_pairs(middle[:-k]).startswith(middle[-k:]):
            middle = middle[:-k]
            break
    return middle.replace("\r\n", "\n")


FIRST_LINES = "first_lines"  # the stop reason of an answer made of a run's whole lines so far


def _set_from_thread(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set ``event`` on ``loop`` from another thread (the engine's); nothing once the loop is closed."""
    try:
        loop.call_soon_threadsafe(event.set)
    except RuntimeError:  # the loop closed (the daemon exits) while the run went on
        pass


def answered_so_far(text: str, request: CompletionRequest) -> Completion:
    """A completion of ``text``, the whole lines ``request``'s run has written so far
    (``FIRST_LINES``), with the run's prompt and engine time up to now (``run_info``), so the
    replay harness can split its latency as a finished run's."""
    info = request.run_info or {}
    timings = {k: info[k] for k in ("queue_ms", "prefill_ms") if k in info}
    if "decode_start" in info:
        timings["decode_ms"] = (time.perf_counter() - info["decode_start"]) * 1000
    return Completion(text, FIRST_LINES, info.get("prompt_tokens", 0), request.progress_tokens, timings,
                      multiline=True, reused_tokens=info.get("reused_tokens", 0), prompt_kind="first-lines")


def first_lines(progress: str) -> str:
    """The whole lines of a multi-line completion's text so far (up to its last line break, line
    breaks as ``\\n``, trailing blank lines dropped), or "" when it has none with code yet.  Last
    lines that repeat the lines just before them are left out: the stop rules cut a repeated line
    or block once it comes a third time, and keep the first copy."""
    text = progress.replace("\r\n", "\n")
    end = text.rfind("\n")
    if end < 0:
        return ""
    lines = text[:end].split("\n")
    while len(lines) > 1 and not lines[-1].strip():
        lines.pop()
    stripped = [ln.strip() for ln in lines]
    for k in range(1, len(lines) // 2 + 1):
        if any(stripped[-k:]) and stripped[-k:] == stripped[-2 * k:-k]:
            lines = lines[:-k]
            break
    out = "\n".join(lines).rstrip()
    return out if out.strip() else ""


def reaches_past(run: Run, typed: str) -> bool:
    """Whether ``run`` may still offer something after ``typed`` (the text typed at its cursor
    since): while in flight, its text so far agrees with it; once done, its completion starts
    with it and goes on."""
    if not run.waiter.done():
        return agrees(run.request.progress, typed)
    done = finished(run)
    return done is not None and done.text.startswith(typed) and bool(done.text[len(typed):].strip())


def finished(run: Run) -> Completion | None:
    """A done run's completion, unless the run failed or was cancelled (then None)."""
    if run.waiter.cancelled() or run.waiter.exception() is not None:
        return None
    done = run.waiter.result()
    return None if done.cancelled or done.error else done


def plain(value: Any) -> Any:
    """pygls hands the params of custom methods over as namedtuples: make them dicts."""
    if hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _folder_paths(folders) -> list[Path]:
    """The local directories of LSP workspace folders (other schemes are skipped)."""
    return [Path(to_fs_path(f.uri)) for f in folders or [] if f.uri.startswith("file:") and to_fs_path(f.uri)]


def _item_id(rid: str, i: int) -> str:
    """The completion id of a request's ``i``-th item (its alternatives: ``c7.2``, ``c7.3``)."""
    return rid if i == 0 else f"{rid}.{i + 1}"


class ChunkReader:
    """An async reader (pygls's ``AsyncReader``: ``readline``, ``readexactly``) over a binary
    stream that reads whatever is available in one worker-thread call (``read1``) and serves
    lines and bodies from its buffer: one hand-off per chunk, not three per message.  Before
    the next message it yields to the event loop once, so a request's handler task starts
    (and can count its own cancellation) before a ``$/cancelRequest`` in the same chunk is
    handled, as with pygls's reader, whose hand-offs gave the loop that turn."""

    CHUNK = 1 << 16

    def __init__(self, stream, executor=None):
        self.stream = stream
        self.executor = executor
        self.buf = bytearray()
        self.eof = False
        self._handed = False  # a body went out since the last yield
        read1 = getattr(stream, "read1", None)
        self._read = read1 if read1 is not None else stream.read

    async def _fill(self) -> None:
        chunk = await asyncio.get_running_loop().run_in_executor(self.executor, self._read, self.CHUNK)
        if chunk:
            self.buf += chunk
        else:
            self.eof = True

    async def readline(self) -> bytes:
        if self._handed:  # the last message's handler runs its first step now
            self._handed = False
            await asyncio.sleep(0)
        start = 0
        while True:
            end = self.buf.find(b"\n", start)
            if end >= 0:
                return self._take(end + 1)
            if self.eof:
                return self._take(len(self.buf))
            start = len(self.buf)
            await self._fill()

    async def readexactly(self, n: int) -> bytes:
        while len(self.buf) < n and not self.eof:
            await self._fill()
        self._handed = True
        return self._take(min(n, len(self.buf)))

    def _take(self, n: int) -> bytes:
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data


def _inside_word(text: str, offset: int) -> bool:
    """An identifier character on both sides of ``offset``."""
    return 0 < offset < len(text) and word_char(text[offset - 1]) and word_char(text[offset])


def _word_start(text: str, offset: int, floor: int) -> int:
    """Where the identifier that ends at ``offset`` starts, not before ``floor``."""
    while offset > floor and word_char(text[offset - 1]):
        offset -= 1
    return offset


def _range(text: str, start: int, end: int, encoding: str) -> types.Range:
    """The LSP range of code-point offsets [start, end) of ``text``."""
    return types.Range(types.Position(*position_at(text, start, encoding)),
                       types.Position(*position_at(text, end, encoding)))


def completion_id_of(params: Any) -> str | None:
    """Find our completion id in a notification's params, ours or Copilot-shaped."""
    params = plain(params)
    if not isinstance(params, dict):
        return None
    if isinstance(params.get("completionId"), str):
        return params["completionId"]
    item = params.get("item") or {}
    command = item.get("command") if isinstance(item, dict) else None
    args = (command or {}).get("arguments") or []
    if args and isinstance(args[0], dict) and isinstance(args[0].get("completionId"), str):
        return args[0]["completionId"]
    return None


def create_server(engine, config: Config, repo: Path | None = None,
                  cli_settings: dict | None = None) -> CodecompleteServer:
    server = CodecompleteServer(engine, config, repo, cli_settings)

    @server.feature(types.INITIALIZE)
    def initialize(ls: CodecompleteServer, params: types.InitializeParams):
        # edits at LSP's line breaks, not str.splitlines' (lsp/workspace.py)
        ls.protocol._workspace = lsp_workspace(ls.workspace, ls._text_document_sync_kind)
        if params.initialization_options:
            ls.apply_settings(params.initialization_options, "initializationOptions")
        if ls.repo is None:  # rootUri is deprecated (LSP 3.17): the first workspace folder
            root = params.root_uri or next((f.uri for f in params.workspace_folders or []
                                            if f.uri.startswith("file:")), None) or (
                Path(params.root_path).as_uri() if params.root_path else None)
            if root and root.startswith("file:"):
                ls.repo = Path(to_fs_path(root) or ".")
        ls.start_index(_folder_paths(params.workspace_folders))
        log.info("client %s, position encoding %s", params.client_info.name if params.client_info else "?",
                 encoding_name(ls.workspace.position_encoding))

    @server.feature(types.INITIALIZED)
    async def initialized(ls: CodecompleteServer, params: types.InitializedParams):
        async def progress():
            try:
                await ls.report_startup()
            except Exception:  # progress is a courtesy: never a reason to fail
                log.exception("start-up progress failed")

        # side by side: a client slow to answer the registration does not delay progress
        await asyncio.gather(ls.watch_through_client(), progress())

    @server.feature(types.WORKSPACE_DID_CHANGE_WATCHED_FILES)
    def did_change_watched_files(ls: CodecompleteServer, params: types.DidChangeWatchedFilesParams):
        ls.files_changed([change.uri for change in params.changes])

    @server.feature(types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS)
    async def did_change_folders(ls: CodecompleteServer, params: types.DidChangeWorkspaceFoldersParams):
        # off the event loop: closing an index waits for its worker
        await asyncio.to_thread(ls.change_folders, _folder_paths(params.event.added),
                                _folder_paths(params.event.removed))

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    def did_change_configuration(ls: CodecompleteServer, params: types.DidChangeConfigurationParams):
        ls.apply_settings(params.settings, "workspace/didChangeConfiguration")

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: CodecompleteServer, params: types.DidOpenTextDocumentParams):
        log.debug("open %s (%s)", params.text_document.uri,
                  params.text_document.language_id or language_of(params.text_document.uri))
        ls.overlay(params.text_document.uri)
        ls.opened(params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: CodecompleteServer, params: types.DidChangeTextDocumentParams):
        ls.changed(params)

    @server.feature(types.TEXT_DOCUMENT_DID_SAVE)
    def did_save(ls: CodecompleteServer, params: types.DidSaveTextDocumentParams):
        log.debug("saved %s", params.text_document.uri)

    @server.feature(types.NOTEBOOK_DOCUMENT_DID_OPEN)
    def did_open_notebook(ls: CodecompleteServer, params: types.DidOpenNotebookDocumentParams):
        ls.overlay_notebook(params.notebook_document.uri)

    @server.feature(types.NOTEBOOK_DOCUMENT_DID_CHANGE)
    def did_change_notebook(ls: CodecompleteServer, params: types.DidChangeNotebookDocumentParams):
        ls.notebook_changed(params)

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: CodecompleteServer, params: types.DidCloseTextDocumentParams):
        ls.forget(params.text_document.uri)

    @server.feature(types.NOTEBOOK_DOCUMENT_DID_CLOSE)
    def did_close_notebook(ls: CodecompleteServer, params: types.DidCloseNotebookDocumentParams):
        for cell in params.cell_text_documents:
            ls.forget(cell.uri)
        ls.overlay_notebook(params.notebook_document.uri, closed=True)

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: CodecompleteServer, params: types.InlineCompletionParams):
        return await ls.inline_completion(params)

    @server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(
        trigger_characters=[".", "(", "[", "{", ",", ":", "=", " "], resolve_provider=False))
    async def completion(ls: CodecompleteServer, params: types.CompletionParams):
        return await ls.completion(params)

    @server.command(ACCEPT_COMMAND)
    def accept(ls: CodecompleteServer, *args):
        ls.record_event("accepted", args[0] if args else None)

    def counter(kind: str):
        def handler(ls: CodecompleteServer, params: Any):
            ls.record_event(kind, params)

        return handler

    for method, kind in ((SHOWN, "shown"), (COPILOT_SHOWN, "shown"), (ACCEPTED, "accepted"),
                         (COPILOT_PARTIAL, "partially_accepted"), (REJECTED, "rejected")):
        server.feature(method)(counter(kind))

    @server.feature(CURSOR_NOTIFICATION)
    def cursor_moved(ls: CodecompleteServer, params: Any):
        ls.cursor_moved(params)

    @server.feature(STATS_REQUEST)
    def stats(ls: CodecompleteServer, params: Any):
        p = plain(params)
        p = p if isinstance(p, dict) else {}
        return ls.stats(recent=bool(p.get("recent")), config=bool(p.get("config")))

    @server.feature(RETRIEVE_REQUEST)
    async def retrieve(ls: CodecompleteServer, params: Any):
        return await asyncio.to_thread(ls.retrieve, params)

    return server
