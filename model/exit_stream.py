"""Exit adapters trained at scale on the frozen model (issue #9): for a GPU.

    python -m codecomplete.model.exit_stream --model default --out DIR [--minutes 5]
        [--exits 12,16,20,24,27] [--kinds linear,mlp] [--texts texts.json.xz] [--subset-from EXITS_DIR]

``exit_train`` fits each exit's residual adapter (``h + A h`` before the shared norm and the
subset head) on ~250 k positions that a CPU collects once; it overfits there (train agreement
0.90 against 0.67 held out at layer 24 on the outputs alone).  The LayerSkip runs
(``layerskip``) changed the model itself and moved its last layer.  Here the model stays
frozen, so its last layer stays the exact teacher, and the adapters see a new FIM/EFIM batch
at every step (the fine-tune's pipeline): tens of millions of positions in minutes on a GPU.

Trained side by side from the same forward passes, per exit:
- ``linear``: the adapter ``early_exit.Exits`` serves (a drop-in: ``exit_train --adapters``
  trains the classifiers and calibrates with these instead of fitting its own);
- ``mlp``: ``h + W2 silu(W1 h)`` (hidden ``--mlp-hidden``, W2 zero-initialised): what a larger
  adapter would add at the same data (measured; the engine does not serve it).

The loss is exit_train's: cross-entropy of the subset head's logits against the full model's
greedy token, at every position whose token lies in the subset (the shipped exits' subset,
so that the adapters fit their head).  Validation (the fine-tune's validation split) before,
during and after: each exit's agreement with the full model, at every position and at the
positions that predict a FIM middle (where ``exit_train`` calibrates), with the shipped
adapters as a reference row.

- ``block``: one decoder layer (attention and MLP) started as a copy of the model's layer at
  the exit, after Kangaroo's adapter (Liu et al. 2024): it reads earlier positions, which the
  others cannot (measured; serving it would need a KV cache of its own).

Writes DIR/<kind>-<i>.safetensors (``exit_<layer>.<name>``: linear fp32, the others bf16; in
files of at most ~15 MB) and DIR/history.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import train as tr
from .early_exit import MLPAdapter
from .layerskip import Batches, load_texts, valid_positions

SHIPPED_EXITS = Path(__file__).resolve().parent / "data" / "efim-smollm2" / "exits"


class BlockAdapter(torch.nn.Module):
    """One decoder layer (attention over the exit's states at every earlier position, and an
    MLP), initialised as a copy of the model's layer at the exit: the output is the block's
    state minus its input, so that ``h + adapter(h)`` is the block's output."""

    def __init__(self, model, layer: int):
        super().__init__()
        import copy

        src = model.model.layers[layer]
        self.layer = copy.deepcopy(src).float()
        self._rotary = [model.model.rotary_emb]  # the model's (a list: not this module's own)
        cfg = model.config
        self.h, self.k = cfg.num_attention_heads, cfg.num_key_value_heads
        self.e = cfg.hidden_size // cfg.num_attention_heads

    def forward(self, x):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, s, _ = x.shape
        lay = self.layer
        pos = torch.arange(s, device=x.device).unsqueeze(0).expand(b, -1)
        with torch.autocast(x.device.type, enabled=False):
            cos, sin = self._rotary[0](x, pos)
        a = lay.self_attn
        y = lay.input_layernorm(x)
        q = a.q_proj(y).view(b, s, self.h, self.e).transpose(1, 2)
        k = a.k_proj(y).view(b, s, self.k, self.e).transpose(1, 2)
        v = a.v_proj(y).view(b, s, self.k, self.e).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos.float(), sin.float())
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.h != self.k)
        z = x + a.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        z = z + lay.mlp(lay.post_attention_layernorm(z))
        return z - x


def make_adapters(kind: str, dim: int, n: int, hidden: int, model=None, exits=()) -> torch.nn.ModuleList:
    if kind == "linear":
        mods = [torch.nn.Linear(dim, dim, bias=False) for _ in range(n)]
        for m in mods:
            torch.nn.init.zeros_(m.weight)
        return torch.nn.ModuleList(mods)
    if kind == "mlp":
        return torch.nn.ModuleList(MLPAdapter(dim, hidden) for _ in range(n))
    if kind == "block":
        return torch.nn.ModuleList(BlockAdapter(model, e) for e in exits)
    raise SystemExit(f"unknown adapter kind {kind!r} (linear, mlp, block)")


def read_subset(folder: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(folder / "exits.safetensors"))["subset"].long()


def read_shipped(folder: Path, exits: list[int], dim: int) -> torch.nn.ModuleList:
    """The shipped linear adapters at these exits (zero, the plain logit lens, where that
    folder has no exit at a layer)."""
    from safetensors.torch import load_file

    layers = json.loads((folder / "exits.json").read_text()).get("layers", [])
    tensors = load_file(str(folder / "exits.safetensors"))
    mods = make_adapters("linear", dim, len(exits), 0)
    with torch.no_grad():
        for m, e in zip(mods, exits):
            if e in layers:
                m.weight.copy_(tensors[f"adapters.{layers.index(e)}.weight"].float())
    return mods


class SubsetHead:
    """A model's final norm and its head's rows of a vocabulary subset, fp32: the exits' head
    while they train (here and in ``exit_train``); ``where`` maps a token to its index in the
    subset (-1: outside)."""

    def __init__(self, head_w: torch.Tensor, norm_w: torch.Tensor, eps: float, subset: torch.Tensor,
                 vocab_size: int, device="cpu"):
        self.w = head_w.detach()[subset.to(head_w.device)].float().to(device)
        self.g = norm_w.detach().float().to(device)
        self.eps = eps
        self.subset = subset.to(device)
        where = torch.full((vocab_size,), -1, dtype=torch.long)
        where[subset] = torch.arange(len(subset))
        self.where = where.to(device)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.g

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Subset logits of (adapted) states x [..., D]."""
        return F.linear(self.norm(x), self.w)

    @torch.no_grad()
    def agreement(self, adapter, h: torch.Tensor, y: torch.Tensor) -> float:
        """How often the adapted states' top subset token is ``y`` (subset indices)."""
        return float((self(h + adapter(h)).argmax(-1) == y).float().mean())

    def logits(self, h: torch.Tensor, adapter, keep: torch.Tensor) -> torch.Tensor:
        """Subset logits at the ``keep`` positions of states h [B, S, D] (an adapter may read the
        whole sequence)."""
        return self((h + adapter(h))[keep])


def forward(model, ids: torch.Tensor, exits: list[int]):
    """Each exit's state (fp32) and the full model's greedy token at every position."""
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        out = model.model(input_ids=ids, output_hidden_states=True)
        top = model.lm_head(out.last_hidden_state).argmax(-1)
    return [out.hidden_states[e].float() for e in exits], top


@torch.no_grad()
def evaluate(model, heads: SubsetHead, kinds: dict[str, torch.nn.ModuleList], exits, batches, device, eos) -> dict:
    res: dict = {}
    counts: dict = {}
    for ids, labels in batches:
        ids, labels = ids.to(device), labels.to(device)
        keep = valid_positions(ids, eos)
        mid = torch.zeros_like(keep)
        mid[:, :-1] = labels[:, 1:] != -100  # position t predicts the middle's token labels[t + 1]
        states, top = forward(model, ids, exits)
        for name, mods in kinds.items():
            for e, h, m in zip(exits, states, mods):
                hit = heads.subset[heads.logits(h, m, keep).argmax(-1)] == top[keep]
                for where, mask in (("all", keep[keep]), ("mid", mid[keep])):
                    c = counts.setdefault((name, e, where), [0, 0])
                    c[0] += int(hit[mask].sum())
                    c[1] += int(mask.sum())
    for (name, e, where), (a, n) in counts.items():
        res[f"{name}_{e}_{where}"] = round(a / max(n, 1), 4)
    res["positions_all"] = counts[next(iter(counts))][1] if counts else 0
    return res


def save(kinds: dict[str, torch.nn.ModuleList], exits: list[int], out: Path, part_bytes: int = 15 * 10**6) -> None:
    """Each kind's adapters in files ``<kind>-<i>.safetensors`` of whole exits and at most about
    ``part_bytes`` each (a device call brings back at most 8 files of 16 MiB); keys
    ``exit_<layer>.<name>``; linear in fp32, the others in bf16."""
    from safetensors.torch import save_file

    for name, mods in kinds.items():
        dtype = torch.float32 if name == "linear" else torch.bfloat16
        parts: list[dict] = [{}]
        size = 0
        for e, m in zip(exits, mods):
            tensors = {f"exit_{e}.{k}": v.detach().to(dtype).cpu().contiguous() for k, v in m.state_dict().items()}
            n = sum(t.numel() * t.element_size() for t in tensors.values())
            if parts[-1] and size + n > part_bytes:
                parts.append({})
                size = 0
            parts[-1].update(tensors)
            size += n
        for i, part in enumerate(parts):
            save_file(part, str(out / f"{name}-{i}.safetensors"), metadata={"format": "pt"})


def load_adapters(folder: Path, kind: str = "linear") -> dict[str, torch.Tensor]:
    """Every tensor a run saved for one kind (``exit_<layer>.<name>``)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob(f"{kind}-*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def saved_at(saved: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """One exit's adapter state dict from ``load_adapters``' tensors (keys ``exit_<layer>.<name>``)."""
    prefix = f"exit_{layer}."
    return {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}


def init_from(kinds: dict[str, torch.nn.ModuleList], exits: list[int], folder: Path) -> list[str]:
    """Copy a run's saved adapters (``save``'s files in ``folder``) into ``kinds`` where that run
    has the same kind at the same exit, keys and shapes checked; returns which (``kind@exit``)."""
    if not folder.is_dir():
        raise SystemExit(f"--init: no such folder {folder}")
    started = []
    for name, mods in kinds.items():
        saved = load_adapters(folder, name)
        for e, m in zip(exits, mods):
            own = saved_at(saved, e)
            if not own:
                continue
            try:
                m.load_state_dict(own)
            except RuntimeError as exc:
                raise SystemExit(f"--init: {name} adapter at exit {e} in {folder} does not fit "
                                 f"(--mlp-hidden?): {exc}") from None
            started.append(f"{name}@{e}")
    return started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codecomplete.model.exit_stream", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--texts", type=Path,
                    help="JSON (or .json.xz) {train: [...], validation: [...]} (default: the local corpus)")
    ap.add_argument("--subset-from", type=Path, default=SHIPPED_EXITS,
                    help="exits folder whose vocabulary subset the adapters' head uses (default: the shipped exits)")
    ap.add_argument("--exits", default="12,16,20,24,27")
    ap.add_argument("--kinds", default="linear,mlp,block")
    ap.add_argument("--mlp-hidden", type=int, default=1536)
    ap.add_argument("--init", type=Path,
                    help="a run's folder: start each kind's adapters from its saved ones (exits it lacks start fresh)")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time (the schedule follows it)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: the time decides)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the mlp adapters' learning rate")
    ap.add_argument("--lr-linear", type=float, default=3e-3)
    ap.add_argument("--lr-block", type=float, default=2e-4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    start = time.perf_counter()

    def log(what: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {what}", file=sys.stderr, flush=True)

    exits = [int(x) for x in args.exits.split(",") if x.strip()]
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    tok, model, base_path = tr.load_base(args.model)
    model.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    log(f"loaded {base_path}")
    n_layers, dim = model.config.num_hidden_layers, model.config.hidden_size
    if any(not 0 < e < n_layers for e in exits):
        raise SystemExit(f"--exits must lie in 1..{n_layers - 1}")
    heads = SubsetHead(model.lm_head.weight, model.model.norm.weight, model.config.rms_norm_eps,
                       read_subset(args.subset_from), model.config.vocab_size, device)
    kinds = {k: make_adapters(k, dim, len(exits), args.mlp_hidden, model, exits).to(device)
             for k in args.kinds.split(",")}
    if args.init is not None:
        started = init_from(kinds, exits, args.init)
        log(f"started from {args.init}: {started}")
    lrs = {"linear": args.lr_linear, "mlp": args.lr, "block": args.lr_block}
    groups = [{"params": [p for p in mods.parameters() if p.requires_grad or k == "block"], "lr": lrs[k]}
              for k, mods in kinds.items()]
    for g in groups:
        for p in g["params"]:
            p.requires_grad_(True)
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    base_lrs = [g["lr"] for g in opt.param_groups]
    params = [p for g in groups for p in g["params"]]
    ref = {"shipped": read_shipped(args.subset_from, exits, dim).to(device)}

    special = tr.special_ids(tok)
    texts = load_texts(args.texts)
    loader = torch.utils.data.DataLoader(Batches(texts["train"], tok, special, args.seed, args.batch, args.seq),
                                         batch_size=None, num_workers=args.workers,
                                         prefetch_factor=4 if args.workers else None)
    val_gen = tr.batches(texts["validation"], tok, special, random.Random(args.seed + 1), 16, args.seq)
    val = [next(val_gen) for _ in range(args.eval_batches)]
    history = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "base": base_path, "device": str(device), "subset": len(heads.subset),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "train_files": len(texts["train"]), "evals": [], "steps": []}

    def check(step: int, positions: int, with_ref: bool = False) -> None:
        rec = evaluate(model, heads, {**kinds, **(ref if with_ref else {})}, exits, val, device, special["eos"])
        history["evals"].append({"step": step, "positions": positions, **rec})
        log(json.dumps(history["evals"][-1]))

    t_eval = time.perf_counter()
    check(0, 0, with_ref=True)
    eval_s = time.perf_counter() - t_eval
    budget = args.minutes * 60
    t0, step, positions = time.perf_counter(), 0, 0
    for ids, _labels in loader:
        frac = (time.perf_counter() - t0) / budget
        if frac >= 1 or (args.max_steps and step >= args.max_steps):
            break
        scale = min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * scale
        ids = ids.to(device, non_blocking=True)
        states, top = forward(model, ids, exits)
        target = heads.where[top]
        keep = valid_positions(ids, special["eos"]) & (target >= 0)
        target = target[keep]
        losses = {}
        for name, mods in kinds.items():
            losses[name] = [F.cross_entropy(heads.logits(h, m, keep), target) for h, m in zip(states, mods)]
        loss = sum(sum(v) for v in losses.values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 5.0)
        opt.step()
        step += 1
        positions += int(keep.sum())
        if step % 50 == 0 or step <= 3:
            rec = {"step": step, "positions": positions, "s": round(time.perf_counter() - t0, 1),
                   **{f"{name}_{e}": round(x.item(), 3) for name, v in losses.items() for e, x in zip(exits, v)}}
            history["steps"].append(rec)
            log(json.dumps(rec))
        if step % args.eval_every == 0 and (time.perf_counter() - t0) + eval_s < budget:
            check(step, positions)
    history["train_s"] = round(time.perf_counter() - t0, 1)
    check(step, positions, with_ref=True)
    save(kinds, exits, args.out)
    (args.out / "history.json").write_text(json.dumps(history, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
