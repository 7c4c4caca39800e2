"""The repository index: scan rules, the SQLite datastore, suffix retrieval, snippets,
and the watcher with a real watchdog observer on a temporary repository."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from codecomplete.indexer import snippets as snip
from codecomplete.indexer.index import RepoIndex
from codecomplete.indexer.scan import Rules, walk
from codecomplete.indexer.store import APPLICATION_ID, open_store
from codecomplete.indexer.suffix import DraftIndex, Segment, lookup
from codecomplete.indexer.tokens import TokenizerInfo


def paths(root: Path, **kw) -> set[str]:
    return {e.path for e in walk(Rules(root, **kw))}


def write(root: Path, rel: str, text: str | bytes) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write(root, "src/app.py", "def main():\n    return 1\n")
    write(root, "src/gen/out.py", "x = 1\n")
    write(root, "src/gen/keep.py", "y = 2\n")
    write(root, "src/.gitignore", "gen/*\n!gen/keep.py\n")
    write(root, ".gitignore", "*.log\nsecret/\n")
    write(root, "debug.log", "noise\n")
    write(root, "secret/key.py", "KEY = 1\n")
    write(root, "node_modules/lib/index.js", "module.exports = 1\n")
    write(root, "env/pyvenv.cfg", "home = /usr\n")
    write(root, "env/lib/site.py", "import os\n")
    write(root, ".git/info/exclude", "local_only.py\n")
    write(root, ".git/HEAD", "ref: refs/heads/main\n")
    write(root, "local_only.py", "z = 3\n")
    write(root, "package-lock.json", "{}\n")
    write(root, "big.py", "a = 1\n" * 300)
    return root


def test_scan_honours_ignore_files_and_default_excludes(tree: Path):
    got = paths(tree)
    assert "src/app.py" in got and "src/gen/keep.py" in got and ".gitignore" in got
    for gone in ("src/gen/out.py", "debug.log", "secret/key.py", "node_modules/lib/index.js",
                 "env/lib/site.py", "local_only.py", ".git/HEAD", "package-lock.json"):
        assert gone not in got, gone
    assert "big.py" not in paths(tree, max_bytes=1000)  # size cap


def test_scan_symlinks_stay_inside_and_loops_end(tree: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    write(outside, "leak.py", "LEAK = 1\n")
    (tree / "out_link").symlink_to(outside, target_is_directory=True)
    (tree / "leak.py").symlink_to(outside / "leak.py")
    (tree / "src" / "loop").symlink_to(tree / "src", target_is_directory=True)
    (tree / "alias.py").symlink_to(tree / "src" / "app.py")
    got = paths(tree)
    assert not any(p.startswith("out_link/") for p in got) and "leak.py" not in got
    assert "alias.py" in got  # a link that stays inside the repository
    assert [p for p in got if p.endswith("app.py")] == ["src/app.py"]  # the loop is walked once


def test_scan_skips_unreadable_folders(tree: Path, monkeypatch):
    real = os.scandir

    def scandir(path):
        if str(path).endswith("src"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    got = paths(tree)
    assert "big.py" in got and not any(p.startswith("src/") for p in got)


def test_a_folder_we_may_not_enter_is_skipped_not_fatal(tmp_path: Path, monkeypatch):
    """A folder of another user with mode 700 (a Docker volume's data folder in a
    repository): its own stat works, anything inside raises EACCES.  pathlib's is_file
    (Python 3.11) raises on EACCES; it stopped the whole scan, so the repository got no
    index.  The scan and a reconcile of paths in there now skip it."""
    root = tmp_path / "repo"
    write(root, "app.py", "def main():\n    return 1\n")
    write(root, "pgdata/base/1.py", "x = 1\n")
    locked = str(root / "pgdata")
    real_stat, real_scandir = os.stat, os.scandir

    def stat(path, *a, **kw):
        if str(path).startswith(locked + os.sep):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *a, **kw)

    def scandir(path="."):
        if str(path).startswith(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "scandir", scandir)
    idx = RepoIndex(root, tmp_path / "idx", watch=False).start()
    try:
        assert idx.ready.wait(30) and not idx.failed
        assert idx.notify(root / "pgdata" / "base" / "1.py") and idx.notify(root / "pgdata")
        assert idx.wait_idle()
        assert idx.counts()["files"] == 1 and idx.stats()["errors"] == 0
    finally:
        idx.close()


def test_corrupt_and_foreign_databases_are_moved_aside_and_rebuilt(tmp_path: Path):
    db = tmp_path / "index.sqlite"
    db.write_bytes(b"this is not sqlite" * 100)
    store = open_store(db)
    assert store.rebuilt and "not a database" in store.rebuilt
    assert store.conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    store.close()
    assert list(tmp_path.glob("index.sqlite.corrupt-*"))

    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    store = open_store(foreign)
    assert store.rebuilt and "foreign" in store.rebuilt
    assert store.counts()["files"] == 0
    store.close()


def _damage_under_a_running_index(idx: RepoIndex, db: Path, how: str) -> None:
    """Scribble over the open database as a failing disk or another program would: the pages
    of a checkpointed file ("pages"), or its write-ahead log and its index ("wal")."""
    if how == "pages":
        conn = sqlite3.connect(db)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        targets, start = [db], 4096
    else:
        targets, start = [Path(str(db) + "-wal"), Path(str(db) + "-shm")], 32
    for p in targets:
        data = bytearray(p.read_bytes())
        assert len(data) > start
        for off in range(start, len(data), 1024):
            data[off:off + 200] = os.urandom(len(data[off:off + 200]))
        p.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["pages", "wal"])
def test_a_database_damaged_while_running_is_rebuilt_and_indexing_goes_on(tmp_path: Path, how: str):
    root = tmp_path / "repo"
    for i in range(60):
        write(root, f"m{i}.py", f"def f{i}(x):\n    return x * {i}\n" * 20)
    write(root, "shipping.py", "def compute_shipping_cost(order, region):\n    return order.weight * RATES[region]\n")
    idx = RepoIndex(root, tmp_path / "idx", watch=False).start()
    try:
        assert idx.ready.wait(30) and not idx.failed
        _damage_under_a_running_index(idx, tmp_path / "idx" / "index.sqlite", how)
        write(root, "fresh.py", "def brand_new(a):\n    return a\n")
        write(root, "m0.py", "VALUE = 1\n")
        assert idx.notify(root / "fresh.py") and idx.notify(root / "m0.py")
        assert idx.wait_idle()
        stats = idx.stats()
        assert stats["rebuilds"] == 1 and stats["rebuilt_from"]
        assert len(list((tmp_path / "idx").glob("index.sqlite.corrupt-*"))) == 1
        assert idx.counts()["files"] == 62  # every file again, from the disk
        assert idx.defines(["brand_new", "f0", "f7", "nowhere"]) == {"brand_new", "f7"}
        write(root, "later.py", "def later_one():\n    pass\n")  # later changes as before
        assert idx.notify(root / "later.py") and idx.wait_idle()
        assert "later_one" in idx.defines(["later_one"]) and idx.stats()["rebuilds"] == 1
        here = "from shipping import compute_shipping_cost\n\ntotal = compute_shipping_cost("
        got = idx.snippets(root / "m3.py", here, len(here))
        assert got and got[0].path == "shipping.py" and "order.weight" in got[0].text
    finally:
        idx.close()


def test_a_reader_that_finds_the_file_damaged_has_it_rebuilt_once(tmp_path: Path):
    root = tmp_path / "repo"
    for i in range(60):
        write(root, f"m{i}.py", f"def f{i}(x):\n    return x * {i}\n" * 20)
    idx = RepoIndex(root, tmp_path / "idx", watch=False).start()
    try:
        assert idx.ready.wait(30) and idx.wait_idle()
        damaged = idx.store.ino
        _damage_under_a_running_index(idx, tmp_path / "idx" / "index.sqlite", "pages")
        # no file changes: only the completion path's queries see the damage; they answer
        # without the index's help (no exception) and report it
        for _ in range(3):
            idx.defines(["f1", "f2"])
        assert idx.wait_idle()
        assert idx.stats()["rebuilds"] == 1 and idx.store.ino != damaged
        assert idx.defines(["f1", "f2", "nowhere"]) == {"f1", "f2"}
        idx._put("corrupt", (damaged, "a late report about the old file"))  # stale: ignored
        assert idx.wait_idle() and idx.stats()["rebuilds"] == 1
    finally:
        idx.close()


def test_damage_is_told_apart_from_a_healthy_store(tmp_path: Path):
    store = open_store(tmp_path / "index.sqlite")
    try:
        assert store.damage() is None
        store.conn.execute("PRAGMA application_id = 7")  # someone else's database now
        assert "foreign" in store.damage()
        store.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        assert store.damage() is None
        # what a lost write-ahead log leaves: a file with no tables, no application id, no version
        for name in ("chunks_vocab", "chunks", "defs", "tokens", "files", "meta"):  # the FTS tables go with chunks
            store.conn.execute(f"DROP TABLE [{name}]")
        store.conn.execute("PRAGMA application_id = 0")
        store.conn.execute("PRAGMA user_version = 0")
        assert store.conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
        assert "tables are gone" in store.damage()
    finally:
        store.close()


def test_a_busy_database_is_not_taken_for_a_damaged_one(tmp_path: Path, monkeypatch):
    from codecomplete.indexer import store as st

    store = open_store(tmp_path / "index.sqlite")
    try:
        def locked(conn):  # what _check raises when the file cannot be read just now
            raise st.CorruptIndex("not a database: database is locked") from sqlite3.OperationalError(
                "database is locked")
        monkeypatch.setattr(st, "_check", locked)
        assert store.damage() is None
        malformed = sqlite3.DatabaseError("database disk image is malformed")
        malformed.sqlite_errorcode = 11  # SQLITE_CORRUPT

        def corrupt(conn):
            raise st.CorruptIndex("integrity check failed") from malformed
        monkeypatch.setattr(st, "_check", corrupt)
        assert store.damage() == "integrity check failed"
    finally:
        store.close()


def test_migrations_bring_an_old_schema_up_to_date(tmp_path: Path):
    import sqlite_utils

    from codecomplete.indexer import store as st

    db = tmp_path / "v1.sqlite"
    conn = sqlite3.connect(db)
    st._v1(sqlite_utils.Database(conn))
    conn.execute("INSERT INTO files (path, hash, size, mtime_ns, language, indexed_at, tokens) "
                 "VALUES ('a.py', 'h', 1, 1, 'python', 0, 0)")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    store = open_store(db)
    assert store.rebuilt is None and store.counts()["files"] == 1  # kept, not rebuilt
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == st.SCHEMA_VERSION
    assert store.conn.execute("SELECT count(*) FROM chunks_vocab").fetchone()[0] == 0
    store.close()


def test_corrupt_page_is_detected(tmp_path: Path):
    root = tmp_path / "repo"
    for i in range(200):
        write(root, f"m{i}.py", f"def f{i}(x):\n    return x * {i}\n" * 20)
    idx = RepoIndex(root, tmp_path / "idx", watch=False)
    idx.build()
    idx.close()
    idx.store.close()
    db = tmp_path / "idx" / "index.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(db.read_bytes())
    for off in range(4096 * 3, len(data) - 4096, 4096 * 2):  # scribble over many pages
        data[off + 100:off + 400] = os.urandom(300)
    db.write_bytes(bytes(data))
    again = RepoIndex(root, tmp_path / "idx", watch=False)
    stats = again.build()
    assert stats["rebuilt_from"]
    assert again.counts()["files"] == 200
    again.close()


def brute(docs, ctx, min_len=2, draft_len=8):
    for length in range(min(16, len(ctx)), min_len - 1, -1):
        q = list(ctx[-length:])
        cont: dict = {}
        for _, ids in docs:
            ids = list(ids)
            for p in range(len(ids) - length + 1):
                if ids[p:p + length] == q:
                    c = tuple(ids[p + length:p + length + draft_len])
                    if c:
                        cont[c] = cont.get(c, 0) + 1
        if cont:
            return length, cont
    return None


def random_edit(index: DraftIndex, docs: dict, rng: random.Random, keys: int, vocab: int, max_len: int) -> None:
    """Remove, change or add one document, in the index and in ``docs`` alike."""
    key = f"f{rng.randrange(keys)}"
    if rng.random() < 0.2 and key in docs:
        del docs[key]
        index.remove(key)
    else:
        docs[key] = np.array([rng.randrange(vocab) for _ in range(rng.randrange(1, max_len))])
        index.update(key, docs[key])


def assert_brute(index: DraftIndex, docs: dict, ctx: list[int]) -> None:
    m = index.lookup(ctx, top_k=10**6, max_positions=10**9)
    expected = brute(list(docs.items()), ctx)
    if expected is None:
        assert m is None
    else:
        assert m is not None and m.length == expected[0]
        assert {c.tokens: c.count for c in m.continuations} == expected[1]


@pytest.mark.parametrize("width", [2, 4])
def test_suffix_lookup_equals_brute_force_through_updates(width: int):
    rng = random.Random(width)
    docs = {f"f{i}": np.array([rng.randrange(12) for _ in range(rng.randrange(0, 120))]) for i in range(30)}
    index = DraftIndex.from_documents(list(docs.items()), width, delta_min_tokens=300, max_small=3,
                                      background=False)
    for step in range(150):
        if step % 3 == 0:
            random_edit(index, docs, rng, 40, 12, 80)
        assert_brute(index, docs, [rng.randrange(12) for _ in range(rng.randrange(1, 24))])
    assert index.stats()["documents"] == len(docs)


@pytest.mark.parametrize("segments", [1, 3])
def test_a_small_top_k_is_the_full_counts_most_common(segments: int):
    """Guards the shortcut that builds only the top continuations of a single segment: the
    answer (order of ties included) must be what counting them all and keeping top_k gives."""
    rng = random.Random(segments)
    docs = {f"f{i}": np.array([rng.randrange(6) for _ in range(rng.randrange(20, 200))]) for i in range(40)}
    index = DraftIndex.from_documents(list(docs.items()), 2, max_small=8, delta_min_tokens=10**9, background=False)
    for i in range(segments - 1):  # small segments beside the base: counts add up across them
        index.update(f"f{i}", docs[f"f{i}"])
    assert len(index.segments()) == segments
    for _ in range(60):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
        full = index.lookup(ctx, top_k=10**6, draft_len=4)
        for k in (1, 2, 5):
            m = index.lookup(ctx, top_k=k, draft_len=4)
            assert (m is None) == (full is None)
            if m is not None:
                assert m.length == full.length and m.continuations == full.continuations[:k]


def test_background_compaction_keeps_updates_made_meanwhile():
    rng = random.Random(7)
    docs = {f"f{i}": np.array([rng.randrange(10) for _ in range(400)]) for i in range(200)}
    index = DraftIndex.from_documents(list(docs.items()), 2, delta_min_tokens=50, max_small=2)
    for _ in range(400):  # each update may start a compaction on its thread
        random_edit(index, docs, rng, 220, 10, 60)
    index.compact()  # waits for a running one
    assert index.compactions >= 1
    for _ in range(40):
        assert_brute(index, docs, [rng.randrange(10) for _ in range(rng.randrange(3, 12))])
    assert index.stats()["documents"] == len(docs)


def test_segment_saves_and_memory_maps(tmp_path: Path):
    rng = random.Random(1)
    docs = [(f"d{i}", np.array([rng.randrange(50000) for _ in range(200)])) for i in range(5)]
    seg = Segment.build(docs, 2)
    seg.save(tmp_path / "common", {"tokenizer": "t"})
    loaded, meta = Segment.load(tmp_path / "common")
    ctx = list(docs[3][1][50:60])
    a, b = lookup([seg], ctx), lookup([loaded], ctx)
    assert a == b and a.length == 10 and a.continuations[0].tokens == tuple(docs[3][1][60:68])
    assert meta["documents"] == 5


def test_chunks_definitions_and_similarity():
    text = "".join(f"line {i}\n" for i in range(50))
    cs = snip.chunks(text)
    assert "".join(c.text for c in cs) == text and cs[0].end_line == snip.CHUNK_LINES
    src = "class Box:\n    def open(self):\n        pass\n\nasync def fetch(url):\n    pass\n"
    assert [(d.name, d.kind, d.line) for d in snip.definitions(src, "python")] == [
        ("Box", "class", 0), ("open", "def", 1), ("fetch", "def", 4)]
    go = "package x\n\nfunc (s *Server) Serve(addr string) error {\n}\ntype Config struct{}\n"
    assert [d.name for d in snip.definitions(go, "go")] == ["Serve", "Config"]
    assert snip.jaccard({"a", "b"}, {"a", "b"}) == 1.0 and snip.jaccard(set(), {"a"}) == 0.0


def test_c_definitions_in_whole_and_half_written_files():
    """Guards the C pattern's bounded repeats: multi-line parameters and function
    pointers are still found, and a half-written file (calls left open, a 100 kB line)
    gives the definitions it has."""
    src = ("static int\nfoo(int a,\n    int b)\n{\n  return a;\n}\n"
           "unsigned long long *bar(void (*cb)(int), char *s) {\n}\n"
           "int main(int argc, char **argv)\n{\n  if (argc) {\n  }\n")
    assert [(d.name, d.line) for d in snip.definitions(src, "c")] == [("foo", 1), ("bar", 6), ("main", 8)]
    half = "call(\n" * 3000 + "x" * 100_000 + " y(\n" + src
    assert [d.name for d in snip.definitions(half, "c")] == ["foo", "bar", "main"]


@pytest.fixture
def tokenizer(tiny_model: Path) -> TokenizerInfo:
    return TokenizerInfo.from_file(tiny_model / "tokenizer.json")


UNIQUE = "def zebra_quokka_handler(request):\n    payload = request.json()\n    return respond(payload)\n"


def drafts_after(idx: RepoIndex, tokenizer: TokenizerInfo, text: str, prefix: str) -> list[str]:
    """Continuations the draft index offers after ``prefix`` of ``text``."""
    ids = tokenizer.encode(text).tolist()
    n = len(tokenizer.encode(prefix))
    out = []
    for m in idx.lookup(ids[:n], draft_len=6, min_len=min(n, 8)):  # long matches only
        out += [tokenizer.backend.decode(list(c.tokens)) for c in m.continuations]
    return out


def indexed(idx: RepoIndex, rel: str) -> bool:
    row = idx.store.conn.execute("SELECT 1 FROM files WHERE path = ?", (rel,)).fetchone()
    return row is not None


def test_watcher_follows_edits_with_a_real_observer(tmp_path: Path, tokenizer: TokenizerInfo):
    root = tmp_path / "repo"
    write(root, "a.py", "import os\n")
    write(root, ".gitignore", "ignored/\n")
    idx = RepoIndex(root, tmp_path / "idx", tokenizer=tokenizer, debounce_ms=30).start()
    try:
        assert idx.tokens_ready.wait(30)
        assert wait_for(lambda: idx._observer is not None)
        # create
        write(root, "pkg/new.py", UNIQUE)
        assert wait_for(lambda: idx.drafts is not None and "pkg/new.py" in idx.drafts)
        assert any(d.startswith(" request") or "request" in d
                   for d in drafts_after(idx, tokenizer, UNIQUE, "def zebra_quokka_handler("))
        # modify in place
        write(root, "a.py", "import os\nimport sys\n")
        assert wait_for(lambda: idx.store.conn.execute(
            "SELECT size FROM files WHERE path = 'a.py'").fetchone()[0] == len("import os\nimport sys\n"))
        # an editor's atomic save: write a temporary file, then move it onto the real path
        tmp = root / "pkg" / ".new.py.swp"
        tmp.write_text(UNIQUE.replace("zebra_quokka_handler", "yak_otter_handler"))
        os.replace(tmp, root / "pkg" / "new.py")
        assert wait_for(lambda: drafts_after(idx, tokenizer, UNIQUE.replace("zebra_quokka", "yak_otter"),
                                             "def yak_otter_handler("))
        assert wait_for(lambda: not drafts_after(idx, tokenizer, UNIQUE, "def zebra_quokka_handler("))
        assert not indexed(idx, "pkg/.new.py.swp")
        # rename
        os.rename(root / "pkg" / "new.py", root / "pkg" / "renamed.py")
        assert wait_for(lambda: indexed(idx, "pkg/renamed.py") and not indexed(idx, "pkg/new.py"))
        # gitignored and binary files stay out
        write(root, "ignored/x.py", "x = 1\n")
        write(root, "blob.py", b"\x00\x01\x02binary")
        write(root, "b.py", "b = 1\n")
        assert wait_for(lambda: indexed(idx, "b.py"))
        assert idx.wait_idle()
        assert not indexed(idx, "ignored/x.py") and not indexed(idx, "blob.py")
        # a symlink loop appears: the folder is indexed once, the worker keeps going
        write(root, "cyc/inner.py", "inner = 1\n")
        (root / "cyc" / "again").symlink_to(root / "cyc", target_is_directory=True)
        idx.notify("cyc")
        assert wait_for(lambda: indexed(idx, "cyc/inner.py"))
        assert idx.wait_idle()
        assert idx.store.conn.execute("SELECT count(*) FROM files WHERE path LIKE 'cyc/%'").fetchone()[0] == 1
        # delete a file, then a whole folder
        (root / "b.py").unlink()
        assert wait_for(lambda: not indexed(idx, "b.py"))
        import shutil
        shutil.rmtree(root / "pkg")
        assert wait_for(lambda: not indexed(idx, "pkg/renamed.py"))
        assert wait_for(lambda: "pkg/renamed.py" not in idx.drafts)
        assert idx.stats()["errors"] == 0
    finally:
        idx.close()


def test_branch_switch_reconciles_in_a_few_batches(tmp_path: Path):
    root = tmp_path / "repo"
    write(root, "seed.py", "x = 1\n")
    idx = RepoIndex(root, tmp_path / "idx", debounce_ms=200).start()
    try:
        assert idx.ready.wait(30)
        assert wait_for(lambda: idx._observer is not None)
        before = idx.stats()["reconciles"]
        for i in range(1000):  # what a checkout does: a burst of writes
            write(root, f"mod{i // 100}/f{i}.py", f"value_{i} = {i}\n")
        assert wait_for(lambda: idx.counts()["files"] == 1001, timeout=60)
        assert idx.wait_idle()
        stats = idx.stats()
        assert stats["events"] >= 1000
        assert stats["reconciles"] - before <= 5, stats  # one or a few, never one per file
    finally:
        idx.close()


def test_open_buffer_overlays_the_disk(tmp_path: Path, tokenizer: TokenizerInfo):
    root = tmp_path / "repo"
    write(root, "lib.py", "def old_name():\n    pass\n")
    write(root, "main.py", "import lib\n")
    idx = RepoIndex(root, tmp_path / "idx", tokenizer=tokenizer, watch=False).start()
    try:
        assert idx.tokens_ready.wait(30)
        unsaved = "def compute_shipping_cost(order, region):\n    rate = RATES[region]\n    return order.weight * rate\n"
        idx.overlay(root / "lib.py", unsaved)
        assert idx.wait_idle()
        # snippets see the buffer, not the disk
        here = "from lib import compute_shipping_cost\n\ntotal = compute_shipping_cost("
        got = idx.snippets(root / "main.py", here, len(here))
        assert got and got[0].path == "lib.py" and "order.weight * rate" in got[0].text
        assert got[0].reason == "definition of compute_shipping_cost"
        assert drafts_after(idx, tokenizer, unsaved, "def compute_shipping_cost(")
        # closing the buffer falls back to the disk
        idx.close_overlay(root / "lib.py")
        assert idx.wait_idle()
        assert not drafts_after(idx, tokenizer, unsaved, "def compute_shipping_cost(")
        assert not idx.snippets(root / "main.py", here, len(here))
    finally:
        idx.close()


def test_a_costly_buffer_is_reread_at_most_a_share_of_the_time_and_ends_current(tmp_path: Path, monkeypatch):
    """Guards typing in a 1 MB buffer: re-reading it (0.5 s) on every keystroke would keep a
    core busy beside the engine.  While texts keep coming the worker spends about a quarter
    of its time on them (it was all of it); the newest is applied once its turn comes,
    wait_idle waits for it, and a buffer closed meanwhile is not applied afterwards."""
    root = tmp_path / "repo"
    write(root, "a.py", "a = 1\n")
    idx = RepoIndex(root, tmp_path / "idx", watch=False, debounce_ms=1, max_delay_ms=1)
    applied: list[tuple[str, float, float]] = []
    real = idx._set_overlay

    def slow(key, text):
        t0 = time.monotonic()
        time.sleep(0.05)
        real(key, text)
        applied.append((text, t0, time.monotonic()))

    monkeypatch.setattr(idx, "_set_overlay", slow)
    idx.start()
    try:
        assert idx.ready.wait(10)
        texts = [f"x = {i}\n" for i in range(60)]
        for text in texts:
            idx.overlay(root / "a.py", text)
            time.sleep(0.01)
        assert idx.wait_idle()
        assert applied[-1][0] == texts[-1] and idx.overlays["a.py"].text == texts[-1]
        busy = sum(end - start for _, start, end in applied[:-1])
        span = applied[-1][1] - applied[0][1]
        assert len(applied) >= 3 and busy / span < 0.5, (len(applied), busy, span)
        # a buffer closed while a text of it is held back stays closed
        idx.overlay(root / "a.py", "y = 1\n")
        idx.overlay(root / "a.py", "y = 2\n")
        time.sleep(0.002)
        idx.overlay(root / "a.py", "y = 3\n")
        idx.close_overlay(root / "a.py")
        assert idx.wait_idle()
        time.sleep(0.3)
        assert "a.py" not in idx.overlays
    finally:
        idx.close()


def test_restart_maps_the_saved_draft_index_and_applies_changes(tmp_path: Path, tokenizer: TokenizerInfo):
    root = tmp_path / "repo"
    for i in range(10):
        write(root, f"m{i}.py", f"def handler_{i}(request):\n    return request.get('key_{i}')\n")
    write(root, "gone.py", UNIQUE)
    first = RepoIndex(root, tmp_path / "idx", tokenizer=tokenizer, watch=False)
    first.build()
    assert first.stats()["drafts"]["source"] == "built"
    first.close()
    (root / "gone.py").unlink()  # while the daemon is not running
    write(root, "m3.py", UNIQUE.replace("zebra_quokka", "yak_otter"))
    again = RepoIndex(root, tmp_path / "idx", tokenizer=tokenizer, watch=False)
    again.build()
    assert again.stats()["drafts"]["source"] == "mapped"
    assert not drafts_after(again, tokenizer, UNIQUE, "def zebra_quokka_handler(")
    assert drafts_after(again, tokenizer, UNIQUE.replace("zebra_quokka", "yak_otter"), "def yak_otter_handler(")
    assert drafts_after(again, tokenizer, "def handler_7(request):\n    return request.get('key_7')\n",
                        "def handler_7(request):\n    return request")
    assert again.drafts.stats()["documents"] == 10
    again.close()


def test_similar_snippets_drop_the_local_window(tmp_path: Path):
    root = tmp_path / "repo"
    body = "def parse_header(stream):\n    magic = stream.read(4)\n    version = stream.read(2)\n    return magic, version\n"
    write(root, "copy.py", body)  # the same code as the cursor's window
    write(root, "other.py", "def parse_footer(stream):\n    checksum = stream.read(8)\n    return checksum\n")
    idx = RepoIndex(root, tmp_path / "idx", watch=False)
    idx.build()
    got = idx.snippets(root / "here.py", body, len(body))
    assert [s.path for s in got] == ["other.py"]
    idx.close()


def test_reads_while_the_writer_runs(tmp_path: Path):
    root = tmp_path / "repo"
    for i in range(300):
        write(root, f"m{i}.py", f"def handler_{i}(request):\n    return request.get('k{i}')\n")
    idx = RepoIndex(root, tmp_path / "idx", watch=False, debounce_ms=10).start()
    assert idx.ready.wait(30)
    errors, results = [], []
    stop = threading.Event()

    def reader():
        text = "def handler_x(request):\n    return request.get("
        while not stop.is_set():
            try:
                results.append(len(idx.snippets(root / "q.py", text, len(text), budget_ms=200)))
            except Exception as exc:  # any failure of a reader fails the test
                errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(300):
        write(root, f"m{i}.py", f"def handler_{i}(request, extra):\n    return request.get('k{i}', extra)\n")
        idx.notify(f"m{i}.py")
    assert idx.wait_idle(60)
    stop.set()
    for t in threads:
        t.join()
    idx.close()
    assert not errors and results and max(results) > 0


def test_kill_during_indexing_leaves_a_consistent_database(tmp_path: Path):
    root = tmp_path / "repo"
    for i in range(3000):
        write(root, f"d{i % 30}/m{i}.py", f"def f{i}(x):\n    return x + {i}\n" * 40)
    idx_dir = tmp_path / "idx"
    cmd = [sys.executable, "-m", "codecomplete.daemon", "index", "--repo", str(root),
           "--index-dir", str(idx_dir), "--no-tokens", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    db = idx_dir / "index.sqlite"
    assert wait_for(lambda: db.exists() and db.stat().st_size > 200_000, timeout=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    files = conn.execute("SELECT count(*) FROM files").fetchone()[0]
    defs_orphans = conn.execute("SELECT count(*) FROM defs WHERE path NOT IN (SELECT path FROM files)").fetchone()[0]
    conn.close()
    assert 0 < files < 3000 and defs_orphans == 0  # whole batches only
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import json
    out = json.loads(done.stdout)
    assert out["files"] == 3000 and out["files_unchanged"] >= files
    assert out["definitions"] == 3000 * 40


def test_vanished_repository_keeps_the_index(tmp_path: Path):
    root = tmp_path / "repo"
    write(root, "a.py", "a = 1\n")
    idx = RepoIndex(root, tmp_path / "idx", watch=False)
    idx.build()
    import shutil
    shutil.rmtree(root)
    idx.rescan()
    idx._full_scan()
    assert idx.counts()["files"] == 1 and idx.failed is None
    idx.close()


def test_a_repository_that_vanishes_and_comes_back_is_watched_again(tmp_path: Path):
    import shutil

    root = tmp_path / "repo"
    write(root, "a.py", "a = 1\n")
    idx = RepoIndex(root, tmp_path / "idx", debounce_ms=30, check_s=0.1).start()
    try:
        assert wait_for(lambda: idx._observer is not None) and idx.wait_idle()
        assert indexed(idx, "a.py")
        shutil.rmtree(root)  # the old observer watched this folder's inode
        assert wait_for(lambda: not indexed(idx, "a.py"))
        write(root, "b.py", "b = 2\n")  # a new folder at the same path
        assert wait_for(lambda: indexed(idx, "b.py"))
        write(root, "c.py", "c = 3\n")  # and its changes are followed again
        assert wait_for(lambda: indexed(idx, "c.py"))
        assert idx.failed is None and idx._observer is not None and idx._observer.is_alive()
    finally:
        idx.close()


def blind_index(tmp_path: Path, monkeypatch, start_s: float = 0.0, **kw) -> tuple[RepoIndex, list[float]]:
    """An index of one file whose observers never start, as when inotify's watch limit is
    reached (each attempt taking ``start_s``), and the times of those attempts."""
    import watchdog.observers

    attempts: list[float] = []

    class Blind(watchdog.observers.Observer):
        def start(self):
            attempts.append(time.monotonic())
            time.sleep(start_s)  # adding watches to a huge tree until the limit
            raise OSError(28, "inotify watch limit reached")

    monkeypatch.setattr(watchdog.observers, "Observer", Blind)
    root = tmp_path / "repo"
    write(root, "a.py", "a = 1\n")
    return RepoIndex(root, tmp_path / "idx", **kw).start(), attempts


def test_without_an_observer_the_repository_is_rescanned(tmp_path: Path, monkeypatch):
    idx, _ = blind_index(tmp_path, monkeypatch, debounce_ms=30, check_s=0.05, poll_s=0.2)
    root = idx.root
    try:
        assert idx.ready.wait(10) and indexed(idx, "a.py")
        assert idx._observer is None
        write(root, "b.py", "b = 2\n")
        assert wait_for(lambda: indexed(idx, "b.py"))
        (root / "a.py").unlink()
        assert wait_for(lambda: not indexed(idx, "a.py"))
        assert idx.failed is None
    finally:
        idx.close()


def test_two_daemons_share_one_index_without_failing(tmp_path: Path):
    """Guards two editor windows on one repository: both daemons open, migrate and fill
    the same database at once; neither fails (a UNIQUE failure ended one's indexing),
    neither moves the other's database aside, and the rows are the files on disk."""
    import threading

    root = tmp_path / "repo"
    for i in range(300):
        write(root, f"pkg{i % 7}/m{i}.py", f"def f{i}():\n    return {i}\n" * 20)
    indexes = [RepoIndex(root, tmp_path / "idx", watch=False) for _ in range(2)]
    barrier = threading.Barrier(2)

    def build(idx):
        barrier.wait()
        idx.build()

    threads = [threading.Thread(target=build, args=(idx,)) for idx in indexes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        for idx in indexes:
            assert idx.failed is None and idx.store.rebuilt is None
            assert idx.counts()["files"] == 300
        assert not list((tmp_path / "idx").glob("index.sqlite.corrupt-*"))
    finally:
        for idx in indexes:
            idx.close()


def test_a_new_tokenizer_retokenizes_the_repository(tmp_path: Path, tiny_model: Path):
    from tokenizers import Tokenizer

    first = TokenizerInfo.from_file(tiny_model / "tokenizer.json")
    other = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    other.add_tokens(["zebra_quokka"])  # another model's tokenizer: another id
    second = TokenizerInfo(other, "other")
    assert first.id != second.id
    root = tmp_path / "repo"
    write(root, "a.py", UNIQUE)
    idx = RepoIndex(root, tmp_path / "idx", tokenizer=first, watch=False)
    idx.build()
    idx.close()
    again = RepoIndex(root, tmp_path / "idx", tokenizer=second, watch=False)
    stats = again.build()
    rows = again.store.conn.execute("SELECT tokenizer, ids FROM tokens").fetchall()
    assert [r[0] for r in rows] == [second.id] and stats["files_unchanged"] == 1
    assert list(np.frombuffer(rows[0][1], dtype="<i4")) == second.encode(UNIQUE).tolist()
    again.close()


def test_common_datastore_builds_maps_and_serves_drafts(tmp_path: Path, tokenizer: TokenizerInfo):
    from codecomplete.indexer.common import build_common, load_common, stdlib_sources

    sources = [p for p in stdlib_sources() if p.name in ("textwrap.py", "shlex.py", "fnmatch.py")]
    assert len(sources) == 3
    folder = tmp_path / "common"
    meta = build_common(tokenizer, folder, sources)
    assert meta["documents"] == 3 and meta["tokens"] > 1000 and meta["licence"].startswith("PSF")
    seg = load_common(tokenizer, folder)
    assert seg is not None and seg.tokens == meta["tokens"]
    text = (sources[0].parent / "textwrap.py").read_text()
    cut = text.index("def dedent(text):") + len("def dedent(text):")
    root = tmp_path / "repo"
    write(root, "a.py", "x = 1\n")
    idx = RepoIndex(root, tmp_path / "idx", tokenizer=tokenizer, watch=False, common=seg)
    idx.build()
    matches = idx.lookup(tokenizer.encode(text[:cut]).tolist(), draft_len=4)
    assert [m.source for m in matches] == ["common"] and matches[0].length >= 8
    want = tokenizer.encode(text[:cut + 40]).tolist()[len(tokenizer.encode(text[:cut])):][:2]
    assert any(list(c.tokens[:2]) == want for c in matches[0].continuations)
    (folder / "meta.json").write_text("{broken")
    assert load_common(tokenizer, folder) is None  # a broken datastore is reported, not used
    idx.close()


def test_notify_takes_paths_in_the_repository_only(tmp_path: Path):
    """The editor's file reports (workspace/didChangeWatchedFiles) are hints: a path
    outside the repository or in .git is nothing to reconcile; one inside is read."""
    root = tmp_path / "repo"
    write(root, "a.py", "a = 1\n")
    idx = RepoIndex(root, tmp_path / "idx", watch=False).start()
    try:
        assert idx.ready.wait(30)
        assert not idx.notify(tmp_path / "elsewhere.py") and not idx.notify(root / ".git" / "HEAD")
        assert not idx.notify(root)
        write(root, "b.py", "b = 2\n")
        assert idx.notify(root / "b.py") and idx.notify(root / ".git" / "info" / "exclude")
        assert idx.wait_idle()
        assert idx.counts()["files"] == 2
    finally:
        idx.close()


def test_a_folder_of_too_many_files_is_indexed_up_to_max_files(tmp_path: Path):
    """A home folder opened as the workspace: the first max_files files in walk order,
    and files that appear later stay out while the index is full."""
    root = tmp_path / "repo"
    for i in range(12):
        write(root, f"d{i // 5}/f{i:02d}.py", f"v{i} = {i}\n")
    idx = RepoIndex(root, tmp_path / "idx", watch=False, max_files=10).start()
    try:
        assert idx.ready.wait(30)
        assert idx.counts()["files"] == 10 and idx.stats()["capped"]
        write(root, "late.py", "late = 1\n")
        idx.notify(root / "late.py")
        assert idx.wait_idle()
        assert idx.counts()["files"] == 10
        (root / "d0" / "f00.py").unlink()  # room for one
        idx.notify(root / "d0" / "f00.py")
        assert idx.wait_idle()
        idx.notify(root / "late.py")
        assert idx.wait_idle()
        conn = sqlite3.connect(idx.db_path)
        assert "late.py" in {r[0] for r in conn.execute("SELECT path FROM files")}
        conn.close()
    finally:
        idx.close()


def test_kernel_and_virtual_file_systems_are_not_walked(tmp_path: Path):
    """A repository at / (or one that holds a bound /proc): reading /proc/kmsg blocks for
    ever.  Mount points of proc, sysfs, devtmpfs... are skipped, from the mount table."""
    from codecomplete.indexer import scan

    table = tmp_path / "mounts"
    table.write_text(f"proc {tmp_path}/repo/proc proc rw 0 0\nsysfs /sys sysfs rw 0 0\n"
                     f"/dev/sda1 {tmp_path}/repo ext4 rw 0 0\nx {tmp_path}/repo/my\\040dir tmpfs rw 0 0\n"
                     f"y {tmp_path}/repo/with\\040space cgroup2 rw 0 0\n")
    assert scan.pseudo_mounts(str(table)) == {f"{tmp_path}/repo/proc", "/sys", f"{tmp_path}/repo/with space"}
    root = tmp_path / "repo"
    write(root, "a.py", "a = 1\n")
    write(root, "proc/kmsg", "would block\n")
    write(root, "with space/x.py", "x = 1\n")
    rules = Rules(root)
    rules.pseudo = scan.pseudo_mounts(str(table))
    assert [e.path for e in walk(rules)] == ["a.py"]
    assert rules.accepts("proc/kmsg") is None and rules.accepts("a.py") is not None
    assert scan.pseudo_mounts(str(tmp_path / "missing")) == frozenset()


def test_the_draft_index_starts_with_the_newest_files_within_its_token_budget(tmp_path: Path,
                                                                             tokenizer: TokenizerInfo):
    """Suffix arrays cost memory per token: past max_draft_tokens the draft index starts
    with the most recently modified files that fit; one left out enters when it changes."""
    root = tmp_path / "repo"
    old = write(root, "old.py", "def ancient_walrus_helper(x):\n    return x + 1\n")
    os.utime(old, (1_000_000_000, 1_000_000_000))
    write(root, "new.py", UNIQUE)
    n_new = len(tokenizer.encode(UNIQUE))
    idx = RepoIndex(root, tmp_path / "idx", tokenizer=tokenizer, watch=False, max_draft_tokens=n_new + 2).start()
    try:
        assert idx.tokens_ready.wait(30)
        assert drafts_after(idx, tokenizer, UNIQUE, "def zebra_quokka_handler(")
        assert not drafts_after(idx, tokenizer, "def ancient_walrus_helper(x):\n", "def ancient_walrus_helper(")
        assert idx.stats()["draft_tokens_left_out"] > 0
        assert idx.counts()["files"] == 2  # snippets still see every file
        write(root, "old.py", "def ancient_walrus_helper(x):\n    return x + 2\n")
        idx.notify(root / "old.py")
        assert idx.wait_idle()
        assert drafts_after(idx, tokenizer, "def ancient_walrus_helper(x):\n", "def ancient_walrus_helper(")
    finally:
        idx.close()


def test_a_blind_index_polls_less_often_when_polling_is_costly(tmp_path: Path, monkeypatch):
    """Without an observer the repository is rescanned every poll_s, and each time a new
    observer is tried.  On a huge tree both are slow (a home folder opened as the
    workspace): the interval stretches to ten times their cost."""
    idx, attempts = blind_index(tmp_path, monkeypatch, start_s=0.3, debounce_ms=10, check_s=0.02, poll_s=0.05)
    try:
        assert idx.ready.wait(10)
        time.sleep(2.5)
        # unthrottled: one attempt per 0.35 s (~7); throttled: one per >= 3 s after the first
        assert 1 <= len(attempts) <= 3, attempts
    finally:
        idx.close()


def test_the_index_folder_inside_the_repository_is_not_watched_back(tmp_path: Path):
    """A home folder as the workspace holds the default index folder (~/.cache/...): the
    database's own writes are not events to reconcile."""
    root = tmp_path / "home"
    write(root, "proj/a.py", "a = 1\n")
    idx = RepoIndex(root, root / ".cache" / "codecomplete" / "idx", debounce_ms=20).start()
    try:
        assert idx.ready.wait(30) and wait_for(lambda: idx._observer is not None)
        write(root, "proj/b.py", "b = 2\n")
        assert wait_for(lambda: idx.counts()["files"] == 2)
        assert idx.wait_idle()
        time.sleep(0.3)
        # b.py's and its folder's events (4 here); with the database's writes it was 11
        assert 1 <= idx.stats()["events"] <= 6
    finally:
        idx.close()


def test_indexing_waits_while_completions_are_computed_and_still_finishes(tmp_path: Path, tokenizer: TokenizerInfo):
    """``RepoIndex.foreground``: while it says the engine computes a completion, the index's work
    waits before its next few files, at most ``yield_ms`` at a time; the index it makes is the one
    made without waiting."""
    root = tmp_path / "repo"
    for i in range(100):
        write(root, f"m{i}.py", f"def handler_{i}(request):\n    return request.get('key_{i}')\n")
    plain = RepoIndex(root, tmp_path / "plain", tokenizer=tokenizer, watch=False)
    plain.build()
    busy = threading.Event()
    busy.set()
    idx = RepoIndex(root, tmp_path / "idx", tokenizer=tokenizer, watch=False, foreground=busy.is_set,
                    yield_ms=60_000).start()
    try:
        time.sleep(1.0)
        assert not idx.ready.is_set() and idx.stats()["files_indexed"] == 0  # waiting for the engine
        busy.clear()
        assert idx.tokens_ready.wait(30)
        s = idx.stats()
        assert s["files_indexed"] == 100 and s["yields"] >= 1 and s["yield_ms"] >= 900
        tokens = dict(idx.store.all_tokens(tokenizer.id))
        assert len(tokens) == 100 and tokens == dict(plain.store.all_tokens(tokenizer.id))
        assert drafts_after(idx, tokenizer, "def handler_7(request):\n    return request.get('key_7')\n",
                            "def handler_7(request):\n    return request")
    finally:
        idx.close()
        plain.close()
    # an engine that never rests: the work still moves, waiting at most yield_ms before each piece
    slow = RepoIndex(root, tmp_path / "slow", tokenizer=tokenizer, watch=False, foreground=lambda: True,
                     yield_ms=20)
    t0 = time.monotonic()
    s = slow.build()
    assert s["files_indexed"] == 100 and s["yields"] >= 4 and time.monotonic() - t0 < 20
    slow.close()
    # a probe that fails is ignored, and without one (the index command) nothing waits
    broken = RepoIndex(root, tmp_path / "broken", tokenizer=tokenizer, watch=False, foreground=lambda: 1 / 0)
    assert broken.build()["files_indexed"] == 100 and broken.stats()["yields"] == 0
    broken.close()
    assert plain.stats()["yields"] == 0


def test_the_daemons_indexes_yield_to_its_engine(tmp_path: Path):
    """The server gives each index it makes the engine's ``busy`` (the repository's and other
    workspace folders'), and ``index.yield_ms`` from the editor reaches the indexes already made."""
    from codecomplete.daemon.config import Config
    from codecomplete.lsp.server import create_server

    class Engine:
        settings = []

        def busy(self) -> bool:
            return False

        def configure(self, settings) -> None:
            self.settings.append(settings)

    root = tmp_path / "repo"
    write(root, "a.py", "import os\n")
    write(tmp_path / "other", "b.py", "import sys\n")
    cfg = Config()
    cfg.index_dir = str(tmp_path / "idx")
    engine = Engine()
    server = create_server(engine, cfg, root)
    try:
        made = [server.folders.add(root), server.folders.add(tmp_path / "other")]
        assert all(i is not None for i in made) and len(server.folders.all()) == 2
        for index in made:
            assert index.foreground == engine.busy and index.yield_ms == 500
        server.apply_settings({"index": {"yieldMs": 0}}, "test")
        assert [i.yield_ms for i in made] == [0, 0]
    finally:
        for index in server.folders.all():
            index.close()


def notebook_json(cells: list[tuple[str, str]], language: str | None = "python", outputs: str = "") -> str:
    """An nbformat 4 notebook: (cell_type, source) cells, each code cell with ``outputs`` as a
    PNG and as text; the source as a list of lines, as Jupyter writes it."""
    import json

    def cell(kind, source):
        c = {"cell_type": kind, "metadata": {}, "source": source.splitlines(keepends=True)}
        if kind == "code":
            c.update(execution_count=1, outputs=[{"output_type": "display_data", "metadata": {},
                                                  "data": {"image/png": outputs, "text/plain": [outputs[:40]]}}])
        return c

    meta = {"kernelspec": {"name": "k", "display_name": "k", "language": language}} if language else {}
    return json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": meta,
                       "cells": [cell(k, s) for k, s in cells]}, indent=1)


def test_a_notebooks_code_cells_in_order_and_its_language():
    from codecomplete.indexer.files import SourceError, notebook_code

    text = notebook_json([("markdown", "# Title\nsome prose"), ("code", "import os\n\n"), ("code", "  \n"),
                          ("raw", "raw text"), ("code", "def f(x):\n    return x\n")], language="python3")
    assert notebook_code(text) == ("import os\n\ndef f(x):\n    return x\n\n", "python")
    assert notebook_code(notebook_json([("code", "x <- 1")], language="R")) == ("x <- 1\n\n", "r")
    # cells of another language under a cell magic are left out, those timing Python kept
    magics = [("code", "%%bash\nls -l\n"), ("code", "%%time\ny = 2\n"), ("code", "  %%html\n<b>x</b>"),
              ("code", "%matplotlib inline\n")]
    assert notebook_code(notebook_json(magics)) == ("%%time\ny = 2\n\n%matplotlib inline\n\n", "python")
    assert notebook_code(notebook_json([("code", "x = 1")], language=None))[1] == "python"
    # nbformat 3: cells in worksheets, a code cell's source under "input"; a source as one string
    v3 = '{"nbformat": 3, "metadata": {"language": "julia"}, "worksheets": [{"cells": [' \
         '{"cell_type": "code", "input": ["y = 2\\n", "z = y"]}, {"cell_type": "code", "source": "w = 3\\n"}]}]}'
    assert notebook_code(v3) == ("y = 2\nz = y\n\nw = 3\n\n", "julia")
    for bad in ["{not json", "[1, 2]", '{"cells": 3}', '"text"']:
        with pytest.raises(SourceError) as err:
            notebook_code(bad, "bad.ipynb")
        assert err.value.reason == "not_notebook" and "bad.ipynb is not a Jupyter notebook" in str(err.value)


def test_a_notebook_is_indexed_as_its_code_cells(tmp_path: Path, tokenizer: TokenizerInfo):
    """A notebook file is mostly outputs: the index holds its code cells (drafts, chunks,
    definitions, its kernel's language), may read a file up to 16x the size limit when its code
    is within it, and skips a file that is no notebook or whose code is over the limit."""
    root = tmp_path / "repo"
    image = "iVBORw0KGgo" + "A" * 20_000  # an output: 20 KB of base64, over the 8 KB limit set below
    write(root, "analysis.ipynb", notebook_json([("markdown", "# MARKDOWN_PROSE_MARKER"), ("code", UNIQUE)],
                                                outputs=image))
    write(root, "stats.ipynb", notebook_json([("code", "summarise_quarterly_sales <- function(df) df\n")],
                                             language="R"))
    write(root, "broken.ipynb", '{"cells": [')
    write(root, "huge_code.ipynb", notebook_json([("code", f"value_{i} = " + "1 + " * 25 + "1\n")
                                                  for i in range(100)]))  # 10 KB of code in a 40 KB file
    write(root, "main.py", "import os\n")
    idx = RepoIndex(root, tmp_path / "idx", tokenizer=tokenizer, watch=False, max_file_bytes=8192).start()
    try:
        assert idx.tokens_ready.wait(30) and idx.wait_idle()
        assert indexed(idx, "analysis.ipynb") and indexed(idx, "stats.ipynb") and indexed(idx, "main.py")
        assert not indexed(idx, "broken.ipynb") and not indexed(idx, "huge_code.ipynb")
        assert idx.stats()["skipped"] == {"not_notebook": 1, "too_large": 1}
        conn = idx.store.conn
        langs = dict(conn.execute("SELECT path, language FROM files").fetchall())
        assert langs["analysis.ipynb"] == "python" and langs["stats.ipynb"] == "r"
        chunks = " ".join(t for (t,) in conn.execute("SELECT text FROM chunks WHERE path = 'analysis.ipynb'"))
        assert "payload = request.json()" in chunks
        assert "iVBORw0KGgo" not in chunks and "MARKDOWN_PROSE_MARKER" not in chunks and '"source"' not in chunks
        # drafts continue the code across its lines, as a .py file's would
        # (in the file's JSON a line ends with an escaped \\n and a quote)
        typed = "def zebra_quokka_handler(request):\n    payload = request.json()"
        drafts = drafts_after(idx, tokenizer, UNIQUE, typed)
        assert drafts and all(t.startswith("\n    re") for t in drafts), drafts
        here = "total = zebra_quokka_handler("
        got = idx.snippets(root / "main.py", here, len(here))
        assert got and got[0].path == "analysis.ipynb" and got[0].text.startswith("def zebra_quokka_handler")
        assert got[0].reason == "definition of zebra_quokka_handler"
    finally:
        idx.close()
