"""Finding and loading checkpoints."""

import os

import pytest

from codecomplete.indexer.files import SourceError, read_source
from codecomplete.model.loader import ModelLoadError, default_model_path, resolve_checkpoint, resolve_dtype


def test_default_model_is_found_in_the_installed_wheel():
    path = default_model_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_bad_model_specs_have_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_checkpoint(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="model file not found"):
        resolve_checkpoint(str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelLoadError, match="neither"):
        resolve_checkpoint(str(tmp_path / "x.bin"))


def test_explicit_dtype_names():
    import torch

    assert resolve_dtype("float32", torch.device("cpu")) is torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    with pytest.raises(ModelLoadError):
        resolve_dtype("int3", torch.device("cpu"))


def test_auto_dtype_follows_the_cpu_and_the_kernels():
    """"auto" on CPU is bf16 where bf16 products are fast (AMX/AVX512-BF16), or where the native
    kernels run bf16 on SIMD (AVX2 + FMA); without the kernels an AVX2 CPU gets fp32 (PyTorch's
    bf16 is slow there).  The kernels' path must be the one the CPU's flags allow."""
    import torch

    from codecomplete.model import native
    from codecomplete.model.loader import cpu_flags, cpu_has_fast_bf16

    cpu = torch.device("cpu")
    flags = cpu_flags()
    fast = cpu_has_fast_bf16()
    assert resolve_dtype("auto", cpu, native=False) is (torch.bfloat16 if fast else torch.float32)
    if not native.available():
        assert resolve_dtype("auto", cpu) is (torch.bfloat16 if fast else torch.float32)
        return
    path = native.linear_bf16_path()
    probe = native.linear_probe()  # AVX512-BF16: the dot products, or the panels where FMAs issue 2.5x as often
    forced = {"panels": 3, "dot": 2}.get(os.environ.get("CODECOMPLETE_LINEAR", ""))
    dot_or_panels = forced or (3 if probe["fma_per_s"] > 2.5 * probe["dot_per_s"] else 2)
    assert path == (dot_or_panels if "avx512_bf16" in flags else 3 if {"avx2", "fma", "avx512f"} <= flags
                    else 1 if {"avx2", "fma"} <= flags else 0)
    assert native.linear_bf16_simd() == (path >= 1)
    assert resolve_dtype("auto", cpu) is (torch.bfloat16 if fast or path >= 1 else torch.float32)


def test_auto_dtype_on_cuda_keeps_small_models_in_float32(tiny_model, monkeypatch):
    """On CUDA, "auto" keeps a model of at most CUDA_FP32_MAX_PARAMS weights in fp32 (exact
    multi-row passes, no slower at batch 1 for small models) and gives a larger one, or one of
    unknown size, bf16 (fp16 where bf16 is not supported).  The size is read from the
    checkpoint's safetensors headers; a device object is all the rule needs, so this runs
    without a GPU."""
    import torch
    from safetensors.torch import load_file

    from codecomplete.model.loader import CUDA_FP32_MAX_PARAMS, _params
    from codecomplete.model.transformer import checkpoint_params

    cuda = torch.device("cuda")
    weights = load_file(str(tiny_model / "model.safetensors"))
    assert checkpoint_params(tiny_model) == _params(tiny_model) == sum(t.numel() for t in weights.values())
    assert checkpoint_params(tiny_model / "missing") is None and _params("some/hub-id") is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", cuda, params=checkpoint_params(tiny_model)) is torch.float32
    assert resolve_dtype("auto", cuda, params=CUDA_FP32_MAX_PARAMS) is torch.float32
    assert resolve_dtype("auto", cuda, params=CUDA_FP32_MAX_PARAMS + 1) is torch.bfloat16
    assert resolve_dtype("auto", cuda) is torch.bfloat16
    assert resolve_dtype("bfloat16", cuda, params=10) is torch.bfloat16  # a name given is kept
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", cuda, params=CUDA_FP32_MAX_PARAMS + 1) is torch.float16


def test_read_source_rejects_binary_big_and_non_utf8(tmp_path):
    (tmp_path / "bin").write_bytes(b"abc\0def")
    (tmp_path / "big").write_text("x" * 100)
    (tmp_path / "l1").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "ok").write_text("héllo")
    with pytest.raises(SourceError, match="binary"):
        read_source(tmp_path / "bin")
    with pytest.raises(SourceError, match="limit"):
        read_source(tmp_path / "big", max_bytes=10)
    with pytest.raises(SourceError, match="UTF-8"):
        read_source(tmp_path / "l1")
    with pytest.raises(SourceError, match="not a regular file"):
        read_source(tmp_path)
    assert read_source(tmp_path / "ok") == "héllo"


def test_gguf_is_converted_once_and_serves(tmp_path, monkeypatch):
    """Guards .gguf loading: transformers dequantizes the default model's GGUF into a
    cached safetensors checkpoint that the own forward serves; the second load reuses it."""
    import torch

    from codecomplete.model.api import CompletionRequest, EngineSettings
    from codecomplete.model.engine import generate
    from codecomplete.model.loader import load_model

    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path))
    gguf = default_model_path()
    lm = load_model(str(gguf), device="cpu", dtype="bfloat16")
    converted = list((tmp_path / "models").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    assert lm.template.template is None  # SmolLM2 has no FIM tokens: prefix-only
    with torch.inference_mode():
        result = generate(lm, CompletionRequest("def add(a, b):\n    return a", "\n", max_tokens=8),
                          EngineSettings(token_healing=False))
    assert result.text.strip().startswith("+ b")
    weights = (converted[0] / "model.safetensors").stat()
    again = load_model(str(gguf), device="cpu", dtype="bfloat16")
    assert again.path == str(converted[0]) and list((tmp_path / "models").iterdir()) == converted
    now = (converted[0] / "model.safetensors").stat()
    assert (now.st_ino, now.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns)  # not converted again


def test_a_gguf_conversion_reads_the_file_once():
    """While converting, gguf's reader and tensor-name map are built once and handed out again
    (transformers asks three times and 397 times), and gguf is left as it was after."""
    import gguf
    import numpy as np

    from codecomplete.model.loader import _gguf_read_once

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = default_model_path()
    with _gguf_read_once():
        first, second = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is second
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30).mapping == real_map(arch, 30).mapping
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_map
    # the shared reader is the faster one: every field and tensor as gguf's own reader has them
    plain = real_reader(path)
    assert type(first) is not real_reader and isinstance(first, real_reader)
    assert list(plain.fields) == list(first.fields)
    for a, b in zip(plain.fields.values(), first.fields.values()):
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types)
        assert len(a.parts) == len(b.parts) and all(np.array_equal(x, y) for x, y in zip(a.parts, b.parts))
        assert all(x.dtype == y.dtype for x, y in zip(a.parts, b.parts))
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in plain.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in first.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.tensors, first.tensors))


def test_the_default_model_is_smollm2_with_the_shipped_fim_adapter():
    """Guards #3 part 6: "default" = the base GGUF + the package's adapter, merged once
    into the cache; it has the FIM tokens and the StarCoder template, the base does not."""
    import json

    from codecomplete.model.adapter import SHIPPED

    meta = json.loads((SHIPPED / "adapter.json").read_text())
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert meta["base"] == "smollm2-135m" and meta["fragments"] is True and size <= 40 * 2**20
    name, merged = resolve_checkpoint("default")
    assert "EFIM" in name and (merged / "config.json").is_file()
    assert resolve_checkpoint("default")[1] == merged  # cached: merged once
    from transformers import AutoTokenizer

    from codecomplete.model.fim import detect_template

    tok = AutoTokenizer.from_pretrained(merged)
    assert detect_template(tok.get_vocab(), "auto").name == "starcoder"
    base = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m")[1])
    assert detect_template(base.get_vocab(), "auto").name == "prefix-only"


def test_onednn_copy_only_where_pytorch_serves_passes(tiny_model):
    """A bf16 model whose every pass runs in the native stack keeps no oneDNN copy of its weights
    (memory nothing reads); with the native kernels off it has one, and switching them at run
    time (the engine's native_attention setting) brings it back or drops it."""
    import torch

    from codecomplete.model.api import CompletionRequest, EngineSettings
    from codecomplete.model.engine import Engine
    from codecomplete.model.loader import load_model
    from codecomplete.model.transformer import can_pack

    packable = can_pack(torch.device("cpu"), torch.bfloat16)
    plain = load_model(str(tiny_model), dtype="bfloat16", native=False)
    assert plain.model.native_stack is None and plain.model.packed == packable
    native = load_model(str(tiny_model), dtype="bfloat16")
    if not native.model.native_serves_all:
        pytest.skip("the native stack does not serve every pass here (no compiler, or AMX without its attention)")
    assert not native.model.packed
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="bfloat16")).start()
    try:
        first = engine.complete(CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=12))
        assert engine.lm.model.native_serves_all and not engine.lm.model.packed
        engine.configure(EngineSettings(model=str(tiny_model), dtype="bfloat16", native_attention=False))
        assert engine.lm.model.native_stack is None and engine.lm.model.packed == packable
        served = engine.complete(CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=12))
        assert served.error is None and served.generated_tokens > 0  # PyTorch's path, on the oneDNN copy
        engine.configure(EngineSettings(model=str(tiny_model), dtype="bfloat16"))
        assert engine.lm.model.native_serves_all and not engine.lm.model.packed
        again = engine.complete(CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=12))
        assert again.token_ids == first.token_ids
    finally:
        engine.close()


def test_dense_weights_dropped_where_the_native_copy_serves(tiny_model):
    """Where the native stack serves every pass, the linear layers keep only their native copy:
    the dense weights are dropped (one copy of the model less in memory) and come back, the
    same numbers, where something reads them: the native kernels switched off at run time, or
    any reader of ``weight``.  Serving completions brings none back."""
    import torch

    from codecomplete.model.api import CompletionRequest, EngineSettings
    from codecomplete.model.engine import Engine
    from codecomplete.model.loader import load_model
    from codecomplete.model.transformer import Linear

    def dropped(model) -> list[Linear]:
        return [m for m in model.modules() if isinstance(m, Linear) and "weight" not in m._parameters]

    plain = load_model(str(tiny_model), dtype="bfloat16", native=False)
    assert not dropped(plain.model)  # PyTorch's path reads them
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="bfloat16")).start()
    try:
        first = engine.complete(CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=12))
        model = engine.lm.model
        if not model.native_serves_all:
            pytest.skip("the native stack does not serve every pass here (no compiler, or AMX without its attention)")
        mats = [m for m in model.modules() if isinstance(m, Linear)]
        gone = dropped(model)
        assert len(gone) == len(mats) > 0  # the head too: tied, the embedding reads its native copy
        assert model.args.tie_embeddings and "weight" not in model.embed._parameters
        ids = torch.tensor([[0, 5, 1023], [7, 7, 2]])
        with torch.no_grad():  # (with gradients on, a lookup brings the weight back: training reads it)
            assert torch.equal(model.embed(ids), plain.model.embed.weight[ids])
        for req in (CompletionRequest("x = 1\ny = ", "\n", max_tokens=8, alternatives=3),
                    CompletionRequest("def f():\n" * 200, "", max_tokens=8)):  # alternatives; a long prompt
            assert engine.complete(req).error is None
        assert len(dropped(model)) == len(gone) and "weight" not in model.embed._parameters  # serving read none
        names = dict(plain.model.named_modules())
        own = dict(model.named_modules())
        name = next(n for n, m in own.items() if m is gone[0])
        assert torch.equal(gone[0].dense(), names[name].weight) and "weight" not in gone[0]._parameters
        assert torch.equal(gone[0].weight, names[name].weight) and "weight" in gone[0]._parameters  # read: back
        engine.configure(EngineSettings(model=str(tiny_model), dtype="bfloat16", native_attention=False))
        assert not dropped(model) and model.embed.weight is model.head.weight  # back, still tied
        assert torch.equal(model.embed.weight, plain.model.embed.weight)
        for n, m in own.items():
            if isinstance(m, Linear):
                assert torch.equal(m.weight, names[n].weight), n
        assert engine.complete(CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=12)).error is None
        engine.configure(EngineSettings(model=str(tiny_model), dtype="bfloat16"))
        assert len(dropped(model)) == len(gone)
        again = engine.complete(CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=12))
        assert again.token_ids == first.token_ids
    finally:
        engine.close()


def test_loads_in_several_threads_at_once_all_succeed(tiny_model, tmp_path):
    """Loading through transformers is process-wide state (lazy imports, meta-device
    initialisation): three threads loading at once each get a working model (before the loader
    took turns, every such load failed in a probe), each its own.  The checkpoint is a PyTorch
    .bin one, so that the loads go through transformers (local safetensors do not)."""
    import shutil
    import threading

    import torch
    from safetensors.torch import load_file

    from codecomplete.model.api import CompletionRequest, EngineSettings
    from codecomplete.model.engine import generate
    from codecomplete.model.loader import load_model

    ckpt = tmp_path / "bin"
    shutil.copytree(tiny_model, ckpt)
    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    got, errors = [], []

    def load():
        try:
            got.append(load_model(str(ckpt), dtype="bfloat16"))
        except Exception as exc:  # noqa: BLE001 - the test reports every failure
            errors.append(repr(exc))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(got) == 3
    assert len({id(lm.model) for lm in got}) == 3
    req = CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=8)
    outs = {tuple(generate(lm, req, EngineSettings(model=str(tiny_model), dtype="bfloat16")).token_ids) for lm in got}
    assert len(outs) == 1


@pytest.mark.parametrize("spec,dtype", [("tiny", "bfloat16"), ("tiny", "float32"), ("default", "bfloat16")])
def test_safetensors_read_directly_equal_the_hugging_face_models_weights(spec, dtype, tiny_model):
    """``load_model`` reads a local checkpoint's safetensors straight into the engine's forward;
    every tensor equals what Hugging Face's ``from_pretrained`` then ``from_hf`` give."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from codecomplete.model.transformer import from_hf, from_safetensors

    ckpt = tiny_model if spec == "tiny" else resolve_checkpoint(spec)[1]
    dt = getattr(torch, dtype)
    direct = from_safetensors(ckpt, AutoConfig.from_pretrained(ckpt, local_files_only=True), dt, torch.device("cpu"))
    assert direct is not None
    hf = from_hf(AutoModelForCausalLM.from_pretrained(ckpt, dtype=dt, local_files_only=True).eval())
    a, b = direct.state_dict(), hf.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == dt and torch.equal(a[k], b[k]), k
    assert (direct.head.weight is direct.embed.weight) == (hf.head.weight is hf.embed.weight)
    assert torch.equal(direct.inv_freq, hf.inv_freq) and direct.args == hf.args


def test_checkpoints_the_direct_read_does_not_know_go_through_hugging_face(tiny_model, tmp_path):
    """No safetensors, or names it does not know: ``from_safetensors`` declines (None) and
    ``load_model`` loads the checkpoint through Hugging Face, the same model."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from codecomplete.model.api import CompletionRequest, EngineSettings
    from codecomplete.model.engine import generate
    from codecomplete.model.loader import load_model
    from codecomplete.model.transformer import from_safetensors

    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_model, renamed)
    state = load_file(renamed / "model.safetensors")
    save_file({k.replace("model.", "base.", 1): v for k, v in state.items()}, renamed / "model.safetensors")
    cfg = AutoConfig.from_pretrained(renamed, local_files_only=True)
    assert from_safetensors(renamed, cfg, torch.float32, torch.device("cpu")) is None
    missing = tmp_path / "missing"
    shutil.copytree(tiny_model, missing)
    (missing / "model.safetensors").unlink()
    assert from_safetensors(missing, cfg, torch.float32, torch.device("cpu")) is None
    bin_ckpt = tmp_path / "bin"  # a PyTorch .bin checkpoint: Hugging Face reads it
    shutil.copytree(tiny_model, bin_ckpt)
    (bin_ckpt / "model.safetensors").unlink()
    torch.save(state, bin_ckpt / "pytorch_model.bin")
    req = CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=8)
    want = generate(load_model(str(tiny_model), dtype="float32"), req, EngineSettings()).token_ids
    assert generate(load_model(str(bin_ckpt), dtype="float32"), req, EngineSettings()).token_ids == want


@pytest.mark.parametrize("spec", ["tiny", "default", "smollm2-135m"])
def test_the_tokenizer_read_from_its_file_answers_as_autotokenizer_does(spec, tiny_model):
    """``FastTokenizer`` (the ``tokenizers`` library on tokenizer.json) gives what Hugging Face's
    ``AutoTokenizer`` gives for every call serving makes: ids of code with and without special
    tokens, every id's text with and without specials, the vocabulary, the special ids."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from codecomplete.model.tokenizer import FastTokenizer

    ckpt = tiny_model if spec == "tiny" else resolve_checkpoint(spec)[1]
    ours, hf = FastTokenizer.load(ckpt), AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    assert ours is not None
    assert len(ours) == len(hf) and ours.vocab_size == hf.vocab_size and ours.get_vocab() == hf.get_vocab()
    for key in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert ours.all_special_ids == sorted(set(hf.all_special_ids))
    assert ours.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces  # (the engine's healing reads it)
    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text(encoding="utf-8") for p in sorted((root / "model").glob("*.py"))[:12]]
    texts += ["", " ", "\n\n\t  x", "naïve café 🐍 日本語", "<fim_prefix>def f(<fim_suffix>)<fim_middle>x<|endoftext|>",
              "\ufffd\u200b\r\n", "    return a +"]
    for text in texts:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    every = [[i] for i in range(len(hf))]
    for skip in (False, True):
        assert ours.batch_decode(every, skip_special_tokens=skip) == hf.batch_decode(every, skip_special_tokens=skip)
        ids = hf.encode(texts[0] + texts[-3], add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    names = ["<fim_prefix>", "<fim_middle>", "<|endoftext|>", "def", "no-such-token-here"]
    assert ours.convert_tokens_to_ids(names) == hf.convert_tokens_to_ids(names)
    assert ours.convert_ids_to_tokens([0, 1, 5, 100]) == hf.convert_ids_to_tokens([0, 1, 5, 100])


def test_a_tokenizer_class_with_rules_of_its_own_goes_to_autotokenizer(tiny_model, tmp_path):
    """A class that changes what tokenizer.json says (here Llama's SentencePiece rules), BOS added
    by the class, a special token or an added token the file does not have as the config says, or
    no tokenizer.json: ``FastTokenizer.load`` declines, so the loader keeps ``AutoTokenizer``."""
    import json
    import shutil

    from codecomplete.model.tokenizer import FastTokenizer

    for change in ({"tokenizer_class": "LlamaTokenizerFast"}, {"add_bos_token": True},
                   {"clean_up_tokenization_spaces": True}, {"eos_token": "<not-in-the-file>"},
                   {"added_tokens_decoder": {"0": {"content": "<|endoftext|>", "special": False}}}, None):
        ckpt = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_model, ckpt)
        if change is None:
            (ckpt / "tokenizer.json").unlink()
        else:
            cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
            (ckpt / "tokenizer_config.json").write_text(json.dumps({**cfg, **change}))
        assert FastTokenizer.load(ckpt) is None, change


@pytest.mark.parametrize("spec", ["tiny", "default", "smollm2-135m"])
def test_config_json_read_here_gives_the_model_autoconfig_gives(spec, tiny_model, tmp_path):
    """``config_from_json`` (no transformers) gives the same ``ModelArgs`` as ``AutoConfig``; a file
    that leaves out a key whose default depends on the model class is left to ``AutoConfig``."""
    import json
    import shutil

    from transformers import AutoConfig

    from codecomplete.model.loader import config_from_json
    from codecomplete.model.transformer import ModelArgs

    ckpt = tiny_model if spec == "tiny" else resolve_checkpoint(spec)[1]
    ours = config_from_json(ckpt)
    assert ours is not None
    assert ModelArgs.from_hf_config(ours) == ModelArgs.from_hf_config(AutoConfig.from_pretrained(ckpt))
    raw = json.loads((ckpt / "config.json").read_text())
    for drop in (("tie_word_embeddings",), ("num_key_value_heads",), ("rope_parameters", "rope_theta")):
        part = tmp_path / drop[0]
        shutil.copytree(ckpt, part, ignore=shutil.ignore_patterns("*.safetensors"))
        (part / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in drop}))
        assert config_from_json(part) is None, drop


@pytest.mark.parametrize("architectures", ["as saved", "null"])
def test_loading_a_local_checkpoint_does_not_import_transformers(architectures, tiny_model, tmp_path):
    """The tokenizer, config and weights of a local checkpoint come from its files: a process that
    loads the model and completes never imports transformers (1-2 s and ~100 MB of a start), nor
    torch._dynamo, which PyTorch's reference ops on the meta device pull in (1-1.7 s).  Also where
    config.json names no architectures, as transformers' own GGUF conversions write it (a GGUF the
    built-in conversion declines, a conversion cached by an earlier version, and a merge onto one)."""
    import json
    import shutil
    import subprocess
    import sys

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from codecomplete.model.transformer import from_hf, from_safetensors

    if architectures == "null":
        ckpt = tmp_path / "ckpt"
        shutil.copytree(tiny_model, ckpt)
        raw = json.loads((ckpt / "config.json").read_text())
        assert raw["architectures"]
        (ckpt / "config.json").write_text(json.dumps({**raw, "architectures": None}))
        direct = from_safetensors(ckpt, AutoConfig.from_pretrained(ckpt, local_files_only=True), torch.float32,
                                  torch.device("cpu"))
        assert direct is not None
        hf = from_hf(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, local_files_only=True).eval())
        a, b = direct.state_dict(), hf.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        tiny_model = ckpt
        (tmp_path / "model").mkdir()  # architectures that name no causal LM: Hugging Face's path still
        (tmp_path / "model" / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaModel"]}))
        shutil.copy(ckpt / "model.safetensors", tmp_path / "model")
        cfg = AutoConfig.from_pretrained(tmp_path / "model", local_files_only=True)
        assert from_safetensors(tmp_path / "model", cfg, torch.float32, torch.device("cpu")) is None
    code = ("import sys\n"
            "from codecomplete.model.loader import load_model\n"
            "from codecomplete.model.api import CompletionRequest, EngineSettings\n"
            "from codecomplete.model.engine import generate\n"
            f"lm = load_model({str(tiny_model)!r}, dtype='bfloat16')\n"
            "req = CompletionRequest('def add(a, b):\\n    return', '\\n', max_tokens=8)\n"
            "out = generate(lm, req, EngineSettings())\n"
            "print(type(lm.tokenizer).__name__, out.generated_tokens > 0, "
            "sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')[:3], "
            "'torch._dynamo' in sys.modules)\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split("\n")[-2] == "FastTokenizer True [] False"


def test_a_damaged_checkpoint_is_a_model_load_error_that_names_it(tiny_model, tmp_path):
    """Truncated weights, an unreadable tokenizer.json, weights that do not fit config.json: each
    is a ``ModelLoadError`` naming the checkpoint (the daemon reports it and keeps serving; the
    CLI exits 1 with it), not a library's bare exception."""
    import json
    import shutil

    from codecomplete.model.loader import load_model

    def truncate(d):
        with open(d / "model.safetensors", "r+b") as f:
            f.truncate(5000)

    def wider(d):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))

    damage = {"truncated": truncate, "tokenizer": lambda d: (d / "tokenizer.json").write_text("{not json"),
              "shape": wider}
    for name, fn in damage.items():
        ckpt = tmp_path / name
        shutil.copytree(tiny_model, ckpt)
        fn(ckpt)
        with pytest.raises(ModelLoadError, match=str(ckpt)):
            load_model(str(ckpt), dtype="float32")


def _hub_cache(root, repo_id: str, ckpt) -> str:
    """``ckpt``'s files laid out as Hugging Face's cache holds a downloaded model: content in
    blobs/, the snapshot's names as symbolic links to them, refs/main naming the snapshot."""
    import hashlib

    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(ckpt.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(f"../../blobs/{blob.name}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return str(snap)


def test_a_hub_id_in_the_local_cache_is_read_as_a_local_checkpoint(tiny_model, tmp_path):
    """``--model org/name`` of a model in the local Hugging Face cache serves its snapshot folder:
    read directly (no transformers import), the same completion as the folder itself gives; an
    id that is not cached is a clear ModelLoadError, and nothing is downloaded."""
    import os
    import subprocess
    import sys

    snap = _hub_cache(tmp_path / "hub", "acme/tiny-coder", tiny_model)
    code = ("import sys\n"
            "from codecomplete.model.loader import load_model, ModelLoadError\n"
            "from codecomplete.model.api import CompletionRequest, EngineSettings\n"
            "from codecomplete.model.engine import generate\n"
            "req = CompletionRequest('def add(a, b):\\n    return', '\\n', max_tokens=8)\n"
            "lm = load_model('acme/tiny-coder', dtype='float32')\n"
            "print(lm.name, lm.path, type(lm.tokenizer).__name__, "
            "any(m.split('.')[0] == 'transformers' for m in sys.modules))\n"
            "print(generate(lm, req, EngineSettings()).token_ids)\n"
            f"print(generate(load_model({str(tiny_model)!r}, dtype='float32'), req, EngineSettings()).token_ids)\n"
            "try:\n"
            "    load_model('acme/not-cached')\n"
            "except ModelLoadError as exc:\n"
            "    print('error', exc)\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.strip().split("\n")
    assert lines[0] == f"acme/tiny-coder {snap} FastTokenizer False"
    assert lines[1] == lines[2] and lines[1] != "[]"
    assert lines[3].startswith("error ") and "acme/not-cached" in lines[3]
