"""The native stack's packed weights, kept between starts.

A load of a bf16 model on the CPU copies every linear weight into the native kernels' layout
(``Transformer.native_decode``: one arena on huge pages) and, where the greedy head is built,
makes the head's int8 copy (``native.pack_greedy_head``).  On the default model that is most of
a later start's load: the checkpoint's fp32 linear weights read and rounded to bf16, packed,
and the head quantized.  This module keeps the result in one file per checkpoint and CPU
layout under ``<cache>/packed/``.  A later load reads that file straight into a new arena and
builds the model without reading the linear weights (``from_safetensors(linear=False)``);
a weight read later is unpacked from its native copy (``Linear.restore_dense``).

A file is used only where its key equals the load's: the checkpoint's files (name, size,
modification time, inode), the dtype, the native library (its name hashes the C sources, their
flags and the CPU), the packing code (the Python files that lay the weights out), the AMX layout,
the bf16 kernel's path, whether a greedy head is built and the layers' weights (bf16 or int8).
Any other file (another key, short, damaged, not this format) is ignored: the load packs as before and writes a new one.  A file is
written by a background thread under a temporary name, flushed to disk and then renamed, so a
reader sees a whole file or none; a folder that cannot be written, or a disk with less than
``MIN_FREE`` left after the file, costs nothing but the log line.  The write goes in pieces
while the engine rests (``Entry.write``'s ``busy``) and is finished when the process ends
(``finish``).  The daemon reads the file ahead, before torch's import (model/pack_prefetch.py,
which also holds the file's layout); ``Entry.read`` takes those bytes where they fit.
``CODECOMPLETE_PACK_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import native, native_build, pack_prefetch

log = logging.getLogger(__name__)

FORMAT = 1
MIN_FREE = 1 << 30  # bytes a write leaves free on the cache's disk, at least
PIECE = 16 << 20  # bytes written at a time, between looks at the engine (Entry.write's busy)
MAX_WAIT = 60.0  # seconds a write waits for the engine to rest, in all
_CODE = [Path(__file__), Path(native.__file__), Path(__file__).with_name("transformer.py")]
_writers: list[threading.Thread] = []
_writers_lock = threading.Lock()
_exiting = threading.Event()  # the process ends: writes stop waiting for the engine (finish)


def enabled() -> bool:
    return os.environ.get("CODECOMPLETE_PACK_CACHE", "1") != "0"


def folder() -> Path:
    from codecomplete.paths import cache_dir

    return cache_dir() / "packed"


@dataclass
class Prepacked:
    """A cache file's contents: the arena of every native copy (``huge_views``' layout) and the
    greedy head's tensors (None where the head is not built), as ``native_decode`` adopts them."""

    arena: torch.Tensor
    qhead: list[torch.Tensor] | None
    shapes: list[list[int]] = field(default_factory=list)  # of the arena's matrices, as written
    filling: threading.Thread | None = None  # reading the tensors' bytes in (Entry.read); wait() for it
    error: str | None = None  # why the bytes could not be read
    ahead: bool = False  # the bytes were read before torch's import (pack_prefetch)

    def wait(self) -> bool:
        """Wait until the tensors hold the file's bytes; False where they could not be read (the
        model built on them must not be used then)."""
        if self.filling is not None:
            self.filling.join()
        return self.error is None

    def check(self, lin: bool, shapes: list[torch.Tensor], head) -> None:
        """ValueError unless these copies fit a model whose native matrices are ``shapes``
        (``pack_linear``'s, in ``native_decode``'s order) and whose head is ``head`` here."""
        if not lin:
            raise ValueError("packed weights serve only the native bf16 stack")
        if self.shapes != [list(s.shape) for s in shapes] or self.arena.numel() != native.arena_bytes(shapes):
            raise ValueError("the packed weights do not fit this model's matrices")
        want = native.greedy_head_like(head.out_features, head.in_features) if native.greedy_head_available() else None
        got = self.qhead
        if (want is None) != (got is None) or (want is not None and [(t.shape, t.dtype) for t in want]
                                                != [(t.shape, t.dtype) for t in got]):
            raise ValueError("the packed greedy head does not fit this model's head")


@dataclass
class Entry:
    """Where a checkpoint's packed weights live on this CPU, and the key a file there must hold."""

    path: Path
    key: dict
    checkpoint: str

    def read(self) -> Prepacked | None:
        """The file's contents where it holds this key, else None (no file, another key, a short
        or damaged file: the reason logged).  The header is checked here; the tensors' bytes are
        read on a thread of their own (their page faults are most of the time), while the caller
        builds the rest of the model: ``Prepacked.wait()`` before the tensors are used."""
        ahead = pack_prefetch.take(self.path)
        if ahead is not None:
            got = self._adopt(ahead)
            if got is not None:
                return got
        start = time.perf_counter()
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("packed weights %s not used (%s): packing again", self.path, exc)
            return None
        try:
            with contextlib.ExitStack() as closing:
                closing.callback(f.close)
                header = pack_prefetch.read_header(f)
                n = len(header)
                meta = json.loads(header)
                if meta.get("key") != self.key:
                    log.info("packed weights %s were made for another checkpoint, CPU or code: packing again",
                             self.path.name)
                    return None
                arena_n, qlike, data = _layout(meta)
                data_at = pack_prefetch.data_start(n)
                want = data_at + data
                size = os.fstat(f.fileno()).st_size
                if size != want:
                    raise ValueError(f"{size} bytes where its header says {want}")
                arena = native.huge_empty((arena_n,), torch.uint8)
                qhead = [torch.empty(t.shape, dtype=t.dtype) for t in qlike]
                out = Prepacked(arena, qhead if meta["qhead"] is not None else None, meta["shapes"])
                parts = [(arena, _room(arena_n))] + [
                    (t.view(-1).view(torch.uint8), _room(t.numel() * t.element_size())) for t in qhead]

                def fill():
                    try:
                        f.seek(data_at)
                        for t, room in parts:
                            _read_into(f, t, room)
                        log.info("packed weights read from %s (%d MB, %.2f s)", self.path, size >> 20,
                                 time.perf_counter() - start)
                    except (OSError, ValueError) as exc:
                        out.error = str(exc)
                        log.warning("packed weights %s not used (%s): packing again", self.path, exc)
                    finally:
                        f.close()

                out.filling = threading.Thread(target=fill, name="pack-cache-read", daemon=True)
                out.filling.start()
                closing.pop_all()  # the file is the thread's to close
                return out
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            log.warning("packed weights %s not used (%s): packing again", self.path, exc)
            return None

    def _adopt(self, ahead: pack_prefetch.Prefetched) -> Prepacked | None:
        """The tensors in the bytes the daemon read ahead (pack_prefetch), where their header
        holds this key and they are as long as it says; else None (the file is read again)."""
        try:
            meta = json.loads(ahead.header)
            if meta.get("key") != self.key:
                return None
            arena_n, qlike, data = _layout(meta)
            if ahead.size != data:
                return None
            arena = torch.frombuffer(ahead.buffer, dtype=torch.uint8, count=arena_n, offset=ahead.offset)
            at, qhead = ahead.offset + _room(arena_n), []
            for t in qlike:
                qhead.append(torch.frombuffer(ahead.buffer, dtype=t.dtype, count=t.numel(), offset=at).view(t.shape))
                at += _room(t.numel() * t.element_size())
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            log.warning("packed weights read ahead from %s not used (%s)", self.path, exc)
            return None
        # (the tensors hold the read-ahead buffer alive: torch.frombuffer keeps a reference)
        return Prepacked(arena, qhead if meta["qhead"] is not None else None, meta["shapes"], ahead=True)

    def write(self, model, background: bool = True, busy: Callable[[], bool] | None = None) -> threading.Thread | None:
        """Keep ``model``'s native copies (after ``native_decode``) in this entry's file, on a
        thread of its own (returned) unless ``background`` is False.  Nothing where the model has
        no native stack.  ``busy``: the engine's probe; the file is written in pieces, each after
        the engine has come to rest (at most ``MAX_WAIT`` seconds of waiting in all): a write
        beside a first start's first prefill made it 120-400 ms slower."""
        stack, arena = model.native_stack, model.native_arena
        if stack is None or arena is None:
            return None
        mats = [m.native_weight for m in model.modules() if getattr(m, "native_weight", None) is not None]
        qhead = list(stack._qkeep) if stack.qhead is not None else None
        meta = {"key": self.key, "checkpoint": self.checkpoint, "arena": arena.numel(),
                "shapes": [list(t.shape) for t in mats],
                "qhead": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in qhead] if qhead else None}

        def run():
            try:
                _write(self.path, meta, arena, qhead or [], busy)
            except OSError as exc:
                log.warning("packed weights not kept in %s: %s", self.path.parent, exc)

        if not background:
            run()
            return None
        thread = threading.Thread(target=run, name="pack-cache-write", daemon=True)
        with _writers_lock:
            _writers[:] = [t for t in _writers if t.is_alive()] + [thread]
        thread.start()
        return thread


def entry(ckpt: Path, dtype: torch.dtype, weights: str = "bf16") -> Entry | None:
    """The cache entry of a local checkpoint folder for this CPU, or None where the cache is off
    or the native kernels are not available (this waits for their build)."""
    if not enabled() or not native.available():
        return None
    try:
        ckpt = ckpt.resolve()
        files = sorted(p for p in ckpt.iterdir() if p.suffix in (".safetensors", ".json"))
        stats = [[p.name, st.st_size, st.st_mtime_ns, st.st_ino] for p in files for st in [p.stat()]]
        code = hashlib.sha256(b"".join(p.read_bytes() for p in _CODE)).hexdigest()[:16]
    except OSError as exc:
        log.debug("no packed weights for %s: %s", ckpt, exc)
        return None
    layout = {"dtype": str(dtype), "amx": native.amx(), "path": native.linear_bf16_path(),
              "greedy": native.greedy_head_available(), "weights": weights}
    key = {"format": FORMAT, "files": stats, "library": native_build.library_path().name, "code": code, **layout}
    name = hashlib.sha256(json.dumps([str(ckpt), layout], sort_keys=True).encode()).hexdigest()[:16]
    return Entry(folder() / f"{name}.pack", key, str(ckpt))


def wait(timeout: float | None = None) -> None:
    """Wait for the writes in flight in this process (tests; a caller about to read them)."""
    with _writers_lock:
        pending = list(_writers)
    for t in pending:
        t.join(timeout)


@atexit.register
def finish(timeout: float = 5.0) -> None:
    """At the process's end: the writes in flight stop waiting for the engine to rest and are
    given ``timeout`` seconds to complete (a short-lived process, the ``complete`` command or a
    daemon whose editor closed soon, would otherwise leave a partial file and no cache).  The
    daemon calls it before its ``os._exit``; atexit calls it on a normal exit."""
    _exiting.set()
    deadline = time.monotonic() + timeout
    with _writers_lock:
        pending = list(_writers)
    for t in pending:
        t.join(max(0.0, deadline - time.monotonic()))


def _layout(meta: dict) -> tuple[int, list[torch.Tensor], int]:
    """From a file's header: the arena's bytes, the greedy head's tensors (meta tensors; [] where
    none) and the bytes of the data after the header."""
    qshapes = meta["qhead"]
    qlike = [torch.empty(s, dtype=getattr(torch, d), device="meta") for s, d in qshapes] if qshapes is not None else []
    arena_n = int(meta["arena"])
    return arena_n, qlike, _room(arena_n) + sum(_room(t.numel() * t.element_size()) for t in qlike)


def _room(n: int) -> int:
    return -(-n // 64) * 64


def _read_into(f, t: torch.Tensor, room: int) -> None:
    """Fill the uint8 tensor ``t`` from the file, then skip to the end of its ``room``."""
    view, got = memoryview(t.numpy()).cast("B"), 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError("the file ended early")
        got += n
    if room > len(view):
        f.seek(room - len(view), os.SEEK_CUR)


def _rest(busy: Callable[[], bool] | None, deadline: float) -> None:
    """Wait while ``busy()`` says the engine works, until ``deadline`` (monotonic) at most."""
    while busy is not None and time.monotonic() < deadline and not _exiting.is_set():
        try:
            if not busy():
                return
        except Exception:  # noqa: BLE001 - a broken probe does not stop the write
            return
        time.sleep(0.05)


def _write(path: Path, meta: dict, arena: torch.Tensor, qhead: list[torch.Tensor],
           busy: Callable[[], bool] | None = None) -> None:
    deadline = time.monotonic() + MAX_WAIT
    _rest(busy, deadline)
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path.parent)
    header = json.dumps(meta).encode()
    parts = [arena] + [t.reshape(-1).view(torch.uint8) for t in qhead]
    total = pack_prefetch.data_start(len(header)) + sum(_room(p.numel()) for p in parts)
    import shutil

    if shutil.disk_usage(path.parent).free < total + MIN_FREE:
        raise OSError(f"less than {MIN_FREE >> 20} MB would be left on the disk")
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(pack_prefetch.MAGIC + len(header).to_bytes(8, "little") + header)
            f.write(bytes(pack_prefetch.data_start(len(header)) - 16 - len(header)))
            for p in parts:
                view = memoryview(p.numpy()).cast("B")
                for at in range(0, len(view), PIECE):
                    _rest(busy, deadline)
                    f.write(view[at:at + PIECE])
                f.write(bytes(_room(p.numel()) - p.numel()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("packed weights kept in %s (%d MB, %.2f s after the engine first came to rest)", path, total >> 20,
             time.perf_counter() - start)


def _remove_stale(where: Path) -> None:
    """Remove what no load will read: files of checkpoints that are gone, and temporary files a
    process left when it exited while writing (``pack_prefetch.classify``)."""
    now = time.time()
    for p in where.iterdir():
        try:
            kind, ckpt = pack_prefetch.classify(p, now)
            if kind in ("tmp-left", "gone"):
                p.unlink()
                if kind == "gone":
                    log.info("packed weights of %s removed: the checkpoint is gone", ckpt)
        except OSError:
            pass
