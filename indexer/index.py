"""The repository index: scan, datastore, watcher, open-buffer overlay, retrieval.

One worker thread owns every mutation.  Watcher events, open-buffer edits and the
tokenizer's arrival only put work on its queue; the worker waits until the queue has
been quiet for ``debounce_ms`` (at most ``max_delay_ms`` after the first event) and then
reconciles all queued paths in one batch through the same code path as the start-up
scan: stat, hash, and only for changed content read, tokenize, chunk and write in one
transaction, then update the in-memory suffix index.  A branch switch that touches a
thousand files is one reconcile.

Readers (snippet search, draft lookup) never wait for the worker: the draft index hands
out immutable snapshots, snippet search uses its own read-only SQLite connection and
is time-boxed.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import shutil
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


from . import snippets as snip
from .files import SourceError, decode_source, index_language, is_notebook, language_of, notebook_code
from .scan import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_FILES, Entry, Rules, walk
from .store import CHUNK_BITS, Store, connect, is_corrupt, open_store, rebuild_store
from .store import counts as store_counts
from .suffix import DraftIndex, Match, Segment, lookup, width_for
from .tokens import TokenizerInfo, blob_to_ids, ids_to_blob

log = logging.getLogger(__name__)

DEFAULT_MAX_DRAFT_TOKENS = 32_000_000  # the draft index's start-up budget (see _draft_files)

BATCH_FILES = 256  # files per transaction
YIELD_FILES = 32  # files between two looks at whether completions are computing (RepoIndex._yield)
MINIFIED_LINE = 1000  # a file whose average line is longer than this is generated/minified


def default_index_dir(repo: Path) -> Path:
    from codecomplete.paths import cache_dir

    real = os.path.realpath(repo)
    key = hashlib.sha256(real.encode()).hexdigest()[:12]
    return cache_dir() / "index" / f"{Path(real).name}-{key}"


@dataclass
class Overlay:
    text: str
    language: str
    chunks: list
    words: list  # identifier sets of the chunks
    defs: list


@dataclass
class IndexStats:
    files_indexed: int = 0  # files (re)written since start
    files_unchanged: int = 0
    files_removed: int = 0
    files_skipped: int = 0  # binary, not UTF-8, minified, unreadable
    reconciles: int = 0
    events: int = 0  # from the watcher
    client_events: int = 0  # from the editor (workspace/didChangeWatchedFiles)
    last_reconcile_ms: float = 0.0
    scan_seconds: float = 0.0
    tokens_seconds: float = 0.0
    errors: int = 0
    rebuilds: int = 0  # the database found damaged while running and built anew
    yields: int = 0  # times the work waited for the engine's completions (``RepoIndex.foreground``)
    yield_ms: float = 0.0  # time it waited
    skipped: dict = field(default_factory=dict)  # reason -> count


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class RepoIndex:
    def __init__(self, root: Path, index_dir: Path | None = None, *,
                 tokenizer: TokenizerInfo | None = None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 watch: bool = True, debounce_ms: int = 50, max_delay_ms: int = 1000,
                 common: Segment | None = None, want_common: bool = False, check_s: float = 5.0,
                 poll_s: float = 30.0, max_files: int = DEFAULT_MAX_FILES,
                 max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                 foreground: Callable[[], bool] | None = None, yield_ms: int = 500):
        self.root = Path(root).resolve()
        self.index_dir = Path(index_dir) if index_dir else default_index_dir(self.root)
        self.db_path = self.index_dir / "index.sqlite"
        try:  # the index folder, when it lies inside the repository (a home folder as the workspace)
            self._own_rel = Path(os.path.realpath(self.index_dir)).relative_to(self.root).as_posix()
        except ValueError:
            self._own_rel = None
        self.tokenizer = tokenizer
        self.rules = Rules(self.root, max_file_bytes)
        # A folder of more files than this (a home folder or / opened as the workspace) is
        # indexed up to this many, in walk order, with a warning: its database, token ids
        # and suffix arrays grow with it (~6 bytes per token in memory).
        self.max_files = max_files
        self.capped = False
        self.max_draft_tokens = max_draft_tokens
        self.draft_tokens_left_out = 0
        self.watch = watch
        self.debounce = debounce_ms / 1000
        self.max_delay = max_delay_ms / 1000
        self.common = common
        # Every check_s while idle the worker checks its watcher: a repository folder that
        # vanished and came back (a new inode the old observer does not see) is watched
        # again and rescanned; without a working observer (inotify's watch limit) the
        # repository is rescanned every poll_s instead.
        self.check_s = check_s
        self.poll_s = poll_s
        self._root_id: tuple[int, int] | None = None
        self._polled_at = time.monotonic()
        self._blind = False  # the last observer failed to start
        self._poll_cost = 0.0  # seconds of the last blind cycle: observer attempt + full scan
        self._scan_s = 0.0  # the last full scan's
        # Re-reading an open buffer (tokens, chunks, definitions) costs ~0.5 s for 1 MB;
        # done on every keystroke it would keep a core busy beside the engine.  A buffer's
        # next text is applied no sooner than its last one's cost x (1/share - 1) later;
        # meanwhile the newest text waits in _deferred (and counts as outstanding work).
        self.overlay_share = 0.25
        self._deferred: dict[str, tuple] = {}
        self._overlay_due: dict[str, float] = {}
        self.want_common = want_common  # load (or build once) the common datastore for the tokenizer
        # Background work yields to completions: while ``foreground()`` says the engine computes
        # one, the work waits before its next few files (at most ``yield_ms`` at a time, so that
        # it still moves while requests follow each other).  The indexer runs at a lower nice,
        # but on two cores it still shares one with the engine's threads, which wait for each
        # other at every barrier of a pass (docs/decisions.md, nineteenth session).
        self.foreground = foreground
        self.yield_ms = yield_ms
        self.stats_ = IndexStats()
        self.store: Store | None = None
        self.drafts: DraftIndex | None = None
        self.overlays: dict[str, Overlay] = {}
        self.ready = threading.Event()  # the first scan is in the datastore
        self.tokens_ready = threading.Event()  # the draft index holds the repository
        self.failed: str | None = None
        self.drafts_source = ""  # "built" or "mapped" (the saved base segment)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._observer = None
        self._stop = threading.Event()
        self._reader: sqlite3.Connection | None = None
        self._reader_ino: int | None = None  # the inode of the file the reader opened
        self._reader_lock = threading.Lock()
        self._chunks_n, self._chunks_at = 0, -10.0
        self._idle = threading.Condition()
        self._busy = 0
        self.progress = lambda done, total: None  # the index command draws a bar with it

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "RepoIndex":
        self._thread = threading.Thread(target=self._run, name="codecomplete-indexer", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._queue.put(("stop", None))
        if self._observer is not None:
            try:
                self._observer.stop()
                self._observer.join(timeout)
            except Exception:  # an observer that failed to start
                pass
        if self._thread is not None:
            self._thread.join(timeout)
        self._stop_watcher()  # one the worker may have started meanwhile
        if self._reader is not None:
            self._reader.close()

    def build(self) -> dict:
        """Index once on the calling thread (the ``index`` command); returns stats."""
        self._open()
        self._full_scan()
        if self.tokenizer is not None:
            self._tokenize_missing()
        self.ready.set()
        return self.stats()

    # -- public, thread-safe requests ------------------------------------------------------
    def set_tokenizer(self, tokenizer: TokenizerInfo) -> None:
        self._put("tokenizer", tokenizer)

    def overlay(self, path: str | Path, text: str) -> None:
        """An editor's buffer for ``path`` now holds ``text`` (it wins over the disk)."""
        self._put("overlay", (self.key_of(path), text))

    def close_overlay(self, path: str | Path) -> None:
        self._put("unoverlay", self.key_of(path))

    def notify(self, path: str | Path) -> bool:
        """A path may have changed on disk (a hint; the reconcile decides).  False for a
        path there is nothing to do for (see ``_unwatched``)."""
        key = self.key_of(path)
        if self._unwatched(key):
            return False
        self._put("path", key)
        return True

    def _unwatched(self, rel: str) -> bool:
        """Reports of changes to ``rel`` (a key) that queue nothing: a path outside the
        repository, the root, ``.git`` (but its ``info/exclude``), and the index's own folder
        when it lies inside the repository (its database's writes)."""
        own = self._own_rel
        return (rel.startswith("/") or rel in (".", ".git")
                or (rel.startswith(".git/") and rel != ".git/info/exclude")
                or (own is not None and (rel == own or rel.startswith(own + "/"))))

    def rescan(self) -> None:
        self._put("rescan", None)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until every queued change has been applied (tests, the index command)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy or not self._queue.empty():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.05))
        return True

    def key_of(self, path: str | Path) -> str:
        """Repository-relative posix path, or the absolute path for a file outside it."""
        p = Path(path)
        if not p.is_absolute():
            return p.as_posix()
        try:
            return p.resolve().relative_to(self.root).as_posix()
        except (ValueError, OSError):
            return p.as_posix()

    def _put(self, kind: str, value) -> None:
        with self._idle:
            self._busy += 1
        self._queue.put((kind, value))

    # -- the worker ----------------------------------------------------------------------
    def _run(self) -> None:
        try:  # background work: below the engine's priority (Linux nice is per thread)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        try:
            self._open()
            self._full_scan()
            self.ready.set()
            if self.watch:
                self._start_watcher()
            if self.tokenizer is not None:
                self._tokenize_missing()
                self._ensure_common()
        except Exception as exc:  # the daemon keeps serving completions without an index
            self.failed = f"{type(exc).__name__}: {exc}"
            log.exception("indexing %s failed", self.root)
            self.ready.set()
            self._drain_forever()
            return
        while not self._stop.is_set():
            batch = self._collect()
            if batch is None:
                break
            try:
                self._apply(batch)
            except Exception as exc:
                damage = self._damage(exc)
                if damage is not None:
                    self._recover(*damage)
                else:
                    self.stats_.errors += 1
                    log.exception("index update failed")
            finally:
                with self._idle:
                    self._busy -= len(batch)
                    self._idle.notify_all()

    def _damage(self, exc: BaseException) -> tuple[str, int | None] | None:
        """(why, the inode of the damaged file) when an update failed because the database is
        damaged, else None (a busy database, a full disk, a bug: logged as an error)."""
        if self.store is None:
            return None
        if is_corrupt(exc):
            return str(exc), self.store.ino
        try:
            reason = self.store.damage()
        except Exception:
            return None
        return (f"{reason} after: {exc}", self.store.ino) if reason else None

    def _recover(self, reason: str, ino: int | None) -> None:
        """The database was damaged under the running daemon (a disk error, another program
        writing to it, a lost write-ahead log): move it aside and build a new one from the
        files, as a start that finds it damaged does, instead of failing every later update.
        The draft index and open buffers live in memory and keep serving meanwhile."""
        if self.store is not None and ino != self.store.ino:
            return  # a report about the file that an earlier rebuild replaced
        self.stats_.errors += 1
        log.error("index %s damaged while in use (%s); rebuilding it", self.db_path, reason)
        old = self.store
        try:
            self.store = rebuild_store(self.db_path, reason, old.ino if old is not None else None)
        except Exception:
            log.exception("cannot rebuild the index %s", self.db_path)
            return
        finally:
            if old is not None:
                old.close()
        with self._reader_lock:  # readers open the new file on their next query
            if self._reader is not None:
                self._reader.close()
            self._reader, self._reader_ino = None, None
        self.stats_.rebuilds += 1
        try:
            self.store.set_meta("repo", str(self.root))
            self._full_scan()
            if self.tokenizer is not None:
                self._tokenize_missing()
        except Exception:
            self.stats_.errors += 1
            log.exception("rebuilding the index %s failed", self.db_path)

    def _reader_failed(self, exc: sqlite3.Error, what: str) -> None:
        """A query of a reader failed: log it, and have the worker rebuild a damaged file."""
        log.warning("%s failed: %s", what, exc)
        if is_corrupt(exc) and self._reader_ino is not None:
            self._put("corrupt", (self._reader_ino, str(exc)))

    def _drain_forever(self) -> None:
        while True:
            kind, _ = self._queue.get()
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
            if kind == "stop":
                return

    def _collect(self) -> list | None:
        """Block for one item, then gather until the queue is quiet (debounce)."""
        while True:
            timeout = self.check_s
            if self._deferred:
                soonest = min(self._overlay_due.get(k, 0.0) for k in self._deferred)
                timeout = max(0.0, min(timeout, soonest - time.monotonic()))
            try:
                item = self._queue.get(timeout=timeout)
                break
            except queue.Empty:
                now = time.monotonic()
                due = [k for k in self._deferred if self._overlay_due.get(k, 0.0) <= now]
                if due:  # held-back buffer texts whose turn has come (counted busy already)
                    return [("overlay", self._deferred.pop(k)) for k in due]
                try:
                    self._check_watcher()
                except Exception:  # never a reason to stop indexing
                    log.exception("checking the watcher of %s failed", self.root)
        if item[0] == "stop":
            return None
        batch = [item]
        first = time.monotonic()
        while True:
            wait = min(self.debounce, self.max_delay - (time.monotonic() - first))
            if wait <= 0:
                break
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                break
            if item[0] == "stop":
                self._queue.put(item)
                break
            batch.append(item)
        return batch

    def _apply(self, batch: list) -> None:
        self._yield()
        paths: set[str] = set()
        rescan = False
        overlays = {value[0]: value for kind, value in batch if kind == "overlay"}
        damaged = None
        for kind, value in batch:
            if kind == "path":
                paths.add(value)
                if value == ".gitignore" or value.endswith("/.gitignore") or value == ".git/info/exclude":
                    rescan = True
            elif kind == "rescan":
                rescan = True
            elif kind == "tokenizer":
                if self.tokenizer is None or self.tokenizer.id != value.id or not self.tokens_ready.is_set():
                    self.tokenizer = value
                    self._tokenize_missing()
                    self._ensure_common()
            elif kind == "overlay":
                if overlays[value[0]] is value:  # only the newest text of each buffer
                    self._overlay_now_or_later(value)
            elif kind == "corrupt":  # a reader found the file damaged: after the rest of the batch
                damaged = value
            elif kind == "unoverlay":
                self._forget_deferred(value)
                self._overlay_due.pop(value, None)
                self._drop_overlay(value)
        if damaged is not None:
            ino, reason = damaged
            self._recover(reason, ino)  # the rebuild rescans every file
            return
        if rescan:
            self.rules = Rules(self.root, self.rules.max_bytes)
            self._full_scan()
        elif paths:
            self._reconcile_paths(paths)

    def _open(self) -> None:
        self.index_dir.mkdir(parents=True, exist_ok=True)
        self.store = open_store(self.db_path)
        if self.store.get_meta("repo") not in (None, str(self.root)):
            log.warning("index %s belonged to %s; reusing it for %s", self.db_path,
                        self.store.get_meta("repo"), self.root)
        self.store.set_meta("repo", str(self.root))

    # -- reconcile ---------------------------------------------------------------------
    def _full_scan(self) -> None:
        t0 = time.perf_counter()
        if not os.path.isdir(self.root):  # (os.path answers False where pathlib raises: EACCES)
            log.warning("repository %s is gone; index kept as it was", self.root)
            return
        known = self.store.file_states()
        entries = list(itertools.islice(walk(self.rules), self.max_files + 1))
        self.capped = len(entries) > self.max_files
        if self.capped:
            entries = entries[:self.max_files]
            log.warning("%s holds more than %d files; indexing the first %d (index.max_files)",
                        self.root, self.max_files, self.max_files)
        seen = {e.path for e in entries}
        changed = []
        for entry in entries:
            old = known.get(entry.path)
            if old is not None and old[0] == entry.size and old[1] == entry.mtime_ns:
                self.stats_.files_unchanged += 1
            else:
                changed.append(entry)
        removed = [p for p in known if p not in seen]
        self.progress(0, len(changed))
        for i in range(0, max(len(changed), 1), BATCH_FILES):
            self._write(changed[i:i + BATCH_FILES], removed if i == 0 else [], known)
            self.progress(min(i + BATCH_FILES, len(changed)), len(changed))
        self._scan_s = time.perf_counter() - t0
        self.stats_.scan_seconds += self._scan_s
        self.stats_.reconciles += 1
        self.stats_.last_reconcile_ms = self._scan_s * 1000

    def _reconcile_paths(self, paths: set[str]) -> None:
        t0 = time.perf_counter()
        known = self.store.states_for(sorted(paths))
        entries: list[Entry] = []
        removed: list[str] = []
        for rel in sorted(paths):
            if rel.startswith("/") or rel.startswith(".git/") or rel == ".git":
                continue
            full = self.root / rel
            if os.path.isdir(full) and not os.path.islink(full):
                # a folder appeared or moved in: walk it with the same rules
                parts = rel.split("/")
                if not any(self.rules.ignored("/".join(parts[:i + 1]), True) for i in range(len(parts))):
                    entries.extend(walk(self.rules, start=rel))
                continue
            entry = self.rules.accepts(rel)
            if entry is not None:
                entries.append(entry)
            # a vanished file, or a vanished folder: drop what the index had under it
            prefix = rel + "/"
            gone = [p for p in known if (p == rel and entry is None) or p.startswith(prefix)]
            removed.extend(p for p in gone if not os.path.isfile(self.root / p)
                           or self.rules.accepts(p) is None)
        fresh = [e for e in entries if known.get(e.path, (None, None))[:2] != (e.size, e.mtime_ns)]
        new = [e for e in fresh if e.path not in known]
        if new:  # new files stop at max_files
            room = self.max_files - self.store.conn.execute("SELECT count(*) FROM files").fetchone()[0] + len(removed)
            if len(new) > room:
                drop = {e.path for e in new[max(room, 0):]}
                fresh = [e for e in fresh if e.path not in drop]
                self.capped = True
                log.warning("%s: %d new files not indexed (index.max_files = %d)", self.root, len(drop),
                            self.max_files)
        for i in range(0, max(len(fresh), 1), BATCH_FILES):
            self._write(fresh[i:i + BATCH_FILES], removed if i == 0 else [], known)
        self.stats_.reconciles += 1
        self.stats_.last_reconcile_ms = (time.perf_counter() - t0) * 1000
        log.debug("reconciled %d paths (%d changed, %d removed) in %.1f ms", len(paths),
                  len(fresh), len(removed), self.stats_.last_reconcile_ms)

    def _write(self, entries: list[Entry], removed: list[str], known: dict) -> None:
        """Read, hash, tokenize and store a batch of files in one transaction."""
        upserts, texts = [], []
        for n, e in enumerate(entries):
            if n % YIELD_FILES == 0:
                self._yield()
            try:
                data = (self.root / e.path).read_bytes()
            except OSError as exc:
                self._skip(e.path, "unreadable", exc)
                if e.path in known:
                    removed.append(e.path)
                continue
            h = _hash(data)
            old = known.get(e.path)
            if old is not None and old[2] == h:
                upserts.append({"path": e.path, "size": len(data), "mtime_ns": e.mtime_ns, "touch_only": True})
                self.stats_.files_unchanged += 1
                continue
            try:
                text, language = self._text_of(e.path, data)
            except SourceError as exc:
                self._skip(e.path, exc.reason, exc)
                if e.path in known:
                    removed.append(e.path)
                continue
            lines = text.count("\n") + 1
            if len(text) > 4096 and len(text) / lines > MINIFIED_LINE:
                self._skip(e.path, "minified", None)
                if e.path in known:
                    removed.append(e.path)
                continue
            upserts.append({"path": e.path, "hash": h, "size": len(data), "mtime_ns": e.mtime_ns,
                            "language": language, "chunks": snip.chunks(text),
                            "defs": snip.definitions(text, language)})
            texts.append(text)
        full = [u for u in upserts if not u.get("touch_only")]
        tok = self.tokenizer
        if tok is not None and full:
            ids = self._encode(texts)
            for u, arr in zip(full, ids):
                u["ids"] = ids_to_blob(arr)
        self.store.write_batch(upserts, removed, tok.id if tok else None)
        self.stats_.files_indexed += len(full)
        self.stats_.files_removed += len(set(removed))
        if self.drafts is not None:
            docs = {u["path"]: blob_to_ids(u["ids"]) for u in full
                    if "ids" in u and u["path"] not in self.overlays}
            gone = [p for p in removed if p not in self.overlays]
            if docs or gone:
                self.drafts.update_many(docs, gone)

    def _text_of(self, path: str, data: bytes) -> tuple[str, str]:
        """What the index holds of a file and its language: its text, or a Jupyter notebook's
        code cells (whose size the limit then applies to).  SourceError: nothing to hold."""
        text = decode_source(data, path)
        if not is_notebook(path):
            return text, language_of(path)
        code, language = notebook_code(text, path)
        if len(code.encode("utf-8")) > self.rules.max_bytes:
            raise SourceError(f"{path}'s code cells are over the {self.rules.max_bytes}-byte limit", "too_large")
        return code, language

    def _yield(self) -> None:
        """Wait while the engine computes a completion (``foreground``), at most ``yield_ms``."""
        busy = self.foreground
        if busy is None or self.yield_ms <= 0 or self._stop.is_set():
            return
        try:
            if not busy():
                return
            t0 = time.monotonic()
            deadline = t0 + self.yield_ms / 1000
            while not self._stop.wait(0.005) and time.monotonic() < deadline and busy():
                pass
        except Exception:  # noqa: BLE001 - a broken probe must not stop the index
            log.debug("the foreground probe failed", exc_info=True)
            return
        self.stats_.yields += 1
        self.stats_.yield_ms += (time.monotonic() - t0) * 1000

    def _encode(self, texts: list[str]) -> list:
        """``encode_batch`` in pieces of YIELD_FILES texts, yielding to completions between them
        (the same ids: each text is encoded on its own)."""
        tok, out = self.tokenizer, []
        t0 = time.perf_counter()
        for i in range(0, len(texts), YIELD_FILES):
            if i:
                self._yield()
            out.extend(tok.encode_batch(texts[i:i + YIELD_FILES]))
        self.stats_.tokens_seconds += time.perf_counter() - t0
        return out

    def _skip(self, path: str, reason: str, exc) -> None:
        self.stats_.files_skipped += 1
        self.stats_.skipped[reason] = self.stats_.skipped.get(reason, 0) + 1
        log.debug("not indexing %s: %s%s", path, reason, f" ({exc})" if exc else "")

    def _tokenize_missing(self) -> None:
        """Give every file token ids for the current tokenizer; (re)build the draft index."""
        tok = self.tokenizer
        t0 = time.perf_counter()
        missing = self.store.missing_tokens(tok.id)
        for i in range(0, len(missing), BATCH_FILES):
            part = missing[i:i + BATCH_FILES]
            rows, texts = [], []
            for n, (path, h) in enumerate(part):
                if n % YIELD_FILES == 0:
                    self._yield()
                try:
                    data = (self.root / path).read_bytes()
                    if _hash(data) != h:
                        self.notify(path)  # changed since the scan: the reconcile redoes it
                        continue
                    texts.append(self._text_of(path, data)[0])
                    rows.append((path, h))
                except (OSError, SourceError):
                    self.notify(path)
            ids = self._encode(texts)
            self.store.write_tokens([(p, tok.id, h, ids_to_blob(a)) for (p, h), a in zip(rows, ids)])
        dropped = self.store.drop_other_tokenizers(tok.id)
        if dropped:
            log.info("dropped %d token rows of an earlier tokenizer", dropped)
        hashes = self._draft_files(tok.id)
        drafts = self._load_saved_drafts(hashes)
        self.drafts_source = "mapped" if drafts is not None else "built"
        if drafts is None:
            self._yield()
            docs = [(p, blob_to_ids(b)) for p, b in self.store.all_tokens(tok.id) if p in hashes]
            drafts = DraftIndex.from_documents(docs, width_for(tok.vocab_size))
            self._save_drafts(drafts, hashes)
        for key, ov in self.overlays.items():
            drafts.update(key, tok.encode(ov.text))
        self.drafts = drafts
        self.tokens_ready.set()
        log.info("draft index: %d files, %d tokens in %.1f s", len(hashes), drafts.stats()["base_tokens"],
                 time.perf_counter() - t0)

    # -- the saved base segment: a restart maps it instead of rebuilding the suffix array
    def _drafts_dir(self) -> Path:
        return self.index_dir / f"drafts-{self.tokenizer.id}"

    def _draft_files(self, tokenizer: str) -> dict[str, str]:
        """path -> hash of the files the draft index starts with: all of them, or when
        their tokens exceed ``max_draft_tokens`` the most recently modified that fit (the
        suffix arrays cost ~6 bytes per token in memory and ~60 while built).  A file left
        out enters when it changes."""
        rows = self.store.conn.execute(
            "SELECT t.path, t.hash, length(t.ids) / 4, f.mtime_ns FROM tokens t JOIN files f "
            "ON f.path = t.path AND f.hash = t.hash WHERE t.tokenizer = ?", (tokenizer,)).fetchall()
        total = sum(r[2] for r in rows)
        self.draft_tokens_left_out = 0
        if total <= self.max_draft_tokens:
            return {p: h for p, h, _, _ in rows}
        out, used = {}, 0
        for p, h, n, _ in sorted(rows, key=lambda r: -r[3]):
            if used + n <= self.max_draft_tokens:
                out[p] = h
                used += n
        self.draft_tokens_left_out = total - used
        log.warning("%s: %d of %d files' tokens (%d of %d) in the draft index, the most recently modified "
                    "(index.max_draft_tokens)", self.root, len(out), len(rows), used, total)
        return out

    def _save_drafts(self, drafts: DraftIndex, hashes: dict) -> None:
        base = drafts.base()
        folder = self._drafts_dir()
        tmp = folder.with_name(folder.name + ".tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            base.save(tmp, {"tokenizer": self.tokenizer.id, "hashes": [hashes.get(k, "") for k in base.keys]})
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        except OSError as exc:
            log.warning("cannot save the draft index (%s); the next start rebuilds it", exc)

    def _load_saved_drafts(self, hashes: dict) -> DraftIndex | None:
        """The saved base with what changed since applied as small segments, or None."""
        folder = self._drafts_dir()
        if not (folder / "meta.json").is_file():
            return None
        try:
            seg, meta = Segment.load(folder)
            saved = dict(zip(meta["keys"], meta["hashes"]))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("saved draft index unusable (%s); rebuilding", exc)
            return None
        if meta.get("tokenizer") != self.tokenizer.id:
            return None
        changed = [p for p, h in hashes.items() if saved.get(p) != h]
        if len(changed) > 0.3 * max(1, len(hashes)):
            return None  # mostly new: a fresh build is cheaper than many small segments
        drafts = DraftIndex.from_segment(seg)
        gone = [p for p in saved if p not in hashes]
        docs = {}
        for path in changed:
            row = self.store.conn.execute("SELECT ids FROM tokens WHERE path = ? AND tokenizer = ?",
                                          (path, self.tokenizer.id)).fetchone()
            if row:
                docs[path] = blob_to_ids(row[0])
        if docs or gone:
            drafts.update_many(docs, gone)
        log.info("draft index mapped from %s (%d files changed since)", folder, len(changed) + len(gone))
        return drafts

    def _ensure_common(self) -> None:
        if not self.want_common or self.tokenizer is None:
            return
        from .common import build_common, common_dir, load_common

        seg = load_common(self.tokenizer)
        if seg is None:
            try:
                build_common(self.tokenizer, common_dir(self.tokenizer), pause=self._yield)
            except OSError as exc:
                log.warning("cannot build the common datastore: %s", exc)
                return
            seg = load_common(self.tokenizer)
        self.common = seg

    # -- open buffers ------------------------------------------------------------------
    def _overlay_now_or_later(self, value: tuple) -> None:
        key = value[0]
        if time.monotonic() < self._overlay_due.get(key, 0.0):
            if key not in self._deferred:
                with self._idle:
                    self._busy += 1  # outstanding until applied or dropped
            self._deferred[key] = value
            return
        self._forget_deferred(key)  # this text is newer than the one held back
        t0 = time.perf_counter()
        self._set_overlay(*value)
        cost = time.perf_counter() - t0
        self._overlay_due[key] = time.monotonic() + cost * (1 / self.overlay_share - 1)

    def _forget_deferred(self, key: str) -> None:
        if self._deferred.pop(key, None) is not None:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _set_overlay(self, key: str, text: str) -> None:
        language = index_language(key)
        chunks = snip.chunks(text)
        self.overlays[key] = Overlay(text, language, chunks,
                                     [set(snip.identifiers(c.text)) for c in chunks],
                                     snip.definitions(text, language))
        if self.drafts is not None and self.tokenizer is not None:
            self.drafts.update(key, self.tokenizer.encode(text))

    def _drop_overlay(self, key: str) -> None:
        if self.overlays.pop(key, None) is None or self.drafts is None:
            return
        row = self.store.conn.execute(
            "SELECT t.ids FROM tokens t JOIN files f ON f.path = t.path AND f.hash = t.hash "
            "WHERE t.path = ? AND t.tokenizer = ?", (key, self.tokenizer.id)).fetchone()
        if row:
            self.drafts.update(key, blob_to_ids(row[0]))
        else:
            self.drafts.remove(key)

    # -- watcher -----------------------------------------------------------------------
    def _root_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.root)
        except OSError:
            return None
        return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

    def _check_watcher(self) -> None:
        """Called by the worker when idle (see ``check_s``)."""
        if not self.watch or self._stop.is_set():
            return
        now = self._root_identity()
        if now is None:
            if self._root_id is not None:
                log.warning("repository %s is gone; the index waits for it to come back", self.root)
                self._root_id = None
            return
        observer = self._observer
        # watchdog's observer thread outlives an emitter whose folder was deleted
        alive = observer is not None and observer.is_alive() and all(e.is_alive() for e in observer.emitters)
        if now == self._root_id and alive:
            return
        if now != self._root_id:
            log.info("repository %s is back (or replaced): watching it again and rescanning", self.root)
        elif time.monotonic() - self._polled_at < max(self.poll_s, 10 * self._poll_cost):
            return  # blind: a rescan (and a new observer's attempt) takes at most ~10% of the time
        self._polled_at = time.monotonic()
        t0 = time.perf_counter()
        self._start_watcher()  # replaces a dead or blind observer; may fail again (watch limit)
        self._poll_cost = time.perf_counter() - t0 + self._scan_s
        self._put("rescan", None)

    def _stop_watcher(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            try:
                observer.stop()
            except Exception:  # one that never started
                pass

    def _start_watcher(self) -> None:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        index = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event):
                if event.event_type in ("opened", "closed", "closed_no_write"):
                    return
                for raw in (event.src_path, getattr(event, "dest_path", "")):
                    if not raw:
                        continue
                    path = os.fsdecode(raw)
                    try:
                        rel = Path(path).relative_to(index.root).as_posix()
                    except ValueError:
                        continue
                    if rel == "." and event.event_type in ("deleted", "moved"):
                        index._root_id = None  # this observer is blind now; see _check_watcher
                    if index._unwatched(rel):
                        continue
                    index.stats_.events += 1
                    index._put("path", rel)

        self._stop_watcher()
        self._root_id = self._root_identity()
        observer = Observer()
        observer.daemon = True
        try:
            observer.schedule(Handler(), str(self.root), recursive=True)
            observer.start()
        except OSError as exc:  # inotify watch limit, a vanished folder
            (log.debug if self._blind else log.warning)(
                "cannot watch %s (%s); rescanning it every %.0f s instead", self.root, exc, self.poll_s)
            self._blind = True
            return
        self._blind = False
        self._observer = observer

    # -- retrieval ---------------------------------------------------------------------
    def lookup(self, context: list[int], *, others: tuple = (), **kw) -> list[Match]:
        """Draft continuations for the token ids before the cursor, per source.  ``others``:
        more repositories' draft indexes, searched as one with this one's (the folders of a
        multi-root workspace: the longest match in any of them wins)."""
        out = []
        segments = [seg for d in (self.drafts, *others) if d is not None for seg in d.segments()]
        m = lookup(segments, context, **kw) if segments else None
        if m:
            out.append(Match(m.length, m.occurrences, m.continuations, "repository"))
        if self.common is not None:
            m = lookup([self.common], context, **kw)
            if m:
                out.append(Match(m.length, m.occurrences, m.continuations, "common"))
        return out

    def _reader_conn(self) -> sqlite3.Connection | None:
        """The shared read-only connection; call with ``_reader_lock`` held (the worker
        replaces it after rebuilding a damaged file)."""
        if self._reader is None and self.db_path.exists():
            try:
                ino = os.stat(self.db_path).st_ino
                self._reader = connect(self.db_path, readonly=True)
                self._reader_ino = ino
            except (sqlite3.Error, OSError) as exc:
                log.warning("cannot open index for reading: %s", exc)
        return self._reader

    def snippets(self, path: str | Path, text: str, offset: int, *, limit: int = 3,
                 budget_ms: float = 40.0, window_lines: int = 30, max_similarity: float = 0.5,
                 max_lines: int = 20) -> list[snip.Snippet]:
        """Code from elsewhere in the repository that the cursor's surroundings resemble
        or use: definitions of names used just before the cursor first, then chunks by
        BM25.  Stops at ``budget_ms``; chunks too similar to the local window are dropped."""
        if not self.ready.is_set() or self.failed:
            return []
        deadline = time.perf_counter() + budget_ms / 1000
        key = self.key_of(path)
        before = text[:offset].splitlines()[-window_lines:]
        after = text[offset:].splitlines()[:10]
        window = "\n".join(before + after)
        local = set(snip.identifiers(window))
        out: list[snip.Snippet] = []
        with self._reader_lock:
            conn = self._reader_conn()
            if conn is None:
                return []
            conn.set_progress_handler(lambda: int(time.perf_counter() > deadline), 2000)
            try:
                self._definition_snippets(conn, key, text, "\n".join(before[-8:]), local, out,
                                          limit, max_lines, max_similarity)
                if len(out) < limit:
                    self._similar_snippets(conn, key, window, local, out, limit, max_lines, max_similarity)
            except sqlite3.Error as exc:
                if "interrupted" not in str(exc):
                    self._reader_failed(exc, "snippet search")
            finally:
                conn.set_progress_handler(None, 0)
        return out[:limit]

    def defines(self, names: list[str]) -> set[str]:
        """Which of ``names`` this repository defines (files or open buffers)."""
        names = list(dict.fromkeys(names))[:64]
        found = {n for ov in list(self.overlays.values()) for n in (d.name for d in ov.defs) if n in names}
        if not names or not self.ready.is_set() or self.failed:
            return found
        marks = ",".join("?" * len(names))
        with self._reader_lock:
            conn = self._reader_conn()
            if conn is None:
                return found
            try:
                found |= {r[0] for r in conn.execute(f"SELECT DISTINCT name FROM defs WHERE name IN ({marks})", names)}
            except sqlite3.Error as exc:
                self._reader_failed(exc, "definition lookup")
        return found

    def _definition_snippets(self, conn, key, text, near, local, out, limit, max_lines, max_sim):
        defined_here = {d.name for d in snip.definitions(text, index_language(key))}
        names = [n for n in snip.used_names(near) if n not in defined_here][:12]
        if not names:
            return
        marks = ",".join("?" * len(names))
        rows = conn.execute(f"SELECT name, kind, path, line FROM defs WHERE name IN ({marks}) "
                            f"AND path != ? LIMIT 50", (*names, key)).fetchall()
        overlays = dict(self.overlays)  # the worker may change it meanwhile
        rows = [r for r in rows if r[2] not in overlays]
        for ov_key, ov in overlays.items():
            if ov_key != key:
                rows += [(d.name, d.kind, ov_key, d.line) for d in ov.defs if d.name in names]
        rank = {n: i for i, n in enumerate(names)}
        rows.sort(key=lambda r: rank[r[0]])
        seen = set()
        for name, _kind, path, line in rows:
            if len(out) >= limit or name in seen:
                continue
            body = self._lines(conn, path, line, max_lines)
            if body and snip.jaccard(set(snip.identifiers(body)), local) <= max_sim:
                seen.add(name)
                out.append(snip.Snippet(path, line, line + body.count("\n"), body, 1.0, f"definition of {name}"))

    def _chunk_count(self, conn) -> int:
        """Chunks in the table, re-counted at most every 30 seconds."""
        now = time.monotonic()
        if now - self._chunks_at > 30.0:
            self._chunks_n = conn.execute("SELECT count(*) FROM chunks").fetchone()[0]
            self._chunks_at = now
        return self._chunks_n

    def _lines(self, conn, path: str, line: int, max_lines: int) -> str:
        ov = self.overlays.get(path)
        if ov is not None:
            return "".join(ov.text.splitlines(keepends=True)[line:line + max_lines])
        file = conn.execute("SELECT rowid FROM files WHERE path = ?", (path,)).fetchone()
        if file is None:
            return ""
        base = file[0] << CHUNK_BITS  # a file's chunks: a rowid range (no FTS column scan)
        row = conn.execute("SELECT start_line, text FROM chunks WHERE rowid >= ? AND rowid < ? "
                           "AND start_line <= ? AND end_line > ? ORDER BY rowid DESC LIMIT 1",
                           (base, base + (1 << CHUNK_BITS), line, line)).fetchone()
        if not row:
            return ""
        lines = row[1].splitlines(keepends=True)
        return "".join(lines[line - row[0]:line - row[0] + max_lines])

    def _similar_snippets(self, conn, key, window, local, out, limit, max_lines, max_sim):
        words = list(dict.fromkeys(w.lower() for w in snip.identifiers(window)))[:200]
        if not words:
            return
        marks = ",".join("?" * len(words))
        df = dict(conn.execute(f"SELECT term, doc FROM chunks_vocab WHERE term IN ({marks})", words))
        n_chunks = self._chunk_count(conn)
        # The rarest words that occur at all, none in more than 5% of chunks (when every
        # word is that common, the two rarest).
        present = sorted((w for w in words if df.get(w, 0) > 0), key=lambda w: df[w])
        rare = [w for w in present if df[w] <= max(2, 0.05 * n_chunks)] or present[:2]
        query = snip.fts_query(rare[:snip.QUERY_TERMS])
        rows = []
        if query:
            rows = conn.execute("SELECT path, start_line, end_line, text, bm25(chunks) FROM chunks "
                                "WHERE chunks MATCH ? AND path != ? ORDER BY bm25(chunks) LIMIT 30",
                                (query, key)).fetchall()
        overlays = dict(self.overlays)  # the worker may change it meanwhile
        rows = [r for r in rows if r[0] not in overlays]
        for ov_key, ov in overlays.items():  # open buffers: scored by shared identifiers
            if ov_key == key:
                continue
            for ch, words in zip(ov.chunks, ov.words):
                shared = len(words & local)
                if shared:
                    rows.append((ov_key, ch.start_line, ch.end_line, ch.text, -float(shared)))
        rows.sort(key=lambda r: r[4])
        taken = {(s.path, s.start_line) for s in out}
        for path, start, end, body, score in rows:
            if len(out) >= limit:
                break
            if any(p == path and abs(s - start) < snip.CHUNK_LINES for p, s in taken):
                continue  # overlapping windows of one place
            words = set(snip.identifiers(body))
            if snip.jaccard(words, local) > max_sim:
                continue
            body = "".join(body.splitlines(keepends=True)[:max_lines])
            taken.add((path, start))
            out.append(snip.Snippet(path, start, min(end, start + max_lines), body, -score, "similar"))

    # -- stats -------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.stats_
        out = {"root": str(self.root), "db": str(self.db_path), "ready": self.ready.is_set(),
               "failed": self.failed, "tokenizer": self.tokenizer.id if self.tokenizer else None,
               "overlays": len(self.overlays), "files_indexed": s.files_indexed,
               "files_unchanged": s.files_unchanged, "files_removed": s.files_removed,
               "files_skipped": s.files_skipped, "skipped": dict(s.skipped), "reconciles": s.reconciles,
               "events": s.events, "client_events": s.client_events,
               "last_reconcile_ms": round(s.last_reconcile_ms, 2), "scan_seconds": round(s.scan_seconds, 3),
               "tokens_seconds": round(s.tokens_seconds, 3), "errors": s.errors, "rebuilds": s.rebuilds,
               "yields": s.yields, "yield_ms": round(s.yield_ms, 1), "capped": self.capped,
               "draft_tokens_left_out": self.draft_tokens_left_out,
               "rebuilt_from": self.store.rebuilt if self.store else None}
        if self.drafts is not None:
            out["drafts"] = dict(self.drafts.stats(), source=self.drafts_source)
        if self.common is not None:
            out["common_tokens"] = self.common.tokens
        return out

    def counts(self) -> dict:
        """Row counts from a fresh read-only connection (safe from any thread)."""
        conn = connect(self.db_path, readonly=True)
        try:
            return store_counts(conn)
        finally:
            conn.close()

