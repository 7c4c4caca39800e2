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
