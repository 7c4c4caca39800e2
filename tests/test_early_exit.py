"""Early exit on the tiny real model (fp32): KV filling, batch rules, lossless mode,
trained and calibrated exits through the project's command, the engine's settings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from codecomplete.model import native
from codecomplete.model.api import CompletionRequest, EngineSettings, ExitSettings, SpecSettings
from codecomplete.model.early_exit import (Exits, ExitPolicy, ExitsError, exit_forward, fill_kv, load_exits,
                                            untrained_exits)
from codecomplete.model.engine import (Engine, ExitRuntime, advance, decode_step, generate, plan_prompt,
                                       self_spec_step, start)
from codecomplete.model.loader import load_model, model_identity
from codecomplete.model.speculate import Drafter
from codecomplete.model.transformer import apply_rope

PROMPTS = [("def mean(data):\n    total = 0\n    for x in data:\n        total", "\n    return total\n"),
           ("class Point:\n    def __init__(self, x, y):\n        self.", "\n"),
           ("import os\nimport ", "")]
PLAIN = EngineSettings(token_healing=False, speculation=SpecSettings(enabled=False))


@pytest.fixture(scope="module")
def lm(tiny_model):
    return load_model(str(tiny_model), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def trained(tiny_exits):
    return tiny_exits


def prefill(lm, text: str):
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    cache = lm.model.new_cache(len(ids) + 8)
    with torch.inference_mode():
        lm.model(torch.tensor([ids]), [cache])
    return ids, cache


def assert_filled_from(model, cache, pos: int, h: torch.Tensor) -> None:
    """Layer 1's K and V at ``pos`` are its projections of the state h (RoPE at that position)."""
    a = model.args
    x = model.layers[1].attn_norm(h.view(1, -1))
    k, v = model.layers[1].attn.wqkv(x)[:, a.n_heads * a.head_dim:].split(a.n_kv_heads * a.head_dim, -1)
    cos, sin = model.rope(torch.tensor([[pos]]))
    k = apply_rope(k.view(1, 1, a.n_kv_heads, a.head_dim).transpose(1, 2), cos, sin)[0, :, 0]
    torch.testing.assert_close(cache.k[1, :, pos], k)
    torch.testing.assert_close(cache.v[1, :, pos], v.view(a.n_kv_heads, a.head_dim))


def test_kv_filling_keeps_every_layer_aligned(lm):
    """Guards KV filling: a token that exits after layer 1 leaves the same cache length in
    every layer, and the skipped layer's K, V at its position are that layer's
    projections of the exit state (with RoPE at that position)."""
    model = lm.model
    exits = untrained_exits(model, [1])
    ids, cache = prefill(lm, PROMPTS[0][0])
    pos = cache.length
    captured = {}
    hook = model.layers[0].register_forward_hook(lambda m, i, o: captured.update(h=o[0, -1].clone()))
    with torch.inference_mode():
        logits, ran = exit_forward(model, exits, ExitPolicy("cosine", {1: -2.0}), [ids[-1]], [cache], [0])
    hook.remove()
    assert ran == [1] and cache.length == pos + 1
    h = captured["h"]
    assert_filled_from(model, cache, pos, h)
    # the exit's logits are the shared head on the exit state
    torch.testing.assert_close(logits[0], model.head(model.norm(h)).float())
    # the next token attends to both layers' caches at the same length: decoding goes on
    with torch.inference_mode():
        out, ran = exit_forward(model, exits, ExitPolicy("cosine", {}), [int(logits[0].argmax())], [cache], [1])
    assert ran == [2] and cache.length == pos + 2 and torch.isfinite(out).all()


def test_kv_filling_takes_the_exit_layers_state_not_the_adapted_one(lm):
    """With a trained adapter the exit's token comes from the adapted state (h + A h), but the
    skipped layers' KV is filled from the exit layer's own hidden state h: the adapter serves
    the head (filling from its state lost 1-2.6 ES points as served, docs/decisions.md)."""
    model = lm.model
    exits = Exits(model.args.dim, [1]).to(model.dtype)
    with torch.no_grad():
        exits.adapters[0].weight.copy_(torch.randn(model.args.dim, model.args.dim,
                                                   generator=torch.Generator().manual_seed(3)) * 0.2)
    exits.trained = True
    ids, cache = prefill(lm, PROMPTS[1][0])
    pos = cache.length
    captured = {}
    hook = model.layers[0].register_forward_hook(lambda m, i, o: captured.update(h=o[0, -1].clone()))
    with torch.inference_mode():
        logits, ran = exit_forward(model, exits, ExitPolicy("softmax", {1: 0.0}), [ids[-1]], [cache], [0])
    hook.remove()
    assert ran == [1] and cache.length == pos + 1
    h = captured["h"]
    assert_filled_from(model, cache, pos, h)
    with torch.inference_mode():
        adapted = exits.state(1, h.view(1, -1))
        want = model.head(model.norm(adapted))[0].float()
    assert not torch.allclose(adapted, h.view(1, -1))
    torch.testing.assert_close(logits[0], want)


def test_folded_kv_filling_matches_the_layer_by_layer_filling(tiny_model):
    """``FoldedKV`` (bf16 on a CPU with the native kernels): the skipped layers' K and V from one
    product with the norms' weights folded in equal, within bf16 rounding, what the layer-by-layer
    filling writes; layers below the exit and other positions are left alone."""
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.error()}")
    lm16 = load_model(str(tiny_model), device="cpu", dtype="bfloat16")
    model = lm16.model
    with torch.no_grad():  # norms that scale (the tiny model's are ones): folding them must count
        for layer in model.layers:
            layer.attn_norm.weight.copy_(torch.linspace(0.5, 1.5, layer.attn_norm.weight.numel()))
    exits = untrained_exits(model, [1])
    with torch.inference_mode():
        folded = exits.folded_kv(model)
        assert folded is not None and exits.folded_kv(model) is folded  # built once
        ids = lm16.tokenizer.encode(PROMPTS[0][0], add_special_tokens=False)
        cache = model.new_cache(len(ids) + 4)
        cache.k.zero_()
        cache.v.zero_()
        model(torch.tensor([ids]), [cache])
        pos = cache.length
        cos, sin = model.rope(torch.tensor([[pos]]))
        h = model.embed(torch.tensor([[ids[-1]]]))[0, 0] * 4
        before = cache.k.clone(), cache.v.clone()
        fill_kv(model, h, cache, 1, pos, cos, sin)
        want = cache.k[:, :, pos].clone(), cache.v[:, :, pos].clone()
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        fill_kv(model, h, cache, 1, pos, cos, sin, folded)
    for got, ref, old in zip((cache.k, cache.v), want, before):
        torch.testing.assert_close(got[1, :, pos].float(), ref[1].float(), rtol=3e-2,
                                   atol=3e-2 * float(ref[1].abs().max()))
        assert torch.equal(got[0], old[0]) and torch.equal(got[1, :, :pos], old[1, :, :pos])
        assert not torch.equal(got[1, :, pos], old[1, :, pos])


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_native_kv_filling_writes_what_the_pytorch_ops_write(tiny_model, kv_dtype):
    """``native.fill_kv_folded`` (``FoldedKV.fill``: the norm, the folded product, RoPE and the
    cache writes in one call) writes what ``FoldedKV.project`` and PyTorch's RoPE and indexing
    write, within one bf16 rounding (the norm's fp32 sum may round differently), into a bf16 or an
    fp32 cache; only the skipped layers at that position change."""
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.error()}")
    lm16 = load_model(str(tiny_model), device="cpu", dtype="bfloat16")
    model = lm16.model
    a = model.args
    kd = a.n_kv_heads * a.head_dim
    with torch.no_grad():
        for layer in model.layers:
            layer.attn_norm.weight.copy_(torch.linspace(0.5, 1.5, layer.attn_norm.weight.numel()))
    exits = untrained_exits(model, [1])
    torch.manual_seed(0)
    with torch.inference_mode():
        folded = exits.folded_kv(model)
        first = next(f for f in range(1, a.n_layers) if native.packed_rows(folded.packed, f * folded.rows) is not None)
        cache = model.new_cache(8)
        cache.k = torch.randn(cache.k.shape).to(kv_dtype)
        cache.v = torch.randn(cache.v.shape).to(kv_dtype)
        pos = 5
        cos, sin = model.rope(torch.tensor([[pos]]))
        h = torch.randn(a.dim).to(torch.bfloat16) * 3
        before = cache.k.clone(), cache.v.clone()
        assert folded.fill(h, first, a.n_layers, cos, sin, cache, pos)
        kvp = folded.project(h, first, a.n_layers)
        n = a.n_layers - first
        want_k = apply_rope(kvp[:, :kd].reshape(n, 1, a.n_kv_heads, a.head_dim).transpose(1, 2), cos, sin)[:, :, 0]
        want_v = kvp[:, kd:].reshape(n, a.n_kv_heads, a.head_dim)
    for got, want, old in ((cache.k, want_k, before[0]), (cache.v, want_v, before[1])):
        torch.testing.assert_close(got[first:, :, pos].float(), want.float(), rtol=1e-2,
                                   atol=1e-2 * float(want.abs().max()))
        assert (got[first:, :, pos].float() == want.float()).float().mean() > 0.9  # mostly to the bit
        assert torch.equal(got[:first], old[:first])
        assert torch.equal(got[:, :, :pos], old[:, :, :pos]) and torch.equal(got[:, :, pos + 1:], old[:, :, pos + 1:])
    with pytest.raises(ValueError, match="out of the cache"):
        folded.fill(h, first, a.n_layers, cos, sin, cache, cache.k.shape[2])


def test_native_softmax_check_is_the_pytorch_check(tiny_model, trained):
    """``native.exit_check`` (one bf16 row on a CPU with the native kernels) computes what
    ``Exits.confidence``'s PyTorch path does: the same subset logits to the bit and the same
    softmax margin within float rounding, at a trained exit (adapter) and at the last layer."""
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.error()}")
    lm16 = load_model(str(tiny_model), device="cpu", dtype="bfloat16")
    model = lm16.model
    exits = load_exits(trained, model)
    assert exits.trained and len(exits.subset)
    torch.manual_seed(0)
    calls = []
    real = native.ExitCheck.__call__
    with torch.inference_mode():
        for scale in (0.5, 2.0, 8.0):
            h = (torch.randn(1, model.args.dim) * scale).to(torch.bfloat16)
            for layer in (exits.layers[0], model.args.n_layers):
                native.ExitCheck.__call__ = lambda self, *a: calls.append(1) or real(self, *a)
                try:
                    margin, logits = exits.confidence(model, "softmax", layer, h, None)
                finally:
                    native.ExitCheck.__call__ = real
                want = exits.logits(model, layer, h, subset=True).float()
                top2 = torch.softmax(want, -1).topk(2, dim=-1).values
                assert torch.equal(logits, want)
                assert abs(float(margin[0]) - float(top2[0, 0] - top2[0, 1])) < 1e-4
    assert len(calls) == 6  # every check took the native call
    # the bound check follows its weights: an adapter changed in place is read again
    with torch.inference_mode():
        h = (torch.randn(1, model.args.dim) * 2).to(torch.bfloat16)
        layer = exits.layers[0]
        before = exits.confidence(model, "softmax", layer, h, None)[1]
        with torch.no_grad():
            exits.adapters[exits.index(layer)].weight.mul_(3)
        after = exits.confidence(model, "softmax", layer, h, None)[1]
        assert not torch.equal(before, after)
        assert torch.equal(after, exits.logits(model, layer, h, subset=True).float())
    # the one-call form gives copies, not the bound buffer
    check = exits._check(model, layer, torch.bfloat16)
    subset = exits._pack("subset", exits._subset_weight(model, h.dtype, h.device))
    m1, l1, y1 = native.exit_check(h, None, model.norm.weight, model.norm.eps, subset, len(exits.subset))
    assert l1.data_ptr() != check.logits.data_ptr()
    with pytest.raises(ValueError, match="one bf16 row"):
        check(h.float())


def _mlp_exits(model, layers, hidden=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = Exits(model.args.dim, layers, torch.arange(0, model.args.vocab_size, 3), adapter="mlp", adapter_hidden=hidden)
    with torch.no_grad():
        for a in ex.adapters:
            a.w1.weight.copy_(torch.randn(a.w1.weight.shape, generator=g) / model.args.dim ** 0.5)
            a.w2.weight.copy_(torch.randn(a.w2.weight.shape, generator=g) / hidden ** 0.5)
    ex.trained = True
    return ex


def test_mlp_adapters_save_load_and_serve_natively(tiny_model, tmp_path):
    """Exits with MLP adapters (exit_stream's "mlp" kind): the exit state is h + W2 silu(W1 h);
    they round-trip through save / load_exits; the native check (``native.exit_check`` with the MLP's weights)
    gives the PyTorch path's logits and margin within bf16 rounding; an unknown kind is refused."""
    lm16 = load_model(str(tiny_model), device="cpu", dtype="bfloat16")
    model = lm16.model
    ex = _mlp_exits(model, [1])
    ex.thresholds = {"softmax@0.1": {1: 0.5}}
    ex.save(tmp_path / "mlp")
    meta = json.loads((tmp_path / "mlp" / "exits.json").read_text())
    assert meta["adapter_kind"] == "mlp" and meta["adapter_hidden"] == 96
    got = load_exits(tmp_path / "mlp", model)
    assert got.adapter_kind == "mlp" and got.adapter_hidden == 96 and "adapter_kind" not in got.meta
    assert torch.equal(got.adapters[0].w1.weight, ex.adapters[0].w1.weight.to(torch.bfloat16))
    h = torch.randn(3, model.args.dim)
    a = ex.adapters[0]
    want = h + a.w2(F.silu(a.w1(h)))
    torch.testing.assert_close(ex.float().state(1, h), want)  # fp32: PyTorch's ops

    calls = []
    if native.available():
        real = native.ExitCheck.__call__
        mlp_fn = native._lib.exit_check_mlp
        native.ExitCheck.__call__ = lambda self, h: calls.append(self._fn is mlp_fn) or real(self, h)
    try:
        with torch.inference_mode():
            for scale in (0.5, 2.0, 8.0):
                h = (torch.randn(1, model.args.dim) * scale).to(torch.bfloat16)
                margin, logits = got.confidence(model, "softmax", 1, h, None)
                x = model.norm(h.float() + a.w2(F.silu(a.w1(h.float())))).float()  # fp32 reference
                ref = F.linear(x, model.head.weight.float()[got.subset])
                torch.testing.assert_close(logits, ref, rtol=5e-2, atol=5e-2 * float(ref.abs().max()))
                top2 = torch.softmax(logits, -1).topk(2, dim=-1).values
                assert abs(float(margin[0]) - float(top2[0, 0] - top2[0, 1])) < 1e-4
    finally:
        if native.available():
            native.ExitCheck.__call__ = real
    assert calls == ([True] * 3 if native.available() else [])  # the MLP's weights went to the native check

    meta["adapter_kind"] = "conv"
    (tmp_path / "mlp" / "exits.json").write_text(json.dumps(meta))
    with pytest.raises(ExitsError, match="adapter kind 'conv'"):
        load_exits(tmp_path / "mlp", model)


def test_native_mlp_check_is_the_bf16_pytorch_path(tiny_model):
    """``native.exit_check`` with an MLP adapter (step_ops.c's exit_check_mlp) against the same
    bf16 products through PyTorch: the exit
    state to one bf16 step (PyTorch's exp and the kernel's may round a silu differently), the
    logits and the margin within the rounding that follows."""
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.error()}")
    lm16 = load_model(str(tiny_model), device="cpu", dtype="bfloat16")
    model = lm16.model
    ex = _mlp_exits(model, [1], hidden=160, seed=1).to(torch.bfloat16)
    a = ex.adapters[0]
    sub = model.head.weight[ex.subset].contiguous()
    torch.manual_seed(1)
    with torch.inference_mode():
        for scale in (0.5, 2.0, 8.0):
            h = (torch.randn(1, model.args.dim) * scale).to(torch.bfloat16)
            mlp = (native.pack_linear(a.w1.weight), native.pack_linear(a.w2.weight), 160)
            margin, logits, y = native.exit_check(h, mlp, model.norm.weight, model.norm.eps, native.pack_linear(sub),
                                                  len(ex.subset))
            mid = F.silu(F.linear(h, a.w1.weight))
            want_y = (h + F.linear(mid, a.w2.weight))[0]
            torch.testing.assert_close(y.float(), want_y.float(), rtol=1.6e-2, atol=1e-2 * float(want_y.abs().max()))
            want = F.linear(model.norm(y.view(1, -1)), sub).float()[0]
            torch.testing.assert_close(logits.float(), want, rtol=1.6e-2, atol=1e-2 * float(want.abs().max()))
            top2 = torch.softmax(logits.float(), -1).topk(2).values
            assert abs(margin - float(top2[0] - top2[1])) < 1e-4


def test_never_confident_is_the_full_model(lm):
    exits = untrained_exits(lm.model, [1])
    rt = ExitRuntime(exits, ExitPolicy("softmax", {1: 2.0}))
    for prefix, suffix in PROMPTS:
        req = CompletionRequest(prefix, suffix, mode="multi", max_tokens=16, max_lines=50, time_budget_ms=10**6)
        full = generate(lm, req, PLAIN)
        ee = generate(lm, CompletionRequest(prefix, suffix, mode="multi", max_tokens=16, max_lines=50, time_budget_ms=10**6), PLAIN,
                      exits=rt)
        assert full.stop_reason != "time_budget" and ee.stop_reason == full.stop_reason
        assert ee.token_ids == full.token_ids
        assert ee.layers_run == lm.model.args.n_layers * ee.forward_passes


def test_always_confident_exits_every_decode_step(lm):
    exits = untrained_exits(lm.model, [1])
    rt = ExitRuntime(exits, ExitPolicy("cosine", {1: -2.0}))
    c = generate(lm, CompletionRequest(PROMPTS[0][0], PROMPTS[0][1], mode="multi", max_tokens=12, max_lines=50,
                                       ignore_eos=True), PLAIN, exits=rt)
    assert c.generated_tokens == 12 and c.layers_run == 1 * c.forward_passes


def test_final_check_skips_the_full_head_only_when_confident(lm):
    """Guards the last layer's cheap check: a confident subset-head margin there gives
    the token from the subset head (the full head is skipped); the cache is the full
    model's either way.  With a subset holding the whole vocabulary the tokens are
    the full model's; an unconfident check changes nothing."""
    model = lm.model
    vocab = model.args.vocab_size
    for subset, thr in [(torch.arange(vocab), 0.0), (torch.arange(vocab // 2), 2.0)]:
        exits = Exits(model.args.dim, [1], subset).to(dtype=model.dtype).eval()
        exits.final = model.args.n_layers
        rt = ExitRuntime(exits, ExitPolicy("softmax", {model.args.n_layers: thr}))
        for prefix, suffix in PROMPTS:
            req = dict(mode="multi", max_tokens=12, max_lines=50, time_budget_ms=10**6)
            full = generate(lm, CompletionRequest(prefix, suffix, **req), PLAIN)
            skips = exits.head_skips
            ee = generate(lm, CompletionRequest(prefix, suffix, **req), PLAIN, exits=rt)
            assert ee.token_ids == full.token_ids
            assert ee.layers_run == model.args.n_layers * ee.forward_passes
            assert exits.head_skips - skips == (ee.forward_passes if thr == 0.0 else 0)
    # a subset without the full model's choice: the confident check picks inside the subset
    ids, cache = prefill(lm, PROMPTS[0][0])
    exits = Exits(model.args.dim, [1], torch.tensor([t for t in range(vocab) if t != 0])).to(dtype=model.dtype).eval()
    with torch.inference_mode():
        logits, ran = exit_forward(model, exits, ExitPolicy("softmax", {model.args.n_layers: 0.0}), [ids[-1]], [cache], [0])
    assert ran == [model.args.n_layers] and logits[0, 0] == float("-inf") and torch.isfinite(logits[0, 1:]).all()


def test_batch_rules(lm):
    """'each': the confident sequence leaves alone; 'all': nobody leaves unless all are
    confident (CALM's rule)."""
    model = lm.model
    exits = untrained_exits(model, [1])
    texts = [PROMPTS[0][0], PROMPTS[1][0]]
    confs = []
    for text in texts:  # each sequence's cosine confidence at the exit, measured alone
        ids, cache = prefill(lm, text)
        seen = {}
        h0 = model.layers[0].register_forward_hook(lambda m, i, o: seen.update(after=o[0, -1].clone()))
        h1 = model.layers[0].register_forward_pre_hook(lambda m, i: seen.update(before=i[0][0, -1].clone()))
        with torch.inference_mode():
            model(torch.tensor([[ids[-1]]]), [cache])
        h0.remove()
        h1.remove()
        confs.append(float(torch.cosine_similarity(seen["after"], seen["before"], dim=0)))
    assert confs[0] != confs[1]
    thr = sum(confs) / 2
    for rule, expect in [("each", [1 if c >= thr else 2 for c in confs]), ("all", [2, 2])]:
        caches, last = [], []
        for text in texts:
            ids, cache = prefill(lm, text)
            caches.append(cache)
            last.append(ids[-1])
        with torch.inference_mode():
            _, ran = exit_forward(model, exits, ExitPolicy("cosine", {1: thr}, rule), last, caches, [0, 0])
        assert ran == expect


@pytest.mark.parametrize("draft_tokens,margin", [(1, 0.0), (3, 0.0), (6, 0.0), (6, 0.05)])
def test_lossless_mode_is_greedy_decoding(lm, trained, draft_tokens, margin):
    """Guards self-speculation: drafts from the exit, verified by the full model, give
    exactly the full model's greedy output, and the cache then holds exactly the KV a
    plain decode would have; with a margin too, drafting only while the exit is confident."""
    exits = load_exits(trained, lm.model)
    rt = ExitRuntime(exits, ExitPolicy("softmax", {}), lossless=True, draft_layer=1, draft_tokens=draft_tokens,
                     draft_margin=margin)
    accepted = 0
    for prefix, suffix in PROMPTS:
        full = generate(lm, CompletionRequest(prefix, suffix, mode="multi", max_tokens=20, max_lines=50, time_budget_ms=10**6), PLAIN)
        ss = generate(lm, CompletionRequest(prefix, suffix, mode="multi", max_tokens=20, max_lines=50, time_budget_ms=10**6), PLAIN,
                      exits=rt)
        assert full.stop_reason != "time_budget" and ss.stop_reason == full.stop_reason
        assert ss.token_ids == full.token_ids and ss.text == full.text
        accepted += ss.accepted_tokens
    assert accepted > 0
    # the cache after self-speculative decoding = a fresh prefill of what was fed
    req = CompletionRequest(PROMPTS[0][0], PROMPTS[0][1], mode="multi", max_tokens=20, max_lines=50,
                            ignore_eos=True)
    with torch.inference_mode():
        live = start(lm, req, plan_prompt(lm, req, PLAIN, None, None), None)
        going = [live] if advance(lm, live, None) else []
        while going:
            going = [lv for lv in self_spec_step(lm, going, rt, None) if advance(lm, lv, None)]
        n = live.cache.length
        assert live.fed[:n] == live.fed and n == len(live.fed)
        fresh = lm.model.new_cache(n)
        lm.model(torch.tensor([live.fed]), [fresh])
    torch.testing.assert_close(live.cache.k[:, :, :n], fresh.k[:, :, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(live.cache.v[:, :, :n], fresh.v[:, :, :n], rtol=1e-4, atol=1e-4)


def test_lossless_drafts_only_while_the_exit_is_confident(lm, trained):
    """``draft_margin``: a draft chain stops at the first token whose exit margin is below it.
    A margin above any softmax margin (1.0 is the largest) never drafts: every round is one
    full step and the output is still greedy decoding's; with no margin every round drafts."""
    exits = load_exits(trained, lm.model)
    prefix, suffix = PROMPTS[0]
    full = generate(lm, CompletionRequest(prefix, suffix, mode="multi", max_tokens=16, max_lines=50,
                                          ignore_eos=True), PLAIN)
    drafted = {}
    for margin in (0.0, 1.5):
        rt = ExitRuntime(exits, ExitPolicy("softmax", {}), lossless=True, draft_layer=1, draft_tokens=4,
                         draft_margin=margin)
        req = CompletionRequest(prefix, suffix, mode="multi", max_tokens=16, max_lines=50, ignore_eos=True)
        with torch.inference_mode():
            live = start(lm, req, plan_prompt(lm, req, PLAIN, None, None), None)
            going, rounds, n = ([live] if advance(lm, live, None) else []), 0, 0
            while going:
                before = len(live.fed)
                going = [lv for lv in self_spec_step(lm, going, rt, None) if advance(lm, lv, None)]
                rounds += 1
                n += len(live.fed) - before
        assert live.result.token_ids == full.token_ids
        drafted[margin] = live.accepted
        if margin > 1:
            assert live.accepted == 0 and n == rounds and live.spec_steps >= rounds - 1  # one token a round
    assert drafted[0.0] > 0


def test_lossless_oracle_drafts_are_still_verified(lm, trained):
    """``ExitRuntime.oracle`` (bench/early_exit_ceiling.py) replaces the exit head's drafts: drafts
    that are the full model's own tokens are all accepted (every round takes its drafts and
    one more token), wrong ones are all rejected; the output is greedy decoding's either way."""
    exits = load_exits(trained, lm.model)
    prefix, suffix = PROMPTS[1]
    full = generate(lm, CompletionRequest(prefix, suffix, mode="multi", max_tokens=16, max_lines=50,
                                          ignore_eos=True), PLAIN)
    ref = full.token_ids
    vocab = lm.model.args.vocab_size
    for right in (True, False):
        rt = ExitRuntime(exits, ExitPolicy("softmax", {}), lossless=True, draft_layer=1, draft_tokens=3)
        calls = []

        def oracle(lv, j, right=right):
            n = len(lv.generated)
            calls.append((n, j))
            if n + j >= len(ref):
                return None
            return ref[n + j] if right else (ref[n + j] + 1) % vocab

        rt.oracle = oracle
        req = CompletionRequest(prefix, suffix, mode="multi", max_tokens=16, max_lines=50, ignore_eos=True)
        with torch.inference_mode():
            live = start(lm, req, plan_prompt(lm, req, PLAIN, None, None), None)
            going = [live] if advance(lm, live, None) else []
            while going:
                going = [lv for lv in self_spec_step(lm, going, rt, None) if advance(lm, lv, None)]
        assert live.result.token_ids == ref
        assert calls and live.spec_steps > 0
        if right:  # 3 drafts and a bonus token a round while the budget lasts
            assert live.accepted == len(ref) - 1 - live.passes
            assert live.passes < len(ref) - 1
        else:
            assert live.accepted == 0


def test_lossless_draft_bound_picks_the_calibrated_threshold(lm, trained):
    """``ExitSettings.draft_bound`` resolves to the softmax threshold calibrated for the nearest
    calibrated bound at the drafting exit (these exits: 0.02 and 0.5); 0 drafts always; exits
    with no softmax calibration draft always."""
    exits = load_exits(trained, lm.model)

    def margin(bound: float) -> float:
        return ExitRuntime.build(exits, ExitSettings(enabled=True, lossless=True, draft_layer=1,
                                                     draft_bound=bound)).draft_margin

    at = {b: exits.thresholds[f"softmax@{b:g}"].get(1, float("inf")) for b in (0.02, 0.5)}  # left out: never drafts
    assert margin(0.02) == at[0.02] and margin(0.05) == at[0.02] and margin(0.3) == at[0.5] and margin(0) == 0
    saved = exits.thresholds
    exits.thresholds = {k: v for k, v in saved.items() if not k.startswith("softmax@")}
    try:
        assert margin(0.1) == 0
    finally:
        exits.thresholds = saved


def test_trained_exits_round_trip_and_drive_the_engine(lm, tiny_model, trained):
    meta = json.loads((trained / "exits.json").read_text())
    assert meta["layers"] == [1] and meta["trained"] and meta["positions_train"] > 0
    # softmax/2: the check after the last layer (the subset head's margin skips the full head)
    assert set(meta["calibration"]) == {"softmax/1", "cosine/1", "classifier/1", "softmax/2"}
    assert meta["final_layer"] == 2
    # the heads record the weights they were trained on; other weights are refused
    assert meta["model_id"] and meta["model_id"] == model_identity(lm.home)
    exits = load_exits(trained, lm.model, model_identity(lm.home))
    with pytest.raises(ExitsError, match="trained on other weights"):
        load_exits(trained, lm.model, "0123456789abcdef")
    assert exits.trained and len(exits.subset) == 256
    assert set(exits.thresholds) >= {"softmax@0.5", "softmax@0.02", "classifier@0.5", "cosine@0.5"}
    rt = ExitRuntime.build(exits, ExitSettings(enabled=True, measure="classifier", bound=0.5))
    assert rt.policy.thresholds == exits.thresholds["classifier@0.5"]
    with pytest.raises(ExitsError, match="no thresholds calibrated for softmax@0.3"):
        ExitRuntime.build(exits, ExitSettings(enabled=True, measure="softmax", bound=0.3))
    lossless = ExitRuntime.build(exits, ExitSettings(enabled=True, lossless=True, bound=0.3))
    assert lossless.lossless and lossless.draft_layer == 1  # drafts need no calibrated thresholds
    # a trained adapter is not the identity
    assert exits.adapters[0].weight.abs().sum() > 0
    settings = EngineSettings(model=str(tiny_model), dtype="float32", token_healing=False,
                              speculation=SpecSettings(enabled=False),
                              early_exit=ExitSettings(enabled=True, path=str(trained), measure="softmax",
                                                      threshold=1e-9))
    engine = Engine(settings).start()
    try:
        engine.ready.wait()
        c = engine.complete(CompletionRequest(PROMPTS[0][0], PROMPTS[0][1], mode="multi", max_tokens=8,
                                              ignore_eos=True))
        assert c.generated_tokens == 8 and c.layers_run < 2 * c.forward_passes
        st = engine.stats()
        assert st["early_exit"]["enabled"] and st["early_exit"]["error"] is None
        assert st["early_exit"]["mean_layers"] < 2
    finally:
        engine.close()


def test_missing_or_broken_exits_keep_serving(tiny_model, trained, tmp_path):
    (tmp_path / "exits.json").write_text("{not json")
    other = tmp_path / "other"  # heads trained on other weights
    shutil.copytree(trained, other)
    meta = json.loads((other / "exits.json").read_text())
    (other / "exits.json").write_text(json.dumps(meta | {"model_id": "0123456789abcdef"}))
    for path in [str(tmp_path / "nowhere"), str(tmp_path), str(other)]:
        settings = EngineSettings(model=str(tiny_model), dtype="float32", speculation=SpecSettings(enabled=False),
                                  early_exit=ExitSettings(enabled=True, path=path))
        engine = Engine(settings).start()
        try:
            engine.ready.wait()
            c = engine.complete(CompletionRequest("def f(x):\n    return", "", max_tokens=4))
            assert c.stop_reason != "error"
            err = engine.stats()["early_exit"]["error"]
            assert err and ("other weights" if path == str(other) else "exit heads") in err
        finally:
            engine.close()
    with pytest.raises(ExitsError):
        load_exits(tmp_path, load_model(str(tiny_model), device="cpu", dtype="float32").model)


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
def test_native_segments_between_exits_equal_the_layer_loop():
    """A bf16 model runs the layers between two exit points as one native call; against the
    same steps one layer a call: identical logits, layers run, caches and filled KV (exits at
    layers 2 and 4 of 6, thresholds that let some tokens leave and keep others)."""
    from tests.test_native import random_bf16_model

    model = random_bf16_model(11, 0.1, tie=True, unit_norms=True, vocab_size=200, dim=64, n_layers=6, n_heads=4,
                              n_kv_heads=2, head_dim=16, hidden_dim=128)
    assert model.native_decode(True) and model.native_stack is not None
    exits = untrained_exits(model, [2, 4])
    prompt = torch.randint(0, 200, (1, 30))

    def run(segments: bool, greedy: bool = False):
        saved = model.native_stack
        if not segments:
            model.native_stack = None  # exit_forward then calls Block.forward layer by layer
        try:
            caches = [model.new_cache(64), model.new_cache(64)]
            with torch.inference_mode():
                for c in caches:
                    model(prompt, [c])
                toks, out = [3, 7], []
                for step in range(6):
                    logits, ran = exit_forward(model, exits, ExitPolicy("softmax", {2: 0.02, 4: 0.01}), toks, caches,
                                               [step, step], greedy=greedy)
                    out.append((logits, ran))
                    toks = [int(t) for t in logits.argmax(-1)]
            return out, caches
        finally:
            model.native_stack = saved

    (a, ca), (b, cb) = run(True), run(False)
    assert any(r < 6 for _, ran in a for r in ran) and any(r == 6 for _, ran in a for r in ran)
    for (la, ra), (lb, rb) in zip(a, b):
        assert ra == rb and torch.equal(la, lb)
    if model.native_stack.qhead is not None:  # the final head as the greedy head: the same choices
        g, _ = run(True, greedy=True)
        sparse = 0
        for (lg, rg), (la, ra) in zip(g, a):
            kept = torch.isfinite(lg)
            assert rg == ra and torch.equal(lg[kept], la[kept]) and torch.equal(lg.argmax(-1), la.argmax(-1))
            sparse += int((~kept).any())
        assert sparse  # some step did take the greedy head
    for x, y in zip(ca, cb):
        n = x.length
        assert n == y.length and torch.equal(x.k[:, :, :n], y.k[:, :, :n]) and torch.equal(x.v[:, :, :n], y.v[:, :, :n])


def test_exit_data_at_every_position_or_at_the_outputs(lm):
    """``exit_train --positions all`` (the default) trains on every position of the samples;
    ``outputs`` only where the model's output is predicted.  Same samples (same seed): the
    output positions are a part of every position, with the same states and targets."""
    from codecomplete.model.exit_train import collect

    every = collect(lm, 1, [1], "train", 0, batch=2, seq=64, every=True)
    outputs = collect(lm, 1, [1], "train", 0, batch=2, seq=64)
    n = len(outputs["top"])
    assert len(every["top"]) == 2 * 64 and 0 < n < 2 * 64
    assert every["states"][1].shape == (2 * 64, lm.model.args.dim)
    assert torch.equal(every["counts"], outputs["counts"])  # the same input tokens
    # each output position's (state, target) pair is among every position's pairs
    rows = {(tuple(s.tolist()), int(t)) for s, t in zip(every["states"][1], every["top"])}
    assert all((tuple(s.tolist()), int(t)) in rows for s, t in zip(outputs["states"][1], outputs["top"]))


def test_lossless_batch_takes_plain_batched_steps(lm, trained):
    """Self-speculation runs one request at a time; a batch of several takes plain batched
    steps: no drafts, one pass per token, and each request's output is its greedy output."""
    exits = load_exits(trained, lm.model)
    rt = ExitRuntime(exits, ExitPolicy("softmax", {}), lossless=True, draft_layer=1, draft_tokens=4)
    reqs = [CompletionRequest(p, s, mode="multi", max_tokens=10, max_lines=50, ignore_eos=True) for p, s in PROMPTS[:2]]
    want = [generate(lm, r, PLAIN).token_ids for r in reqs]
    with torch.inference_mode():
        lives = [start(lm, r, plan_prompt(lm, r, PLAIN, None, None), None) for r in reqs]
        going = [lv for lv in lives if advance(lm, lv, None)]
        while going:
            going = [lv for lv in decode_step(lm, going, None, rt) if advance(lm, lv, None)]
    assert [lv.result.token_ids for lv in lives] == want
    assert all(lv.spec_steps == 0 and lv.passes == len(lv.generated) - 1 for lv in lives)  # the first: prefill


def _decode_together(lm, reqs, rt, drafter=None):
    with torch.inference_mode():
        lives = [start(lm, r, plan_prompt(lm, r, PLAIN, None, None), None) for r in reqs]
        going = [lv for lv in lives if advance(lm, lv, None)]
        while going:
            going = [lv for lv in decode_step(lm, going, None, rt, drafter) if advance(lm, lv, None)]
    return lives


def test_batches_past_max_batch_decode_as_without_exits(lm, trained):
    """Guards the batch cutoff: a step of more requests than ``max_batch`` skips the exits
    (lossy ones measured slower than the full model from batch 2) and decodes as the daemon
    does without them, by retrieval speculation when a drafter is given, else plain steps:
    every layer, the full model's greedy output.  A batch within ``max_batch``, or a request
    alone, takes the exits."""
    n_layers = lm.model.args.n_layers
    exits = untrained_exits(lm.model, [1])

    def reqs():
        return [CompletionRequest(p, s, mode="multi", max_tokens=10, max_lines=50, ignore_eos=True)
                for p, s in PROMPTS[:2]]

    want = [generate(lm, r, PLAIN).token_ids for r in reqs()]
    always = ExitRuntime(exits, ExitPolicy("cosine", {1: -2.0}), max_batch=1)  # confident at every step
    assert always.takes(1) and not always.takes(2)
    for drafter in (None, Drafter(SpecSettings())):
        lives = _decode_together(lm, reqs(), always, drafter)
        assert [lv.result.token_ids for lv in lives] == want
        assert all(lv.layers == n_layers * lv.passes for lv in lives)
        if drafter is not None:
            assert drafter.stats["drafts"] > 0  # the batch went to retrieval speculation
    wide = ExitRuntime(exits, ExitPolicy("cosine", {1: -2.0}), max_batch=2)
    lives = _decode_together(lm, reqs(), wide)
    assert all(lv.layers == lv.passes and lv.passes == 9 for lv in lives)  # every step exited at layer 1
    alone = _decode_together(lm, reqs()[:1], always)[0]
    assert alone.layers == alone.passes
    # lossless: self-speculation for one request, a batch of two to the drafter
    rt = ExitRuntime(load_exits(trained, lm.model), ExitPolicy("softmax", {}), lossless=True, draft_layer=1)
    assert rt.takes(1) and not rt.takes(2)
    drafter = Drafter(SpecSettings())
    lives = _decode_together(lm, reqs(), rt, drafter)
    assert [lv.result.token_ids for lv in lives] == want and drafter.stats["drafts"] > 0
    # the setting reaches the runtime
    built = ExitRuntime.build(exits, ExitSettings(enabled=True, measure="cosine", threshold=0.5, max_batch=4))
    assert built.max_batch == 4 and built.takes(4) and not built.takes(5)


@pytest.mark.parametrize("lossless", [True, False])
def test_retrieved_drafts_are_verified_and_early_exit_takes_the_steps_without(lm, trained, monkeypatch, lossless):
    """Guards early exit beside retrieval speculation: a step whose request has a retrieved
    draft verifies it with the full model; a step without one goes to early exit (lossless:
    the early layers draft; lossy: the token may leave early).  Lossless, the output is the
    full model's greedy output."""
    import codecomplete.model.engine as engine_mod

    calls = {"retrieved": 0, "early": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(engine_mod, "verify", counting("retrieved", engine_mod.verify))
    monkeypatch.setattr(engine_mod, "self_spec" if lossless else "exit_forward",
                        counting("early", engine_mod.self_spec if lossless else engine_mod.exit_forward))
    if lossless:
        rt = ExitRuntime(load_exits(trained, lm.model), ExitPolicy("softmax", {}), lossless=True, draft_layer=1)
    else:
        rt = ExitRuntime(untrained_exits(lm.model, [1]), ExitPolicy("cosine", {1: -2.0}))  # always leaves at 1
    drafter = Drafter(SpecSettings())  # drafts from the request's own tokens (and its verified cache)
    for prefix, suffix in PROMPTS:
        req = dict(mode="multi", max_tokens=24, max_lines=50, ignore_eos=True)
        want = generate(lm, CompletionRequest(prefix, suffix, **req), PLAIN).token_ids
        got = generate(lm, CompletionRequest(prefix, suffix, **req), PLAIN, drafter=drafter, exits=rt)
        assert got.generated_tokens == 24
        if lossless:
            assert got.token_ids == want
        else:
            assert got.layers_run < lm.model.args.n_layers * got.forward_passes  # some steps left early
    assert calls["retrieved"] > 0 and calls["early"] > 0


def test_replay_costs_the_engine_policy_by_hand():
    """``exit_train.replay``: the first confident exit takes the token (a check at every exit it
    reaches, the KV filling of the layers it skips); the rest pay the full head unless the last
    layer's check skips it.  Four positions, costs worked out by hand."""
    from codecomplete.model.exit_train import ExitCost, replay

    conf = {8: torch.tensor([0.9, 0.1, 0.1, 0.1]), 16: torch.tensor([0.0, 0.9, 0.1, 0.1]),
            30: torch.tensor([0.0, 0.0, 0.9, 0.1])}
    agree = {8: torch.tensor([True, False, False, False]), 16: torch.tensor([False, False, True, True]),
             30: torch.tensor([True, True, False, True])}
    cost = ExitCost(check=1.0, head=8.0, fill_a=2.0, fill_b=0.1)
    thr = {8: 0.5, 16: 0.5, 30: 0.5}
    c, wrong, depth = replay(conf, agree, thr, 30, 30, cost)
    per = [1 + 8 + 2 + 0.1 * 22,        # leaves at 8
           2 + 16 + 2 + 0.1 * 14,       # two checks, leaves at 16 with another token
           2 + 30 + 1,                  # the last check skips the head, with another token
           2 + 30 + 1 + 8]              # the last check not confident: the full head
    assert c == pytest.approx(sum(per) / 4)
    assert wrong == pytest.approx(2 / 4) and depth == pytest.approx((8 + 16 + 30 + 30) / 4)
    # no thresholds: the full model (its head included) and nothing wrong
    assert replay(conf, agree, {}, 30, 30, cost) == (pytest.approx(38.0), 0.0, 30.0)


@pytest.mark.parametrize("seed", range(6))
def test_joint_thresholds_stay_within_the_bound_on_all_tokens_and_cost_no_more(seed):
    """``--policy joint``: over all tokens, the share that leaves with another token than the full
    model's stays within the bound (per-exit calibration bounds each exit's own tokens only); the
    policy costs no more than no exits or a feasible start; an exit that is never right is left
    unchecked while the bound is too small to pay for its checks, and an exit that is always right
    where it is confident is used."""
    from codecomplete.model.exit_train import ExitCost, joint_thresholds, replay

    g = torch.Generator().manual_seed(seed)
    n = 3000
    conf, agree = {}, {}
    for layer, skill in ((8, 0.3), (16, 0.6), (24, 0.85), (30, 0.95)):
        conf[layer] = torch.rand(n, generator=g)
        # confident positions agree more often: agreement probability rises with confidence
        agree[layer] = torch.rand(n, generator=g) < skill * (0.5 + conf[layer]) / 1.5 + (1 - skill) * 0.1
    agree[8] = torch.zeros(n, dtype=torch.bool)  # never right: its checks only cost
    cost = ExitCost()
    for bound in (0.01, 0.05, 0.2):
        start = {24: float(conf[24].quantile(0.99)), 30: float(conf[30].quantile(0.99))}
        thr = joint_thresholds(conf, agree, 30, 30, bound, cost, start=start)
        c, wrong, _ = replay(conf, agree, thr, 30, 30, cost)
        assert wrong <= bound + 1e-9
        assert c <= replay(conf, agree, {}, 30, 30, cost)[0] + 1e-9
        if replay(conf, agree, start, 30, 30, cost)[1] <= bound:
            assert c <= replay(conf, agree, start, 30, 30, cost)[0] + 1e-9
        if bound <= 0.05:  # its check costs 1.55 layers for every token, leaving saves ~25: worth it past ~6 %
            assert 8 not in thr
    # an exit right wherever it is confident takes every confident token
    sure = {12: torch.cat([torch.ones(n // 2), torch.zeros(n - n // 2)]), 30: torch.zeros(n)}
    right = {12: torch.cat([torch.ones(n // 2, dtype=torch.bool), torch.zeros(n - n // 2, dtype=torch.bool)]),
             30: torch.ones(n, dtype=torch.bool)}
    thr = joint_thresholds(sure, right, 30, 30, 0.0, cost)
    c, wrong, depth = replay(sure, right, thr, 30, 30, cost)
    assert wrong == 0.0 and 12 in thr and depth == pytest.approx((12 + 30) / 2)


def test_recalibrate_with_the_joint_policy(tiny_model, trained, tmp_path):
    """``exit_train --recalibrate DIR --policy joint``: the stored thresholds are the joint ones
    (every exit of them within the report's), the report gives each bound's projected cost and
    share of tokens leaving with another token (within the bound), and the engine serves them."""
    from codecomplete.model import exit_train

    out = tmp_path / "joint"
    assert exit_train.main(["--model", str(tiny_model), "--out", str(out), "--recalibrate", str(trained),
                            "--val-batches", "2", "--bounds", "0.5,0.02", "--dtype", "float32",
                            "--policy", "joint", "--cost", "0.5,1,0.2,0.01"]) == 0
    meta = json.loads((out / "exits.json").read_text())
    assert meta["policy"] == "joint" and meta["cost"] == {"check": 0.5, "head": 1.0, "fill_a": 0.2, "fill_b": 0.01}
    for key in ("softmax@0.5", "softmax@0.02", "classifier@0.5"):
        j = meta["joint"][key]
        assert j["wrong"] <= float(key.split("@")[1]) + 1e-9
        assert {k: pytest.approx(v, abs=1e-5) for k, v in j["thresholds"].items()} == meta["thresholds"][key]
        assert j["cost"] <= j["per_exit"]["cost"] + 1e-9 or j["per_exit"]["wrong"] > float(key.split("@")[1])
    with pytest.raises(SystemExit, match="--cost takes four"):
        exit_train.main(["--model", str(tiny_model), "--out", str(tmp_path / "x"), "--recalibrate", str(trained),
                         "--cost", "1,2,3"])
    lm_ = load_model(str(tiny_model), device="cpu", dtype="float32")
    exits = load_exits(out, lm_.model)
    rt = ExitRuntime.build(exits, ExitSettings(enabled=True, measure="softmax", bound=0.5))
    assert rt.policy.thresholds == exits.thresholds["softmax@0.5"]
    # lossless drafts stay gated on the drafting exit's own threshold (the per-exit one, kept
    # beside the joint ones): the same as the per-exit folder's
    each = load_exits(trained, lm_.model)
    assert exits.draft_thresholds["softmax@0.5"].keys() == each.thresholds["softmax@0.5"].keys()
    for bound in ("0.5", "0.02"):
        per_exit = meta["calibration"]["softmax/1"][f"@{bound}"]
        assert exits.draft_thresholds[f"softmax@{bound}"].get(1) == (
            pytest.approx(per_exit["threshold"], abs=1e-5) if per_exit["used"] else None)
    lossless = ExitRuntime.build(exits, ExitSettings(enabled=True, lossless=True, draft_layer=1, draft_bound=0.5))
    assert lossless.draft_margin == exits.draft_thresholds["softmax@0.5"].get(1, float("inf"))
    # a folder with malformed thresholds is refused with a clear error, not a crash
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    meta["thresholds"]["softmax@0.5"] = {"1": "high"}
    (bad / "exits.json").write_text(json.dumps(meta))
    with pytest.raises(ExitsError, match="malformed thresholds"):
        load_exits(bad, lm_.model)


def test_one_sequence_fast_path_is_the_general_path(monkeypatch):
    """``exit_forward`` of one sequence on a bf16 model with the native stack takes ``_exit_one``
    (fewer Python ops between the native calls); it gives what the general path gives, to the bit:
    logits, layers run, caches and filled KV, with exits, with the last layer's check, with none,
    and with ``allow`` False (no exit; the native head, within bf16 rounding of PyTorch's)."""
    from codecomplete.model import early_exit
    from tests.test_native import random_bf16_model

    model = random_bf16_model(11, 0.1, tie=True, unit_norms=True, vocab_size=200, dim=64, n_layers=6, n_heads=4,
                              n_kv_heads=2, head_dim=16, hidden_dim=128)
    assert model.native_decode(True) and model.native_stack is not None
    exits = untrained_exits(model, [2, 4])
    exits.subset = torch.arange(0, 200, 2)
    prompt = torch.randint(0, 200, (1, 30), generator=torch.Generator().manual_seed(1))
    calls = []
    real = early_exit._exit_one
    monkeypatch.setattr(early_exit, "_exit_one", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(fast: bool, thresholds: dict, allow: bool = True, greedy: bool = False):
        monkeypatch.setattr(early_exit, "FAST_ONE", fast)
        cache = model.new_cache(64)
        out = []
        with torch.inference_mode():
            model(prompt, [cache])
            tok = 3
            for step in range(8):
                logits, ran = exit_forward(model, exits, ExitPolicy("softmax", thresholds), [tok], [cache], [step],
                                           allow=[allow], greedy=greedy)
                out.append((logits, ran))
                tok = int(logits.argmax(-1)[0])
        return out, cache

    seen = set()
    for thresholds in ({2: 0.05, 4: 0.02}, {4: 0.03, 6: 0.005}, {}, {2: 0.0}):
        for greedy in (False, True):
            calls.clear()
            exits.head_skips = 0
            a, ca = run(True, thresholds, greedy=greedy)
            skips, exits.head_skips = exits.head_skips, 0
            b, cb = run(False, thresholds, greedy=greedy)
            assert len(calls) == 8  # every step took the fast path, and only when asked to
            assert skips == exits.head_skips and (skips > 0) == (6 in thresholds)  # the last layer's check too
            for (la, ra), (lb, rb) in zip(a, b):
                assert ra == rb and torch.equal(la, lb)
                seen.update(ra)
            n = ca.length
            assert n == cb.length == 38
            assert torch.equal(ca.k[:, :, :n], cb.k[:, :, :n]) and torch.equal(ca.v[:, :, :n], cb.v[:, :, :n])
    assert {2, 4, 6} <= seen  # tokens left at each exit and went the whole way
    # exits and a model made under inference mode (as served): their tensors track no versions
    monkeypatch.setattr(early_exit, "FAST_ONE", True)
    with torch.inference_mode():
        served = random_bf16_model(11, 0.1, tie=True, unit_norms=True, vocab_size=200, dim=64, n_layers=6, n_heads=4,
                                   n_kv_heads=2, head_dim=16, hidden_dim=128)
        assert served.native_decode(True)
        ex = untrained_exits(served, [2, 4])
        ex.subset = torch.arange(0, 200, 2)
        ex.trained = True  # the (zero) adapters are read by the check
        assert ex.adapters[0].weight.is_inference()
        cache = served.new_cache(64)
        served(prompt, [cache])
        calls.clear()
        for step in range(4):
            _, ran = exit_forward(served, ex, ExitPolicy("softmax", {2: 0.0}), [3], [cache], [step])
            assert ran == [2]
        assert len(calls) == 4 and cache.length == 34
    (a, _), (b, _) = run(True, {2: 0.0}, allow=False), run(False, {2: 0.0}, allow=False)
    for (la, ra), (lb, rb) in zip(a, b):
        assert ra == rb == [6] and torch.equal(la.argmax(-1), lb.argmax(-1))
        torch.testing.assert_close(la, lb, rtol=2e-2, atol=2e-2)


def test_self_speculation_on_the_native_stack_is_greedy_decoding(monkeypatch):
    """Lossless mode on a bf16 model with the native stack (its drafts through the fast path's
    direct calls): every round's accepted tokens and logits are what the PyTorch-op drafting
    gives, and the tokens are greedy decoding's, to the bit."""
    from codecomplete.model.early_exit import self_spec
    from tests.test_native import random_bf16_model

    model = random_bf16_model(5, 0.1, tie=True, unit_norms=True, vocab_size=200, dim=64, n_layers=6, n_heads=4,
                              n_kv_heads=2, head_dim=16, hidden_dim=128)
    assert model.native_decode(True)
    exits = untrained_exits(model, [3])
    exits.subset = torch.arange(0, 200)
    prompt = torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(2))

    def lossless(fast: bool) -> tuple[list[int], list[torch.Tensor], int]:
        if not fast:
            monkeypatch.setattr(Exits, "fast_path", lambda self, model: None)
        try:
            cache = model.new_cache(64)
            with torch.inference_mode():
                logits = model(prompt, [cache])[0]
                out, rows, drafted, accepted = [int(logits.argmax())], [], 0, 0
                while len(out) < 16:
                    acc, lg, d = self_spec(model, exits, 3, out[-1], cache, 4)
                    drafted, accepted = drafted + d, accepted + len(acc)
                    rows.append(lg)
                    out += acc + [int(lg[-1].argmax())]
            return out[:16], rows, (drafted, accepted)
        finally:
            monkeypatch.undo()

    fast, rows_fast, drafted = lossless(True)
    slow, rows_slow, _ = lossless(False)
    assert drafted[0] > drafted[1] > 0 and fast == slow and all(torch.equal(a, b) for a, b in zip(rows_fast, rows_slow))
    cache = model.new_cache(64)
    with torch.inference_mode():
        greedy = [int(model(prompt, [cache])[0].argmax())]
        while len(greedy) < 16:
            greedy.append(int(model(torch.tensor([[greedy[-1]]]), [cache])[0].argmax()))
    assert fast == greedy
