"""The own forward against transformers' models on small random configs (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from codecomplete.model import native
from codecomplete.model.transformer import can_pack, causal_mask, from_hf

# decode attention: PyTorch, and the native CPU kernel where a C compiler is here
NATIVE = [False, True] if native.available() else [False]

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def pair(family: str, tie: bool = False, packed: bool = False, native_decode: bool = False):
    torch.manual_seed(0)
    config_cls, model_cls, extra = FAMILIES[family]
    cfg = config_cls(vocab_size=311, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=tie, **extra)
    hf = model_cls(cfg).eval()
    own = from_hf(hf)
    assert own.pack(packed) == packed
    assert own.native_decode(native_decode) == native_decode
    return hf, own


@pytest.mark.parametrize("native_decode", NATIVE, ids=lambda n: "native" if n else "torch-attn")
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_with_chunked_prefill(family, packed, native_decode):
    """Guards the forward and the KV cache: chunks through the cache (and single-token
    decode steps) = one pass of HF."""
    hf, own = pair(family, tie=family == "llama", packed=packed, native_decode=native_decode)
    ids = torch.randint(0, 311, (1, 40))
    with torch.no_grad():
        want = hf(ids).logits
        cache = own.new_cache(8)  # small on purpose: it must grow
        got = torch.cat([own(ids[:, a:b], [cache], logits_for="all")
                         for a, b in ((0, 17), (17, 18), (18, 19), (19, 20), (20, 40))], 1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_long_chunks_after_a_cache_match_transformers(family):
    """Guards the prefill over a reused prefix (> 64 new tokens after cached ones): the
    mask-free two-pass attention must equal one causal pass of HF and the masked path."""
    hf, own = pair(family)
    ids = torch.randint(0, 311, (1, 300))
    with torch.no_grad():
        want = hf(ids).logits
        cache = own.new_cache(8)
        got = torch.cat([own(ids[:, a:b], [cache], logits_for="all") for a, b in ((0, 90), (90, 91), (91, 300))], 1)
        masked = own.new_cache()
        own(ids[:, :91], [masked])
        via_mask = own(ids[:, 91:], [masked], masks=[causal_mask(91, 209, "cpu")], logits_for="all")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[:, 91:], via_mask, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("native_decode", NATIVE, ids=lambda n: "native" if n else "torch-attn")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_tokens_identical(family, native_decode):
    hf, own = pair(family, native_decode=native_decode)
    prompt = torch.randint(0, 311, (1, 12))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 12:].tolist()
        cache, out = own.new_cache(), []
        logits = own(prompt, [cache])
        for _ in range(20):
            out.append(int(logits[0].argmax()))
            logits = own(torch.tensor([[out[-1]]]), [cache])
    assert out == ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_change_no_result(dtype):
    """The oneDNN-prepacked linears give the plain ones' logits (prefill, decode, a
    verification-sized step); with autograd on, the plain weights run so gradients flow."""
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN on this CPU does not prepack {dtype} (see test_pack_falls_back_where_onednn_refuses)")
    _, own = pair("qwen2", tie=True)
    own = own.to(dtype)
    ids = torch.randint(0, 311, (2, 30))
    outs = []
    for packed in (False, True):
        assert own.pack(packed) == packed and own.packed == packed
        with torch.no_grad():
            caches = [own.new_cache(), own.new_cache()]
            steps = [own(ids[:, :20], caches, logits_for="all"), own(ids[:, 20:21], caches, logits_for="all"),
                     own(ids[:, 21:], caches, logits_for="all")]
        outs.append(torch.cat(steps, 1))
    exact = dtype == torch.bfloat16  # fp32 may round differently in the last bit
    torch.testing.assert_close(outs[1], outs[0], atol=0 if exact else 1e-6, rtol=0 if exact else 1e-5)
    x = torch.randn(3, 64, dtype=dtype, requires_grad=True)
    own.layers[0].mlp.w13(x).sum().backward()
    assert x.grad is not None and own.layers[0].mlp.w13.weight.grad is not None
    own.pack(False)
    assert own.layers[0].mlp.w13.packed is None


@pytest.mark.parametrize("native_decode", NATIVE, ids=lambda n: "native" if n else "torch-attn")
def test_batched_decode_equals_one_at_a_time(native_decode):
    """Guards batching: sequences of different lengths stepped together."""
    _, own = pair("llama", native_decode=native_decode)
    prompts = [torch.randint(0, 311, (1, n)) for n in (5, 9, 14)]
    with torch.no_grad():
        caches = [own.new_cache() for _ in prompts]
        first = [own(p, [c]) for p, c in zip(prompts, caches)]
        tokens = torch.tensor([[int(f[0].argmax())] for f in first])
        batched = own(tokens, caches)
        alone = []
        for p, t in zip(prompts, tokens):
            c = own.new_cache()
            own(p, [c])
            alone.append(own(t.view(1, 1), [c])[0])
    torch.testing.assert_close(batched, torch.stack(alone), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native_decode", NATIVE, ids=lambda n: "native" if n else "torch-attn")
def test_explicit_positions_and_mask_reproduce_the_causal_default(native_decode):
    """Guards the hooks speculation needs: explicit positions and a 4D-able mask."""
    _, own = pair("qwen2", native_decode=native_decode)
    ids = torch.randint(0, 311, (1, 10))
    with torch.no_grad():
        c1, c2 = own.new_cache(), own.new_cache()
        own(ids[:, :6], [c1])
        own(ids[:, :6], [c2])
        a = own(ids[:, 6:], [c1], logits_for="all")
        b = own(ids[:, 6:], [c2], positions=torch.arange(6, 10).view(1, 4), masks=[causal_mask(6, 4, "cpu")],
                logits_for="all")
    torch.testing.assert_close(a, b)


def test_unsupported_family_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="not supported"):
        from_hf(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_gives_the_computed_angles(dtype):
    """``rope`` looks positions up in a table that grows as they do; every lookup is the bits
    ``rope_angles`` computes, whatever the batch's shape; a new dtype or frequencies rebuild it."""
    _, own = pair("llama3-rope")
    own.to(dtype)
    g = torch.Generator().manual_seed(1)
    for end in (5, 1500, 3000, 9000):  # the table starts at 1024 and doubles past it
        pos = torch.randint(0, end, (3, 17), generator=g)
        cos, sin = own.rope(pos)
        ref = own.rope_angles(pos)
        assert cos.dtype == dtype and cos.shape == ref[0].shape == (3, 1, 17, own.args.head_dim)
        assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
    assert own._rope_table[1].shape[0] > int(pos.max())
    own.inv_freq = own.inv_freq * 0.5  # new frequencies (as from_hf sets them): a new table
    pos = torch.arange(40).view(2, 20)
    assert torch.equal(own.rope(pos)[0], own.rope_angles(pos)[0])


def test_pack_falls_back_where_onednn_refuses(monkeypatch):
    """Where this CPU's oneDNN refuses a dtype (bf16 without AVX-512BW/VL/DQ or AVX-NE-CONVERT,
    which raises on the first reorder), pack() keeps the plain weights and says so, and the
    model still runs; where it accepts, the probe agrees with a real reorder."""
    from codecomplete.model import transformer as tr

    for dtype in (torch.float32, torch.bfloat16):
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), None)
            works = True
        except RuntimeError:
            works = False
        assert tr._onednn_takes(dtype) == works
    _, own = pair("qwen2", tie=True)
    own = own.to(torch.bfloat16)
    monkeypatch.setattr(tr, "_onednn_takes", lambda dtype: False)
    assert own.pack(True) is False and own.packed is False
    assert all(m.packed is None for m in own.modules() if isinstance(m, tr.Linear))
    with torch.no_grad():
        out = own(torch.randint(0, 311, (1, 12)), [own.new_cache()], logits_for="all")
    assert out.shape == (1, 12, 311) and torch.isfinite(out.float()).all()
