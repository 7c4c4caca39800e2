"""A Llama-family GGUF file as a Hugging Face checkpoint folder, without transformers.

``loader.convert_gguf`` turns a ``.gguf`` file into a safetensors checkpoint once (cached).  It
went through transformers: importing it (3.7 s here), building its tokenizer and model classes and
its own GGUF reader took most of a first start's 29 s, later 7.5 s.  ``convert`` writes the same
checkpoint from gguf's reader alone for the files it knows completely:

* architecture ``llama`` whose every metadata key and tensor is one it knows (no rope scaling,
  no biases, no experts, no file that transformers would read as Mistral);
* a byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``) whose pre-tokenizer transformers
  builds as GPT-2's (``smollm``, ``gpt2``, ``default``), that adds no BOS or EOS of its own.

It builds what transformers builds for those: the same tensors (dequantized with the same
arithmetic, Q and K rows un-permuted from llama.cpp's order), the same tokenizer (vocabulary,
merges, control tokens as special tokens, GPT-2's byte-level pre-tokenizer and decoder), and a
config.json with the same model keys.  tests/test_gguf_convert.py compares the two conversions
of the default model's file and of small files written there.  For any other file ``convert``
returns False and the caller goes through transformers as before.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# llama.<key> -> config.json key; any other llama.* key makes the file transformers' to convert
_LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# tokenizer.ggml.* keys read here or without effect on the tokenizer transformers builds
_TOKENIZER_KEYS = {"model", "pre", "tokens", "token_type", "merges", "scores", "bos_token_id", "eos_token_id",
                   "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token",
                   "add_space_prefix"}
# pre-tokenizers transformers builds as GPT-2's plain byte-level one (it splits others its own way)
_GPT2_PRE = {"smollm", "gpt2", "gpt-2", "default"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


class Unsupported(Exception):
    """This file needs transformers' conversion (the message says why)."""


def _value(field):
    """A reader field's value: a scalar, a string, or a list of either."""
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        raise Unsupported(f"{field.name}: no type")
    if types[0] == GGUFValueType.ARRAY:
        if len(types) < 2:
            return []
        if types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if types[1] == GGUFValueType.ARRAY:
            raise Unsupported(f"{field.name}: nested arrays")
        return [field.parts[i].tolist()[0] for i in field.data]
    part = field.parts[field.data[0]]
    if types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part.tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: byte -> printable character (as tokenizers' ByteLevel spells bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _metadata(reader) -> dict:
    return {name: _value(field) for name, field in reader.fields.items()}


def _config(meta: dict, tensors: list) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise Unsupported(f"architecture {arch!r}")
    name = meta.get("general.name")
    if isinstance(name, str) and "mistral" in name:  # transformers reads such a file as Mistral
        raise Unsupported("a Mistral file")
    cfg: dict = {}
    for key, value in meta.items():
        if key.startswith("llama."):
            sub = key[len("llama."):]
            if sub not in _LLAMA_KEYS:
                raise Unsupported(f"metadata key {key}")
            cfg[_LLAMA_KEYS[sub]] = value
        elif key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            if not key.startswith("tokenizer.ggml.") or key[len("tokenizer.ggml."):] not in _TOKENIZER_KEYS:
                raise Unsupported(f"metadata key {key}")
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise Unsupported(f"no {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    cfg.setdefault("num_key_value_heads", heads)
    cfg.setdefault("head_dim", cfg["hidden_size"] // heads)
    if "vocab_size" not in cfg:
        cfg["vocab_size"] = len(meta.get("tokenizer.ggml.tokens") or [])
    names = {t.name for t in tensors}
    out = {
        "_model_name_or_path": name,
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "dtype": "float32",
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "head_dim": cfg["head_dim"],
        "hidden_act": "silu",
        "hidden_size": cfg["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": cfg["intermediate_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "pretraining_tp": 1,
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_parameters": {"rope_theta": float(cfg.get("rope_theta", 10000.0)), "rope_type": "default"},
        "tie_word_embeddings": "output.weight" not in names,
        "unk_token_id": meta.get("tokenizer.ggml.unknown_token_id"),
        "use_cache": True,
        "vocab_size": cfg["vocab_size"],
    }
    return out


def _hf_name(gguf_name: str, layers: int) -> str:
    stem, dot, kind = gguf_name.rpartition(".")
    if kind != "weight":
        raise Unsupported(f"tensor {gguf_name}")
    if stem in _TOP_TENSORS:
        return f"{_TOP_TENSORS[stem]}.weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < layers \
            and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise Unsupported(f"tensor {gguf_name}")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary reordering of Q or K rows (transformers' _reverse_permute_weights)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _tensors(reader, cfg: dict) -> dict:
    """HF name -> float32 torch tensor, as transformers' GGUF loader makes them."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    layers = cfg["num_hidden_layers"]
    plan = [(t, _hf_name(t.name, layers)) for t in reader.tensors]
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{v}.weight" for i in range(layers) for v in _LAYER_TENSORS.values()}
    got = {hf for _, hf in plan}
    if not expected <= got:
        raise Unsupported(f"tensors missing: {sorted(expected - got)[:3]}")
    out = {}
    for t, hf in plan:
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise Unsupported(f"{t.name}: {GGMLQuantizationType(t.tensor_type).name}") from exc
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if ".attn_q." in t.name:
            w = _unpermute(w, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = _unpermute(w, cfg["num_key_value_heads"])
        if not w.flags.writeable or not w.flags.c_contiguous:  # a view of the file's read-only memmap
            w = np.array(w, order="C")
        out[hf] = torch.from_numpy(w)
    if cfg["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return out


def _tokenizer(meta: dict):
    """(tokenizers.Tokenizer, tokenizer_config dict) as transformers builds them for this file."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise Unsupported(f"tokenizer {meta.get('tokenizer.ggml.model')!r}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _GPT2_PRE:
        raise Unsupported(f"pre-tokenizer {pre!r}")
    if meta.get("tokenizer.ggml.add_bos_token") or meta.get("tokenizer.ggml.add_eos_token"):
        raise Unsupported("a tokenizer that adds BOS or EOS")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise Unsupported("no vocabulary or no merges")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        key = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab[key] = i
    if len(vocab) != len(tokens) or "<|endoftext|>" not in vocab:
        # transformers' GPT-2 class adds <|endoftext|> where the file lacks it (a larger vocabulary
        # than the model's), and a repeated spelling makes ids ambiguous: leave those to it
        raise Unsupported("duplicate spellings or no <|endoftext|>")
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or " " in b:
            raise Unsupported(f"merge {m!r}")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    types = meta.get("tokenizer.ggml.token_type") or []
    specials = ["<|endoftext|>"] + [t for t, k in zip(tokens, types)
                                    if k == _CONTROL and set(t) <= alphabet and t != "<|endoftext|>"]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    config = {"backend": "tokenizers", "model_max_length": 1000000000000000019884624838656,
              "tokenizer_class": "TokenizersBackend"}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        idx = meta.get(f"tokenizer.ggml.{key}")
        if idx is not None:
            if not 0 <= idx < len(tokens):
                raise Unsupported(f"{name} id {idx} outside the vocabulary")
            config[name] = tokens[idx]
    return tok, config


def convert(reader, out: Path) -> bool:
    """Write ``out``'s config.json, tokenizer.json, tokenizer_config.json, model.safetensors (and
    chat_template.jinja where the file has one) from an open ``gguf.GGUFReader``; False, with
    nothing written, where the file needs transformers (see the module docstring)."""
    from safetensors.torch import save_file

    try:
        meta = _metadata(reader)
        cfg = _config(meta, reader.tensors)
        tok, tok_config = _tokenizer(meta)
        tensors = _tensors(reader, cfg)
    except Unsupported as exc:
        log.info("%s: converting through transformers (%s)", getattr(reader, "path", "GGUF"), exc)
        return False
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        (out / "chat_template.jinja").write_text(template)
    return True
