"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

Why: a decode step of a batch runs attention once per sequence and layer; in PyTorch that
is ~10 small ops each (16 sequences x 30 layers = ~5k ops a step) whose matmuls stream a
3k-token fp32 cache at ~16 GB/s.  ``decode_attention`` does a whole layer's batch in one
call (docs/decisions.md has the measurements).

The shared library is built once per source version and CPU into a cache directory
(``$CODECOMPLETE_NATIVE_DIR``, else ``$XDG_CACHE_HOME/codecomplete`` or
``~/.cache/codecomplete``) and reused; building takes about 2 s.  Nothing here is
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
    fn.argtypes = [ctypes.c_int] * 7 + [ctypes.c_void_p] * 3 + [ctypes.POINTER(ctypes.c_void_p)] * 2 + [
        ctypes.POINTER(ctypes.c_int64)] * 2 + [ctypes.POINTER(ctypes.c_void_p), ctypes.c_float, ctypes.c_int,
                                               ctypes.c_void_p]
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


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches, layer: int,
                     masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """S new tokens per sequence (a decode step, S = 1, or a verification pass): q [B, H, S, E],
    k and v [B, K, S, E] (rotary applied).  Writes k, v at positions ``caches[b].length``..
    of layer ``layer`` and returns the attention output [B, H, S, E] in q's dtype over
    the cache and the new tokens: causal, or as ``masks[b]`` says (boolean, True = attend,
    [S, length + S] or a view of it with leading ones).  Caches' lengths are left to the
    caller."""
    if not available():
        raise RuntimeError(f"native decode attention unavailable: {_error}")
    bsz, h, s, e = q.shape
    kv = k.shape[1]
    dt = caches[0].k.dtype
    for c in caches:  # the kernel writes in place: never past a cache's end
        if c.length + s > c.capacity or c.k.dtype != dt or not (c.k.is_contiguous() and c.v.is_contiguous()):
            raise ValueError(f"cache cannot take {s} new tokens here (length {c.length}, capacity {c.capacity}, "
                             f"{c.k.dtype}); reserve first")
    qf = q.to(torch.float32).contiguous()
    kn = k.to(dt).contiguous()
    vn = v.to(dt).contiguous()
    out = torch.empty((bsz, h, s, e), dtype=torch.float32)
    ptrs, ints = ctypes.c_void_p * bsz, ctypes.c_int64 * bsz  # ctypes arrays pass as the C pointers
    kp, vp = ptrs(*[c.k.data_ptr() for c in caches]), ptrs(*[c.v.data_ptr() for c in caches])
    cp, lp = ints(*[c.capacity for c in caches]), ints(*[c.length for c in caches])
    mp = None
    keep = []  # the masks' contiguous copies live through the call
    if masks is not None and any(m is not None for m in masks):
        mp = ptrs()
        for b, (m, c) in enumerate(zip(masks, caches)):
            if m is None:
                continue
            m = m.reshape(s, c.length + s)
            m = m if m.dtype == torch.bool and m.is_contiguous() else m.to(torch.bool).contiguous()
            keep.append(m)
            mp[b] = m.data_ptr()
    rc = _lib.decode_attention(bsz, kv, h // kv, e, s, layer, _ELSIZE[dt], qf.data_ptr(), kn.data_ptr(),
                               vn.data_ptr(), kp, vp, cp, lp, mp, e ** -0.5, CHUNK, out.data_ptr())
    if rc != 0:
        raise MemoryError("native decode attention: out of scratch memory")
    return out.to(q.dtype)
