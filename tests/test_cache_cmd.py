"""``codecomplete-daemon cache``: the cache folder listed with what is stale, and ``--prune``
removing exactly that (real indexes, a real packed-weights header, checkpoints with SOURCE files)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _index(repo: Path, cache: Path) -> Path:
    """A real index of ``repo`` where the daemon would keep it."""
    from codecomplete.indexer.index import RepoIndex, default_index_dir

    repo.mkdir(parents=True, exist_ok=True)
    (repo / "a.py").write_text("def f(x):\n    return x + 1\n")
    idx = RepoIndex(repo, watch=False)
    idx.build()
    idx.close()
    where = default_index_dir(repo)
    assert where.parent.parent == cache and (where / "index.sqlite").is_file()
    return where


def _pack(path: Path, checkpoint: Path) -> None:
    from codecomplete.model import pack_prefetch

    header = json.dumps({"checkpoint": str(checkpoint)}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pack_prefetch.MAGIC + len(header).to_bytes(8, "little") + header + bytes(64))


def _model(folder: Path, *sources: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "SOURCE").write_text("".join(s + "\n" for s in sources))
    (folder / "model.safetensors").write_bytes(bytes(1000))
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "my cache #1?"  # characters a SQLite URI must escape
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(root))
    monkeypatch.delenv("CODECOMPLETE_NATIVE_DIR", raising=False)  # the kernels' folder is the cache's here
    root.mkdir()
    return root


def _layout(cache: Path, tmp_path: Path) -> dict[str, Path]:
    from codecomplete.model import native_build

    kept, gone = tmp_path / "kept", tmp_path / "gone"
    out = {"index_kept": _index(kept, cache), "index_gone": _index(gone, cache)}
    shutil.rmtree(gone)  # the repository deleted after its index was built
    empty_old = cache / "index" / "half-0123456789ab"
    empty_old.mkdir()
    os.utime(empty_old, (time.time() - 3600, time.time() - 3600))
    out["index_empty_old"] = empty_old
    out["index_empty_new"] = cache / "index" / "new-0123456789ab"
    out["index_empty_new"].mkdir()
    out["index_damaged"] = cache / "index" / "bad-0123456789ab"  # kept: the daemon rebuilds it in place
    out["index_damaged"].mkdir()
    (out["index_damaged"] / "index.sqlite").write_bytes(b"garbage" * 100)
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF")
    out["model_kept"] = _model(cache / "models" / "w-0123456789abcdef", f"converted from {gguf}")
    out["model_gone"] = _model(cache / "models" / "v-0123456789abcdef", f"converted from {tmp_path / 'v.gguf'}")
    # the default model's case: merged onto a conversion that was removed after the merge
    out["model_merged_base_gone"] = _model(cache / "models" / "m-0123456789abcdef",
                                           f"base {tmp_path / 'conversion'}", f"adapter {tmp_path}")
    out["model_merged_adapter_gone"] = _model(cache / "models" / "n-0123456789abcdef",
                                              f"base {out['model_kept']}", f"adapter {tmp_path / 'adapter'}")
    out["model_with_heads"] = _model(cache / "models" / "h-0123456789abcdef", f"converted from {tmp_path / 'x.gguf'}")
    (out["model_with_heads"] / "exits").mkdir()
    _pack(cache / "packed" / "aaaa.pack", out["model_kept"])
    _pack(cache / "packed" / "bbbb.pack", out["model_gone"] / "nothing")
    out["pack_kept"], out["pack_gone"] = cache / "packed" / "aaaa.pack", cache / "packed" / "bbbb.pack"
    out["pack_damaged"] = cache / "packed" / "cccc.pack"
    out["pack_damaged"].write_bytes(b"not a pack")
    current = native_build.library_path()
    assert current.parent == cache  # never a real build's file: it is overwritten just below
    current.write_bytes(b"\x7fELF")
    out["native_kept"] = current
    out["native_old"] = cache / "codecomplete_native-0000000000000000.so"
    out["native_old"].write_bytes(b"\x7fELF")
    out["common"] = cache / "common" / "0123456789abcdef"
    out["common"].mkdir(parents=True)
    (out["common"] / "meta.json").write_text("{}")
    return out


STALE = {"index_gone", "index_empty_old", "model_gone", "model_merged_adapter_gone", "pack_gone", "pack_damaged",
         "native_old"}


def test_the_listing_marks_what_no_start_reads_and_prune_removes_only_that(cache: Path, tmp_path: Path, capsys):
    from codecomplete.daemon import cli

    paths = _layout(cache, tmp_path)
    assert cli.main(["cache", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert Path(listed["cache"]) == cache and listed["removed"] == []
    by_path = {e["path"]: e for e in listed["entries"]}
    for name, p in paths.items():
        assert by_path[str(p)]["stale"] == (name in STALE), (name, by_path[str(p)])
    assert "unreadable" in by_path[str(paths["index_damaged"])]["status"]
    assert "repository gone" in by_path[str(paths["index_gone"])]["status"]
    assert str(tmp_path / "kept") in by_path[str(paths["index_kept"])]["status"]
    assert by_path[str(paths["index_kept"])]["bytes"] > 0
    assert all(p.exists() for p in paths.values())  # listing removes nothing

    assert cli.main(["cache", "--prune"]) == 0
    out = capsys.readouterr().out
    assert f"removed {len(STALE)}," in out
    for name, p in paths.items():
        assert p.exists() == (name not in STALE), name

    from codecomplete.indexer.index import RepoIndex  # the kept index is read again, not rebuilt

    idx = RepoIndex(tmp_path / "kept", watch=False)
    try:
        stats = idx.build()
    finally:
        idx.close()
    assert stats["files_unchanged"] == 1 and stats["files_indexed"] == 0, stats
    assert cli.main(["cache", "--json"]) == 0
    assert not any(e["stale"] for e in json.loads(capsys.readouterr().out)["entries"])


def test_the_command_runs_without_torch_and_on_an_empty_cache(cache: Path):
    """The real entry point, in a process of its own: it never imports torch (it is for a cache a
    user wants to look at, not a start), and an empty cache lists nothing."""
    code = ("import sys, runpy; sys.argv = ['codecomplete-daemon', 'cache', '--json']\n"
            "from codecomplete.daemon import cli\n"
            "rc = cli.main()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CODECOMPLETE_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["entries"] == []


def test_kernels_kept_in_codecomplete_native_dir_are_listed_and_pruned_too(cache: Path, tmp_path: Path, capsys,
                                                                           monkeypatch):
    from codecomplete.daemon import cli
    from codecomplete.model import native_build

    elsewhere = tmp_path / "kernels"
    elsewhere.mkdir()
    monkeypatch.setenv("CODECOMPLETE_NATIVE_DIR", str(elsewhere))
    current = native_build.library_path()
    assert current.parent == elsewhere  # never a real build's file: it is overwritten just below
    current.write_bytes(b"\x7fELF")
    old = elsewhere / "codecomplete_native-0000000000000000.so"
    old.write_bytes(b"\x7fELF")
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(current) in out and str(old) in out  # shown whole: they are outside the cache folder
    assert cli.main(["cache", "--prune", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["removed"] == [str(old)]
    assert current.exists() and not old.exists()
