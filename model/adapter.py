"""Fine-tune adapters: what a FIM fine-tune changed, applied to its base at load (issue #3).

An adapter folder holds ``adapter.json`` (format, base model spec, FIM tokens) and
``adapter.safetensors``: per adapted projection ``<module>.lora_a`` [r, in] and
``<module>.lora_b`` [out, r] (LoRA scale folded in), and ``fim_rows`` [3, D], the
embedding rows of the added FIM tokens.  ``merged_checkpoint`` adds the tokens to the
base tokenizer, writes the rows, folds ``B @ A`` into each weight and saves the result
once as a Hugging Face checkpoint in the cache (keyed by the adapter's and the base's
identity), so later loads cost what a plain checkpoint costs.  It does that itself where the
base is a folder the engine reads itself (``_merge_native``), through transformers elsewhere.

The daemon's default model is the base SmolLM2-135M plus the adapter shipped in
``codecomplete/model/data/efim-smollm2`` (trained by ``codecomplete.model.train``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FORMAT = "codecomplete-adapter/1"
SHIPPED = Path(__file__).resolve().parent / "data" / "efim-smollm2"


class AdapterError(RuntimeError):
    """An adapter folder that cannot be applied."""


def is_adapter(path: Path) -> bool:
    return (path / "adapter.json").is_file()


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "adapter.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {path / 'adapter.json'}: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise AdapterError(f"{path}: unknown adapter format {meta.get('format')!r} (expected {FORMAT})")
    if not (path / "adapter.safetensors").is_file():
        raise AdapterError(f"{path}: adapter.safetensors is missing")
    return meta


def _identity(path: Path, base: Path | None, base_identity: str | None = None) -> str:
    """The merge's cache key: the adapter's files, and the base's (its weights' and config's
    sizes and mtimes, or ``base_identity`` where the caller names the base's source instead)."""
    h = hashlib.sha256()
    h.update((path / "adapter.json").read_bytes())
    st = (path / "adapter.safetensors").stat()
    h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    if base_identity is not None:
        h.update(base_identity.encode())
        return h.hexdigest()[:16]
    for f in sorted(base.glob("*.safetensors")) + [base / "config.json"]:
        if f.is_file():
            s = f.stat()
            h.update(f"{f.name}:{s.st_size}:{s.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _publish(tmp: Path, out: Path, path: Path) -> None:
    """The finished merge onto ``out``; then the merges of this adapter it replaces go (an
    upgrade's new adapter file, or one whose adapter folder is gone: ``paths.prune_replaced``)."""
    from codecomplete.paths import publish

    publish(tmp, out, "adapter ", str(path))


def _fim_rows(path: Path, meta: dict, tensors: dict) -> tuple[list[str], "torch.Tensor | None"]:
    """The FIM tokens the adapter adds and their embedding rows (checked against each other)."""
    fim_tokens = list(meta.get("fim_tokens") or [])
    rows = tensors.get("fim_rows")
    if fim_tokens and (rows is None or rows.shape[0] != len(fim_tokens)):
        raise AdapterError(f"{path}: fim_rows does not match fim_tokens {fim_tokens}")
    return fim_tokens, rows


def _fold_lora(path: Path, tensors: dict, weight_of) -> None:
    """Add ``B @ A`` to each adapted weight, ``weight_of(name)`` (None: the base has no such
    module), after checking the pair against it."""
    for name in sorted({k.rsplit(".", 1)[0] for k in tensors if k != "fim_rows"}):
        a, b = tensors.get(f"{name}.lora_a"), tensors.get(f"{name}.lora_b")
        if a is None or b is None:
            raise AdapterError(f"{path}: {name} lacks lora_a or lora_b")
        weight = weight_of(name)
        if weight is None:
            raise AdapterError(f"{path}: the base model has no module {name}")
        if tuple(weight.shape) != (b.shape[0], a.shape[1]):
            raise AdapterError(f"{path}: {name} is {tuple(weight.shape)} in the base, "
                               f"{(b.shape[0], a.shape[1])} in the adapter")
        with torch.no_grad():
            weight += b.float() @ a.float()


def merged_checkpoint(path: Path, base, cache: Path, base_identity: str | None = None) -> Path:
    """The base checkpoint folder ``base`` with the adapter in ``path`` applied, saved
    once under ``cache`` (returned as is when already there).  With ``base_identity`` (what the
    base is made from, e.g. a GGUF file's identity) the key does not read the base folder, and
    ``base`` may be a function that makes the folder, called only where the merge is not cached."""
    meta = read_meta(path)
    if base_identity is None and callable(base):
        base = base()
    out = cache / f"{path.name}-{_identity(path, base, base_identity)}"  # a base_identity: base unread
    if (out / "config.json").is_file():
        return out
    if callable(base):
        base = base()
    from .loader import _staged

    with _staged("applying the fine-tune (once)"):
        return _merge(path, base, out, meta)


def _merge(path: Path, base: Path, out: Path, meta: dict) -> Path:
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    tensors = load_file(str(path / "adapter.safetensors"))
    if _merge_native(path, base, meta, tensors, out):
        log.info("applied adapter %s to %s in %.1f s (cached in %s)", path, base, time.perf_counter() - t0, out)
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    fim_tokens, rows = _fim_rows(path, meta, tensors)
    if fim_tokens:
        vocab = tok.get_vocab()
        missing = [t for t in fim_tokens if t not in vocab]
        if missing:
            tok.add_special_tokens({"additional_special_tokens": missing})
            model.resize_token_embeddings(len(tok), mean_resizing=False)
        ids = [tok.convert_tokens_to_ids(t) for t in fim_tokens]
        with torch.no_grad():
            model.get_input_embeddings().weight[ids] = rows.float()
    def weight_of(name: str):
        try:
            return model.get_submodule(name).weight
        except AttributeError:
            return None

    _fold_lora(path, tensors, weight_of)
    from codecomplete.paths import staging_dir

    tmp = staging_dir(out)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"base {base}\nadapter {path}\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out, path)
    log.info("applied adapter %s to %s in %.1f s (cached in %s)", path, base, time.perf_counter() - t0, out)
    return out


def _merge_native(path: Path, base: Path, meta: dict, tensors: dict, out: Path) -> bool:
    """``merged_checkpoint``'s work without transformers (the default model's merge: 4.5 ->
    1.6 s), for a base whose files the engine reads itself: one model.safetensors, a config.json
    ``loader.config_from_json`` reads, a tokenizer ``tokenizer.FastTokenizer`` reads, and tied
    embeddings or no token to add (transformers gives an untied head's new rows random values).
    The same arithmetic as the transformers path: the FIM tokens added as special tokens, the
    embedding grown and the rows written, ``B @ A`` added to each weight in float32.  False, with
    nothing written, where the base is not such a folder; an adapter that does not fit it raises
    ``AdapterError`` as the transformers path does."""
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    from .loader import config_from_json
    from .tokenizer import FastTokenizer

    cfg = config_from_json(base)
    if (cfg is None or not (base / "model.safetensors").is_file() or FastTokenizer.load(base) is None
            or len(list(base.glob("*.safetensors"))) != 1):
        return False
    try:
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))
        tok_config = json.loads((base / "tokenizer_config.json").read_text(encoding="utf-8"))
        tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - a file it cannot read: the transformers path reports it
        return False
    fim_tokens, rows = _fim_rows(path, meta, tensors)
    vocab = tok.get_vocab(with_added_tokens=True)
    missing = [t for t in fim_tokens if t not in vocab]
    if missing and not cfg.tie_word_embeddings:
        return False
    state = load_file(str(base / "model.safetensors"))
    if any(v.dtype != torch.float32 for v in state.values()) or "model.embed_tokens.weight" not in state:
        return False
    if fim_tokens:
        if missing:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
            extra = tok_config.get("extra_special_tokens")
            extra = list(extra) if isinstance(extra, list) else []
            tok_config["extra_special_tokens"] = extra + [t for t in missing if t not in extra]
        size = tok.get_vocab_size(with_added_tokens=True)
        emb = state["model.embed_tokens.weight"]
        if size > emb.shape[0]:
            grown = torch.empty(size, emb.shape[1], dtype=emb.dtype)
            grown[:emb.shape[0]] = emb
            grown[emb.shape[0]:] = 0.0
            state["model.embed_tokens.weight"] = emb = grown
            config["vocab_size"] = size
        ids = [tok.token_to_id(t) for t in fim_tokens]
        emb[ids] = rows.float()
    # one thread: a first start compiles the native kernels on the other core meanwhile, and
    # OpenMP's spinning against the compiler made this 1.7 -> 3.9-4.5 s (alone: 1.6 s either way)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fold_lora(path, tensors, lambda name: state.get(f"{name}.weight"))
    finally:
        torch.set_num_threads(threads)
    from codecomplete.paths import staging_dir

    tmp = staging_dir(out)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True))
        for extra_file in ("chat_template.jinja", "generation_config.json"):
            if (base / extra_file).is_file():
                shutil.copyfile(base / extra_file, tmp / extra_file)
        (tmp / "SOURCE").write_text(f"base {base}\nadapter {path}\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out, path)
    return True
