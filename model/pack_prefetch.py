"""The packed weights' file read before torch is imported (torch-free).

A later start spends most of its load faulting in the packed weights' arena (model/packcache.py:
284 MB for the default model, 0.1-0.9 s on the AVX-512 VM here). The daemon starts this read on
a thread of its own as soon as it knows its model's settings, beside torch's import, which holds
one core for ~1-1.5 s meanwhile. The file to read is the one the last load of the same settings
used (``hints.json`` beside the packed files); the load then takes the bytes read here
(``take``) only where the file is still the one read (inode, size, modification time) and its
header still holds the load's key, which packcache checks as for a file it reads itself.
Anything else: the bytes are dropped and the load reads the file as before.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# the packed weights' file (model/packcache.py writes it; its layout lives here, torch-free): MAGIC,
# the header's length (8 bytes, little-endian), the JSON header, zeros to the next ALIGN, the data
MAGIC = b"CCPACK01"
ALIGN = 4096  # the data starts on a page
HUGE_PAGE = 2 << 20
_lock = threading.Lock()
_thread: threading.Thread | None = None
_got: dict[str, "Prefetched"] = {}


@dataclass
class Prefetched:
    """A packed weights' file read into memory: its header (JSON bytes) and its data from the
    data start to the end, ``size`` bytes at ``offset`` in ``buffer`` (2 MB aligned there)."""

    ident: tuple[int, int, int]  # inode, size, mtime_ns of the file read
    header: bytes
    buffer: mmap.mmap
    offset: int
    size: int


def enabled() -> bool:
    """The packed weights' cache on, and its read-ahead (``CODECOMPLETE_PACK_PREFETCH=0``: off,
    a comparison's switch)."""
    return os.environ.get("CODECOMPLETE_PACK_CACHE", "1") != "0" and os.environ.get("CODECOMPLETE_PACK_PREFETCH",
                                                                                   "1") != "0"


def hints_file() -> Path:
    from codecomplete.paths import cache_dir

    return cache_dir() / "packed" / "hints.json"


def hint_key(spec: str, device: str, dtype: str) -> str:
    return json.dumps([spec, device, dtype])


def remember(spec: str, device: str, dtype: str, path: Path) -> None:
    """Note that a load of these settings used the packed weights at ``path`` (the loader)."""
    hints = hints_file()
    try:
        try:
            data = json.loads(hints.read_text())
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            data = {}
        key = hint_key(spec, device, dtype)
        if data.get(key) == str(path):
            return
        data = {k: v for k, v in data.items() if isinstance(v, str) and Path(v).is_file()}  # files since removed
        data[key] = str(path)
        hints.parent.mkdir(parents=True, exist_ok=True)  # (a first start's file is written after this)
        tmp = hints.with_name(f".hints.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, hints)
    except OSError as exc:
        log.debug("packed weights' hint not kept: %s", exc)


def start(spec: str, device: str, dtype: str) -> threading.Thread | None:
    """Read the packed weights that the last load of these settings used, on a thread of its
    own (None where there is nothing to read or the cache is off)."""
    global _thread
    if not enabled() or str(device).startswith("cuda"):
        return None
    try:
        path = json.loads(hints_file().read_text()).get(hint_key(spec, device, dtype))
    except (OSError, ValueError, AttributeError):
        return None
    if not path:
        return None

    def run():
        started = time.perf_counter()
        try:
            got = _read(Path(path))
        except (OSError, ValueError) as exc:
            log.debug("packed weights not read ahead: %s", exc)
            return
        with _lock:
            _got[path] = got
        log.info("packed weights read ahead from %s (%d MB, %.2f s)", path, got.size >> 20,
                 time.perf_counter() - started)

    with _lock:
        _thread = threading.Thread(target=run, name="pack-cache-prefetch", daemon=True)
        _thread.start()
        return _thread


def take(path: Path) -> Prefetched | None:
    """The bytes read ahead from ``path`` where the file is still the one read (waits for the
    read in flight), else None.  Each read is taken once."""
    _settle()
    with _lock:
        got = _got.pop(str(path), None)
    if got is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return got if got.ident == (st.st_ino, st.st_size, st.st_mtime_ns) else None


def drop() -> None:
    """Forget what was read ahead and not taken (a load that did not use it: its memory back)."""
    _settle()
    with _lock:
        _got.clear()


def _settle() -> None:
    """Wait for the read in flight, if any."""
    with _lock:
        thread = _thread
    if thread is not None:
        thread.join()


def read_header(f) -> bytes:
    """The JSON header of a packed weights' file open at its start (ValueError: not one)."""
    head = f.read(16)
    if len(head) != 16 or head[:8] != MAGIC:
        raise ValueError("not a packed weights file")
    n = int.from_bytes(head[8:], "little")
    if not 2 <= n <= 1 << 20:
        raise ValueError(f"a header of {n} bytes")
    header = f.read(n)
    if len(header) != n:
        raise ValueError("the file ended in its header")
    return header


STALE_TMP_S = 600.0  # a temporary file older than this was left by a process stopped while writing


def classify(p: Path, now: float) -> tuple[str, str | None]:
    """What a file in the packed folder is: ("tmp", None) a write in progress, ("tmp-left", None)
    one a stopped process left (older than ``STALE_TMP_S``), ("pack", CHECKPOINT) packed weights
    whose checkpoint folder exists, ("gone", CHECKPOINT) ones whose checkpoint is gone, ("damaged",
    None) a ``.pack`` whose header cannot be read or names no checkpoint, ("other", None) anything
    else.  One rule for
    packcache's clean-up and ``codecomplete-daemon cache`` (OSError where ``p`` vanished)."""
    if p.suffix == ".tmp":
        return ("tmp-left" if now - p.stat().st_mtime > STALE_TMP_S else "tmp"), None
    if p.suffix != ".pack":
        return "other", None
    try:
        with open(p, "rb") as f:
            ckpt = json.loads(read_header(f)).get("checkpoint")
    except (ValueError, AttributeError):
        return "damaged", None
    if not ckpt:  # a header without its checkpoint
        return "damaged", None
    return ("pack" if Path(ckpt).is_dir() else "gone"), ckpt


def data_start(header: int) -> int:
    """Where the data of a file with a header of ``header`` bytes starts."""
    return -(-(16 + header) // ALIGN) * ALIGN


def _read(path: Path) -> Prefetched:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        header = read_header(f)
        start = data_start(len(header))
        size = st.st_size - start
        if size <= 0:
            raise ValueError("no data")
        buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # shared anonymous memory gets no huge pages
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        offset = -base % HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                buf.madvise(mmap.MADV_HUGEPAGE, offset, size // HUGE_PAGE * HUGE_PAGE)
            except (OSError, ValueError):
                pass
        view, got = memoryview(buf)[offset:offset + size], 0
        try:
            f.seek(start)
            while got < size:
                k = f.readinto(view[got:])
                if not k:
                    raise ValueError("the file ended early")
                got += k
        finally:
            view.release()
        return Prefetched((st.st_ino, st.st_size, st.st_mtime_ns), header, buf, offset, size)
