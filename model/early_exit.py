"""Early exit: tokens leave the layer stack when an exit point is confident.

An ``Exits`` object holds, for a model, the exit points (after how many layers a token
may leave), a small trained adapter per exit (``h + A h`` before the shared final norm
and head; zero = the plain "logit lens"), a small classifier per exit that predicts
whether the exit's top token equals the full model's, a vocabulary subset for cheap
heads, and calibrated thresholds per confidence measure.  Stored as ``exits.json`` +
``exits.safetensors`` (``python -m codecomplete.model.exits``).

Decoding (``exit_forward``): layer by layer; at each exit point the chosen measure gives
every sequence a confidence:

* ``softmax``: top-1 minus top-2 probability of the exit head (on the vocabulary subset
  when there is one: the full head costs about eight of SmolLM2's layers);
* ``cosine``: cosine similarity of the hidden states before and after the last layer;
* ``classifier``: the trained classifier's probability (cheapest).

A sequence exits when its confidence reaches the layer's threshold (optionally CALM's
schedule, which starts strict and relaxes along the output).  Its token comes from the
exit head (over the subset, which the adapters are trained on); the KV of the layers it skipped
is filled from the exit layer's hidden state (CALM's state propagation: each skipped layer's K
and V projections of that state; the state before the adapter, which serves only the head), so
every layer's cache keeps the same length and positions.  ``batch_rule="all"`` exits an
iteration only when every sequence is confident (CALM's rule); ``"each"`` lets each
sequence leave on its own and continues with the rest.

Lossless mode (``self_spec``): the early layers draft a few tokens through the exit head
(LayerSkip's self-speculation), the remaining layers verify them in one pass starting
from the drafts' exit hidden states; the early layers' KV is shared.  The output equals
greedy decoding of the full model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .sampling import greedy_tokens
from .transformer import SeqKV, Transformer, apply_rope, causal_mask

FORMAT = "codecomplete-exits/1"
MEASURES = ("softmax", "cosine", "classifier")


class MLPAdapter(nn.Module):
    """An exit adapter of exit_stream's "mlp" kind: h -> W2 silu(W1 h) (the exit state is h
    plus this); W2 starts at zero, so an untrained adapter is the plain logit lens."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        nn.init.zeros_(self.w2.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)))


ADAPTER_KINDS = ("linear", "mlp")


def _version(w: torch.Tensor) -> int:
    """A weight's in-place version, 0 for an inference tensor (they track none; loaded for
    serving, they are never trained)."""
    return 0 if w.is_inference() else w._version


class Exits(nn.Module):
    """Exit points of one model: adapters, classifiers, vocabulary subset, thresholds.
    An adapter is ``linear`` (h + A h, A [D, D]) or ``mlp`` (h + W2 silu(W1 h), ``MLPAdapter``
    with ``adapter_hidden`` units: more accurate exits for about a third of a layer more per check)."""

    def __init__(self, dim: int, layers: list[int], subset: torch.Tensor | None = None, hidden: int = 64,
                 adapter: str = "linear", adapter_hidden: int = 1536):
        super().__init__()
        if adapter not in ADAPTER_KINDS:
            raise ValueError(f"unknown adapter kind {adapter!r} (one of {', '.join(ADAPTER_KINDS)})")
        self.layers = sorted(layers)
        self.adapter_kind = adapter
        self.adapter_hidden = adapter_hidden if adapter == "mlp" else 0
        if adapter == "mlp":
            self.adapters = nn.ModuleList(MLPAdapter(dim, adapter_hidden) for _ in self.layers)
        else:
            self.adapters = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in self.layers)
            for a in self.adapters:
                nn.init.zeros_(a.weight)
        self.classifiers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)) for _ in self.layers)
        self.register_buffer("subset", subset if subset is not None else torch.zeros(0, dtype=torch.long))
        self.thresholds: dict[str, dict[int, float]] = {}  # "measure@bound" -> exit layer -> threshold
        # each exit's own thresholds where ``thresholds`` were chosen jointly (exit_train --policy
        # joint): lossless mode's drafts are gated on an exit's own confidence; {}: ``thresholds``
        self.draft_thresholds: dict[str, dict[int, float]] = {}
        self.trained = False  # adapters and classifiers learned (not the zero "logit lens")
        self._subset_w: torch.Tensor | None = None  # the head's rows of the subset
        self._packed: dict[str, tuple] = {}  # name -> (weight's address and version, weight in native.linear's layout)
        self._checks: dict[int, tuple] = {}  # layer -> (weights read with their versions, native.ExitCheck)
        self.meta: dict = {}
        # the model's layer count when its last layer has a calibrated check too: a token
        # whose subset-head margin there is confident skips the full vocabulary head
        self.final = 0
        self.head_skips = 0  # tokens the final check took (benchmarks read and reset it)
        self._kv: tuple | None = None  # (key, FoldedKV) for fill_kv (``folded_kv``)
        self._fast: FastPath | None = None  # exit_forward's one-sequence path (``fast_path``)
        self._neg: torch.Tensor | None = None  # [V] fp32 -inf: ``in_vocab``'s rows start as its copies

    def index(self, layer: int) -> int:
        return self.layers.index(layer)

    def fast_path(self, model: Transformer) -> "FastPath | None":
        """``FastPath`` for ``_exit_one`` (built once; again when the model or its first layer's
        weights changed), or None where it does not apply: not a bf16 CPU model running through
        the native stack, gradients on, no vocabulary subset."""
        got = self._fast
        if (got is not None and got.model is model and got.stack is model.native_stack
                and _version(got.watch) == got.version):
            return got
        stack = model.native_stack
        folded = self.folded_kv(model) if stack is not None and len(self.subset) else None
        if folded is None or torch.is_grad_enabled():
            return None
        w0 = model.layers[0].attn.wqkv.weight
        self._fast = FastPath(model, stack, folded, w0, _version(w0), model.args.n_layers, model.args.vocab_size,
                              model.embed.weight.detach())
        return self._fast

    def folded_kv(self, model: Transformer) -> "FoldedKV | None":
        """The K and V rows of every layer with its input norm's weight folded in, stacked and
        packed once for the native kernel (fill_kv's one-product path); None where that path
        does not apply (not a bf16 CPU model with the native kernels, no grad)."""
        w0 = model.layers[0].attn.wqkv.weight
        if (w0.dtype != torch.bfloat16 or w0.device.type != "cpu" or torch.is_grad_enabled()
                or not native.available()):
            return None
        key = (id(model), w0.data_ptr())
        if self._kv is None or self._kv[0] != key:
            self._kv = (key, FoldedKV.build(model))
        return self._kv[1]

    def _linear(self, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x W^T; a bf16 step of few rows without autograd through the native kernel, on a
        copy of W repacked once (again when W changes): an exit check is then a small fraction
        of a layer, not ~0.3 ms of PyTorch's bf16 matrix-vector product."""
        if (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not torch.is_grad_enabled() and x.numel() <= native.LINEAR_ROWS * x.shape[-1] and native.available()):
            return native.linear(x, self._pack(name, w), None, w.shape[0])
        return F.linear(x, w)

    def _pack(self, name: str, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), _version(w))
        got = self._packed.get(name)
        if got is None or got[0] != key:
            got = self._packed[name] = (key, native.pack_linear(w))
        return got[1]

    def _check(self, model: Transformer, layer: int, dtype: torch.dtype) -> "native.ExitCheck":
        """The native check of an exit (or of the last layer), bound once; bound again when a
        weight it reads changed in place (its version) or was replaced (its address)."""
        got = self._checks.get(layer)
        if got is not None and all(_version(w) == v and w.data_ptr() == p for w, v, p in got[0]):
            return got[1]
        adapter, watch = None, [model.norm.weight]
        if self.trained and layer < model.args.n_layers:
            i = self.index(layer)
            a = self.adapters[i]
            if self.adapter_kind == "mlp":
                adapter = (self._pack(f"adapter{i}.w1", a.w1.weight), self._pack(f"adapter{i}.w2", a.w2.weight),
                           self.adapter_hidden)
                watch += [a.w1.weight, a.w2.weight]
            else:
                adapter = self._pack(f"adapter{i}", a.weight)
                watch.append(a.weight)
        subset = self._pack("subset", self._subset_weight(model, dtype, model.norm.weight.device))
        check = native.ExitCheck(adapter, model.norm.weight, model.norm.eps, subset, len(self.subset), model.args.dim)
        self._checks[layer] = ([(w, _version(w), w.data_ptr()) for w in watch], check)
        return check

    def _subset_weight(self, model: Transformer, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        w = self._subset_w
        if w is None or w.dtype != dtype or w.device != device:  # gathered once, not per token
            w = self._subset_w = model.head.weight.detach()[self.subset].to(dtype)
        return w

    def state(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The exit hidden state: h + A h (A = 0 before training)."""
        if not self.trained:
            return h
        i = self.index(layer)
        a = self.adapters[i]
        if self.adapter_kind == "mlp":
            mid = F.silu(self._linear(f"adapter{i}.w1", h, a.w1.weight))
            return h + self._linear(f"adapter{i}.w2", mid, a.w2.weight)
        return h + self._linear(f"adapter{i}", h, a.weight)

    def logits(self, model: Transformer, layer: int, h: torch.Tensor, subset: bool = False) -> torch.Tensor:
        """Exit logits [.., V] (or [.., |subset|] over the subset) of hidden states h [.., D]."""
        x = model.norm(self.state(layer, h) if layer < model.args.n_layers else h)
        if subset and len(self.subset):
            return self._linear("subset", x, self._subset_weight(model, x.dtype, x.device))
        return model.head(x)

    def in_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Exit-head logits [R, |subset|] in the full vocabulary [R, V] (-inf outside the
        subset); as they are when there is no subset."""
        if len(self.subset) == 0:
            return logits
        neg = self._neg
        if neg is None or neg.shape[0] != vocab_size or neg.device != logits.device:
            neg = self._neg = torch.full((vocab_size,), float("-inf"), device=logits.device)
        # a copy of a kept -inf row, not torch.full and an indexed write: fewer ops inside a step
        return neg.expand(logits.shape[0], vocab_size).clone().index_copy_(1, self.subset, logits.float())

    def tokens(self, logits: torch.Tensor, subset: bool) -> torch.Tensor:
        top = logits.argmax(-1)
        return self.subset[top] if subset and len(self.subset) else top

    def confidence(self, model: Transformer, measure: str, layer: int, h: torch.Tensor, before: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Confidence [B] of hidden states h [B, D] at an exit (``before``: the state
        entering the last layer), and the exit logits when the measure computed them."""
        if measure == "softmax":
            if (h.shape[0] == 1 and h.dtype == torch.bfloat16 and h.device.type == "cpu" and len(self.subset)
                    and not torch.is_grad_enabled() and model.norm.weight.dtype == torch.bfloat16
                    and native.available()):
                # one native call (native.ExitCheck, bound once per exit): the same products and
                # roundings, without the ~0.5 ms that the PyTorch calls' dispatch costs inside a step
                margin, logits, _ = self._check(model, layer, h.dtype)(h)
                return torch.tensor([margin]), logits.float().view(1, -1)
            logits = self.logits(model, layer, h, subset=True).float()
            top2 = torch.softmax(logits, -1).topk(2, dim=-1).values
            return top2[:, 0] - top2[:, 1], logits
        if measure == "cosine":
            return F.cosine_similarity(h.float(), before.float(), dim=-1), None
        if measure == "classifier":
            x = model.norm(self.state(layer, h))
            return torch.sigmoid(self.classifiers[self.index(layer)](x.to(self.float_dtype())).float()[:, 0]), None
        raise ValueError(f"unknown confidence measure {measure!r} (one of {', '.join(MEASURES)})")

    def float_dtype(self) -> torch.dtype:
        """The exits' floating dtype (their classifiers')."""
        return self.classifiers[0][0].weight.dtype

    def to_json(self) -> dict:
        return {"format": FORMAT, "layers": self.layers, "final_layer": self.final, "trained": self.trained,
                **({"adapter_kind": "mlp", "adapter_hidden": self.adapter_hidden}
                   if self.adapter_kind == "mlp" else {}),
                "thresholds": {m: {str(k): v for k, v in t.items()} for m, t in self.thresholds.items()},
                **({"draft_thresholds": {m: {str(k): v for k, v in t.items()}
                                         for m, t in self.draft_thresholds.items()}} if self.draft_thresholds else {}),
                "subset_size": int(len(self.subset)), **self.meta}

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(folder / "exits.safetensors"))
        (folder / "exits.json").write_text(json.dumps(self.to_json(), indent=2) + "\n")


class ExitsError(RuntimeError):
    """Exit heads that cannot be loaded."""


def load_exits(folder: str | Path, model: Transformer, model_id: str = "") -> Exits:
    """Exit heads saved by ``Exits.save``.  ``model_id`` (``loader.model_identity`` of the
    model's home): heads that recorded another model's fingerprint are refused, since their
    thresholds were calibrated against other weights."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        meta = json.loads((folder / "exits.json").read_text())
        if meta.get("format") != FORMAT:
            raise ExitsError(f"{folder}: not a {FORMAT} file")
        tensors = load_file(str(folder / "exits.safetensors"))
    except (OSError, ValueError) as exc:
        raise ExitsError(f"cannot read exit heads in {folder}: {exc}") from exc
    trained_on = meta.get("model_id") or ""
    if model_id and trained_on and trained_on != model_id:
        raise ExitsError(f"{folder}: trained on other weights ({meta.get('model', '?')}, fingerprint {trained_on}; "
                         f"this model's is {model_id}): run python -m codecomplete.model.exit_train again")
    bad = [n for n in meta["layers"] if not 0 < n < model.args.n_layers]
    if bad:
        raise ExitsError(f"{folder}: exit layers {bad} outside 1..{model.args.n_layers - 1}")
    kind = meta.get("adapter_kind", "linear")
    if kind not in ADAPTER_KINDS:
        raise ExitsError(f"{folder}: adapter kind {kind!r} is not one this version serves ({', '.join(ADAPTER_KINDS)})")
    try:
        hidden = int(meta.get("adapter_hidden") or 1536)
    except (TypeError, ValueError) as exc:
        raise ExitsError(f"{folder}: malformed adapter_hidden: {exc}") from exc
    ex = Exits(model.args.dim, meta["layers"], tensors.get("subset"), adapter=kind, adapter_hidden=hidden)
    try:
        ex.load_state_dict(tensors)
    except RuntimeError as exc:
        raise ExitsError(f"{folder}: exit heads do not fit this model: {exc}") from exc
    ex.trained = bool(meta.get("trained"))
    ex.final = int(meta.get("final_layer") or 0)
    if ex.final not in (0, model.args.n_layers):
        raise ExitsError(f"{folder}: calibrated for a final layer {ex.final}, the model has {model.args.n_layers}")
    try:
        ex.thresholds, ex.draft_thresholds = ({m: {int(k): float(v) for k, v in t.items()}
                                               for m, t in meta.get(name, {}).items()}
                                              for name in ("thresholds", "draft_thresholds"))
    except (AttributeError, TypeError, ValueError) as exc:
        raise ExitsError(f"{folder}: malformed thresholds: {exc}") from exc
    ex.meta = {k: v for k, v in meta.items()
               if k not in ("format", "layers", "final_layer", "trained", "thresholds", "draft_thresholds",
                            "subset_size", "adapter_kind", "adapter_hidden")}
    return ex.to(device=model.device, dtype=model.dtype).eval()


def untrained_exits(model: Transformer, layers: list[int]) -> Exits:
    """The plain logit lens at the given layers (no adapters, no classifier)."""
    return Exits(model.args.dim, layers).to(device=model.device, dtype=model.dtype).eval()


@dataclass
class ExitPolicy:
    """How the engine uses exits (``api.ExitSettings`` resolved against the exits)."""

    measure: str = "softmax"
    thresholds: dict[int, float] = field(default_factory=dict)  # exit layer -> threshold
    batch_rule: str = "each"  # each | all
    decay: float = 0.0  # CALM: threshold_t = 0.9 t0 + 0.1 exp(-decay t / max_len); 0: constant
    max_len: int = 64

    def threshold(self, layer: int, t: int) -> float:
        base = self.thresholds[layer]
        if self.decay <= 0:
            return base
        return min(1.0, 0.9 * base + 0.1 * math.exp(-self.decay * t / max(1, self.max_len)))


@dataclass
class FoldedKV:
    """Every layer's K and V rows times its input norm's weight (W diag(g): the norm's scale
    moved into the product), stacked [n_layers * 2 kd, D] and packed for ``native.linear``:
    the KV filling of all skipped layers is then one product of the exit state's normalised
    row, instead of a norm, a product, RoPE and two writes per layer from Python (measured
    on the AVX2 EPYC: 3.0 ms for the 22 layers after an exit at 8, 0.46 ms folded).
    The bf16 weights are rounded once more than the model's path rounds (g times W): KV
    filling approximates the skipped layers anyway."""

    packed: torch.Tensor
    bias: torch.Tensor | None  # [n_layers * 2 kd] or None
    rows: int  # 2 kd: one layer's rows
    eps: float
    _fills: dict = field(default_factory=dict)  # first layer -> native.KVFill, or False where it cannot run

    @classmethod
    def build(cls, model: Transformer) -> "FoldedKV":
        a = model.args
        qd = a.n_heads * a.head_dim
        ws, bs = [], []
        for layer in model.layers:
            w = layer.attn.wqkv.dense().detach()[qd:].float() * layer.attn_norm.weight.detach().float()
            ws.append(w.to(torch.bfloat16))
            b = layer.attn.wqkv.bias
            bs.append(None if b is None else b.detach()[qd:].to(torch.bfloat16))
        bias = None if any(b is None for b in bs) else torch.cat(bs).contiguous()
        return cls(native.pack_linear(torch.cat(ws)), bias, ws[0].shape[0], model.layers[0].attn_norm.eps)

    def fill(self, h: torch.Tensor, first: int, n_layers: int, cos: torch.Tensor, sin: torch.Tensor, cache: SeqKV,
             pos: int) -> bool:
        """``fill_kv`` in one native call (``native.KVFill``, bound once per exit layer: the norm,
        the product, RoPE and the cache writes; measured on the AVX-512 EPYC inside a decode step:
        0.39 ms through ``project`` and PyTorch's ops, 0.2 ms so); False where it does not apply."""
        fill = self._fills.get(first)
        if fill is None:
            rows = native.packed_rows(self.packed, first * self.rows)
            b = self.bias[first * self.rows:] if self.bias is not None else None
            e = cache.k.shape[-1]
            try:
                fill = native.KVFill(rows, b, first, n_layers - first, self.eps, h.numel(), self.rows // 2 // e, e) \
                    if rows is not None else False
            except (RuntimeError, ValueError):
                fill = False
            self._fills[first] = fill
        return bool(fill) and fill(h, cos, sin, cache.k, cache.v, pos)

    def project(self, h: torch.Tensor, first: int, n_layers: int) -> torch.Tensor | None:
        """K and V of layers ``first``.. for the state h [D] ([n_layers - first, 2 kd] bf16),
        or None where the packed layout cannot start at that layer."""
        rows = native.packed_rows(self.packed, first * self.rows)
        if rows is None:
            return None
        u = F.rms_norm(h.view(1, -1).float(), h.shape[-1:], eps=self.eps).to(torch.bfloat16)
        n = (n_layers - first) * self.rows
        b = self.bias[first * self.rows:] if self.bias is not None else None
        return native.linear(u, rows, b, n).view(n_layers - first, self.rows)


def fill_kv(model: Transformer, h: torch.Tensor, cache: SeqKV, first: int, pos: int,
            cos: torch.Tensor, sin: torch.Tensor, folded: FoldedKV | None = None) -> None:
    """Write the KV of layers ``first``.. at position ``pos`` from the exit state h [D]:
    each skipped layer's K and V projections of its own input norm of h (``folded``: all
    layers in one product, ``FoldedKV``)."""
    a = model.args
    qd, kd = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    if folded is not None and h.dtype == torch.bfloat16 and first < a.n_layers \
            and folded.fill(h, first, a.n_layers, cos, sin, cache, pos):
        return
    kvp = folded.project(h, first, a.n_layers) if folded is not None and h.dtype == torch.bfloat16 else None
    if kvp is not None:
        n = a.n_layers - first
        k = apply_rope(kvp[:, :kd].reshape(n, 1, a.n_kv_heads, a.head_dim).transpose(1, 2), cos, sin)
        cache.k[first:, :, pos] = k[:, :, 0]
        cache.v[first:, :, pos] = kvp[:, kd:].reshape(n, a.n_kv_heads, a.head_dim)
        return
    for j in range(first, a.n_layers):
        layer = model.layers[j]
        wqkv = layer.attn.wqkv
        b = wqkv.bias[qd:] if wqkv.bias is not None else None
        kv_rows = native.packed_rows(wqkv.native_weight, qd) if wqkv.native_weight is not None else None
        if kv_rows is not None and h.dtype == torch.bfloat16 and not torch.is_grad_enabled():
            # the K and V rows of the repacked projection
            x = native.rms_norm(h.view(1, -1), layer.attn_norm.weight, layer.attn_norm.eps)
            kvp = native.linear(x, kv_rows, b, 2 * kd)
        else:
            kvp = F.linear(layer.attn_norm(h.view(1, -1)), wqkv.weight[qd:], b)
        k, v = kvp.split([kd, kd], -1)
        k = apply_rope(k.view(1, 1, a.n_kv_heads, a.head_dim).transpose(1, 2), cos, sin)
        cache.k[j, :, pos] = k[0, :, 0]
        cache.v[j, :, pos] = v.view(a.n_kv_heads, a.head_dim)


def _confident(policy: ExitPolicy, layer: int, conf: torch.Tensor, active: list[int], steps: list[int],
               allow: list[bool] | None) -> list[bool]:
    """Which active rows leave at ``layer``: confidence over the threshold (and allowed);
    under batch rule "all" every row or none."""
    ok = [bool(conf[r] >= policy.threshold(layer, steps[b])) and (allow is None or allow[b])
          for r, b in enumerate(active)]
    return [all(ok)] * len(ok) if policy.batch_rule == "all" else ok


@torch.no_grad()
def exit_forward(model: Transformer, exits: Exits, policy: ExitPolicy, tokens: list[int],
                 caches: list[SeqKV], steps: list[int], allow: list[bool] | None = None, greedy: bool = False
                 ) -> tuple[torch.Tensor, list[int]]:
    """One decode step with early exit: token b appended to caches[b]; ``steps[b]`` is
    its index in the output (CALM's schedule), ``allow[b]`` False keeps it to the end.
    ``greedy``: only the greedy choice of the rows that ``allow`` is read, so the full head
    may be the native greedy head (``Transformer.forward``'s ``greedy``).

    Returns next-token logits [B, V] (exit or full head; over the full vocabulary, with
    the subset's logits scattered in and -inf elsewhere when a subset head decided) and
    the number of layers each token ran."""
    if len(tokens) == 1 and FAST_ONE and policy.measure == "softmax":
        fast = exits.fast_path(model)
        if fast is not None:
            row, ran = _exit_one(model, exits, fast, policy, tokens[0], caches[0], steps[0],
                                 allow is None or allow[0], greedy)
            return row.view(1, -1), [ran]
    n_layers = model.args.n_layers
    dev = model.device
    bsz = len(tokens)
    for c in caches:
        c.reserve(1)
    positions = torch.tensor([[c.length] for c in caches], device=dev)
    cos_all, sin_all = model.rope(positions)
    x = model.embed(torch.tensor([[t] for t in tokens], device=dev))
    active = list(range(bsz))
    cos, sin = cos_all, sin_all
    out: list[torch.Tensor | None] = [None] * bsz
    ran = [n_layers] * bsz
    exit_at = {n for n in exits.layers if n in policy.thresholds and 0 < n < n_layers}
    stack = model.native_stack if len(active) <= native.STACK_ROWS and not torch.is_grad_enabled() else None
    final_check = n_layers in policy.thresholds and policy.measure == "softmax" and len(exits.subset)
    n = 0
    while n < n_layers:
        # the layers up to the next exit point in one native call where the model has one (the
        # cosine measure needs the state before the exit layer: that layer runs alone)
        end = min([e for e in exit_at if e > n] or [n_layers])
        group = [caches[b] for b in active]
        if stack is not None and end - n > 1 and policy.measure != "cosine":
            if end == n_layers and not final_check:
                # the last layers and the head in the same native call (the greedy head where only
                # greedy choices are read): one call fewer for every token that goes the whole way
                g = greedy and model.use_greedy_head(len(active)) and (allow is None or all(allow[b] for b in active))
                x, logits = native.decode_stack(stack, x, cos, sin, native.StepCaches(group), None, logits="last",
                                                layers=(n, end), greedy=g)
                for r, b in enumerate(active):
                    out[b] = logits[r].float()
                active, n = [], end
                break
            x = native.decode_stack(stack, x, cos, sin, native.StepCaches(group), None, logits=None,
                                    layers=(n, end))[0]
            before, n = None, end
        else:
            before = x
            x = model.layers[n](x, cos, sin, n, group, [None] * len(active))
            n += 1
        if n not in exit_at:
            continue
        h = x[:, -1]
        conf, logits = exits.confidence(model, policy.measure, n, h, before[:, -1] if before is not None else None)
        ok = _confident(policy, n, conf, active, steps, allow)
        if not any(ok):
            continue
        rows = [r for r, o in enumerate(ok) if o]
        picked = logits[rows] if logits is not None else exits.logits(model, n, h[rows], subset=True).float()
        full = exits.in_vocab(picked, model.args.vocab_size)
        # the skipped layers' KV comes from the exit layer's own hidden state, not the adapted one:
        # the adapter is trained for the head, and filling from its state lost 1-2.6 ES points
        # (docs/decisions.md, ninth session)
        folded = exits.folded_kv(model)
        for j, r in enumerate(rows):
            b = active[r]
            out[b] = full[j]
            ran[b] = n
            fill_kv(model, h[r], caches[b], n, caches[b].length, cos_all[b:b + 1], sin_all[b:b + 1], folded)
        keep = [r for r, o in enumerate(ok) if not o]
        if not keep:
            active = []
            break
        x = x[keep]
        cos, sin = cos[keep], sin[keep]
        active = [active[r] for r in keep]
    if active and final_check:
        # the last layer's cheap check: a confident subset-head margin skips the full head
        h = x[:, -1]
        conf, logits = exits.confidence(model, "softmax", n_layers, h, h)
        ok = _confident(policy, n_layers, conf, active, steps, allow)
        rows = [r for r, o in enumerate(ok) if o]
        for r, row in zip(rows, exits.in_vocab(logits[rows], model.args.vocab_size)):
            out[active[r]] = row
        exits.head_skips += len(rows)
        keep = [r for r, o in enumerate(ok) if not o]
        x = x[keep]
        active = [active[r] for r in keep]
    if active:
        if stack is not None and greedy and model.use_greedy_head(len(active)) \
                and (allow is None or all(allow[b] for b in active)):
            # the final norm and the greedy head in one native call (no layers)
            logits = native.decode_stack(stack, x[:, -1:], cos, sin, native.StepCaches([caches[b] for b in active]),
                                         None, logits="last", layers=(n_layers, n_layers), greedy=True)[1].float()
        else:
            logits = model.head(model.norm(x[:, -1])).float()
        for r, b in enumerate(active):
            out[b] = logits[r]
    for c in caches:
        c.length += 1
    return torch.stack(out), ran


FAST_ONE = True  # exit_forward of one sequence through _exit_one where it applies (tests compare both paths)


@dataclass
class FastPath:
    """What ``_exit_one`` needs, resolved once per model (``Exits.fast_path``): inside a decode
    step every Python lookup runs with the caches cold from the layers' weights (measured on the
    AVX-512 EPYC: ~50-150 us for an nn.Module attribute chain or a small tensor op), so the step
    touches as little Python as it can."""

    model: Transformer
    stack: object  # native.Stack
    folded: FoldedKV
    watch: torch.Tensor  # the first layer's qkv weight: a change in place (its version) rebuilds the path
    version: int
    n_layers: int
    vocab: int
    embed: torch.Tensor  # the embedding's weight [V, D]


def _rope_at(model: Transformer, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.rope`` of one position ([1, 1, 1, E] each), read from its table directly: two views."""
    table = model._rope_table
    if table is None or table[1].shape[0] <= pos or table[1].dtype != torch.bfloat16:
        model.rope(torch.tensor([[pos]]), end=pos + 1)
        table = model._rope_table
    return table[1][pos].view(1, 1, 1, -1), table[2][pos].view(1, 1, 1, -1)


def _exit_one(model: Transformer, exits: "Exits", fast: FastPath, policy: ExitPolicy, token: int, cache: SeqKV,
              step: int, allow: bool, greedy: bool) -> tuple[torch.Tensor, int]:
    """``exit_forward`` of one sequence through the native kernels with as little Python between
    the native calls as it can (bf16 CPU model, softmax measure): the same calls and results as
    the general path (tests/test_early_exit.py compares them) - the layers up to each exit in one
    ``decode_stack`` call, the bound ``ExitCheck``, the one-call KV filling, and the last layers
    and the head in one call.  Returns the next-token logits [V] (fp32) and the layers run."""
    n_layers = fast.n_layers
    cache.reserve(1)
    pos = cache.length
    cos, sin = _rope_at(model, pos)
    x = fast.embed[token].view(1, 1, -1)
    caches = native.StepCaches([cache])
    n = 0
    if allow:
        for e in exits.layers:
            if e <= n or e >= n_layers or e not in policy.thresholds:
                continue
            x = native.decode_stack(fast.stack, x, cos, sin, caches, None, logits=None, layers=(n, e))[0]
            n = e
            margin, logits, _ = exits._check(model, e, torch.bfloat16)(x)
            if margin >= policy.threshold(e, step):
                fill_kv(model, x.view(-1), cache, e, pos, cos, sin, fast.folded)
                cache.length += 1
                return exits.in_vocab(logits.view(1, -1), fast.vocab)[0], e
    final = allow and n_layers in policy.thresholds and len(exits.subset) > 0
    g = greedy and allow and model.use_greedy_head(1)
    if final:
        if n < n_layers:
            x = native.decode_stack(fast.stack, x, cos, sin, caches, None, logits=None, layers=(n, n_layers))[0]
        margin, logits, _ = exits._check(model, n_layers, torch.bfloat16)(x)
        if margin >= policy.threshold(n_layers, step):
            exits.head_skips += 1
            cache.length += 1
            return exits.in_vocab(logits.view(1, -1), fast.vocab)[0], n_layers
        out = native.decode_stack(fast.stack, x, cos, sin, caches, None, logits="last", layers=(n_layers, n_layers),
                                  greedy=g)[1]
    else:
        out = native.decode_stack(fast.stack, x, cos, sin, caches, None, logits="last", layers=(n, n_layers),
                                  greedy=g)[1]
    cache.length += 1
    return out[0].float(), n_layers


def _run_layers(model: Transformer, x: torch.Tensor, cos, sin, first: int, end: int, cache: SeqKV,
                logits: bool = False, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layers ``first`` .. ``end`` - 1 over x [1, S, D] (causal over the S rows, written into
    ``cache`` from its length on; the length is left to the caller), and with ``logits`` the
    head's logits of every row [S, V] after the last layer: one native call where the model
    has the native step (``greedy``: its greedy head where ``use_greedy_head`` says so), else
    layer by layer."""
    s = x.shape[1]
    stack = model.native_stack
    if stack is not None and s <= native.STACK_ROWS and not torch.is_grad_enabled():
        greedy = greedy and model.use_greedy_head(s)
        x, out = native.decode_stack(stack, x, cos, sin, native.StepCaches([cache]), None,
                                     logits="all" if logits else None, layers=(first, end), greedy=greedy)
        return x, (out[0] if out is not None else None)
    mask = [causal_mask(cache.length, s, x.device).view(1, 1, s, -1)] if s > 1 else [None]
    for i in range(first, end):
        x = model.layers[i](x, cos, sin, i, [cache], mask)
    return x, (model.head(model.norm(x[0])) if logits else None)


@torch.no_grad()
def self_spec(model: Transformer, exits: Exits, layer: int, root: int, cache: SeqKV, draft: int,
              stop_ids: frozenset[int] = frozenset(), min_margin: float = 0.0,
              oracle: Callable[[int], int | None] | None = None) -> tuple[list[int], torch.Tensor, int]:
    """Lossless early exit: draft up to ``draft`` tokens with the first ``layer`` layers
    and the exit head (subset), verify them with the remaining layers in one pass.  Drafting
    stops at the first token whose exit margin (softmax top-1 minus top-2, the calibrated
    ``softmax`` measure) is below ``min_margin``: an unlikely draft costs its early layers and
    saves nothing, and with no draft the round is one full step.

    ``oracle`` (what-if measurements, bench/early_exit_ceiling.py): called with the draft's
    index, it picks the draft token instead of the exit head (None: stop drafting); the
    exit check still runs, so a round costs what a real one does.

    Returns (accepted drafts, logits [1 + accepted, V] of the full model at the root and
    each accepted token, drafted count); the cache then holds root + accepted tokens in
    every layer.  The logits are the greedy head's (exact where the greedy choice can be)."""
    a = model.args
    dev = model.device
    base = cache.length
    cache.reserve(draft + 1)
    seq = [root]
    states = []
    # a bf16 model on the native stack drafts with fewer Python ops a token (as _exit_one decodes):
    # the rope table and the embedding read directly, the exit's bound check called directly
    fast = exits.fast_path(model)
    while True:  # the early layers over the newest token; the exit head drafts the next
        j = len(seq) - 1
        cache.length = base + j
        if fast is not None:
            cos, sin = _rope_at(model, base + j)
            x, _ = _run_layers(model, fast.embed[seq[-1]].view(1, 1, -1), cos, sin, 0, layer, cache)
        else:
            cos, sin = model.rope(torch.tensor([[base + j]], device=dev))
            x, _ = _run_layers(model, model.embed(torch.tensor([[seq[-1]]], device=dev)), cos, sin, 0, layer, cache)
        states.append(x)
        if j >= draft or (j and seq[-1] in stop_ids):
            break
        if fast is not None:
            margin, sub, _ = exits._check(model, layer, torch.bfloat16)(x)
            tok = int(exits.subset[int(sub.argmax())])
        else:
            conf, logits = exits.confidence(model, "softmax", layer, x[:, -1], None)
            margin, tok = float(conf[0]), int(exits.tokens(logits, subset=True)[0])
        if oracle is not None:
            tok = oracle(j)
            if tok is None:
                break
            seq.append(tok)
            continue
        if margin < min_margin:
            break
        seq.append(tok)
    drafts = seq[1:]
    # verification: the upper layers over root + drafts, from the early layers' states
    s = len(seq)
    cos, sin = model.rope(torch.arange(base, base + s, device=dev).unsqueeze(0))
    cache.length = base
    _, logits = _run_layers(model, torch.cat(states, 1), cos, sin, layer, a.n_layers, cache, logits=True, greedy=True)
    greedy = greedy_tokens(logits)  # [s, V] in the model's dtype (bf16: the native argmax, no fp32 copy)
    acc = 0
    while acc < len(drafts) and greedy[acc] == drafts[acc]:
        acc += 1
    cache.length = base + 1 + acc
    return drafts[:acc], logits[: acc + 1].float(), len(drafts)
