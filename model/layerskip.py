"""Continual training of the early exits, LayerSkip style (issue #9): for a GPU.

    python -m codecomplete.model.layerskip --model default --out DIR [--minutes 5.5]
        [--exits 12,16,20,24,27] [--exit-weight 0.15] [--rank 32] [--batch 16] [--texts texts.json.xz]

Measured once on an H200 (bench/results/layerskip.md): exits 16 and 20 gained 4-6 points of
agreement, early exit on a CPU gained nothing measurable, and the last layer drifted from
the teacher (top-1 0.91), so the result is not shipped (docs/decisions.md, 2026-11-26).

The per-exit adapters of ``exit_train`` are trained on a frozen model, so an exit can only
read what the layers below it happen to hold: at layer 16 of the default model it agrees
with the full model 41 % of the time.  Here the layers themselves learn to make their
states exit-ready, by self-distillation:

- teacher: the model as it ships (frozen, bf16);
- student: the same model plus a new LoRA (rank ``--rank``) on every projection of every
  layer, and a residual linear adapter per exit (``h + A h`` before the shared norm and
  head, the form ``early_exit.Exits`` serves);
- loss, at every position of FIM/EFIM samples (the fine-tune's pipeline):
  ``KL(teacher || student's last layer) + sum_e w_e KL(teacher || student's exit e)``.
  The first term holds the model's outputs where they were; the others pull each exit's
  distribution towards the full model's (soft targets, all 49,152 tokens).

The learning rate follows a cosine over the wall-clock budget (``--minutes``), so one run
fits a lent GPU's time.  Validation (the fine-tune's validation split) before and after:
the student's last layer against the teacher (top-1 agreement, KL, FIM loss on the
middles) and each exit's agreement with the teacher.

``--export-texts CHARS`` writes the texts to carry (the train split's random subset and the
validation split) and ``--combine RUN_DIR`` turns a run into an adapter (see below).

``--layer-dropout P_MAX`` skips layer i of the student with probability
P_MAX (2^(i/(L-1)) - 1) at each step (LayerSkip's rates; the layers run in ``forward_all``'s
loop), and ``--exit-loss ce`` trains the exits on the target's top token instead of its
distribution.  Both measured on an H100 (layerskip.md, runs 5 and 6): layer dropout 0.2 left
the exits lower and the model worse (FIM loss +5.8 %); the hard labels gained 1-2 points at
layers 24 and 27 only.

``--target own`` distils each exit towards the student's own last layer (detached) instead
of the teacher, so the exit terms pull the layers only through the exits' inputs; the last
layer's KL to the teacher (weight ``--final-weight``) holds the model's outputs.

Writes DIR/lora-*.safetensors (the new LoRA, scale folded, bf16, in files of whole layers of
at most ~14 MB each), DIR/exits.safetensors (the exit adapters, for reference: ``exit_train`` retrains
them on the result) and DIR/history.json.  ``combine`` appends the new LoRA to a shipped
adapter, which gives an adapter of rank 32 + r in the same format (``B1 A1 + B2 A2 =
[B1 B2] [A1; A2]``), loadable with ``--model``.
"""

from __future__ import annotations

import argparse
import copy
import json
import lzma
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import train as tr


def load_texts(path: Path | None) -> dict[str, list[str]]:
    """The train and validation texts: from ``path`` (JSON {split: [text]}, xz-compressed when
    it ends in .xz: how the texts travel to a machine without this one's site-packages) or
    from the local corpus."""
    if path is not None:
        raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
        data = json.loads(raw)
        return {k: data[k] for k in ("train", "validation")}
    from .exit_train import _splits

    return {k: [t for _, t in _splits()[k]] for k in ("train", "validation")}


def export_texts(out: Path, max_chars: int, seed: int = 0) -> dict:
    """Write the train split (a random subset of at most ``max_chars``) and the whole
    validation split to ``out`` (JSON, xz)."""
    from .exit_train import _splits

    rng = random.Random(seed)
    train = [t for _, t in _splits()["train"]]
    rng.shuffle(train)
    keep, n = [], 0
    for t in train:
        if n + len(t) > max_chars:
            continue
        keep.append(t)
        n += len(t)
    data = {"train": keep, "validation": [t for _, t in _splits()["validation"]]}
    out.write_bytes(lzma.compress(json.dumps(data).encode(), preset=6))
    return {"train_files": len(keep), "train_chars": n, "validation_files": len(data["validation"])}


class Batches(torch.utils.data.IterableDataset):
    """Endless FIM/EFIM batches (``train.batches``), each worker with its own seed."""

    def __init__(self, texts, tok, special, seed, batch, seq):
        self.texts, self.tok, self.special, self.seed, self.batch, self.seq = texts, tok, special, seed, batch, seq

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.seed * 1000 + (info.id if info else 0))
        return tr.batches(self.texts, self.tok, self.special, rng, self.batch, self.seq)


def valid_positions(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """Positions up to each row's last non-padding token (batches pad with EOS)."""
    return (ids != eos).flip(1).cumsum(1).flip(1) > 0


def kl(student_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), mean over positions."""
    return F.kl_div(F.log_softmax(student_logits.float(), -1), teacher_logp, log_target=True, reduction="batchmean")


def forward_all(model, ids: torch.Tensor, exits: list[int], drop: frozenset[int] = frozenset()):
    """The last layer's normed state and the raw state after each exit's layers, by the model's own
    decoder layers in a loop of ours so that layers in ``drop`` (0-based) can be skipped: their
    input passes on unchanged, LayerSkip's layer dropout.  Causal attention without a mask: the
    batches pad only at the end of a row, after every real token."""
    m = model.model
    h = m.embed_tokens(ids)
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    pe = m.rotary_emb(h, position_ids=pos)
    at: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(m.layers):
        if i not in drop:
            h = layer(h, attention_mask=None, position_embeddings=pe, position_ids=pos)
            h = h[0] if isinstance(h, tuple) else h
        at[i + 1] = h
    return m.norm(h), [at[e] for e in exits]


def dropout_rates(n_layers: int, p_max: float) -> list[float]:
    """LayerSkip's per-layer dropout: 0 at the first layer, rising exponentially to ``p_max`` at the last."""
    if n_layers < 2:
        return [0.0] * n_layers
    return [p_max * (math.exp(i * math.log(2) / (n_layers - 1)) - 1) for i in range(n_layers)]


def draw_drop(rates: list[float], rng: random.Random) -> frozenset[int]:
    return frozenset(i for i, p in enumerate(rates) if p > 0 and rng.random() < p)


def exit_logits(model, adapter, h):
    return model.lm_head(model.model.norm(h + adapter(h)))


@torch.no_grad()
def evaluate(student, teacher, adapters, exits, batches, device, eos) -> dict:
    student.eval()
    agree = {e: [0, 0] for e in exits}
    own = {e: 0 for e in exits}  # the exit's top token = the student's own last layer's
    exit_kl: dict[int, list[float]] = {e: [] for e in exits}
    fin, kls, ce_s, ce_t = [0, 0], [], [], []
    for ids, labels in batches:
        ids, labels = ids.to(device), labels.to(device)
        keep = valid_positions(ids, eos)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            t_last = teacher.model(input_ids=ids).last_hidden_state
            s_last, s_exits = forward_all(student, ids, exits)
            t_logits = teacher.lm_head(t_last[keep]).float()
            s_logits = student.lm_head(s_last[keep]).float()
            top = t_logits.argmax(-1)
            s_top = s_logits.argmax(-1)
            fin[0] += int((s_top == top).sum())
            fin[1] += len(top)
            t_logp = F.log_softmax(t_logits, -1)
            kls.append(float(kl(s_logits, t_logp)))  # the last layer against the teacher
            mid = labels[:, 1:] != -100  # FIM loss on the middles, as the fine-tune measures it
            tgt = labels[:, 1:][mid]
            ce_s.append(float(F.cross_entropy(student.lm_head(s_last[:, :-1][mid]).float(), tgt)))
            ce_t.append(float(F.cross_entropy(teacher.lm_head(t_last[:, :-1][mid]).float(), tgt)))
            for e, h, a in zip(exits, s_exits, adapters):
                logits = exit_logits(student, a, h[keep]).float()
                e_top = logits.argmax(-1)
                agree[e][0] += int((e_top == top).sum())
                agree[e][1] += len(top)
                own[e] += int((e_top == s_top).sum())
                exit_kl[e].append(float(kl(logits, t_logp)))
    student.train()
    res = {"final_agree": round(fin[0] / fin[1], 4), "final_kl": round(sum(kls) / len(kls), 4),
           "fim_loss": round(sum(ce_s) / len(ce_s), 4), "teacher_fim_loss": round(sum(ce_t) / len(ce_t), 4),
           "positions": fin[1]}
    res.update({f"agree_{e}": round(a / n, 4) for e, (a, n) in agree.items()})
    res.update({f"own_{e}": round(own[e] / n, 4) for e, (a, n) in agree.items()})
    res.update({f"exit_kl_{e}": round(sum(v) / len(v), 4) for e, v in exit_kl.items()})
    return res


def save(student, adapters, exits, out: Path, n_layers: int, part_bytes: int = 14 * 10**6) -> None:
    """The LoRA in files of at most about ``part_bytes`` (whole layers each; a device call
    brings back files of at most 16 MiB), and the exit adapters."""
    from safetensors.torch import save_file

    mods = tr.lora_modules(student)
    size = sum(2 * (m.lora_a.numel() + m.lora_b.numel()) for m in mods.values())
    n_parts = max(1, -(-size // part_bytes))
    parts: list[dict] = [{} for _ in range(n_parts)]
    for name, mod in mods.items():
        layer = int(name.split(".")[2])
        part = parts[layer * n_parts // n_layers]
        part[f"{name}.lora_a"] = mod.lora_a.detach().to(torch.bfloat16).cpu().contiguous()
        part[f"{name}.lora_b"] = (mod.lora_b.detach() * mod.scale).to(torch.bfloat16).cpu().contiguous()
    for i, part in enumerate(parts):
        save_file(part, str(out / f"lora-{i}.safetensors"), metadata={"format": "pt"})
    save_file({f"exit_{e}": a.weight.detach().float().cpu().contiguous() for e, a in zip(exits, adapters)},
              str(out / "exits.safetensors"), metadata={"format": "pt"})


def combine(shipped: Path, trained: Path, out: Path) -> Path:
    """``shipped`` adapter + the LoRA in ``trained`` (lora-*.safetensors) -> adapter ``out``
    whose every module has rank r1 + r2 (A stacked by rows, B by columns)."""
    from safetensors.torch import load_file, save_file

    from .adapter import read_meta

    meta = read_meta(shipped)
    base = load_file(str(shipped / "adapter.safetensors"))
    new: dict[str, torch.Tensor] = {}
    for f in sorted(trained.glob("lora-*.safetensors")):
        new.update(load_file(str(f)))
    tensors = dict(base)
    for key, t in new.items():
        if key not in tensors:
            tensors[key] = t
        elif key.endswith(".lora_a"):
            tensors[key] = torch.cat([tensors[key], t], 0).contiguous()
        else:
            tensors[key] = torch.cat([tensors[key], t], 1).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter.safetensors"), metadata={"format": "pt"})
    hist = json.loads((trained / "history.json").read_text()) if (trained / "history.json").is_file() else {}
    meta = dict(meta, rank=meta.get("rank", 0) + hist.get("args", {}).get("rank", 0),
                layerskip=hist.get("args", {}), layerskip_from=str(shipped.name))
    (out / "adapter.json").write_text(json.dumps(meta, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codecomplete.model.layerskip", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--texts", type=Path,
                    help="JSON (or .json.xz) {train: [...], validation: [...]} (default: the local corpus)")
    ap.add_argument("--export-texts", type=int, metavar="CHARS", help="only write --out as such a file and stop")
    ap.add_argument("--combine", type=Path, metavar="RUN_DIR",
                    help="only write --out: the adapter of --model (default: the shipped one) + RUN_DIR's new LoRA")
    ap.add_argument("--minutes", type=float, default=5.5, help="training time (the schedule follows it)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: the time decides)")
    ap.add_argument("--exits", default="12,16,20,24,27")
    ap.add_argument("--exit-weight", type=float, default=0.15,
                    help="weight of each exit's loss (the last layer's is --final-weight)")
    ap.add_argument("--target", choices=("teacher", "own"), default="teacher",
                    help="what the exits learn: the teacher's distribution, or the student's own last layer's "
                         "(detached: the exits follow the layers without pulling them)")
    ap.add_argument("--final-weight", type=float, default=1.0, help="weight of the last layer's KL to the teacher")
    ap.add_argument("--exit-loss", choices=("kl", "ce"), default="kl",
                    help="exits' loss: KL to the target's distribution, or cross-entropy to its top token")
    ap.add_argument("--layer-dropout", type=float, default=0.0, metavar="P_MAX",
                    help="LayerSkip's layer dropout while training: layer i skipped with probability "
                         "P_MAX (2^(i/(L-1)) - 1), one draw per layer and step")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--exit-lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    start = time.perf_counter()

    def log(what: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {what}", file=sys.stderr, flush=True)

    if args.export_texts:
        print(json.dumps(export_texts(args.out, args.export_texts, args.seed)))
        return 0
    if args.combine:
        from .adapter import SHIPPED

        print(combine(SHIPPED if args.model == "default" else Path(args.model), args.combine, args.out))
        return 0
    exits = [int(x) for x in args.exits.split(",") if x.strip()]
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    tok, student, base_path = tr.load_base(args.model)
    log(f"loaded {base_path}")
    n_layers = student.config.num_hidden_layers
    if any(not 0 < e < n_layers for e in exits):
        raise SystemExit(f"--exits must lie in 1..{n_layers - 1}")
    special = tr.special_ids(tok)
    teacher = copy.deepcopy(student).to(device=device, dtype=torch.bfloat16).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    for p in student.parameters():
        p.requires_grad_(False)
    lora = tr.add_lora(student, args.rank, args.alpha, 0)
    student.to(device)
    dim = student.config.hidden_size
    adapters = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in exits).to(device)
    for a in adapters:
        torch.nn.init.zeros_(a.weight)
    opt = torch.optim.AdamW([{"params": lora, "lr": args.lr},
                             {"params": list(adapters.parameters()), "lr": args.exit_lr}], weight_decay=0.0)
    base_lrs = [g["lr"] for g in opt.param_groups]

    texts = load_texts(args.texts)
    train_texts, val_texts = texts["train"], texts["validation"]
    loader = torch.utils.data.DataLoader(Batches(train_texts, tok, special, args.seed, args.batch, args.seq),
                                         batch_size=None, num_workers=args.workers,
                                         prefetch_factor=4 if args.workers else None)
    val_gen = tr.batches(val_texts, tok, special, random.Random(args.seed + 1), args.batch, args.seq)
    val = [next(val_gen) for _ in range(args.eval_batches)]
    log(f"data: {len(train_texts)} train texts, {len(val)} validation batches")
    history = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "model": args.model, "base": base_path, "device": str(device),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "train_files": len(train_texts), "validation_files": len(val_texts), "evals": [], "steps": []}

    def check(step: int, tokens: int) -> None:
        history["evals"].append({"step": step, "tokens": tokens,
                                 **evaluate(student, teacher, adapters, exits, val, device, special["eos"])})
        log(json.dumps(history["evals"][-1]))

    t_eval = time.perf_counter()
    check(0, 0)
    eval_s = time.perf_counter() - t_eval
    budget = args.minutes * 60
    t0, step, tokens = time.perf_counter(), 0, 0
    w_exit = args.exit_weight
    rates = dropout_rates(n_layers, args.layer_dropout)
    drop_rng = random.Random(args.seed + 2)
    for ids, _labels in loader:
        frac = (time.perf_counter() - t0) / budget
        if frac >= 1 or (args.max_steps and step >= args.max_steps):
            break
        scale = min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * frac))
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * scale
        ids = ids.to(device, non_blocking=True)
        keep = valid_positions(ids, special["eos"])
        with torch.autocast(device.type, dtype=torch.bfloat16):
            with torch.no_grad():
                t_last = teacher.model(input_ids=ids).last_hidden_state
                t_logp = F.log_softmax(teacher.lm_head(t_last[keep]).float(), -1)
            drop = draw_drop(rates, drop_rng)
            s_last, s_exits = forward_all(student, ids, exits, drop)
            s_logits = student.lm_head(s_last[keep])
            loss_final = kl(s_logits, t_logp)
            target = t_logp if args.target == "teacher" else F.log_softmax(s_logits.detach().float(), -1)
            if args.exit_loss == "ce":  # the target's top token: what an exit's agreement counts
                top = target.argmax(-1)
                loss_exits = [F.cross_entropy(exit_logits(student, a, h[keep]).float(), top)
                              for h, a in zip(s_exits, adapters)]
            else:
                loss_exits = [kl(exit_logits(student, a, h[keep]), target) for h, a in zip(s_exits, adapters)]
            loss = args.final_weight * loss_final + w_exit * sum(loss_exits)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lora + list(adapters.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += int(keep.sum())
        if step % 20 == 0 or step <= 3:
            rec = {"step": step, "tokens": tokens, "s": round(time.perf_counter() - t0, 1),
                   "loss": round(loss.item(), 4), "final_kl": round(loss_final.item(), 4),
                   **{f"kl_{e}": round(x.item(), 3) for e, x in zip(exits, loss_exits)}}
            history["steps"].append(rec)
            log(json.dumps(rec))
        if step % args.eval_every == 0 and (time.perf_counter() - t0) + eval_s < budget:
            check(step, tokens)
    history["train_s"] = round(time.perf_counter() - t0, 1)
    check(step, tokens)
    save(student, adapters, exits, args.out, n_layers)
    (args.out / "history.json").write_text(json.dumps(history, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
