"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

Why: a decode step of a batch runs attention once per sequence and layer; in PyTorch that
is ~10 small ops each (16 sequences x 30 layers = ~5k ops a step) whose matmuls stream a
3k-token fp32 cache at ~16 GB/s.  ``decode_attention`` does a whole layer's batch in one
call (docs/decisions.md has the measurements).

The shared library is built once per source version and CPU into a cache directory
(``$CODECOMPLETE_NATIVE_DIR``, else the daemon's cache folder, ``codecomplete.paths``)
and reused; building takes about 6 s (``model/native_build.py``, which the daemon starts
before it imports torch).  Nothing here is
required: without a C compiler, with ``CODECOMPLETE_NATIVE=0``, or when building fails,
``available()`` is False and the model keeps its PyTorch path.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import platform
import threading
from pathlib import Path

import numpy as np
import torch

from .. import native_build  # torch-free: the daemon starts the build before importing torch

log = logging.getLogger(__name__)

_SOURCES, _HEADERS, _FLAGS = native_build.SOURCES, native_build.HEADERS, native_build.FLAGS
_ELSIZE = {torch.float32: 4, torch.bfloat16: 2}
KV_DTYPES = tuple(_ELSIZE)  # cache dtypes the kernel reads
CHUNK = 256  # cache positions per work item (split-K); 128-512 measured alike here

_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_lock = threading.Lock()


def _cpu_key() -> str:
    return native_build.cpu_key()


def _cache_dir() -> Path:
    return native_build.cache_dir()


def _build() -> ctypes.CDLL:
    return configure(ctypes.CDLL(str(native_build.build())))


def _switched_on(*names: str) -> bool:
    """Whether none of these environment switches is "0" (each is on unless set so)."""
    return all(os.environ.get(name, "1") != "0" for name in names)


def configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument and result types of a built library's entry points (and its AMX switch
    from the environment); returns ``lib``.  Public so that a benchmark can load another
    revision's build and swap it in (``bench/attention_avx2.py``)."""
    fn = lib.decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 7 + [ctypes.c_void_p] * 3 + [ctypes.POINTER(ctypes.c_void_p)] * 2 + [
        ctypes.POINTER(ctypes.c_int64)] * 2 + [ctypes.POINTER(ctypes.c_void_p), ctypes.c_float, ctypes.c_int,
                                               ctypes.c_void_p]
    ptr, i32, i64p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)
    lib.qkv_attention.restype = i32
    lib.qkv_attention.argtypes = [i32] * 8 + [ptr] * 3 + [ctypes.POINTER(ptr)] * 2 + [i64p] * 2 + [
        ctypes.POINTER(ptr), ctypes.c_float, i32, ptr]
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [i32] * 3 + [ptr] * 4 + [ctypes.c_float, ptr]
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [i32] * 3 + [ptr] * 2
    lib.linear_bf16.restype = None
    lib.linear_bf16.argtypes = [i32] * 3 + [ptr] * 4
    lib.linear_bf16_path.restype = i32
    if hasattr(lib, "linear_probe_rate"):  # an older revision's build may lack it
        lib.linear_probe_rate.restype = ctypes.c_double
        lib.linear_probe_rate.argtypes = [i32]
    lib.linear_bf16_amx.restype = None
    if hasattr(lib, "linear_q8"):  # a build of an older revision (bench/common.build_revision) may lack it
        lib.linear_q8.restype = None
        lib.linear_q8.argtypes = [i32] * 3 + [ptr] * 4
    if hasattr(lib, "q8_amx_set"):
        lib.q8_amx_set.restype = i32
        lib.q8_amx_set.argtypes = [i32]
        lib.q8_amx_set(int(_switched_on("CODECOMPLETE_AMX", "CODECOMPLETE_AMX_INT8")))  # int8 products on tiles
    lib.linear_bf16_amx.argtypes = [i32] * 3 + [ptr] * 4
    lib.amx_enable.restype = i32
    lib.attn_amx_set.restype = i32
    lib.attn_amx_set.argtypes = [i32]
    lib.attn_amx_set(int(_switched_on("CODECOMPLETE_AMX", "CODECOMPLETE_AMX_ATTENTION")))  # attention's on tiles
    lib.decode_stack.restype = i32
    lib.decode_stack.argtypes = [i32] * 9 + [ctypes.POINTER(ptr), ctypes.c_float, i32] + [ptr] * 3 + [
        ctypes.POINTER(ptr)] * 2 + [i64p] * 2 + [ctypes.POINTER(ptr), ctypes.c_float, i32, ptr, ptr, i32, i32, ptr,
                                                 ctypes.POINTER(QHead), i32, i32]
    lib.head_greedy_native.restype = i32
    lib.head_greedy_amx_set.restype = i32
    lib.head_greedy_amx_set.argtypes = [i32]
    lib.argmax_bf16.restype = None
    lib.argmax_bf16.argtypes = [ctypes.c_int64, ctypes.c_int64, ptr, ptr]
    if hasattr(lib, "lookup_rows_bf16"):  # a build of an older revision (bench/common.build_revision) may lack it
        lib.lookup_rows_bf16.restype = None
        lib.lookup_rows_bf16.argtypes = [ptr, i32, ctypes.c_int64, ptr, ctypes.c_int64, ctypes.c_int64, ptr]
    if hasattr(lib, "exit_check"):  # a build of an older revision (bench/common.build_revision) may lack it
        lib.exit_check.restype = ctypes.c_float
        lib.exit_check.argtypes = [i32] * 2 + [ptr] * 3 + [ctypes.c_float] + [ptr] * 5
    if hasattr(lib, "exit_check_mlp"):
        lib.exit_check_mlp.restype = ctypes.c_float
        lib.exit_check_mlp.argtypes = [i32] * 3 + [ptr] * 4 + [ctypes.c_float] + [ptr] * 5
    if hasattr(lib, "fill_kv_folded"):
        lib.fill_kv_folded.restype = None
        lib.fill_kv_folded.argtypes = [i32] * 5 + [ptr, ctypes.c_float] + [ptr] * 2 + [i32] + [ptr] * 2 + [i32] + [
            ptr] * 2 + [ctypes.c_int64] * 2 + [ptr] * 2
    return lib


def available() -> bool:
    """Whether the native decode attention is built and loaded (builds it on first call)."""
    global _lib, _tried, _error
    if _tried:
        return _lib is not None
    with _lock:
        if not _tried:
            if not native_build.enabled():
                _error = "disabled by CODECOMPLETE_NATIVE=0"
            else:
                try:
                    _lib = _build()
                except Exception as exc:  # noqa: BLE001 - any failure means: use the PyTorch path
                    _error = str(exc)
                    log.warning("native decode attention unavailable, using PyTorch: %s", exc)
            _tried = True
    return _lib is not None


def ready() -> bool:
    """Whether the kernels are loaded in this process already (``available`` answered True)."""
    return _tried and _lib is not None


def error() -> str | None:
    """Why ``available()`` is False, if it is."""
    return _error


def problem() -> str | None:
    """Why the kernels were asked for and could not be had (no compiler, a failed build, a
    library that would not load), for a user to fix; None where they were not asked for (a GPU
    model, ``native_attention`` off) or were turned off on purpose (``CODECOMPLETE_NATIVE=0``).
    Builds nothing: it reports what ``available()`` found."""
    if not _tried or _lib is not None or not native_build.enabled():
        return None
    return _error


class StepPlan:
    """What the kernels need to know about a step's caches, built once per forward (the
    caches' addresses and lengths do not change between its layers): their K and V base
    pointers, capacities, lengths and masks as C arrays.  Checks that every cache has room
    for the ``s`` new tokens: the kernels write in place and never past a cache's end."""

    def __init__(self, caches, s: int, masks: list[torch.Tensor | None] | None = None):
        bsz = len(caches)
        self.s = s
        self.dtype = caches[0].k.dtype
        for c in caches:
            if c.length + s > c.capacity or c.k.dtype != self.dtype or not (c.k.is_contiguous() and c.v.is_contiguous()):
                raise ValueError(f"cache cannot take {s} new tokens here (length {c.length}, capacity {c.capacity}, "
                                 f"{c.k.dtype}); reserve first")
        ptrs, ints = ctypes.c_void_p * bsz, ctypes.c_int64 * bsz  # ctypes arrays pass as the C pointers
        self.k, self.v = ptrs(*[c.k.data_ptr() for c in caches]), ptrs(*[c.v.data_ptr() for c in caches])
        self.cap, self.len = ints(*[c.capacity for c in caches]), ints(*[c.length for c in caches])
        self.masks = None
        self._keep = []  # the masks' contiguous copies live as long as the plan
        if masks is not None and any(m is not None for m in masks):
            self.masks = ptrs()
            for b, (m, c) in enumerate(zip(masks, caches)):
                if m is None:
                    continue
                m = m.reshape(s, c.length + s)
                m = m if m.dtype == torch.bool and m.is_contiguous() else m.to(torch.bool).contiguous()
                self._keep.append(m)
                self.masks[b] = m.data_ptr()


class StepCaches(list):
    """A forward's list of caches carrying its ``StepPlan`` from layer to layer."""

    plan: StepPlan | None = None


def _plan(caches, s: int, masks) -> StepPlan:
    plan = getattr(caches, "plan", None)
    if plan is None or plan.s != s:
        plan = StepPlan(caches, s, masks)
        if isinstance(caches, StepCaches):
            caches.plan = plan
    return plan


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
    plan = _plan(caches, s, masks)
    dt = plan.dtype
    qf = q.to(torch.float32).contiguous()
    kn = k.to(dt).contiguous()
    vn = v.to(dt).contiguous()
    out = torch.empty((bsz, h, s, e), dtype=torch.float32)
    rc = _lib.decode_attention(bsz, kv, h // kv, e, s, layer, _ELSIZE[dt], qf.data_ptr(), kn.data_ptr(),
                               vn.data_ptr(), plan.k, plan.v, plan.cap, plan.len, plan.masks, e ** -0.5, CHUNK,
                               out.data_ptr())
    if rc != 0:
        raise MemoryError("native decode attention: out of scratch memory")
    return out.to(q.dtype)


ACT_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes of the fused step ops


def qkv_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches, layer: int, n_heads: int,
                  n_kv_heads: int, masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """``decode_attention`` straight from the fused projection: qkv [B, S, (H + 2K) * E]
    (queries, keys, values), cos and sin [B, 1, S, E] from ``Transformer.rope``, all in one
    activation dtype (``ACT_DTYPES``).  Applies the rotary embedding, writes the new keys and
    values into the caches, attends, and returns [B, S, H * E] in qkv's dtype."""
    if not available():
        raise RuntimeError(f"native decode attention unavailable: {_error}")
    bsz, s, width = qkv.shape
    e = width // (n_heads + 2 * n_kv_heads)
    plan = _plan(caches, s, masks)
    el = _ELSIZE[qkv.dtype]
    qkv, cos, sin = qkv.contiguous(), cos.to(qkv.dtype).contiguous(), sin.to(qkv.dtype).contiguous()
    out = torch.empty((bsz, s, n_heads * e), dtype=qkv.dtype)
    rc = _lib.qkv_attention(bsz, n_kv_heads, n_heads // n_kv_heads, e, s, layer, _ELSIZE[plan.dtype], el,
                            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), plan.k, plan.v, plan.cap, plan.len,
                            plan.masks, e ** -0.5, CHUNK, out.data_ptr())
    if rc != 0:
        raise MemoryError("native decode attention: out of scratch memory")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension in HF Llama's order (normalise in fp32, round, scale).
    With ``residual``: returns ``(x + residual, rms_norm(x + residual))``, the sum rounded as
    PyTorch rounds it.  x, residual and weight share one dtype of ``ACT_DTYPES``."""
    x = x.contiguous()
    d = x.shape[-1]
    out = torch.empty_like(x)
    total = None
    if residual is not None:
        residual = residual.contiguous()
        total = torch.empty_like(x)
    _lib.rms_norm(x.numel() // d, d, _ELSIZE[x.dtype], x.data_ptr(), residual.data_ptr() if total is not None else None,
                  total.data_ptr() if total is not None else None, weight.data_ptr(), eps, out.data_ptr())
    return out if total is None else (total, out)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2F] = gate | up; returns [..., F] in its dtype."""
    gate_up = gate_up.contiguous()
    f = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], f), dtype=gate_up.dtype)
    _lib.silu_mul(gate_up.numel() // (2 * f), f, _ELSIZE[gate_up.dtype], gate_up.data_ptr(), out.data_ptr())
    return out


HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
_MADV_HUGEPAGE = 14  # linux/mman.h
_libc: ctypes.CDLL | None = None


def huge_pages() -> bool:
    """Whether large CPU buffers (``huge_empty``) ask for transparent huge pages: on Linux, unless
    CODECOMPLETE_HUGE_PAGES=0.  Streaming a step's weights through 4 KB pages costs a TLB walk
    every 4 KB and stops the hardware prefetchers at every page's end; measured on an AVX2 EPYC
    (bench/results/huge_pages_avx2.md)."""
    return platform.system() == "Linux" and os.environ.get("CODECOMPLETE_HUGE_PAGES", "1") != "0"


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on the CPU whose memory starts on a huge page's boundary and
    is advised for transparent huge pages (``madvise(MADV_HUGEPAGE)``, before anything touches it,
    so the first writes fault in huge pages where the kernel has them; with THP "madvise" or
    "always").  A view of a slightly larger buffer, which it keeps alive.  Small buffers, other
    systems, ``huge_pages()`` off or a refused madvise: plain memory, the same tensor otherwise."""
    global _libc
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not huge_pages():
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE_PAGE
    view = raw[off:off + nbytes]
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise(view.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)  # refused: plain pages
    except (OSError, AttributeError):
        pass
    return view.view(dtype).view(shape)


def huge_views(like: list[torch.Tensor], arena: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Uninitialised contiguous tensors shaped and typed as ``like``, one after another (64-byte
    aligned) in one ``huge_empty`` buffer: room for a model's packed weights, which every step
    streams from memory.  ``like`` may be meta tensors: ``native_decode`` packs each matrix
    straight into its room in turn, so the copies never hold twice the weights in memory.
    ``arena``: the buffer to lay them in (``arena_bytes(like)`` uint8, e.g. filled from the packed
    weights' cache) instead of a new one."""
    if arena is None:
        arena = huge_empty((arena_bytes(like),), torch.uint8)
    elif arena.dtype != torch.uint8 or arena.numel() != arena_bytes(like):
        raise ValueError(f"an arena of {arena.numel()} bytes does not hold these tensors ({arena_bytes(like)})")
    out, off = [], 0
    for t in like:
        out.append(arena[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
        off += _room(t)
    return out


def _room(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // 64) * 64


def arena_bytes(like: list[torch.Tensor]) -> int:
    """The bytes of the buffer ``huge_views(like)`` lays its tensors in."""
    return sum(_room(t) for t in like)


def linear_bf16_path() -> int:
    """Which path the bf16 linear kernel was built with (linear.c): 2 AVX512-BF16, 1 AVX2 + FMA,
    0 the portable loop; -1 without the native kernels.  Asked of the library once (``linear``
    checks it at every call)."""
    global _path
    if _path is None:
        _path = _lib.linear_bf16_path() if available() else -1  # available() is final once answered
    return _path


_path: int | None = None


def panel_path(path: int | None = None) -> bool:
    """Whether the linear kernel's ``path`` (by default this build's) takes the panel layout
    [N/16, K, 8, 2]: the panels on AVX2 + FMA (1) or on AVX-512F (3, the same bits), not the
    dot products of AVX512-BF16 (2) or the portable loop (0)."""
    return (linear_bf16_path() if path is None else path) in (1, 3)


def linear_probe() -> dict[str, float]:
    """What the library measured when it loaded, to choose between paths 2 and 3 (linear.c's
    linear_choose): vdpbf16ps and FMA instructions a second on one core (0.0 where the build has no
    AVX512-BF16, or without the native kernels)."""
    if not available() or not hasattr(_lib, "linear_probe_rate"):
        return {"dot_per_s": 0.0, "fma_per_s": 0.0}
    return {"dot_per_s": float(_lib.linear_probe_rate(0)), "fma_per_s": float(_lib.linear_probe_rate(1))}


def linear_bf16_simd() -> bool:
    """Whether bf16 products run on SIMD here (AVX512-BF16's dot products, or AVX2 + FMA
    splitting each bf16 pair): a bf16 model's decode step then streams half an fp32 model's
    bytes through the native kernels (3.3x faster than fp32 on an AVX2-only EPYC,
    bench/results/dtype_avx2.md).  False without the kernels or on the portable loop."""
    return linear_bf16_path() >= 1


LINEAR_ROWS = 32  # rows up to which ``linear`` is at least as fast as oneDNN, weights from memory (measured)


def amx_cpu() -> bool:
    """Whether this CPU's AMX tiles are granted to the process (built with AMX, Linux agreed),
    whatever ``CODECOMPLETE_AMX`` says: PyTorch's oneDNN kernels use them too."""
    return available() and bool(_lib.amx_enable())


def amx() -> bool:
    """Whether ``linear`` runs on AMX tiles here (linear.c): ``amx_cpu()``, and not turned off
    with ``CODECOMPLETE_AMX=0``."""
    global _amx
    if _amx is None:
        _amx = _switched_on("CODECOMPLETE_AMX") and amx_cpu()
    return _amx


_amx: bool | None = None


def amx_attention(on: bool | None = None) -> bool:
    """Whether attention's two products run on AMX tiles (decode_attention.c, bf16 caches): where
    the tiles are granted, unless ``CODECOMPLETE_AMX=0`` or ``CODECOMPLETE_AMX_ATTENTION=0``; or as
    ``on`` sets it for the process (a comparison's switch: a row's bits differ between the two
    ways, so a generation keeps one)."""
    return available() and bool(_lib.attn_amx_set(-1 if on is None else int(on)))


def amx_int8(on: bool | None = None) -> bool:
    """Whether int8 layer weights (``pack_linear_q8``) multiply on AMX tiles (linear.c's
    ``q8_team_amx``: each block widened to bf16, every row count on the tile unit): where the tiles
    are granted, unless ``CODECOMPLETE_AMX=0`` or ``CODECOMPLETE_AMX_INT8=0``; or as ``on`` sets it
    for the process (a comparison's switch: a row's bits differ between the two kernels, so a model
    is generated with one)."""
    return available() and hasattr(_lib, "q8_amx_set") and bool(_lib.q8_amx_set(-1 if on is None else int(on)))


def pack_linear(weight: torch.Tensor, amx: bool = False, path: int | None = None) -> torch.Tensor:
    """A bf16 weight [N, K] in ``linear``'s layout for the kernel this build runs (``path``: which
    ``linear_bf16_path`` to pack for, by default this build's; see linear.c for why):

    - AVX512-BF16 and the portable loop (2, 0): [N/4, K/32, 4, 32], N and K padded with zeros;
    - AVX2 + FMA (1): panels [N/16, K, 8, 2] (lane j of column k: rows 16p + j and 16p + 8 + j),
      N padded to a multiple of 16;
    - ``amx``: the AMX tiles' layout [N/16, K/32, 16, 16, 2], N padded to a multiple of 32 (K must
      be a multiple of 32; see ``amx_layout``)."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16)
    if amx:
        if k % 32:
            raise ValueError(f"the AMX layout needs K a multiple of 32, not {k}")
        np_ = -(-n // 32) * 32
        if np_ != n:
            w = torch.nn.functional.pad(w, (0, 0, 0, np_ - n))
        return w.reshape(np_ // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    if panel_path(path):
        np_ = -(-n // 16) * 16
        if np_ != n:
            w = torch.nn.functional.pad(w, (0, 0, 0, np_ - n))
        return w.reshape(np_ // 16, 2, 8, k).permute(0, 3, 2, 1).contiguous()
    np_, kp = -(-n // 4) * 4, -(-k // 32) * 32
    if (np_, kp) != (n, k):
        w = torch.nn.functional.pad(w, (0, kp - k, 0, np_ - n))
    return w.reshape(np_ // 4, 4, kp // 32, 32).transpose(1, 2).contiguous()


WEIGHTS = ("bf16", "int8")  # model.weights: the layers' matrices as the checkpoint's bf16, or int8 (pack_linear_q8)


def pack_linear_q8(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] as int8 with one fp32 scale per output row, in ``linear_q8``'s layout
    (linear.c): [N/16, K * 16 + 64] int8, per panel of sixteen rows column k's sixteen values at
    16 k, then the panel's sixteen scales; q = round(w / s) with s = max |w| / 127 of the row (an
    all-zero row: scale 1), N padded with zero rows to a multiple of 16.  Half the bf16 layouts'
    bytes (a one-row step is bound by reading them); the numbers are the weight's to within s / 2
    each, so a model on them is the checkpoint's approximately (bench/results/int8_weights_avx2.md)."""
    n, k = weight.shape
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127 if k else torch.zeros(n)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    np_ = -(-n // 16) * 16
    if np_ != n:
        q = torch.nn.functional.pad(q, (0, 0, 0, np_ - n))
        scale = torch.nn.functional.pad(scale, (0, np_ - n), value=1.0)
    out = torch.empty(np_ // 16, k * 16 + 64, dtype=torch.int8, device=weight.device)
    out[:, :k * 16] = q.reshape(np_ // 16, 16, k).transpose(1, 2).reshape(np_ // 16, k * 16)
    out[:, k * 16:] = scale.reshape(np_ // 16, 16).contiguous().view(torch.int8)
    return out


def q8_shape(n: int, k: int) -> torch.Tensor:
    """A meta tensor shaped and typed as ``pack_linear_q8`` of an [n, k] weight (room in an arena)."""
    return torch.empty(-(-n // 16), k * 16 + 64, dtype=torch.int8, device="meta")


def q8_layout(packed: torch.Tensor) -> bool:
    """Whether a packed weight is ``pack_linear_q8``'s int8 layout."""
    return packed.dtype == torch.int8


def unpack_linear(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weight [n, k] that ``pack_linear`` packed (any of its layouts), padding dropped: the
    same bf16 numbers, a new tensor (``Linear.dense``)."""
    return lookup_rows(packed, torch.arange(n, device=packed.device), k)


def lookup_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the weight [n, k] that ``pack_linear`` packed, padding dropped,
    in a new tensor (a gather, never a view): an embedding lookup from a tied head's native copy
    (``Transformer.release_dense``), or all rows (``unpack_linear``).  From ``pack_linear_q8``'s
    layout: each row's int8 values times its scale, rounded to bf16."""
    flat = ids.reshape(-1)
    if (packed.dtype == torch.bfloat16 and packed.device.type == "cpu" and packed.is_contiguous()
            and flat.device.type == "cpu" and available() and hasattr(_lib, "lookup_rows_bf16")):
        # step_ops.c's gather: a few microseconds, where PyTorch's indexing over the layouts
        # below took 20-50 us for the rows of a pass (~1 % of one on the caches it leaves cold)
        layout = 2 if amx_layout(packed) else 1 if panel_layout(packed) else 0
        rows = packed.shape[0] * (4 if layout == 0 else 16)
        idx = np.ascontiguousarray(flat.numpy(), dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= rows):
            raise IndexError(f"row {int(idx.min() if idx.min() < 0 else idx.max())} out of range for {rows} rows")
        out = torch.empty(len(idx), k, dtype=torch.bfloat16)
        _lib.lookup_rows_bf16(packed.data_ptr(), layout, packed.shape[1] * (1 if layout == 1 else 32),
                              idx.ctypes.data, len(idx), k, out.data_ptr())
        return out.reshape(*ids.shape, k)
    if q8_layout(packed):  # [N/16, K * 16 + 64]: row 16p + j at column j of panel p's [K, 16], its scale after
        kk = (packed.shape[1] - 64) // 16
        q = packed[:, :kk * 16].reshape(-1, kk, 16)[flat // 16, :, flat % 16]
        scale = packed[:, kk * 16:].contiguous().view(torch.float32)[flat // 16, flat % 16]
        return (q.float() * scale[:, None]).to(torch.bfloat16)[:, :k].reshape(*ids.shape, k)
    if amx_layout(packed):  # [N/16, K/32, 16, 16, 2]: row 16a + b at [a, :, :, b, :]
        rows = packed[flat // 16, :, :, flat % 16, :]
    elif panel_layout(packed):  # [N/16, K, 8, 2]: row 16p + j at [p, :, j % 8, j // 8]
        rows = packed[flat // 16, :, flat % 16 % 8, flat % 16 // 8]
    else:  # [N/4, K/32, 4, 32]: row 4g + r at [g, :, r, :]
        rows = packed[flat // 4, :, flat % 4, :]
    return rows.reshape(flat.shape[0], -1)[:, :k].reshape(*ids.shape, k)


def amx_layout(packed: torch.Tensor) -> bool:
    """Whether a weight from ``pack_linear`` is in the AMX layout."""
    return packed.dim() == 5


def panel_layout(packed: torch.Tensor) -> bool:
    """Whether a weight from ``pack_linear`` is in the AVX2 kernel's panel layout."""
    return packed.dim() == 4 and packed.shape[-1] == 2


def packed_rows(packed: torch.Tensor, start: int) -> torch.Tensor | None:
    """The packed weight's output rows from ``start`` on (a view), or None where the layout
    cannot start there: a multiple of 4 rows, of 16 in the panel layout, of 32 in the AMX layout
    (its tiles go in pairs)."""
    align, group = (32, 16) if amx_layout(packed) else (16, 16) if panel_layout(packed) or q8_layout(packed) else (4, 4)
    return None if start % align else packed[start // group:]


class ExitCheck:
    """An early exit's softmax check of one row, its weights bound once (step_ops.c's exit_check,
    or exit_check_mlp): the exit state h + h A^T (``adapter`` packed by ``pack_linear``), or
    h + silu(h A1^T) A2^T (``adapter`` = (A1, A2, hidden), A1 [hidden, D] and A2 [D, hidden]
    packed), or h (None); its norm (weight ``norm_w``), the subset head's logits (``subset``
    packed, ``n`` rows) and the softmax margin over them.  Calling it with h [D] bf16 returns
    (margin, logits [n] bf16, state [D] bf16), both views of one buffer that the next call
    overwrites.  Binding once matters: inside a decode step, with the caches cold from the
    layers' weights, the per-call checks and allocations cost ~0.1 ms beside the kernel's ~0.3
    (measured on the AVX-512 EPYC)."""

    def __init__(self, adapter: "torch.Tensor | tuple | None", norm_w: torch.Tensor, eps: float,
                 subset: torch.Tensor, n: int, dim: int):
        if not available():
            raise RuntimeError(f"native kernels unavailable: {_error}")
        mlp = isinstance(adapter, tuple)
        weights = [*adapter[:2]] if mlp else [adapter]
        for w in (*weights, subset):
            if w is not None and (amx_layout(w) or panel_layout(w) != panel_path()):
                raise ValueError("weight packed for another linear kernel (pack_linear's path, no AMX)")
        hidden = adapter[2] if mlp else 0
        d = self.dim = dim
        self._keep = (adapter, subset, norm_w.to(torch.bfloat16).contiguous())  # what the pointers point into
        buf = self._buf = torch.empty(3 * d + hidden + n, dtype=torch.bfloat16)
        self.y, hn, tmp, self.logits = buf[:d], buf[d:2 * d], buf[2 * d:3 * d + hidden], buf[3 * d + hidden:]
        tail = (self._keep[2].data_ptr(), eps, subset.data_ptr(), self.y.data_ptr(), hn.data_ptr(),
                self.logits.data_ptr(), tmp.data_ptr())
        if mlp:
            self._fn, self._pre = _lib.exit_check_mlp, (d, n, hidden)
            self._post = (adapter[0].data_ptr(), adapter[1].data_ptr(), *tail)
        else:
            self._fn, self._pre = _lib.exit_check, (d, n)
            self._post = (adapter.data_ptr() if adapter is not None else None, *tail)

    def __call__(self, h: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
        if h.dtype != torch.bfloat16 or h.numel() != self.dim:
            raise ValueError(f"exit check of one bf16 row of {self.dim}, not {h.dtype} {tuple(h.shape)}")
        if not h.is_contiguous():
            h = h.contiguous()
        return float(self._fn(*self._pre, h.data_ptr(), *self._post)), self.logits, self.y


def exit_check(h: torch.Tensor, adapter: "torch.Tensor | tuple | None", norm_w: torch.Tensor, eps: float,
               subset: torch.Tensor, n: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``ExitCheck`` bound and called once: (margin, logits [n] bf16, state [D] bf16) of one row h."""
    margin, logits, y = ExitCheck(adapter, norm_w, eps, subset, n, h.shape[-1])(h.reshape(-1))
    return margin, logits.clone(), y.clone()


class KVFill:
    """Early exit's KV filling of one token, its weights bound once (step_ops.c's fill_kv_folded):
    the exit state h [D] bf16 normalised without a weight, times ``rows`` (the K and V rows of
    layers ``first`` .. ``first + n - 1`` with their norm weights folded in, packed by
    ``pack_linear``: ``early_exit.FoldedKV``) plus ``bias``; keys rotated by cos, sin (the token's
    position's [E] angles, bf16); keys and values written at ``pos`` of those layers of the caches
    ([L, K, capacity, E], contiguous, bf16 or fp32)."""

    def __init__(self, rows: torch.Tensor, bias: torch.Tensor | None, first: int, n: int, eps: float, dim: int,
                 kv_heads: int, head_dim: int):
        if not available() or not hasattr(_lib, "fill_kv_folded"):
            raise RuntimeError(f"native KV filling unavailable: {_error or 'an older build'}")
        self.amx = amx_layout(rows)
        if not self.amx and panel_layout(rows) != panel_path():
            raise ValueError("weight packed for another build's linear kernel (pack_linear's path)")
        self.first, self.n, self.dim, self.e = first, n, dim, head_dim
        self._keep = (rows, bias)
        self._scratch = torch.empty(dim + n * 2 * kv_heads * head_dim, dtype=torch.bfloat16)
        self._pre = (dim, kv_heads, head_dim, first, n)
        self._mid = (eps, rows.data_ptr(), bias.data_ptr() if bias is not None else None, int(self.amx))
        self._post = (self._scratch.data_ptr(), self._scratch[dim:].data_ptr())

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, pos: int) -> bool:
        """Writes the token's K and V; False (nothing written) where the caches do not fit the
        kernel (another dtype, not contiguous): the caller then takes the PyTorch path."""
        el = _ELSIZE.get(k_cache.dtype)
        if el is None or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return False
        _, kv_heads, cap, e = k_cache.shape
        if not 0 <= pos < cap or self.first + self.n > k_cache.shape[0] or e != self.e:
            raise ValueError(f"KV fill out of the cache: position {pos} of {cap}, "
                             f"layers {self.first}..{self.first + self.n - 1} of {k_cache.shape[0]}")
        if h.dtype != torch.bfloat16 or h.numel() != self.dim:
            raise ValueError(f"KV fill of one bf16 row of {self.dim}, not {h.dtype} {tuple(h.shape)}")
        h = h if h.is_contiguous() else h.contiguous()
        cs = cos if cos.dtype == torch.bfloat16 and cos.is_contiguous() else cos.to(torch.bfloat16).contiguous()
        sn = sin if sin.dtype == torch.bfloat16 and sin.is_contiguous() else sin.to(torch.bfloat16).contiguous()
        if cs.numel() != e or sn.numel() != e:
            raise ValueError(f"KV fill needs one position's {e} angles, not {tuple(cos.shape)}")
        _lib.fill_kv_folded(*self._pre, h.data_ptr(), *self._mid, cs.data_ptr(), sn.data_ptr(), el,
                            k_cache.data_ptr(), v_cache.data_ptr(), cap, pos, *self._post)
        return True


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 times a weight packed by ``pack_linear`` (+ bias, bf16): [..., N] bf16."""
    if not available():
        raise RuntimeError(f"native kernels unavailable: {_error}")
    k = x.shape[-1]
    x = x.contiguous()
    y = torch.empty((*x.shape[:-1], out_features), dtype=torch.bfloat16)
    if q8_layout(packed):
        _lib.linear_q8(x.numel() // k, out_features, k, x.data_ptr(), packed.data_ptr(),
                       bias.data_ptr() if bias is not None else None, y.data_ptr())
        return y
    if not amx_layout(packed) and panel_layout(packed) != panel_path():
        raise ValueError("weight packed for another build's linear kernel (pack_linear's path)")
    fn = _lib.linear_bf16_amx if amx_layout(packed) else _lib.linear_bf16
    fn(x.numel() // k, out_features, k, x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
       y.data_ptr())
    return y


def layer_weights(block) -> list[int] | None:
    """The addresses ``decode_stack`` reads of a ``Block`` (its norms, repacked linear weights and
    qkv bias, in step_ops.c's W_* order), or None when the block cannot run natively: its
    weights are not bf16 or not repacked (``Transformer.native_decode``)."""
    attn, mlp = block.attn, block.mlp
    if any(lin.native_weight is None for lin in (attn.wqkv, attn.wo, mlp.w13, mlp.w2)) \
            or block.attn_norm.weight.dtype != torch.bfloat16:
        return None
    bias = attn.wqkv.bias
    return [block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr(), attn.wqkv.native_weight.data_ptr(),
            bias.data_ptr() if bias is not None else None, attn.wo.native_weight.data_ptr(),
            mlp.w13.native_weight.data_ptr(), mlp.w2.native_weight.data_ptr()]


class QHead(ctypes.Structure):
    """common.h's QHead: the int8 copy of a head that ``decode_stack``'s greedy head reads."""

    _fields_ = [("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("dnorm", ctypes.c_void_p),
                ("qnorm", ctypes.c_void_p), ("Kp", ctypes.c_int)]


def greedy_head_available() -> bool:
    """Whether ``decode_stack`` can compute the greedy head (AVX512-VNNI and -BF16, or AVX2 + FMA,
    compiled in)."""
    return available() and bool(_lib.head_greedy_native())


def argmax_bf16(logits: torch.Tensor):
    """``logits.argmax(-1).tolist()`` of a CPU bf16 tensor [..., V] (the first index of each row's
    largest value, a NaN the largest), without an fp32 copy (step_ops.c)."""
    x = logits.detach().contiguous()
    n = x.shape[-1]
    out = np.empty(x.shape[:-1], dtype=np.int64)
    _lib.argmax_bf16(out.size, n, x.data_ptr(), out.ctypes.data)
    return out.tolist()


def amx_greedy_head(on: bool | None = None) -> bool:
    """Whether the greedy head bounds the logits of up to ``GREEDY_HEAD_ROWS_AMX`` rows on AMX's
    int8 tiles (linear.c) for a stack in the AMX layout: where the tiles are granted; or as ``on``
    sets it for the process (a comparison's switch; the logits it returns are the same either way,
    exact where the greedy choice can be)."""
    return available() and bool(_lib.head_greedy_amx_set(-1 if on is None else int(on)))


def greedy_head_rows(stack: "Stack") -> int:
    """Logit rows up to which ``decode_stack(stack, greedy=True)`` takes the greedy head."""
    if stack.qhead is None:
        return 0
    if stack.amx and amx_greedy_head():
        return GREEDY_HEAD_ROWS_AMX
    vnni = _lib.head_greedy_vnni() if hasattr(_lib, "head_greedy_vnni") else linear_bf16_path() != 1
    return GREEDY_HEAD_ROWS if vnni else GREEDY_HEAD_ROWS_AVX2


def greedy_head_like(v: int, k: int) -> list[torch.Tensor]:
    """Meta tensors shaped and typed as the ones ``pack_greedy_head`` makes for a head [v, k]."""
    vp, kp = -(-v // 16) * 16, -(-k // 64) * 64
    return [torch.empty(vp // 16, kp // 4, 16, 4, dtype=torch.uint8, device="meta")] + [
        torch.empty(vp, device="meta") for _ in range(3)]


def pack_greedy_head(weight: torch.Tensor, chunk: int = 2048) -> tuple[QHead, list[torch.Tensor]] | None:
    """The int8 copy of a head weight [V, K] that linear.c's greedy head reads (rows scaled by
    max|w| / 127, stored + 128 as u8, packed [V/16, K/4, 16, 4], K padded with zeros to a multiple of
    64 for the int8 tiles) with each row's scale and the two norms of its error bound; None when the
    weight is not finite.  Returns the C struct and the tensors it points into (keep them alive).
    Every step is row by row, so it runs ``chunk`` rows (a multiple of 16) at a time with the same
    results: the whole head's float temporaries took ~385 MB of the model load's peak."""
    v, k = weight.shape
    vp, kp = -(-v // 16) * 16, -(-k // 64) * 64
    chunk = max(16, chunk // 16 * 16)
    # the results are allocated first and filled in place: kept pieces between the temporaries
    # would fragment the heap (it grew ~290 MB over the default model's head that way)
    keep = [torch.empty(t.shape, dtype=t.dtype) for t in greedy_head_like(v, k)]
    for i in range(0, vp, chunk):
        w = weight.detach()[i:i + chunk].to(torch.float32)
        if not torch.isfinite(w).all():
            return None
        rows = min(chunk, vp - i)
        w = torch.nn.functional.pad(w, (0, kp - k, 0, rows - w.shape[0]))
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127)
        scale = torch.where(amax > 0, scale, torch.zeros_like(scale))
        # the bound's norms, in float64 and rounded up a little (they bound errors, they need not be exact)
        dnorm = (w.double() - scale.double()[:, None] * q.double()).norm(dim=1)
        qnorm = q.double().norm(dim=1)
        q8 = (q + 128).to(torch.uint8).reshape(rows // 16, 16, kp // 4, 4)
        keep[0][i // 16:(i + rows) // 16] = q8.transpose(1, 2)
        for out, got in zip(keep[1:], (scale, (dnorm * (1 + 1e-6)).float(), (qnorm * (1 + 1e-6)).float())):
            out[i:i + rows] = got
    return QHead(*[t.data_ptr() for t in keep], kp), keep


class Stack:
    """What ``decode_stack`` needs of a bf16 model that does not change between steps: its sizes
    and every layer's weights' addresses (as one C array, and one per layer for single-layer
    calls), the final norm and the repacked head.  Built by ``Transformer.native_decode``; it
    holds the weights' tensors so the addresses stay valid."""

    def __init__(self, model, qhead: list[torch.Tensor] | None = None):
        """``qhead``: the greedy head's tensors as ``pack_greedy_head`` made them for this head
        (from the packed weights' cache), instead of packing them here."""
        a = model.args
        self.dims = (a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim)
        self.eps = a.norm_eps
        per = [layer_weights(b) for b in model.layers]
        if any(p is None for p in per) or model.head.native_weight is None:
            raise ValueError("every layer and the head need bf16 weights in the native layout")
        ptrs = ctypes.c_void_p * (len(per) * len(per[0]))
        self.weights = ptrs(*[w for p in per for w in p])
        self.layer = [(ctypes.c_void_p * len(p))(*p) for p in per]
        self.norm, self.head, self.vocab = model.norm.weight.data_ptr(), model.head.native_weight.data_ptr(), a.vocab_size
        mats = [lin.native_weight for b in model.layers for lin in (b.attn.wqkv, b.attn.wo, b.mlp.w13, b.mlp.w2)]
        q8 = {q8_layout(w) for w in mats}
        if len(q8) != 1:
            raise ValueError("the layers' matrices need the same native layout (all int8 or none)")
        self.q8 = q8.pop()  # the layers' matrices are int8 (linear_q8); the head is bf16 either way
        layouts = {amx_layout(w) for w in ([] if self.q8 else mats) + [model.head.native_weight]}
        if len(layouts) != 1:
            raise ValueError("every matrix of the stack needs the same native layout")
        self.amx = layouts.pop()  # every bf16 matrix runs on AMX tiles (linear.c), the greedy head's exact rows too
        if qhead is not None:
            packed = QHead(*[t.data_ptr() for t in qhead], qhead[0].shape[1] * 4), qhead
        else:
            packed = pack_greedy_head(model.head.weight) if greedy_head_available() else None
        self.qhead, self._qkeep = packed if packed is not None else (None, [])
        # what the C code reads: the norms, the biases and the repacked weights (not the linear
        # layers' dense weights, which Transformer.release_dense may drop)
        mods = [m for top in (model.norm, model.head, *model.layers) for m in top.modules()]
        self._keep = [p for m in mods for name, p in m.named_parameters(recurse=False)
                      if not (isinstance(m, torch.nn.Linear) and name == "weight")] + [
            mod.native_weight for mod in model.modules() if getattr(mod, "native_weight", None) is not None]


# logit rows up to which decode_stack(greedy=True) uses the greedy head: it reads half the head's bytes
# but does as many multiply-adds (an int8 copy of the weights times a 16-bit copy of the input, in two
# int8 halves), so it wins while the head is memory-bound: measured on SmolLM2-135M (V = 49152),
# -0.2 to -0.5 ms a step at 1-4 rows, +0.2 at 5, +0.7 at 13
GREEDY_HEAD_ROWS = 4
# the same on AMX's int8 tiles (``amx_greedy_head``), whose products cost little at any row count up to
# a tile's 16: it wins at every size (bench/results/greedy_head_amx.md)
GREEDY_HEAD_ROWS_AMX = 16
# the same on an AVX2 build (no AVX512-BF16), the bounds on vpmaddwd: its sixteen products need an add
# to accumulate, so they cost what the bf16 kernel's FMAs cost and only the halved bytes count; measured
# on an AVX2 EPYC, a step 1.11-1.17x faster at 1 row, 0.97-1.11x at 2, even at 3-4, slower at 5-6
# (bench/results/greedy_head_avx2.md)
GREEDY_HEAD_ROWS_AVX2 = 2
STACK_ROWS = 64  # rows (batch x new tokens) up to which a step runs as one decode_stack call
# a long causal prompt of one sequence runs as decode_stack calls of this many rows (Transformer.forward):
# measured on SmolLM2-135M, 1280 tokens in pieces of 64 / 128 / 256 / 512 rows: 0.64 / 0.57 / 0.55 / 0.57 s
# (PyTorch's path over the whole prompt: 0.81 s); a multiple of 32, so every piece's attention sums keys in
# the same blocks whatever the piece size
PREFILL_ROWS = 256


def decode_stack(stack: Stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches,
                 masks: list[torch.Tensor | None] | None = None, layer: int | None = None,
                 logits: str | None = "last", layers: tuple[int, int] | None = None, greedy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A few-token step of a bf16 model in one native call: x [B, S, D] bf16 (the embeddings)
    through every layer (or only ``layer``, or layers ``first`` .. ``end`` - 1 for ``layers`` =
    (first, end)), the caches written at each layer; cos and sin
    [B, 1, S, E] from ``Transformer.rope``.  Returns the hidden state after the layers [B, S, D]
    and, when ``logits`` is "last" or "all", the head's logits of each sequence's last row
    [B, V] or of every row [B, S, V] (bf16).  ``greedy``: only the greedy choice of each row is
    wanted, so (when the stack has an int8 copy of the head) the logits are exact where a row's
    maximum can be, ties included, and -inf elsewhere (linear.c's greedy head: half the head's
    bytes read).  Cache lengths are left to the caller."""
    if not available():
        raise RuntimeError(f"native kernels unavailable: {_error}")
    d, h, kv, e, f = stack.dims
    bsz, s, _ = x.shape
    plan = _plan(caches, s, masks)
    x = x.contiguous().clone()  # updated in place by the kernel
    cos, sin = cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous()
    if layer is not None:
        weights, first, count = stack.layer[layer], layer, 1
    elif layers is not None:
        first, count = layers[0], layers[1] - layers[0]
        weights = ctypes.cast(ctypes.byref(stack.weights, first * len(stack.layer[0]) * ctypes.sizeof(ctypes.c_void_p)),
                              ctypes.POINTER(ctypes.c_void_p))
    else:
        weights, first, count = stack.weights, 0, len(stack.layer)
    out = None
    if logits is not None:
        out = torch.empty((bsz, stack.vocab) if logits == "last" else (bsz, s, stack.vocab), dtype=torch.bfloat16)
    rc = _lib.decode_stack(bsz, s, d, h, kv, e, f, first, count, weights, stack.eps, _ELSIZE[plan.dtype], x.data_ptr(),
                           cos.data_ptr(), sin.data_ptr(), plan.k, plan.v, plan.cap, plan.len, plan.masks, e ** -0.5,
                           CHUNK, stack.norm if out is not None else None, stack.head if out is not None else None,
                           stack.vocab, int(logits == "last"), out.data_ptr() if out is not None else None,
                           ctypes.byref(stack.qhead) if greedy and stack.qhead is not None and out is not None else None,
                           int(stack.amx), int(stack.q8))
    if rc != 0:
        raise MemoryError("native decode step: out of scratch memory")
    return x, out
