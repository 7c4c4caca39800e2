"""A compact Llama-family transformer (Llama, Mistral, Qwen2) that owns its forward.

Why our own: layer-by-layer execution (early exit), explicit positions and attention
masks (tree verification, EFIM), and one KV layout the KV store can slice and reuse.
Weights come from any Hugging Face causal LM of these families (``from_hf``); the
transformers model stays the slow reference in the parity tests.

Shapes: B batch, S new tokens, T cached + new tokens, D model width, H query heads,
K key/value heads, E head dim.  A sequence's KV lives in a ``SeqKV``: per layer
``k, v: [K, capacity, E]``, of which the first ``length`` positions are filled.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import native

if TYPE_CHECKING:
    from .packcache import Prepacked

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None
    qkv_bias: bool
    tie_embeddings: bool
    max_positions: int

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelArgs":
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model type {cfg.model_type!r} is not supported by the own forward "
                             f"(supported: {', '.join(SUPPORTED)})")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"rope type {kind!r} is not supported by the own forward")
        scaling = None
        if kind == "linear":
            scaling = ("linear", float(rope["factor"]))
        elif kind == "llama3":
            scaling = ("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                       float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(vocab_size=cfg.vocab_size, dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
                   n_heads=cfg.num_attention_heads,
                   n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                   head_dim=head_dim, hidden_dim=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps,
                   rope_theta=float(theta), rope_scaling=scaling,
                   qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
                   tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                   max_positions=int(getattr(cfg, "max_position_embeddings", 4096)))


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [E/2], with linear or llama3 scaling applied; on the CPU (a model built
    on the meta device would send these through torch._refs, whose import pulls in torch._dynamo:
    over a second of every load)."""
    e = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, e, 2, dtype=torch.float64, device="cpu") / e))
    if args.rope_scaling and args.rope_scaling[0] == "linear":
        inv = inv / args.rope_scaling[1]
    elif args.rope_scaling and args.rope_scaling[0] == "llama3":
        _, factor, low, high, orig = args.rope_scaling
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / low, orig / high
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF Llama's order: normalise in fp32, cast back, then scale (one fused op here).
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose weight may be dropped where it is the tied head's and the head's
    native copy holds the same numbers (``Transformer.release_dense``): lookups then read the rows
    from that copy (``native.lookup_rows``); reading ``weight`` brings it back."""

    rows_from: "Linear | None" = None  # the tied head, while the weight is dropped (not a submodule)

    def reset_parameters(self) -> None:
        # a meta weight gets its numbers from the checkpoint (from_safetensors). nn.Embedding's
        # normal_ on the meta device goes through torch._refs, whose import pulls in
        # torch._dynamo: 1.1-1.7 s of every load, for numbers that are never kept
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        head = self.__dict__.get("rows_from")
        if head is not None and not torch.is_grad_enabled():
            return native.lookup_rows(head.native_weight, tokens, self.embedding_dim)
        return super().forward(tokens)

    def __getattr__(self, name: str):
        if name == "weight" and self.__dict__.get("rows_from") is not None:
            self.rows_from.restore_dense()
        return super().__getattr__(name)


class Linear(nn.Linear):
    """``nn.Linear`` that can run on a weight prepacked for oneDNN (see ``pack``).

    Measured on this project's 2-core CPU (bf16, one token): PyTorch's plain linear streams
    the weights at 14-31 GB/s, the prepacked oneDNN kernel at 37-75 GB/s when they are in
    cache; results are bit-identical.  A whole decode step, streaming from memory, ran
    oneDNN at ~17 GB/s, so steps of up to ``native.LINEAR_ROWS`` rows use ``native.linear``
    on its own copy of the weight where it is built (~30-40 GB/s at one row; up to 32 rows
    it is also at least as fast as oneDNN, see model/native/linear.c).
    The copies are used only without autograd (inference)."""

    packed: torch.Tensor | None = None
    native_weight: torch.Tensor | None = None  # in native.linear's layout (Transformer.native_decode)
    _released: bool | None = None  # the dense weight was dropped (its requires_grad): release_dense

    def reset_parameters(self) -> None:
        # a meta weight gets its numbers from the checkpoint or the native copy: kaiming_uniform_ on
        # the meta device goes through torch._decomp, 75 ms of every load for numbers never kept
        if not self.weight.is_meta:
            super().reset_parameters()

    def release_dense(self) -> bool:
        """Drop the dense weight where ``native_weight`` holds the same numbers (bf16, repacked
        by ``Transformer.native_decode``; with int8 weights, the numbers the model now runs): the
        memory of one copy of the weights.  Reading
        ``weight`` afterwards brings it back (``restore_dense``), so a path that needs it stays
        correct.  Returns whether the weight is dropped now."""
        w = self._parameters.get("weight")
        if w is None:
            return self._released is not None
        if self.native_weight is None or w.dtype != torch.bfloat16:
            return False
        self._released = w.requires_grad
        del self._parameters["weight"]
        return True

    def dense(self) -> torch.Tensor:
        """The weight: the parameter, or where it was dropped, a copy unpacked from the native
        layout (not kept)."""
        w = self._parameters.get("weight")
        if w is not None:
            return w
        return native.unpack_linear(self.native_weight, self.out_features, self.in_features)

    def restore_dense(self) -> None:
        """Bring a dropped dense weight back as the parameter (unpacked from the native copy), to
        the embedding too where it was that embedding's tied weight."""
        if self._released is None:
            return
        grad, w = self._released, self.dense()
        self._released = None
        self._parameters["weight"] = weight = nn.Parameter(w, requires_grad=grad)
        tied = self.__dict__.pop("_tied", None)
        if tied is not None:
            tied._parameters["weight"] = weight
            object.__setattr__(tied, "rows_from", None)
        log.debug("dense weight [%d, %d] restored from the native copy", self.out_features, self.in_features)

    def __getattr__(self, name: str):
        if name == "weight" and self.__dict__.get("_released") is not None:
            self.restore_dense()
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            if self.native_weight is not None and x.dtype == torch.bfloat16 \
                    and x.numel() <= native.LINEAR_ROWS * x.shape[-1]:
                return native.linear(x, self.native_weight, self.bias, self.out_features)  # few rows: decode
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``Transformer.pack`` applies: CPU, oneDNN built in, bf16 or fp32 weights, and
    this CPU's oneDNN takes that dtype (its bf16 path needs AVX-512BW/VL/DQ or AVX-NE-CONVERT:
    on an AVX2-only CPU the reorder raises, and the weights stay unpacked)."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and _onednn_takes(dtype))


@functools.lru_cache(maxsize=None)
def _onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN on this CPU prepacks and runs a linear weight of ``dtype`` (probed once
    on a tiny weight: its CPU checks are not exposed for every dtype)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, S, E]; cos, sin: [B, 1, S, E], sin's first half negated (see rope()):
    # HF Llama's rotate-half, x*cos + cat(-x2, x1)*sin, as one roll.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class SeqKV:
    """One sequence's KV cache: per layer k, v [K, capacity, E]; grows by doubling."""

    def __init__(self, args: ModelArgs, capacity: int, dtype: torch.dtype, device):
        self.args, self.dtype, self.device = args, dtype, device
        shape = (args.n_layers, args.n_kv_heads, max(capacity, 16), args.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        need = self.length + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty((old.shape[0], old.shape[1], cap, old.shape[3]), dtype=old.dtype, device=old.device)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def clone(self) -> "SeqKV":
        """A copy that grows apart from this one (a forked decode: an alternative completion)."""
        new = SeqKV.__new__(SeqKV)
        new.args, new.dtype, new.device, new.length = self.args, self.dtype, self.device, self.length
        new.k, new.v = torch.empty_like(self.k), torch.empty_like(self.v)
        new.k[:, :, :self.length] = self.k[:, :, :self.length]  # the room after it holds nothing yet
        new.v[:, :, :self.length] = self.v[:, :, :self.length]
        return new

    def load(self, parts: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Fill the first ``n`` positions from cached KV pieces ``(k, v): [L, K, m, E]``
        (the KV store's edges, in order), copying each once."""
        self.length = 0
        self.reserve(n)
        pos = 0
        for k, v in parts:
            m = min(k.shape[2], n - pos)
            if m <= 0:
                break
            self.k[:, :, pos:pos + m] = k[:, :, :m]
            self.v[:, :, pos:pos + m] = v[:, :, :m]
            pos += m
        self.length = pos


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _causal_after_cache(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Causal attention of S new queries over T = C cached + S new keys, as two mask-free
    flash passes (queries over the cached keys, all visible; queries over the new keys,
    causal) merged by their log-sum-exps.  On CPU the fused kernel with an explicit mask
    runs ~2x slower than without one (measured: 2.4k queries over 3k keys, 140 vs 83 ms a
    layer), and a prefill over a reused prefix is exactly this shape."""
    c = keys.shape[2] - q.shape[2]
    g = q.shape[1] // keys.shape[1]
    if g > 1:
        keys, vals = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)
    qq = q.to(keys.dtype)
    o1, l1 = _CPU_FLASH(qq, keys[:, :, :c], vals[:, :, :c], 0.0, False)[:2]
    o2, l2 = _CPU_FLASH(qq, keys[:, :, c:], vals[:, :, c:], 0.0, True)[:2]
    lse = torch.logaddexp(l1, l2)  # [1, H, S], fp32
    out = o1.float() * (l1 - lse).exp().unsqueeze(-1) + o2.float() * (l2 - lse).exp().unsqueeze(-1)
    return out.to(q.dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
           causal: bool) -> torch.Tensor:
    """Attention of q [1, H, S, E] over keys, vals [1, K, T, E]; mask [1, 1, S, T] (True =
    attend) or ``causal`` (the S queries are the last S positions: each sees every earlier
    key) or neither (all).  Few queries (decode, drafts): plain matmuls with the query heads
    grouped under their KV head, which beats the fused kernel's set-up cost; many queries
    (prefill): the fused kernel, mask-free where the mask is causal."""
    _, h, s, e = q.shape
    kv, t = keys.shape[1], keys.shape[2]
    if s > 64:
        if mask is None and causal and t > s:  # new tokens after cached ones
            if q.device.type == "cpu" and _CPU_FLASH is not None:
                return _causal_after_cache(q, keys, vals)
            mask = causal_mask(t - s, s, q.device).view(1, 1, s, -1)
        out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, vals, attn_mask=mask,
                                             is_causal=causal and mask is None, enable_gqa=h != kv)
        return out.to(q.dtype)
    g = h // kv
    qg = q.reshape(kv, g * s, e).to(keys.dtype)  # heads of one group share a KV head
    scores = torch.matmul(qg, keys[0].transpose(1, 2)).float() * (1.0 / math.sqrt(e))  # [K, G*S, T]
    if mask is None and causal:
        mask = causal_mask(keys.shape[2] - s, s, q.device).view(1, 1, s, -1)
    if mask is not None:
        scores = scores.view(kv, g, s, -1).masked_fill(~mask[0], float("-inf")).view(kv, g * s, -1)
    probs = torch.softmax(scores, dim=-1).to(vals.dtype)
    return torch.matmul(probs, vals[0]).view(1, h, s, e).to(q.dtype)


class Attention(nn.Module):
    native = False  # few-token steps through the native CPU kernel (Transformer.native_decode)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        h, k, e = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = Linear(args.dim, (h + 2 * k) * e, bias=args.qkv_bias)
        self.wo = Linear(h * e, args.dim, bias=False)

    def forward(self, x, cos, sin, layer: int, caches: list[SeqKV], masks: list[torch.Tensor | None]):
        # x: [B, S, D]; every sequence b appends S positions to caches[b]
        a = self.args
        bsz, s, _ = x.shape
        qkv = self.wqkv(x)
        if s <= 64 and self.native and caches[0].k.dtype in native.KV_DTYPES and qkv.dtype in native.ACT_DTYPES:
            # decode or verification: rotary, cache writes and the whole batch's attention in one call
            return self.wo(native.qkv_attention(qkv, cos, sin, caches, layer, a.n_heads, a.n_kv_heads, masks))
        q, k, v = qkv.split([a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], -1)
        q = apply_rope(q.view(bsz, s, a.n_heads, a.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(bsz, s, a.n_kv_heads, a.head_dim).transpose(1, 2), cos, sin)
        v = v.view(bsz, s, a.n_kv_heads, a.head_dim).transpose(1, 2)
        if s <= 64 and self.native and caches[0].k.dtype in native.KV_DTYPES:  # decode or verification
            out = native.decode_attention(q, k, v, caches, layer, masks)  # the whole batch in one call
            return self.wo(out.transpose(1, 2).reshape(bsz, s, a.n_heads * a.head_dim))
        outs = []
        for b, cache in enumerate(caches):
            start = cache.length
            cache.k[layer, :, start:start + s] = k[b]
            cache.v[layer, :, start:start + s] = v[b]
            keys = cache.k[layer, :, : start + s].unsqueeze(0)  # [1, K, T, E]
            vals = cache.v[layer, :, : start + s].unsqueeze(0)
            outs.append(attend(q[b:b + 1], keys, vals, masks[b], causal=s > 1))
        out = torch.cat(outs, 0).transpose(1, 2).reshape(bsz, s, a.n_heads * a.head_dim)
        return self.wo(out)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.hidden_dim, bias=False)
        self.w2 = Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    native = False  # few-token steps through the fused native ops (Transformer.native_decode)
    native_stack: "native.Stack | None" = None  # the model's, set by Transformer.native_decode (bf16 weights)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, layer, caches, masks):
        if self.native and x.shape[1] <= 64 and x.dtype in native.ACT_DTYPES and not torch.is_grad_enabled() \
                and self.attn_norm.weight.dtype == x.dtype:
            if self.native_stack is not None and x.shape[0] * x.shape[1] <= native.STACK_ROWS:  # the block in one call
                return native.decode_stack(self.native_stack, x, cos, sin, caches, masks, layer=layer, logits=None)[0]
            # a few-token step: norms (with the residual add), rotary and attention, and the MLP's
            # gate are one native call each, the same arithmetic as below in ~8 calls instead of ~40
            h = native.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps)
            a = self.attn(h, cos, sin, layer, caches, masks)
            x, h = native.rms_norm(x, self.mlp_norm.weight, self.mlp_norm.eps, residual=a)
            return x + self.mlp.w2(native.silu_mul(self.mlp.w13(h)))
        x = x + self.attn(self.attn_norm(x), cos, sin, layer, caches, masks)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # the KV cache's dtype; None: default_kv_dtype
        self.kv_dtype: torch.dtype | None = None
        self.embed = Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(args), persistent=False)
        self.native_stack: native.Stack | None = None  # Transformer.native_decode
        self.weights_wanted = "bf16"  # native_decode's `weights`: what it packs the layers' matrices as
        self.native_arena: torch.Tensor | None = None  # the one buffer of the native copies (native_decode)
        self.native_prefill = True  # long causal prompts in native pieces (forward; set by native_decode)
        self.greedy_head = True  # forward(greedy=True) may use native's greedy head (exact argmax, half the bytes)
        # called before every pass (and every piece of a long prompt): the engine sets the thread
        # count there while other processes use the cores (threads.ThreadGovernor)
        self.before_pass: Callable[[], None] | None = None
        self._rope_table: tuple | None = None  # (dtype, device, inv_freq) key, cos, sin [n, E]: rope

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # (the embedding's weight may be dropped: release_dense)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def weights(self) -> str:
        """What the layers' matrices run as: "int8" (``native_decode(weights="int8")``), else the dtype's name."""
        stack = self.native_stack
        return "int8" if stack is not None and stack.q8 else str(self.dtype).removeprefix("torch.")

    @torch.no_grad()
    def pack(self, on: bool = True) -> bool:
        """Give every linear layer (the head too) a oneDNN-prepacked copy of its weight, or
        drop the copies (``on=False``).  Costs one more copy of those weights in memory;
        call it again after moving or changing the weights.  Returns whether packing is on."""
        on = on and can_pack(self.device, self.dtype)
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.packed = torch.ops.mkldnn._reorder_linear_weight(mod.weight.detach(), None) if on else None
        return on

    def native_decode(self, on: bool = True, prepacked: "Prepacked | None" = None, weights: str | None = None) -> bool:
        """Run few-token steps (decode steps, speculation's verification: up to 64 new tokens
        per sequence, causal or masked) through the native CPU kernels (``model/native``,
        built on first use): attention with its rotary embedding, the norms and the MLP's
        gate fused into one call each, and, for bf16 weights, the whole step of up to
        ``native.STACK_ROWS`` rows (every layer, the norm and the head) in one call with its own
        linear kernel on a repacked copy of the weights (one more copy in memory).
        ``on=False``: PyTorch throughout.  Call it again after changing the weights.  Returns whether the kernels are in use: CPU and a C compiler.

        ``prepacked``: the native copies as an earlier load made them (model/packcache.py), for a
        model built without its linear weights (``from_safetensors(linear=False)``): they are used
        as they are, and a dense weight read later is unpacked from them.  ValueError where they do
        not fit this model and this CPU's layout (nothing is changed then).

        ``weights`` (``native.WEIGHTS``; None: as the last call chose, at first "bf16"): "int8" packs
        the layers' four matrices as int8 with a scale per output row (``native.pack_linear_q8``:
        half the bytes a step reads; the head stays bf16), from the weights the model holds now, so
        the model becomes an approximation of the checkpoint's (``weights`` reports what runs)."""
        if weights is not None and weights not in native.WEIGHTS:
            raise ValueError(f"weights {weights!r}: expected one of {', '.join(native.WEIGHTS)}")
        want = weights or self.weights_wanted
        on = on and self.device.type == "cpu" and native.available()
        lin = on and self.dtype == torch.bfloat16
        mats = [m for m in self.modules() if isinstance(m, Linear)]
        q8 = lin and want == "int8"
        layer_mats = {id(m) for b in self.layers
                      for m in (b.attn.wqkv, b.attn.wo, b.mlp.w13, b.mlp.w2)} if q8 else set()
        # every bf16 matrix on AMX tiles where the CPU has them (linear.c: up to 16 rows at the cost of
        # one, and faster at one) and every matrix's K allows their layout
        amx = lin and native.amx() and all(m.in_features % 32 == 0 for m in mats)
        shapes = [native.q8_shape(m.out_features, m.in_features) if id(m) in layer_mats else
                  native.pack_linear(torch.empty(m.out_features, m.in_features, dtype=torch.bfloat16, device="meta"),
                                     amx=amx) for m in mats] if lin else []
        if prepacked is not None:
            prepacked.check(lin, shapes, self.head)
        for layer in self.layers:
            layer.native = layer.attn.native = on
        for mod in mats:
            mod.restore_dense()  # its native copy is about to be replaced or dropped
            mod.native_weight = None
        self.native_arena = None  # the buffer of every native copy (the packed weights' cache writes it)
        if lin and prepacked is not None:  # the copies an earlier load packed: used in place
            for mod, room in zip(mats, native.huge_views(shapes, prepacked.arena)):
                mod.native_weight = room
            self.native_arena = prepacked.arena
            self._drop_unread_weights()
        elif lin:  # every step streams them all: one buffer on huge pages, each matrix packed into its room in turn
            self.native_arena = native.huge_empty((native.arena_bytes(shapes),), torch.uint8)
            for mod, room in zip(mats, native.huge_views(shapes, self.native_arena)):
                packed = native.pack_linear_q8(mod.weight) if id(mod) in layer_mats else native.pack_linear(mod.weight,
                                                                                                          amx=amx)
                mod.native_weight = room.copy_(packed)
        self.weights_wanted = want
        # long prompts: native pieces on CPUs without AMX (1.2-1.8x faster than PyTorch's path
        # there), and on a CPU with AMX where our matrices and attention both run on its tiles
        # (1.03-1.5x faster than PyTorch's path at 2k-256 tokens); with our matrices or attention
        # off the tiles, PyTorch's path (oneDNN's AMX matrices, its attention) was faster: 2.1x at
        # 2k tokens with only our matrices on tiles, 4-5x with neither (bench/results/prefill.md)
        self.native_prefill = not native.amx_cpu() or (amx and native.amx_attention())
        if os.environ.get("CODECOMPLETE_NATIVE_PREFILL") in ("0", "1"):  # a comparison's switch
            self.native_prefill = os.environ["CODECOMPLETE_NATIVE_PREFILL"] == "1"
        # steps of up to STACK_ROWS rows: one call
        self.native_stack = native.Stack(self, prepacked.qhead if prepacked else None) if lin else None
        for layer in self.layers:
            layer.native_stack = self.native_stack
        return on

    def _drop_unread_weights(self) -> None:
        """The linear layers' weights left on the meta device (``from_safetensors(linear=False)``)
        marked as dropped (``Linear.release_dense``), an embedding tied to the head too, so that a
        reader of a ``weight`` gets it unpacked from the native copy."""
        head, embed = self.head, self.embed
        tied = embed._parameters.get("weight")
        if tied is not None and tied.is_meta and head._parameters.get("weight") is tied:
            del embed._parameters["weight"]
            object.__setattr__(embed, "rows_from", head)  # not a submodule
            object.__setattr__(head, "_tied", embed)
        for mod in self.modules():
            w = mod._parameters.get("weight") if isinstance(mod, Linear) else None
            if w is not None and w.is_meta:
                mod._released = w.requires_grad
                del mod._parameters["weight"]

    def use_greedy_head(self, rows: int) -> bool:
        """Whether a native step with ``rows`` logit rows whose caller reads only the greedy
        choices should take the greedy head: it is on (``greedy_head``), built (AVX512-VNNI or AVX2), and
        it pays at that many rows (``native.greedy_head_rows``)."""
        stack = self.native_stack
        return self.greedy_head and stack is not None and rows <= native.greedy_head_rows(stack)

    @property
    def packed(self) -> bool:
        return self.head.packed is not None

    @property
    def native_serves_all(self) -> bool:
        """Whether every inference pass of one or a few sequences runs in the native stack (steps
        and passes of up to ``native.STACK_ROWS`` rows, batches in groups of them, long prompts in
        pieces): then oneDNN's prepacked copy (``pack``) would only take memory."""
        return self.native_stack is not None and self.native_prefill

    def pack_where_read(self, on: bool = True) -> bool:
        """``pack(on)`` where PyTorch's path serves passes (fp32, no C compiler, AMX without its
        attention); with the native stack serving them all, no copy: 258 MB of the default model
        that nothing read.  Call it again after ``native_decode``."""
        return self.pack(on and not self.native_serves_all)

    def release_dense(self) -> int:
        """Where the native stack serves every pass (``native_serves_all``), drop PyTorch's dense
        copy of every linear weight that has a native copy: 269 MB of the default model that no
        pass reads.  A head tied to the embedding goes too, and the embedding's lookups read its
        rows from the head's native copy (``Embedding``).  A later reader of a ``weight`` gets
        it back (``Linear.restore_dense``).  Call it again after ``native_decode``.  Returns how
        many linear weights are dropped."""
        if not self.native_serves_all:
            return 0
        head, embed = self.head, self.embed
        tied = embed._parameters.get("weight")
        if tied is not None and head._parameters.get("weight") is tied:
            if head.release_dense():
                del embed._parameters["weight"]
                object.__setattr__(embed, "rows_from", head)  # not a submodule
                object.__setattr__(head, "_tied", embed)
        return sum(m.release_dense() for m in self.modules() if isinstance(m, Linear))

    @property
    def default_kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype unless ``kv_dtype`` says otherwise: the weights' dtype off CPU;
        on a CPU, bf16 for a bf16 model whose few-token steps run in the native kernel (its
        keys and values are bf16 numbers anyway, so nothing is lost, and the kernel reads half
        the bytes: bench/results/kv_dtype.md), else fp32 (PyTorch's small bf16 matmuls are
        slower than fp32 ones here)."""
        if self.device.type != "cpu":
            return self.dtype
        if self.dtype == torch.bfloat16 and self.layers[0].attn.native:
            return torch.bfloat16
        return torch.float32

    def new_cache(self, capacity: int = 256) -> SeqKV:
        return SeqKV(self.args, capacity, self.kv_dtype or self.default_kv_dtype, self.device)

    def rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, S, E] of positions [B, S], computed (``rope`` looks them up)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, S, E/2]
        cos = freqs.cos()
        sin = freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
        sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1)  # signs of rotate-half folded in
        return cos.to(self.dtype), sin.to(self.dtype)

    def rope(self, positions: torch.Tensor, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, S, E] of positions [B, S] (all below ``end`` when given), looked up
        in a table of ``rope_angles`` over 0 .. n - 1 that doubles as positions outgrow it: one
        gather instead of ~8 ops a step (each ~0.05 ms on the cold caches after a native pass
        here), and a position's angles are the same bits whatever else is in the batch."""
        if end is None:
            end = int(positions.max()) + 1 if positions.numel() else 0
        key = (self.dtype, self.device, self.inv_freq.data_ptr())
        table = self._rope_table
        if table is None or table[0] != key or table[1].shape[0] < end:
            n = max(1024, end, 2 * table[1].shape[0] if table is not None and table[0] == key else 0)
            cos, sin = self.rope_angles(torch.arange(n, device=self.device).unsqueeze(0))
            table = self._rope_table = (key, cos[0, 0], sin[0, 0])
        return table[1][positions].unsqueeze(1), table[2][positions].unsqueeze(1)

    def forward(self, tokens: torch.Tensor, caches: list[SeqKV], positions: torch.Tensor | None = None,
                masks: list[torch.Tensor | None] | None = None, logits_for: str = "last",
                greedy: bool = False) -> torch.Tensor:
        """Run new tokens [B, S] through every layer, appending to each sequence's KV.

        ``positions`` default to each cache's length onward; ``masks[b]`` is a boolean
        [S, T] (True = attend) for sequence b, default causal.  Returns logits of the
        last position [B, V] (``logits_for="last"``) or of all positions [B, S, V].
        ``greedy``: the caller only takes each row's greedy choice (the first index of its
        maximum), so a native step of a few rows may return exact logits only where that
        choice can be and -inf elsewhere (``native.greedy_head_rows``; ``greedy_head`` off: never).
        """
        if self.before_pass is not None:
            self.before_pass()
        bsz, s = tokens.shape
        step = native.PREFILL_ROWS
        # a causal prompt of one sequence of a bf16 model runs through the native step, in pieces
        # of PREFILL_ROWS rows each attending to the cache and itself: faster than PyTorch's path
        # over the whole prompt here (bench/results/prefill.md)
        native_step = self.native_stack is not None and not torch.is_grad_enabled()
        pieces = native_step and self.native_prefill and bsz == 1 and (masks is None or all(m is None for m in masks))
        if native_step and bsz > 1 and s <= native.STACK_ROWS < bsz * s:
            # a batch over the native call's rows goes through it in groups of sequences, so
            # that every row gets the logits a one-token step of its sequence alone gets
            # (PyTorch's path rounds differently: greedy decoding's text could change with
            # what else is in the batch)
            per = native.STACK_ROWS // s
            return torch.cat([self.forward(tokens[i:i + per], caches[i:i + per],
                                           None if positions is None else positions[i:i + per],
                                           None if masks is None else masks[i:i + per], logits_for, greedy)
                              for i in range(0, bsz, per)])
        if pieces and s > step:
            outs = []
            for i in range(0, s, step):
                piece = None if positions is None else positions[:, i:i + step]
                out = self.forward(tokens[:, i:i + step], caches, piece, None, logits_for, greedy)
                if logits_for != "last":
                    outs.append(out)
            return out if logits_for == "last" else torch.cat(outs, dim=1)
        end = max(c.length for c in caches) + s  # every position is below it, default or a draft tree's
        if positions is None:
            base = torch.tensor([c.length for c in caches], device=tokens.device)
            positions = base.unsqueeze(1) + torch.arange(s, device=tokens.device)
        if masks is None:
            masks = [None] * len(caches)  # None: causal (attend builds or avoids the mask)
        masks = [m.view(1, 1, *m.shape) if m is not None else None for m in masks]
        for c in caches:
            c.reserve(s)
        if s <= 64 and self.layers[0].attn.native:
            caches = native.StepCaches(caches)  # carries the kernels' view of the caches across layers
        cos, sin = self.rope(positions, end)
        x = self.embed(tokens)
        if pieces or (native_step and bsz * s <= native.STACK_ROWS):
            # a few-token step of a bf16 model (or a prompt's piece): every layer, the norm and the head in one call
            greedy = greedy and self.use_greedy_head(bsz if logits_for == "last" else bsz * s)
            _, logits = native.decode_stack(self.native_stack, x, cos, sin, caches, masks, logits=logits_for,
                                            greedy=greedy)
            for c in caches:
                c.length += s
            return logits
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, caches, masks)
        for c in caches:
            c.length += s
        x = self.norm(x[:, -1:] if logits_for == "last" else x)
        logits = self.head(x)
        return logits[:, -1] if logits_for == "last" else logits


def causal_mask(cached: int, new: int, device) -> torch.Tensor:
    """[new, cached + new] boolean: each new token sees the cache and earlier new tokens."""
    t = cached + new
    return torch.arange(t, device=device).unsqueeze(0) <= (cached + torch.arange(new, device=device)).unsqueeze(1)


@torch.no_grad()
def from_hf(hf_model) -> Transformer:
    """Build a ``Transformer`` with the weights of a Hugging Face Llama/Mistral/Qwen2 model."""
    sd = hf_model.state_dict()
    param = next(hf_model.parameters())
    return _from_state(ModelArgs.from_hf_config(hf_model.config), sd, param.dtype, param.device)


@torch.no_grad()
def from_safetensors(path, cfg, dtype: torch.dtype, device, linear: bool = True) -> Transformer | None:
    """Build a ``Transformer`` straight from a checkpoint folder's safetensors (``cfg``: its
    ``AutoConfig``), without building the Hugging Face model first: the same tensors converted
    to ``dtype`` as ``from_pretrained`` then ``from_hf`` give (tests/test_loader.py), in less
    time and memory.  None where this path does not apply (no safetensors, a quantized or
    unsupported checkpoint, names it does not know): the caller goes through Hugging Face.
    ``linear=False``: the linear layers' weights (and an embedding tied to the head) stay on the
    meta device, unread: their native copies come from the packed weights' cache
    (``Transformer.native_decode(prepacked=...)``)."""
    from pathlib import Path

    path = Path(path)
    # No architectures (transformers' own GGUF conversions write null): AutoModelForCausalLM
    # picks the model type's causal LM then, and so does this path.
    archs = getattr(cfg, "architectures", None)
    if (cfg.model_type not in SUPPORTED or getattr(cfg, "quantization_config", None)
            or (archs and not any(a.endswith("ForCausalLM") for a in archs))):
        return None
    try:
        files = _safetensors_files(path)
    except (OSError, ValueError, KeyError):
        return None
    if not all((path / f).is_file() for f in files):
        return None
    try:
        args = ModelArgs.from_hf_config(cfg)
    except ValueError:
        return None
    with contextlib.ExitStack() as files_open:  # closed once the weights are copied
        where = {}
        for f in files:
            handle = files_open.enter_context(open(path / f, "rb"))
            where.update({k: (handle, *v) for k, v in _safetensors_header(handle, path / f).items()})
        return _from_files(args, where, dtype, device, linear)


def _safetensors_files(path) -> list[str]:
    """A checkpoint folder's safetensors files: those its index names, else ``model.safetensors``
    (raises OSError, ValueError or KeyError for an index that cannot be read)."""
    import json

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def checkpoint_params(path) -> int | None:
    """How many weights a checkpoint folder's safetensors files hold (their headers only; None
    where there are none or one cannot be read): what ``loader.resolve_dtype`` sizes a model by."""
    from pathlib import Path

    path = Path(path)
    try:
        total = 0
        for f in _safetensors_files(path):
            with open(path / f, "rb") as handle:
                total += sum(math.prod(shape) for _, shape, _, _ in _safetensors_header(handle, path / f).values())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return total or None


# safetensors' dtype names that a checkpoint's floating-point weights come in
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _safetensors_header(f, name) -> dict:
    """{tensor name: (dtype or None, shape, start, end)} of an open safetensors file (8 bytes of
    header length, the JSON header, then the data; offsets here are from the file's start).
    Raises ValueError for a file that is not whole (its data past the end, sizes that do not fit)."""
    import json

    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= n <= size - 8:
        raise ValueError(f"{name}: not a whole safetensors file (header length {n}, file {size} bytes)")
    meta = json.loads(f.read(n))
    out = {}
    for key, info in meta.items():
        if key == "__metadata__":
            continue
        dt, shape, (begin, end) = _SAFETENSORS_DTYPES.get(info["dtype"]), tuple(info["shape"]), info["data_offsets"]
        if 8 + n + end > size or (dt is not None and end - begin != math.prod(shape) * dt.itemsize):
            raise ValueError(f"{name}: tensor {key} runs past the file's end or does not fit its shape")
        out[key] = (dt, shape, 8 + n + begin, 8 + n + end)
    return out


class _Tensors(dict):
    """Checkpoint tensors by name, read one at a time with plain reads (converted to ``dtype``)
    as ``_from_state`` copies them: neither a second copy of the checkpoint nor a mapping of its
    files is resident (a mapped fp32 file took 538 MB of the load's peak)."""

    def __init__(self, where: dict, dtype: torch.dtype):
        super().__init__()
        self.where, self.dtype = where, dtype

    def __contains__(self, key) -> bool:
        return key in self.where

    def __getitem__(self, key) -> torch.Tensor:
        f, dt, shape, start, end = self.where[key]
        if dt is None:
            raise ValueError(f"tensor {key} is not floating point")
        buf = bytearray(end - start)
        f.seek(start)
        if f.readinto(buf) != len(buf):
            raise ValueError(f"tensor {key}: the file ended early")
        return (torch.frombuffer(buf, dtype=dt) if buf else torch.empty(0, dtype=dt)).reshape(shape).to(self.dtype)


def _from_files(args: ModelArgs, where: dict, dtype: torch.dtype, device, linear: bool = True) -> Transformer | None:
    need = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(args.n_layers)
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    if args.qkv_bias:
        need += [f"model.layers.{i}.self_attn.{n}_proj.bias" for i in range(args.n_layers) for n in "qkv"]
    if not all(k in where for k in need):
        return None
    return _from_state(args, _Tensors(where, dtype), dtype, device, linear)


def _materialize(model: nn.Module, dtype: torch.dtype, device, skip: frozenset[int] = frozenset()) -> None:
    """Give a model built on the meta device empty storage on ``device``, floating tensors in
    ``dtype``: what ``to_empty(device).to(dtype)`` gives, without its detour (empty_like on the meta
    device goes through torch._refs, which imports sympy and torch.fx: ~0.45 s; the float32
    empties were then converted to ``dtype``: ~0.5 s).  Tensors whose ``id`` is in ``skip`` stay
    on the meta device."""
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is None or id(t) in skip:
                    continue
                dt = dtype if t.is_floating_point() else t.dtype
                new = torch.empty(t.shape, dtype=dt, device=device)
                store[name] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


def _from_state(args: ModelArgs, sd, dtype: torch.dtype, device, linear: bool = True) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    tied = args.tie_embeddings or "lm_head.weight" not in sd
    skip = frozenset() if linear else frozenset(
        id(m.weight) for m in model.modules() if isinstance(m, Linear)) | ({id(model.embed.weight)} if tied else set())
    _materialize(model, dtype, device, skip)
    model.inv_freq = rope_frequencies(args).to(device)
    if linear or not tied:
        model.embed.weight.copy_(sd["model.embed_tokens.weight"])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if linear:
            layer.attn.wqkv.weight.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            layer.attn.wo.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            layer.mlp.w13.weight.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            layer.mlp.w2.weight.copy_(sd[p + "mlp.down_proj.weight"])
        if args.qkv_bias:
            layer.attn.wqkv.bias.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
        layer.attn_norm.weight.copy_(sd[p + "input_layernorm.weight"])
        layer.mlp_norm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
    model.norm.weight.copy_(sd["model.norm.weight"])
    if tied:
        model.head.weight = model.embed.weight
    elif linear:
        model.head.weight.copy_(sd["lm_head.weight"])
    return model.eval()
