"""Teach a causal code model FIM the EFIM way (issue #3): ``python -m codecomplete.model.train``.

    python -m codecomplete.model.train --out DIR [--base smollm2-135m] [--steps N] [--resume]

Adds ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>`` to the tokenizer (new embedding
rows start at the mean row and are the only embedding rows trained), builds samples with
``fimdata`` (PSM, SPM, EFIM-shaped, fragment tokenization), and fine-tunes the upper
layers (``--freeze-layers`` lower ones stay fixed) in bf16 autocast on CPU.  Seeded and
resumable: ``DIR/state.pt`` holds the trainable weights, the optimizer, the step and the
random state; ``--resume`` continues from it.  Validation loss every ``--eval-every``
steps; ``DIR/model`` is a checkpoint the daemon loads (``--model DIR/model``) with a
model card (data manifest, hyperparameters, tokens seen, losses, loss curve).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from . import fimdata as fd

FIM_TOKENS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(torch.nn.Module):
    """``base(x) + scale * x A^T B^T`` with the base frozen; B starts at zero so step 0 is
    the base model.  ``merge`` folds the product into the base weight (for saving)."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.lora_a = torch.nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x):
        return self.base(x) + torch.nn.functional.linear(
            torch.nn.functional.linear(x, self.lora_a), self.lora_b) * self.scale

    def delta(self) -> torch.Tensor:
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale


def add_lora(model, rank: int, alpha: float, first_layer: int) -> list[torch.nn.Parameter]:
    """Wrap every attention and MLP projection of layers >= ``first_layer`` in LoRA."""
    params = []
    for layer in list(model.model.layers)[first_layer:]:
        for owner in (layer.self_attn, layer.mlp):
            for name in LORA_TARGETS:
                base = getattr(owner, name, None)
                if isinstance(base, torch.nn.Linear):
                    wrapped = LoRALinear(base, rank, alpha)
                    setattr(owner, name, wrapped)
                    params += [wrapped.lora_a, wrapped.lora_b]
    return params


def lora_modules(model) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model) -> None:
    """Fold every adapter into its base weight and unwrap it (the saved model is plain)."""
    for name, mod in lora_modules(model).items():
        owner_name, attr = name.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        with torch.no_grad():
            mod.base.weight += mod.delta().to(mod.base.weight.dtype)
        setattr(owner, attr, mod.base)


def load_base(spec: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .loader import resolve_checkpoint

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _, ckpt = resolve_checkpoint(spec)
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True, dtype=torch.float32)
    return tok, model, str(ckpt)


def add_fim_tokens(tok, model) -> list[int]:
    """Add the FIM tokens if missing; new embedding rows start at the mean row."""
    vocab = tok.get_vocab()
    missing = [t for t in FIM_TOKENS if t not in vocab]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": missing})
        old = model.get_input_embeddings().weight.shape[0]
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        emb = model.get_input_embeddings().weight
        with torch.no_grad():
            emb[old:] = emb[:old].mean(0, keepdim=True)
    return [tok.convert_tokens_to_ids(t) for t in FIM_TOKENS]


def special_ids(tok) -> dict[str, int | None]:
    """The FIM tokens' and EOS's ids as ``fimdata.make_sample`` takes them (None or the unknown
    token's id where the tokenizer lacks a FIM token)."""
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in zip(("prefix", "suffix", "middle"), FIM_TOKENS)}
    return dict(ids, eos=tok.eos_token_id)


def trainable(model, freeze_layers: int, new_ids: list[int], lora_rank: int = 0,
              lora_alpha: float = 32.0) -> list[torch.nn.Parameter]:
    """Upper layers and the final norm train (or, with ``lora_rank``, LoRA adapters on
    the upper layers' projections while every base weight stays frozen), plus the new
    tokens' input embeddings.

    The embedding is tied to the output head in SmolLM2: letting it train would compute
    the head's full gradient (tokens x 49152 x 576) every step, for three rows that are
    only ever inputs.  So the matrix stays frozen and the new rows live in a small
    parameter ``model.fim_rows`` that replaces their lookups (written back on save)."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    if lora_rank:
        params += add_lora(model, lora_rank, lora_alpha, freeze_layers)
    else:
        for layer in list(model.model.layers)[freeze_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
                params.append(p)
        for p in model.model.norm.parameters():
            p.requires_grad_(True)
            params.append(p)
    emb = model.get_input_embeddings()
    rows = torch.nn.Parameter(emb.weight[new_ids].detach().clone())
    model.fim_rows = rows
    lookup = torch.full((emb.weight.shape[0],), -1, dtype=torch.long)
    lookup[new_ids] = torch.arange(len(new_ids))
    base_forward = emb.forward

    def forward(ids):
        out = base_forward(ids)
        sel = lookup[ids]
        hit = sel >= 0
        if hit.any():
            out = out.clone()
            out[hit] = rows[sel[hit]].to(out.dtype)
        return out

    emb.forward = forward
    model.fim_ids = list(new_ids)
    params.append(rows)
    return params


def write_back_rows(model) -> None:
    with torch.no_grad():
        model.get_input_embeddings().weight[model.fim_ids] = model.fim_rows.detach()


def batches(texts: list[str], tok, special: dict, rng: random.Random, batch: int, seq: int,
            fragments: bool = True):
    """Endless batches of (ids, labels) with -100 where there is no loss."""
    encode = lambda t: tok.encode(t, add_special_tokens=False) if t else []  # noqa: E731
    while True:
        ids_b, lab_b = [], []
        while len(ids_b) < batch:
            s = fd.make_sample(rng.choice(texts), rng, encode, special, max_chars=seq * 3, fragments=fragments)
            ids = s.ids[:seq]
            labels = [t if keep else -100 for t, keep in zip(s.ids, s.loss)][:seq]
            if not any(x != -100 for x in labels[1:]):
                continue
            pad = seq - len(ids)
            ids_b.append(ids + [special["eos"]] * pad)
            lab_b.append(labels + [-100] * pad)
        yield torch.tensor(ids_b), torch.tensor(lab_b)


def fim_loss(model, ids: torch.Tensor, labels: torch.Tensor, exits: tuple[int, ...] = (),
             detail: dict | None = None) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
    """Next-token loss where labels are set, with the output head applied only there:
    the head (576 x 49152 for SmolLM2) is most of a step, and the loss covers only the
    middle of FIM samples.

    With ``exits`` (layer counts, e.g. (12, 18, 24)) it also returns the same loss at
    each exit: the hidden state after that many layers through the shared final norm
    and head (LayerSkip's early-exit loss).  ``detail`` receives, per exit, the share
    of loss positions where the exit's top-1 equals the final layer's."""
    out = model.model(input_ids=ids, output_hidden_states=bool(exits))
    target = labels[:, 1:]
    keep = target != -100
    logits = model.lm_head(out.last_hidden_state[:, :-1][keep])
    loss = torch.nn.functional.cross_entropy(logits.float(), target[keep])
    if not exits:
        return loss
    exit_losses = []
    for e in exits:
        h = model.model.norm(out.hidden_states[e][:, :-1][keep])
        el = model.lm_head(h)
        exit_losses.append(torch.nn.functional.cross_entropy(el.float(), target[keep]))
        if detail is not None:
            detail.setdefault(e, []).append((el.argmax(-1) == logits.argmax(-1)).float().mean().item())
    return loss, exit_losses


def evaluate(model, data, steps: int, dtype, exits: tuple[int, ...] = ()) -> dict:
    """Mean validation loss, and per exit its loss and top-1 agreement with the last layer
    (measured on every run, trained exits or not, so runs can be compared)."""
    model.eval()
    losses, exit_losses, agree = [], {e: [] for e in exits}, {}
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for _ in range(steps):
            ids, labels = next(data)
            if exits:
                loss, els = fim_loss(model, ids, labels, exits, agree)
                for e, el in zip(exits, els):
                    exit_losses[e].append(el.item())
            else:
                loss = fim_loss(model, ids, labels)
            losses.append(loss.item())
    model.train()
    res = {"val_loss": round(sum(losses) / len(losses), 4)}
    for e in exits:
        res[f"exit{e}_loss"] = round(sum(exit_losses[e]) / len(exit_losses[e]), 4)
        res[f"exit{e}_agree"] = round(sum(agree[e]) / len(agree[e]), 4)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codecomplete.model.train", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", default="smollm2-135m", help="the base model (as --model of the daemon)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--freeze-layers", type=int, default=15)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--corpus", choices=["local", "stdlib"], default="local",
                    help="local: stdlib + permissive site-packages; stdlib: the standard library only")
    ap.add_argument("--no-fragments", action="store_true",
                    help="the oLLM variant: FIM without fragment tokenization (for the comparison)")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="train LoRA adapters of this rank on layers >= --freeze-layers instead of the layers themselves")
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--exit-layers", default="",
                    help="early exits (layer counts, e.g. 12,18,24): their loss and agreement are measured at validation")
    ap.add_argument("--exit-weight", type=float, default=0.0,
                    help="> 0 trains the exits too: loss = final + weight * mean(exit losses) (LayerSkip style)")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    exits = tuple(int(x) for x in args.exit_layers.split(",") if x.strip())
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)

    tok, model, base_path = load_base(args.base)
    new_ids = add_fim_tokens(tok, model)
    special = special_ids(tok)
    import site

    sources = fd.collect_sources(None if args.corpus == "stdlib" else Path(site.getsitepackages()[0]))
    splits, dropped = fd.load_corpus(sources)
    train_texts = [t for _, t in splits["train"]]
    val_texts = [t for _, t in splits["validation"]]
    manifest = {"sources": len(sources), "dropped": dropped,
                "split_files": {k: len(v) for k, v in splits.items()},
                "licences": sorted({f"{s.package}: {s.licence}" for s in sources})}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))

    if any(not 0 < e < model.config.num_hidden_layers for e in exits):
        raise SystemExit(f"--exit-layers must lie in 1..{model.config.num_hidden_layers - 1}")
    params = trainable(model, args.freeze_layers, new_ids, args.lora_rank, args.lora_alpha)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
    state_path = args.out / "state.pt"
    step, tokens_seen, history = 0, 0, []
    if args.resume and state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        rows = st["trainable"].pop("fim_rows")
        model.load_state_dict(st["trainable"], strict=False)
        with torch.no_grad():
            model.fim_rows.copy_(rows)
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step, tokens_seen, history = st["step"], st["tokens_seen"], st["history"]
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        print(f"resumed at step {step}", file=sys.stderr)
    train = batches(train_texts, tok, special, rng, args.batch, args.seq, not args.no_fragments)
    val = batches(val_texts, tok, special, random.Random(args.seed + 1), args.batch, args.seq, not args.no_fragments)
    model.train()
    t0, last = time.perf_counter(), tokens_seen
    while step < args.steps:
        ids, labels = next(train)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            if args.exit_weight > 0 and exits:
                loss, exit_losses = fim_loss(model, ids, labels, exits)
                total = loss + args.exit_weight * sum(exit_losses) / len(exit_losses)
            else:
                loss = total = fim_loss(model, ids, labels)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += ids.numel()
        entry = {"step": step, "loss": round(loss.item(), 4), "tokens": tokens_seen}
        if step % args.eval_every == 0 or step == args.steps:
            entry.update(evaluate(model, val, args.eval_steps, dtype, exits))
        rate = (tokens_seen - last) / max(1e-9, time.perf_counter() - t0)
        entry["tok_per_s"] = round(rate, 1)  # this process's mean so far (validation included)
        history.append(entry)
        sys.stderr.write(f"\rstep {step}/{args.steps} loss {entry['loss']:.3f} "
                         f"{'val ' + str(entry['val_loss']) + ' ' if 'val_loss' in entry else ''}{rate:.0f} tok/s   ")
        if step % args.save_every == 0 or step == args.steps:
            if args.lora_rank:
                trainable_state = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
            else:
                trainable_state = {k: v for k, v in model.state_dict().items()
                                   if any(k.startswith(f"model.layers.{i}.") for i in
                                          range(args.freeze_layers, len(model.model.layers)))
                                   or k.startswith("model.norm")}
            trainable_state["fim_rows"] = model.fim_rows.detach().clone()
            torch.save({"trainable": trainable_state, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "step": step, "tokens_seen": tokens_seen, "history": history, "rng": rng.getstate(),
                        "torch_rng": torch.get_rng_state(), "args": vars(args) | {"out": str(args.out)}},
                       state_path)
            if args.lora_rank:  # a small loadable snapshot per save, for comparisons at equal steps
                save_adapter(model, args.out / "snapshots" / f"step-{step}", args, base_path, tokens_seen)
    sys.stderr.write("\n")
    save_model(model, tok, args, base_path, history, tokens_seen, manifest)
    return 0


def save_adapter(model, out: Path, args, base_path: str, tokens_seen: int) -> Path:
    """What the fine-tune changed, small enough to ship: LoRA factors (bf16), the FIM
    tokens' embedding rows, and ``adapter.json`` naming the base.  The loader applies it
    (``codecomplete.model.adapter``); ``--model`` accepts such a folder."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {"fim_rows": model.fim_rows.detach().to(torch.bfloat16).contiguous()}
    for name, mod in lora_modules(model).items():
        tensors[f"{name}.lora_a"] = mod.lora_a.detach().to(torch.bfloat16).contiguous()
        tensors[f"{name}.lora_b"] = (mod.lora_b.detach() * mod.scale).to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "adapter.safetensors"), metadata={"format": "pt"})
    meta = {"format": "codecomplete-adapter/1", "base": args.base, "base_path": base_path,
            "fim_tokens": FIM_TOKENS, "rank": args.lora_rank, "lora_scale_folded": True,
            "tokens_seen": tokens_seen, "fragments": not args.no_fragments,
            "exit_layers": args.exit_layers, "exit_weight": args.exit_weight}
    (out / "adapter.json").write_text(json.dumps(meta, indent=1))
    return out


def save_model(model, tok, args, base_path: str, history: list, tokens_seen: int, manifest: dict) -> None:
    out = args.out / "model"
    if args.lora_rank:
        save_adapter(model, args.out / "adapter", args, base_path, tokens_seen)
        merge_lora(model)
    write_back_rows(model)
    del model.fim_rows  # written into the embedding; not a weight of the saved model
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    vals = [h for h in history if "val_loss" in h]
    card = ["# FIM fine-tune of " + base_path, "",
            f"- steps: {history[-1]['step'] if history else 0}, tokens seen: {tokens_seen}",
            f"- hyperparameters: {json.dumps({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})}",
            f"- validation loss: {vals[-1]['val_loss'] if vals else 'n/a'} (first {vals[0]['val_loss'] if vals else 'n/a'})",
            f"- data: {manifest['split_files']} files by split; dropped {manifest['dropped']}; licences in manifest.json",
            f"- trained: {'LoRA rank ' + str(args.lora_rank) + ' on layers >= ' + str(args.freeze_layers) if args.lora_rank else 'layers >= ' + str(args.freeze_layers)}"
            f"{'; early-exit loss at layers ' + args.exit_layers + ' weight ' + str(args.exit_weight) if args.exit_weight else ''}",
            "- transformations: PSM, SPM, EFIM-shaped samples"
            f"{', fragment tokenization' if not args.no_fragments else ' (no fragment tokenization: the oLLM variant)'}"
            " (codecomplete.model.fimdata)",
            "", "![loss](loss.png)"]
    (out / "README.md").write_text("\n".join(card) + "\n")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "history.json").write_text(json.dumps(history))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([h["tokens"] for h in history], [h["loss"] for h in history], alpha=0.5, label="train")
        ax.plot([h["tokens"] for h in vals], [h["val_loss"] for h in vals], marker="o", label="validation")
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=100)
        plt.close(fig)
    except ImportError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
