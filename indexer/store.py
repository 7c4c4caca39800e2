"""The SQLite datastore (through sqlite-utils): files, token ids, chunks, definitions.

One writer connection (the indexer's worker thread) and short-lived reader connections;
WAL, so readers never wait for the writer.  The schema has a version (``user_version``)
and ordered migrations; the database carries an ``application_id`` so a foreign or
corrupt file is recognised: it is moved aside (``*.corrupt-<time>``), logged, and a new
index is built, never silently used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path

import sqlite_utils

log = logging.getLogger(__name__)

APPLICATION_ID = 0x43434458  # "CCDX"
SCHEMA_VERSION = 2
CHUNK_BITS = 20


def _v1(db: sqlite_utils.Database) -> None:
    db["meta"].create({"key": str, "value": str}, pk="key")
    db["files"].create({"path": str, "hash": str, "size": int, "mtime_ns": int, "language": str,
                        "indexed_at": float, "tokens": int}, pk="path")
    db["tokens"].create({"path": str, "tokenizer": str, "hash": str, "ids": bytes},
                        pk=("path", "tokenizer"))
    db["defs"].create({"name": str, "kind": str, "path": str, "line": int})
    db["defs"].create_index(["name"])
    db["defs"].create_index(["path"])
    # A chunk's rowid is (its file's rowid << CHUNK_BITS) + its index, so a file's chunks
    # are deleted by a rowid range (an FTS5 column filter would scan the whole table).
    db.execute("CREATE VIRTUAL TABLE chunks USING fts5(path UNINDEXED, start_line UNINDEXED, "
               "end_line UNINDEXED, text, tokenize = \"unicode61 tokenchars '_'\")")


def _v2(db: sqlite_utils.Database) -> None:
    # Document frequency of each FTS term: snippet queries keep only the rarer words
    # (an OR of common identifiers made bm25 rank a large part of the table).
    db.execute("CREATE VIRTUAL TABLE chunks_vocab USING fts5vocab(chunks, 'row')")


MIGRATIONS = [(1, _v1), (2, _v2)]  # (version it brings the schema to, function), in order


class CorruptIndex(RuntimeError):
    pass


def is_corrupt(exc: BaseException) -> bool:
    """Whether an error says the database file is damaged or no longer a database (SQLite's
    CORRUPT and NOTADB), as opposed to a busy database, a full disk or an I/O error."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
    text = str(exc)
    return not isinstance(exc, sqlite3.OperationalError) and ("malformed" in text or "not a database" in text)


def connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=5)
    else:
        conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def _check(conn: sqlite3.Connection) -> int:
    """The schema version of a healthy database of ours (0: empty); raise otherwise."""
    try:
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise CorruptIndex(f"not a database: {exc}") from exc
    if tables == 0 and app == 0:
        return 0
    if app != APPLICATION_ID:
        raise CorruptIndex(f"foreign database (application_id {app:#x})")
    if version > SCHEMA_VERSION:
        raise CorruptIndex(f"schema version {version} is newer than this daemon's {SCHEMA_VERSION}")
    try:
        result = conn.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise CorruptIndex(f"integrity check failed: {exc}") from exc
    if result != "ok":
        raise CorruptIndex(f"integrity check: {result}")
    return version


def _move_aside(path: Path, reason: str) -> Path:
    aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    for old in path.parent.glob(f"{path.name}.corrupt-*"):  # keep only the newest copy
        old.unlink(missing_ok=True)
    path.rename(aside)
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    log.error("index %s is unusable (%s); moved to %s and rebuilding", path, reason, aside.name)
    return aside


@contextlib.contextmanager
def _opening_lock(path: Path):
    """Held while a process checks, migrates or moves aside the database: two daemons on
    one repository (two editor windows) share its index, and without it the second could
    find a half-made schema, take it for a corrupt file and move the first one's aside."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here; one daemon per repository
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def open_store(path: Path) -> "Store":
    """Open (creating, migrating, or rebuilding) the datastore at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _opening_lock(path):
        return _open_store(path)


def _open_store(path: Path) -> "Store":
    rebuilt = None
    for attempt in range(2):
        conn = connect(path)
        try:
            version = _check(conn)
            conn.execute("PRAGMA journal_mode = WAL")
            store = Store(path, conn, version)
            store.rebuilt = rebuilt
            return store
        except (CorruptIndex, sqlite3.DatabaseError) as exc:
            conn.close()
            if attempt:
                raise
            rebuilt = str(exc)
            _move_aside(path, rebuilt)
    raise AssertionError("unreachable")


def rebuild_store(path: Path, reason: str, ino: int | None) -> "Store":
    """A new, empty datastore in place of one found damaged while in use (``ino``: the inode of
    the file the caller had open).  The damaged file is moved aside as at a start that finds it
    so, unless another daemon sharing the index has already done that (the file at ``path`` is
    then not the one the caller opened, and is opened as it is)."""
    with _opening_lock(path):
        try:
            same = os.stat(path).st_ino == ino
        except FileNotFoundError:
            same = False
        if same:
            _move_aside(path, reason)
        store = _open_store(path)
        store.rebuilt = store.rebuilt or reason
        return store


class Store:
    def __init__(self, path: Path, conn: sqlite3.Connection, version: int):
        self.path = path
        self.conn = conn
        self.db = sqlite_utils.Database(conn)
        self.rebuilt: str | None = None
        self.ino = os.stat(path).st_ino  # the file's inode when opened (rebuild_store)
        conn.execute("PRAGMA synchronous = NORMAL")
        self._migrate(version)

    def _migrate(self, version: int) -> None:
        for target, fn in MIGRATIONS:
            if target <= version:
                continue
            with self.conn:
                fn(self.db)
                self.conn.execute(f"PRAGMA user_version = {target}")
                self.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            log.info("index schema migrated to version %d", target)

    # -- meta -------------------------------------------------------------------------
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: str) -> None:
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # -- files ------------------------------------------------------------------------
    def file_states(self) -> dict[str, tuple[int, int, str]]:
        """path -> (size, mtime_ns, hash) of every indexed file."""
        return {p: (s, m, h) for p, s, m, h in
                self.conn.execute("SELECT path, size, mtime_ns, hash FROM files")}

    def states_for(self, paths: list[str]) -> dict[str, tuple[int, int, str]]:
        """Like ``file_states`` for some paths and everything under them (a folder)."""
        out = {}
        c = self.conn
        for path in paths:
            for p, size, mtime, h in c.execute(
                    "SELECT path, size, mtime_ns, hash FROM files WHERE path = ? OR "
                    "(path >= ? AND path < ?)", (path, path + "/", path + "0")):
                out[p] = (size, mtime, h)
        return out

    def write_batch(self, upserts: list[dict], removed: list[str], tokenizer: str | None) -> None:
        """One transaction: replace rows of changed files, delete removed ones.

        An upsert is {path, hash, size, mtime_ns, language, chunks, defs, ids?}; with
        ``content`` None only the stat is refreshed (same hash)."""
        c = self.conn
        now = time.time()
        # IMMEDIATE: the write lock before the first read, so that another daemon's rows
        # for the same paths (two windows on one repository) are seen and replaced, not
        # inserted twice (a UNIQUE failure that ended indexing)
        c.execute("BEGIN IMMEDIATE")
        with c:
            for path in removed:
                self._delete(path)
            for f in upserts:
                if f.get("touch_only"):
                    c.execute("UPDATE files SET size = ?, mtime_ns = ? WHERE path = ?",
                              (f["size"], f["mtime_ns"], f["path"]))
                    continue
                self._delete(f["path"])
                ids = f.get("ids")
                cur = c.execute("INSERT INTO files (path, hash, size, mtime_ns, language, indexed_at, tokens) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                                (f["path"], f["hash"], f["size"], f["mtime_ns"], f["language"], now,
                                 None if ids is None else len(ids) // 4))
                base = cur.lastrowid << CHUNK_BITS
                if ids is not None and tokenizer:
                    c.execute("INSERT INTO tokens (path, tokenizer, hash, ids) VALUES (?, ?, ?, ?)",
                              (f["path"], tokenizer, f["hash"], ids))
                c.executemany("INSERT INTO chunks (rowid, path, start_line, end_line, text) VALUES (?, ?, ?, ?, ?)",
                              [(base + i, f["path"], ch.start_line, ch.end_line, ch.text)
                               for i, ch in enumerate(f["chunks"][:(1 << CHUNK_BITS) - 1])])
                c.executemany("INSERT INTO defs (name, kind, path, line) VALUES (?, ?, ?, ?)",
                              [(d.name, d.kind, f["path"], d.line) for d in f["defs"]])

    def write_tokens(self, rows: list[tuple[str, str, str, bytes]]) -> None:
        """(path, tokenizer, hash, ids) rows for files whose text did not change."""
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO tokens (path, tokenizer, hash, ids) "
                                  "VALUES (?, ?, ?, ?)", rows)
            self.conn.executemany("UPDATE files SET tokens = ? WHERE path = ?",
                                  [(len(r[3]) // 4, r[0]) for r in rows])

    def _delete(self, path: str) -> None:
        c = self.conn
        row = c.execute("SELECT rowid FROM files WHERE path = ?", (path,)).fetchone()
        if row is None:
            return
        base = row[0] << CHUNK_BITS
        c.execute("DELETE FROM chunks WHERE rowid >= ? AND rowid < ?", (base, base + (1 << CHUNK_BITS)))
        c.execute("DELETE FROM files WHERE path = ?", (path,))
        c.execute("DELETE FROM tokens WHERE path = ?", (path,))
        c.execute("DELETE FROM defs WHERE path = ?", (path,))

    def drop_other_tokenizers(self, tokenizer: str) -> int:
        with self.conn:
            return self.conn.execute("DELETE FROM tokens WHERE tokenizer != ?", (tokenizer,)).rowcount

    def missing_tokens(self, tokenizer: str) -> list[tuple[str, str]]:
        """(path, hash) of files without token ids for this tokenizer (or stale ones)."""
        return list(self.conn.execute(
            "SELECT f.path, f.hash FROM files f LEFT JOIN tokens t ON t.path = f.path AND "
            "t.tokenizer = ? AND t.hash = f.hash WHERE t.path IS NULL", (tokenizer,)))

    def all_tokens(self, tokenizer: str):
        """(path, ids bytes) of every file with token ids for this tokenizer."""
        return self.conn.execute(
            "SELECT t.path, t.ids FROM tokens t JOIN files f ON f.path = t.path AND f.hash = t.hash "
            "WHERE t.tokenizer = ?", (tokenizer,))

    def counts(self) -> dict:
        return counts(self.conn)

    def damage(self) -> str | None:
        """Why this open database is no longer a healthy index of ours, or None: for an error
        path (it runs SQLite's quick_check).  A lost write-ahead log leaves a file without
        tables, which is not corruption to SQLite but is to the index."""
        try:
            version = _check(self.conn)
        except (CorruptIndex, sqlite3.DatabaseError) as exc:
            cause = exc.__cause__ if isinstance(exc, CorruptIndex) else exc
            if isinstance(cause, sqlite3.OperationalError) and not is_corrupt(cause):
                return None  # busy, locked, an I/O error: no verdict on the file
            return str(exc)
        return None if version == SCHEMA_VERSION else f"its tables are gone (schema version {version})"

    def close(self) -> None:
        try:
            self.conn.close()
        except sqlite3.Error:
            pass


def counts(c: sqlite3.Connection) -> dict:
    """Rows and sizes of an index, through any connection (a read-only one included)."""
    files, size = c.execute("SELECT count(*), coalesce(sum(size), 0) FROM files").fetchone()
    tokens = c.execute("SELECT coalesce(sum(length(ids)) / 4, 0) FROM tokens").fetchone()[0]
    return {"files": files, "bytes": size, "tokens": tokens,
            "chunks": c.execute("SELECT count(*) FROM chunks").fetchone()[0],
            "definitions": c.execute("SELECT count(*) FROM defs").fetchone()[0]}
