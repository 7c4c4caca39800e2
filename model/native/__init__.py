"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

Why: a decode step of a batch runs attention once per sequence and layer; in PyTorch that
is ~10 small ops each (16 sequences x 30 layers = ~5k ops a step) whose matmuls stream a
3k-token fp32 cache at ~16 GB/s.  ``decode_attention`` does a whole layer's batch in one
call (docs/decisions.md has the measurements).

The shared library is built once per source version and CPU into a cache directory
(``$CODECOMPLETE_NATIVE_DIR``, else ``$XDG_CACHE_HOME/codecomplete`` or
``~/.cache/codecomplete``) and reused; building takes about a second.  Nothing here is
required: without a C compiler, with ``CODECOMPLETE_NATIVE=0``, or when building fails,
``available()`` is False and the model keeps its PyTorch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=fast", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
_ELSIZE = {torch.float32: 4, torch.bfloat16: 2}
KV_DTYPES = tuple(_ELSIZE)  # cache dtypes the kernel reads
CHUNK = 256  # cache positions per work item (split-K); 128-512 measured alike here

_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_lock = threading.Lock()


def _cpu_key() -> str:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                model += line
    except OSError:
        pass
    return model


def _cache_dir() -> Path:
    if os.environ.get("CODECOMPLETE_NATIVE_DIR"):
        return Path(os.environ["CODECOMPLETE_NATIVE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "codecomplete"


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]
    out = _cache_dir() / f"decode_attention-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, out)  # atomic: a concurrent build by another process is harmless
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    fn = lib.decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 3 + [ctypes.POINTER(ctypes.c_void_p)] * 2 + [
        ctypes.POINTER(ctypes.c_int64)] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether the native decode attention is built and loaded (builds it on first call)."""
    global _lib, _tried, _error
    if _tried:
        return _lib is not None
    with _lock:
        if not _tried:
            if os.environ.get("CODECOMPLETE_NATIVE", "1") == "0":
                _error = "disabled by CODECOMPLETE_NATIVE=0"
            else:
                try:
                    _lib = _build()
                except Exception as exc:  # noqa: BLE001 - any failure means: use the PyTorch path
                    _error = str(exc)
                    log.warning("native decode attention unavailable, using PyTorch: %s", exc)
            _tried = True
    return _lib is not None


def error() -> str | None:
    """Why ``available()`` is False, if it is."""
    return _error


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches, layer: int) -> torch.Tensor:
    """One new token per sequence: q [B, H, 1, E], k and v [B, K, 1, E] (rotary applied).
    Writes k, v at position ``caches[b].length`` of layer ``layer`` and returns the
    attention output [B, H, 1, E] in q's dtype; caches' lengths are left to the caller."""
    if not available():
        raise RuntimeError(f"native decode attention unavailable: {_error}")
    bsz, h, _, e = q.shape
    kv = k.shape[1]
    dt = caches[0].k.dtype
    qf = q.reshape(bsz, h, e).to(torch.float32).contiguous()
    kn = k.reshape(bsz, kv, e).to(dt).contiguous()
    vn = v.reshape(bsz, kv, e).to(dt).contiguous()
    out = torch.empty((bsz, h, e), dtype=torch.float32)
    ptrs = (ctypes.c_void_p * (2 * bsz))(*[c.k.data_ptr() for c in caches], *[c.v.data_ptr() for c in caches])
    sizes = (ctypes.c_int64 * (2 * bsz))(*[c.capacity for c in caches], *[c.length for c in caches])
    kp = ctypes.cast(ptrs, ctypes.POINTER(ctypes.c_void_p))
    vp = ctypes.cast(ctypes.byref(ptrs, bsz * ctypes.sizeof(ctypes.c_void_p)), ctypes.POINTER(ctypes.c_void_p))
    cp = ctypes.cast(sizes, ctypes.POINTER(ctypes.c_int64))
    lp = ctypes.cast(ctypes.byref(sizes, bsz * 8), ctypes.POINTER(ctypes.c_int64))
    rc = _lib.decode_attention(bsz, kv, h // kv, e, layer, _ELSIZE[dt], qf.data_ptr(), kn.data_ptr(), vn.data_ptr(),
                               kp, vp, cp, lp, e ** -0.5, CHUNK, out.data_ptr())
    if rc != 0:
        raise MemoryError("native decode attention: out of scratch memory")
    return out.view(bsz, h, 1, e).to(q.dtype)
