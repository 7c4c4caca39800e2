"""The built-in GGUF conversion and adapter merge (no transformers) against transformers' own.

``loader.convert_gguf`` and ``adapter.merged_checkpoint`` used to go through transformers; they
now write the checkpoint themselves where they know the file (model/gguf_convert.py) and fall
back to transformers elsewhere.  Each test converts the same input both ways and compares what
the engine reads: every tensor, the tokenizer (its file, and token ids on text), the config's
model keys."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from codecomplete.model import adapter, gguf_convert, loader

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "  indented\ttabs\r\nand CRLF, ünïcödé ✓ and emoji 🙂, digits 1234567",
    "<|endoftext|>x<|im_start|>user\nhi<|im_end|> <fim_prefix>a<fim_suffix>b<fim_middle>",
    "",
]


def _both_ways(gguf_path: Path, tmp: Path, monkeypatch) -> tuple[Path, Path]:
    """(built-in, transformers) conversions of one file, in two caches."""
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp / "native"))
    native = loader.convert_gguf(gguf_path)
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp / "hf"))
    with monkeypatch.context() as m:
        m.setattr(gguf_convert, "convert", lambda reader, out: False)
        hf = loader.convert_gguf(gguf_path)
    assert "converted from" in (native / "SOURCE").read_text()
    return native, hf


def _same_checkpoint(native: Path, hf: Path, config_keys=()):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from codecomplete.model.tokenizer import FastTokenizer

    a, b = load_file(str(native / "model.safetensors")), load_file(str(hf / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32 and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k
    assert json.loads((native / "tokenizer.json").read_text()) == json.loads((hf / "tokenizer.json").read_text())
    ta, tb = Tokenizer.from_file(str(native / "tokenizer.json")), Tokenizer.from_file(str(hf / "tokenizer.json"))
    for text in TEXTS:
        assert ta.encode(text).ids == tb.encode(text).ids
    ka = json.loads((native / "tokenizer_config.json").read_text())
    kb = json.loads((hf / "tokenizer_config.json").read_text())
    transient = {"is_local", "local_files_only"}  # how transformers was called, not the tokenizer
    assert {k: v for k, v in ka.items() if k not in transient} == {k: v for k, v in kb.items() if k not in transient}
    fa, fb = FastTokenizer.load(native), FastTokenizer.load(hf)
    assert fa is not None and fb is not None
    assert (fa.bos_token_id, fa.eos_token_id, fa.all_special_ids) == (fb.bos_token_id, fb.eos_token_id,
                                                                    fb.all_special_ids)
    ca, cb = loader.config_from_json(native), loader.config_from_json(hf)
    assert ca is not None and cb is not None
    for key in (*loader._CONFIG_KEYS[2:], "head_dim", "rope_parameters", "model_type", *config_keys):
        assert getattr(ca, key) == getattr(cb, key), key


def test_the_default_models_gguf_converts_as_transformers_converts_it(tmp_path, monkeypatch):
    native, hf = _both_ways(loader.default_model_path(), tmp_path, monkeypatch)
    _same_checkpoint(native, hf, ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"))
    # byte for byte, in fact (transformers' config carries its own bookkeeping keys besides)
    assert (native / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    assert (native / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert (native / "chat_template.jinja").read_text() == (hf / "chat_template.jinja").read_text()


def _byte_vocab():
    from codecomplete.model.gguf_convert import _bytes_to_unicode

    alphabet = list(_bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<ctl with space>"] + alphabet
    merges = ["Ġ t", "Ġ a", "i n", "Ġt h", "e r", "o n", "r e", "d e", "Ġ re", "Ġre t", "u r", "Ġret ur", "n Ġ"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    tokens += ["hello world", "<think>"]  # a spelling outside the byte alphabet; a user-defined token
    types = [3, 3, 3, 3] + [1] * (len(tokens) - 6) + [1, 4]
    return tokens, merges, types


def _write_gguf(path: Path, *, qtype="F32", tied=True, pre="gpt-2", extra=None, seed=0) -> dict:
    """A small Llama GGUF (2 layers, 64 wide, 4 heads over 2 KV heads) with a byte-level vocabulary."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges, types = _byte_vocab()
    d, ff, heads, kv, layers = 64, 96, 4, 2, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(d // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    for fn in extra or ():
        fn(w)
    q = getattr(gguf.GGMLQuantizationType, qtype)

    def add(name, shape, matrix=True):
        arr = rng.standard_normal(shape).astype(np.float32) * (0.1 if matrix else 1.0)
        if not matrix or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)

    add("token_embd.weight", (len(tokens), d))
    add("output_norm.weight", (d,), matrix=False)
    if not tied:
        add("output.weight", (len(tokens), d))
    hd = d // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (d,), matrix=False)
        add(f"blk.{i}.attn_q.weight", (heads * hd, d))
        add(f"blk.{i}.attn_k.weight", (kv * hd, d))
        add(f"blk.{i}.attn_v.weight", (kv * hd, d))
        add(f"blk.{i}.attn_output.weight", (d, heads * hd))
        add(f"blk.{i}.ffn_norm.weight", (d,), matrix=False)
        add(f"blk.{i}.ffn_gate.weight", (ff, d))
        add(f"blk.{i}.ffn_up.weight", (ff, d))
        add(f"blk.{i}.ffn_down.weight", (d, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"tokens": tokens}


@pytest.mark.parametrize("qtype,tied", [("F32", True), ("F16", False), ("Q8_0", True), ("Q4_1", False)])
def test_small_llama_ggufs_convert_as_transformers_converts_them(tmp_path, monkeypatch, qtype, tied):
    path = tmp_path / f"tiny-{qtype}.gguf"
    _write_gguf(path, qtype=qtype, tied=tied)
    native, hf = _both_ways(path, tmp_path, monkeypatch)
    _same_checkpoint(native, hf, ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"))
    # and the engine serves the built-in conversion as it serves transformers' (same greedy tokens)
    from codecomplete.model.api import CompletionRequest, EngineSettings
    from codecomplete.model.engine import generate

    a = loader.load_model(str(native), device="cpu", dtype="float32")
    b = loader.load_model(str(hf), device="cpu", dtype="float32")
    req = CompletionRequest("def add(a, b):\n    ret", "", max_tokens=12, ignore_eos=True)
    with torch.inference_mode():
        ra = generate(a, req, EngineSettings(token_healing=False))
        rb = generate(b, req, EngineSettings(token_healing=False))
    assert ra.token_ids == rb.token_ids and len(ra.token_ids) == 12
    assert a.tokenizer.encode(TEXTS[1]) == b.tokenizer.encode(TEXTS[1])


def test_files_the_built_in_conversion_does_not_know_go_through_transformers(tmp_path, monkeypatch):
    """Rope scaling, another pre-tokenizer or a tokenizer that adds BOS: the built-in conversion
    declines (writes nothing) and the loader's conversion is transformers' (the same file as before)."""
    import gguf

    cases = {
        "rope-scaling": dict(extra=[lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                    lambda w: w.add_rope_scaling_factor(2.0)]),
        "llama3-pre": dict(pre="llama-bpe"),
        "bos": dict(extra=[lambda w: w.add_add_bos_token(True)]),
    }
    for name, kwargs in cases.items():
        path = tmp_path / f"{name}.gguf"
        _write_gguf(path, **kwargs)
        # (the "bos" file's later add_bos_token = True replaces _write_gguf's False)
        reader = gguf.GGUFReader(path)
        out = tmp_path / f"{name}-out"
        out.mkdir()
        assert gguf_convert.convert(reader, out) is False, name
        assert list(out.iterdir()) == []
    # the loader falls back: transformers converts the rope-scaling file as before
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = loader.convert_gguf(tmp_path / "rope-scaling.gguf")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "transformers_version" in cfg  # written by transformers (which, for the record, drops the scaling)


def test_a_damaged_gguf_is_still_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "cut.gguf"
    _write_gguf(tmp_path / "whole.gguf")
    path.write_bytes((tmp_path / "whole.gguf").read_bytes()[:5000])
    with pytest.raises(loader.ModelLoadError, match="cannot read GGUF file"):
        loader.convert_gguf(path)
    assert not any((tmp_path / "cache" / "models").glob("cut*"))  # nothing half-written left behind


def test_the_default_adapter_merges_as_transformers_merges_it(tmp_path, monkeypatch):
    """The shipped EFIM adapter on the base: the FIM tokens added (the embedding grown to 49155
    rows), their rows written, B @ A folded into every adapted weight: the same tensors and
    tokenizer as transformers' merge."""
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    base = loader.convert_gguf(loader.default_model_path())
    native = adapter.merged_checkpoint(adapter.SHIPPED, base, tmp_path / "native")
    with monkeypatch.context() as m:
        m.setattr(adapter, "_merge_native", lambda *a: False)
        hf = adapter.merged_checkpoint(adapter.SHIPPED, base, tmp_path / "hf")
    assert native.name == hf.name  # keyed by the same identity
    _same_checkpoint(native, hf)
    assert (native / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    cfg = json.loads((native / "config.json").read_text())
    assert cfg["vocab_size"] == 49155
    tok = json.loads((native / "tokenizer_config.json").read_text())
    assert tok["extra_special_tokens"][-3:] == ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]


def test_an_adapter_that_does_not_fit_its_base_is_refused_as_before(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    base = loader.convert_gguf(path)
    bad = tmp_path / "bad-adapter"
    bad.mkdir()
    (bad / "adapter.json").write_text(json.dumps({"format": adapter.FORMAT, "base": str(path), "fim_tokens": []}))
    save_file({"model.layers.0.self_attn.q_proj.lora_a": torch.zeros(4, 32),
               "model.layers.0.self_attn.q_proj.lora_b": torch.zeros(64, 4)}, str(bad / "adapter.safetensors"))
    with pytest.raises(adapter.AdapterError, match="q_proj is"):
        adapter.merged_checkpoint(bad, base, tmp_path / "merged")
    (bad / "adapter.safetensors").unlink()
    save_file({"model.layers.0.nope.lora_a": torch.zeros(4, 64), "model.layers.0.nope.lora_b": torch.zeros(64, 4)},
              str(bad / "adapter.safetensors"))
    with pytest.raises(adapter.AdapterError, match="no module"):
        adapter.merged_checkpoint(bad, base, tmp_path / "merged")
    assert not any((tmp_path / "merged").glob("bad-adapter*")) if (tmp_path / "merged").exists() else True


def test_an_untied_base_that_needs_new_tokens_is_merged_by_transformers(tmp_path, monkeypatch):
    """transformers gives an untied head's new rows values of its own; the built-in merge leaves
    that case to it rather than invent them."""
    from safetensors.torch import save_file

    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "untied.gguf"
    _write_gguf(path, tied=False)
    base = loader.convert_gguf(path)
    ad = tmp_path / "fim-adapter"
    ad.mkdir()
    (ad / "adapter.json").write_text(json.dumps({"format": adapter.FORMAT, "base": str(path),
                                                 "fim_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]}))
    save_file({"fim_rows": torch.ones(3, 64)}, str(ad / "adapter.safetensors"))
    meta = adapter.read_meta(ad)
    tensors = {"fim_rows": torch.ones(3, 64)}
    assert adapter._merge_native(ad, base, meta, tensors, tmp_path / "never") is False
    assert not (tmp_path / "never").exists()
    assert set(tensors) == {"fim_rows"}  # left as it was for transformers' merge
    # and through the loader's entry: transformers merges it, the tokens added and their rows written
    merged = adapter.merged_checkpoint(ad, base, tmp_path / "merged")
    from safetensors.torch import load_file

    state = load_file(str(merged / "model.safetensors"))
    n = len(_byte_vocab()[0])
    assert state["model.embed_tokens.weight"].shape[0] == n + 3 == state["lm_head.weight"].shape[0]
    assert torch.equal(state["model.embed_tokens.weight"][n:], torch.ones(3, 64))
    assert "transformers_version" in json.loads((merged / "config.json").read_text())


def test_a_first_start_on_an_empty_cache_imports_no_transformers(tmp_path):
    """The default model from its GGUF and the shipped adapter to a first completion, on an empty
    cache: converted and merged without importing transformers (3.7 s of a first start here)."""
    code = (
        "import sys, torch\n"
        "from codecomplete.model.loader import load_model\n"
        "from codecomplete.model.api import CompletionRequest, EngineSettings\n"
        "from codecomplete.model.engine import generate\n"
        "lm = load_model('default', device='cpu', dtype='bfloat16')\n"
        "with torch.inference_mode():\n"
        "    r = generate(lm, CompletionRequest('def add(a, b):\\n    return a', '\\n', max_tokens=8),"
        " EngineSettings(token_healing=False))\n"
        "print(repr(r.text))\n"
        "print('transformers' in sys.modules)\n"
    )
    env = {**os.environ, "CODECOMPLETE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    text, imported = out.stdout.strip().splitlines()[-2:]
    assert imported == "False"
    assert "b" in text
    models = sorted(p.name for p in (tmp_path / "models").iterdir())
    # the merged model alone: the base's conversion was made for the merge and went after it
    assert len(models) == 1 and models[0].startswith("efim-smollm2-"), models


def test_a_reinstalled_gguf_replaces_its_old_conversion(tmp_path, monkeypatch):
    """A reinstalled wheel gives the same GGUF path a new mtime, and so a new cache key: the new
    conversion removes the old one instead of leaving ~540 MB behind at each upgrade."""
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    first = loader.convert_gguf(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = loader.convert_gguf(path)
    assert second != first and second.is_dir() and not first.exists()
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [second.name]




def _gguf_and_adapter(tmp_path: Path) -> tuple[Path, Path]:
    """A small GGUF, and an adapter on it (one random LoRA pair, no FIM tokens)."""
    from safetensors.torch import save_file

    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    ad = tmp_path / "tiny-adapter"
    ad.mkdir()
    (ad / "adapter.json").write_text(json.dumps({"format": adapter.FORMAT, "base": str(path), "fim_tokens": []}))
    g = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.self_attn.q_proj.lora_a": torch.randn(4, 64, generator=g),
               "model.layers.0.self_attn.q_proj.lora_b": torch.randn(64, 4, generator=g)},
              str(ad / "adapter.safetensors"))
    return path, ad

def test_an_adapter_on_a_gguf_keeps_only_the_merged_model(tmp_path, monkeypatch):
    """An adapter whose base is a GGUF file (the default model's case): the merge is keyed by the
    file's identity, the conversion made for it goes after it, a cached merge converts nothing,
    and a conversion someone else made (serving the base itself) stays."""
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    path, ad = _gguf_and_adapter(tmp_path)
    models = tmp_path / "cache" / "models"
    _, merged = loader.resolve_checkpoint(str(ad))
    assert [p.name for p in models.iterdir()] == [merged.name]
    # the merge is the conversion plus B @ A
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "other"))
    base = loader.convert_gguf(path)
    from safetensors.torch import load_file

    a, b = load_file(str(merged / "model.safetensors")), load_file(str(base / "model.safetensors"))
    lora = load_file(str(ad / "adapter.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    assert torch.equal(a[f"{name}.weight"], b[f"{name}.weight"] + lora[f"{name}.lora_b"] @ lora[f"{name}.lora_a"])
    assert all(torch.equal(a[k], b[k]) for k in b if k != f"{name}.weight")
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    with monkeypatch.context() as m:  # cached: nothing is converted again
        m.setattr(loader, "convert_gguf", lambda g: (_ for _ in ()).throw(AssertionError("converted")))
        assert loader.resolve_checkpoint(str(ad))[1] == merged
    # someone serves the base itself: its conversion stays when the merge is made again
    kept = loader.convert_gguf(path)
    import shutil

    shutil.rmtree(merged)
    assert loader.resolve_checkpoint(str(ad))[1] == merged and merged.is_dir()
    assert kept.is_dir() and sorted(p.name for p in models.iterdir()) == sorted([kept.name, merged.name])



def test_a_merge_whose_conversion_another_start_removed_is_made_again(tmp_path, monkeypatch):
    """Two first starts at once: one's merge finishes and removes the conversion the other is
    still reading.  The other merges once more instead of failing."""
    import shutil

    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))
    _, ad = _gguf_and_adapter(tmp_path)
    real, calls = adapter._merge, []

    def racing(path_, base, out, meta):
        calls.append(base)
        if len(calls) == 1:  # the other start's cleanup, while this one reads
            shutil.rmtree(base)
            raise FileNotFoundError(base / "model.safetensors")
        return real(path_, base, out, meta)

    monkeypatch.setattr(adapter, "_merge", racing)
    _, merged = loader.resolve_checkpoint(str(ad))
    assert len(calls) == 2 and (merged / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [merged.name]
    # an error that is not the race (the conversion still there) is not retried
    shutil.rmtree(merged)
    failed = []

    def bad(*args):
        failed.append(args)
        raise adapter.AdapterError("bad")

    monkeypatch.setattr(adapter, "_merge", bad)
    with pytest.raises(loader.ModelLoadError, match="bad"):
        loader.resolve_checkpoint(str(ad))
    assert len(failed) == 1
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # the conversion made for it went too
