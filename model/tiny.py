"""Build a tiny real model for tests: a byte-level BPE tokenizer with FIM tokens and a
two-layer Llama, trained for a few seconds on Python source (plain and PSM FIM samples).

It is a real checkpoint in Hugging Face format, loaded by the same loader as any other
model: seconds to build, milliseconds per token.  Its completions are crude but they
are the model's own.  ``python -m codecomplete.model.tiny OUT_DIR`` builds one.
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

SPECIAL = ["<|endoftext|>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>"]
# Small, stable standard-library modules (PSF licence): the tiny model's corpus.
CORPUS_MODULES = ["textwrap.py", "bisect.py", "heapq.py", "colorsys.py", "fnmatch.py",
                  "shlex.py", "glob.py", "keyword.py", "string.py", "random.py",
                  "statistics.py", "fractions.py", "dataclasses.py", "functools.py"]


def corpus_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in CORPUS_MODULES:
        p = stdlib / name
        if p.is_file():
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise RuntimeError(f"no corpus found under {stdlib}")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<fim_pad>", additional_special_tokens=SPECIAL[1:])


def fim_sample(text: str, tok, rng: random.Random) -> list[int]:
    """PSM: <fim_prefix>prefix<fim_suffix>suffix<fim_middle>middle<|endoftext|>."""
    a, b = sorted(rng.randrange(len(text) + 1) for _ in range(2))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    sid = tok.convert_tokens_to_ids
    return ([sid("<fim_prefix>")] + enc(text[:a]) + [sid("<fim_suffix>")] + enc(text[b:])
            + [sid("<fim_middle>")] + enc(text[a:b]) + [tok.eos_token_id])


def batches(texts: list[str], tok, seq: int, batch: int, rng: random.Random):
    joined = "\n\n".join(texts)
    plain = tok.encode(joined, add_special_tokens=False)
    while True:
        rows = []
        for _ in range(batch):
            if rng.random() < 0.5:
                start = rng.randrange(len(plain) - seq - 1)
                rows.append(plain[start:start + seq + 1])
            else:
                start = rng.randrange(len(joined) - 600)
                ids = fim_sample(joined[start:start + rng.randrange(100, 600)], tok, rng)
                rows.append((ids + [tok.pad_token_id] * (seq + 1))[: seq + 1])
        yield torch.tensor(rows)


def build_tiny_model(out: Path, steps: int = 400, seed: int = 0, log=print) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    texts = corpus_texts()
    tok = train_tokenizer(texts)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    t0 = time.perf_counter()
    for step, rows in zip(range(steps), batches(texts, tok, seq=128, batch=16, rng=rng)):
        labels = rows[:, 1:].clone()
        labels[labels == tok.pad_token_id] = -100
        logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"tiny model step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.1f} s)")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "README.md").write_text(
        f"Tiny test model built by codecomplete.model.tiny: {steps} steps, seed {seed}, "
        f"corpus {', '.join(CORPUS_MODULES)} (CPython standard library, PSF licence).\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    build_tiny_model(args.out, args.steps, args.seed, log=lambda m: print(m, file=sys.stderr))
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
