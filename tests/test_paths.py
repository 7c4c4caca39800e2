"""The cache folder: the preferred one, or a temporary one when it cannot be written."""

from __future__ import annotations

import logging
import tempfile

from codecomplete import paths


def test_a_writable_cache_folder_is_used_and_created(tmp_path, monkeypatch):
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache" / "deep"))
    assert paths.cache_dir() == tmp_path / "cache" / "deep"
    assert (tmp_path / "cache" / "deep").is_dir()


def test_an_unwritable_cache_folder_falls_back_to_a_temporary_one_with_a_warning(tmp_path, monkeypatch, caplog):
    """Guards a read-only home or a sandboxed editor: the model still loads."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    with caplog.at_level(logging.WARNING, logger="codecomplete.paths"):
        got = paths.cache_dir()
        again = paths.cache_dir()
    assert got == again and got.parent == tmp_path / "tmp" and got.name.startswith("codecomplete-cache-")
    assert got.is_dir()
    assert [r.getMessage() for r in caplog.records] == [
        f"cache folder {blocker / 'cache'} is not writable; using {got} (set CODECOMPLETE_CACHE_DIR to choose one)"]


def test_the_model_index_and_kernel_caches_share_the_folder(tmp_path, monkeypatch):
    from codecomplete.indexer.common import cache_root
    from codecomplete.indexer.index import default_index_dir
    from codecomplete.model import native
    from codecomplete.model.loader import cache_dir

    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("CODECOMPLETE_NATIVE_DIR", raising=False)
    assert cache_dir() == cache_root() == native._cache_dir() == tmp_path / "c"
    assert default_index_dir(tmp_path).parent == tmp_path / "c" / "index"


def test_staging_folders_left_by_a_stopped_process_are_removed_when_stale(tmp_path):
    """Guards the cache's size: a daemon stopped while converting the model left a whole
    checkpoint in a temporary folder; the next conversion removes such folders once old,
    and leaves a young one (another process may be writing it)."""
    import os
    import time

    out = tmp_path / "models" / "smollm2-abc"
    stale, young = out.with_name(out.name + ".old1"), out.with_name(out.name + ".new1")
    for d in (stale, young):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\0" * 1000)
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    got = paths.staging_dir(out)
    assert got.is_dir() and got.parent == out.parent and got.name.startswith(out.name + ".")
    assert not stale.exists() and young.exists() and not out.exists()


def test_a_new_checkpoint_removes_the_ones_it_replaces_and_no_other(tmp_path):
    from codecomplete.paths import prune_replaced

    models = tmp_path / "models"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"new")
    elsewhere = tmp_path / "other-venv.gguf"
    elsewhere.write_bytes(b"x")

    def folder(name, source):
        f = models / name
        f.mkdir(parents=True)
        (f / "model.safetensors").write_bytes(b"w")
        if source is not None:
            (f / "SOURCE").write_text(f"converted from {source}\n")
        return f

    out = folder("m-" + "a" * 16, gguf)
    same = folder("m-" + "b" * 16, gguf)  # the same file before it was reinstalled
    gone = folder("m-" + "c" * 16, tmp_path / "deleted.gguf")  # its file is gone
    other = folder("m-" + "d" * 16, elsewhere)  # another installation's: stays
    unknown = folder("m-" + "e" * 16, None)  # no SOURCE: not ours to judge
    staging = folder("m-" + "a" * 16 + ".tmp123", gguf)  # a staging folder: staging_dir's business
    other_name = folder("n-" + "f" * 16, gguf)  # another model's name
    trained = folder("m-" + "0" * 16, gguf)
    (trained / "exits").mkdir()  # exit heads a user trained for it
    removed = prune_replaced(out, "converted from ", str(gguf))
    assert sorted(removed) == sorted([same, gone])
    assert not same.exists() and not gone.exists()
    for kept in (out, other, unknown, staging, other_name, trained):
        assert kept.is_dir(), kept
