"""Where the daemon keeps what it builds: converted checkpoints, compiled kernels, indexes.

One place decides, for every part: ``CODECOMPLETE_CACHE_DIR`` if set, else the user cache
folder (``~/.cache/codecomplete`` on Linux).  When that folder cannot be written (a
read-only home, a sandboxed editor, a ``HOME`` that does not exist), the daemon falls
back to a folder of its own under the system's temporary folder, with one warning,
instead of failing to load its model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_lock = threading.Lock()
_chosen: dict[str, Path] = {}


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
