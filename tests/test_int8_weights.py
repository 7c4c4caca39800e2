"""int8 layer weights (``model.weights = "int8"``): ``native.pack_linear_q8``'s layout, the
``linear_q8`` kernel (linear.c), a model whose native stack runs on them, the packed weights'
cache and the engine's setting."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

from codecomplete.model import native, packcache
from codecomplete.model.api import CompletionRequest, EngineSettings, SpecSettings
from codecomplete.model.engine import Engine, generate
from codecomplete.model.loader import load_model
from tests.test_native import random_bf16_model

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: {native.error()}")
needs_stack = pytest.mark.skipif(not native.available() or not native.linear_bf16_simd(),
                                 reason="the native bf16 stack is not built here")


def dequantized(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 values [n, k] and scales [n] that ``pack_linear_q8`` laid out, read back by hand."""
    q = packed[:, :k * 16].reshape(-1, k, 16).transpose(1, 2).reshape(-1, k)[:n]
    scale = packed[:, k * 16:].contiguous().view(torch.float32).reshape(-1)[:n]
    return q, scale


@pytest.mark.parametrize("n,k", [(40, 64), (37, 70), (3072, 576), (5, 1)])
def test_the_int8_layout_holds_each_row_to_within_half_its_scale(n, k):
    """Each row's values are round(w / s) with s = max |w| / 127 of the row, so within s / 2 of the
    weight (and the row's largest exactly); an all-zero row gets scale 1 and zeros; padding rows
    are zero; ``unpack_linear`` and ``lookup_rows`` give q s rounded to bf16; ``packed_rows``
    starts at panels of 16 rows."""
    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * torch.rand(n, 1)).to(torch.bfloat16)
    w[n // 2] = 0
    packed = native.pack_linear_q8(w)
    assert native.q8_layout(packed) and not native.q8_layout(native.pack_linear(w))
    assert packed.shape == (-(-n // 16), k * 16 + 64) and packed.dtype == torch.int8
    assert packed.shape == native.q8_shape(n, k).shape
    q, scale = dequantized(packed, n, k)
    wf = w.float()
    want = wf.abs().amax(1) / 127
    assert torch.equal(scale[n // 2], torch.tensor(1.0)) and not q[n // 2].any()
    live = want > 0
    torch.testing.assert_close(scale[live], want[live])
    assert (q.abs() <= 127).all() and (q.abs().amax(1)[live] == 127).all()
    assert ((q.float() * scale[:, None] - wf).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()  # fp32 slack
    pad = packed[:, :k * 16].reshape(-1, k, 16).transpose(1, 2).reshape(-1, k)[n:]
    assert not pad.any()
    back = native.unpack_linear(packed, n, k)
    assert back.dtype == torch.bfloat16 and torch.equal(back, (q.float() * scale[:, None]).to(torch.bfloat16))
    ids = torch.tensor([[0, n - 1, n // 2], [n - 1, 1 % n, 0]])
    assert torch.equal(native.lookup_rows(packed, ids, k), back[ids])
    if n > 16:
        assert native.packed_rows(packed, 8) is None and native.packed_rows(packed, 16).shape[0] == packed.shape[0] - 1


@needs_kernel
@pytest.mark.parametrize("n,k,bias", [(960, 576, True), (13, 70, True), (40, 33, False), (8, 1, True),
                                      (64, 1536, False)])
def test_the_int8_kernel_computes_the_product_and_each_row_alone(n, k, bias):
    """``linear`` on the int8 layout: within a bf16 rounding of the exact product of the input and
    the int8 values times their scales (+ bias), and every row of a 1-70-row call (every tile
    shape, past the 60-row chunks) with the bits of that row computed alone: a verification
    pass's rows equal one-token steps' on int8 weights too."""
    torch.manual_seed(k)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    packed = native.pack_linear_q8(w)
    q, scale = dequantized(packed, n, k)
    x = torch.randn(70, k).to(torch.bfloat16)
    exact = (x.double() @ q.double().T) * scale.double() + (b.double() if bias else 0)
    alone = torch.cat([native.linear(x[i:i + 1], packed, b, n) for i in range(70)])
    assert alone.dtype == torch.bfloat16 and alone.shape == (70, n)
    assert (alone.double() - exact).abs().max() <= 2 ** -7 * exact.abs().max() + 1e-3
    for rows in (2, 3, 4, 5, 6, 7, 8, 13, 61, 70):
        assert torch.equal(native.linear(x[:rows].view(1, rows, k), packed, b, n)[0], alone[:rows]), rows
    # the quantization's own error against the bf16 weight: small against the product's size
    full = x.double() @ w.double().T + (b.double() if bias else 0)
    assert (alone.double() - full).abs().max() <= 0.02 * full.abs().max()


needs_amx = pytest.mark.skipif(not native.available() or not native.amx(), reason="no AMX tiles here")


@needs_amx
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 64), (40, 64)])
def test_int8_weights_multiply_on_amx_tiles_where_granted_as_exactly_as_the_panel_kernel(n, k):
    """Where the tiles are granted, int8 matrices whose K is a multiple of 32 multiply on them by
    default (``q8_team_amx``: every block widened to bf16): each of 1-40 rows (the one-chunk path of
    up to 16 rows, four panels at a time, and the chunked path past it, odd panel counts included)
    within a bf16 rounding of the exact int8 product and with the bits of that row alone; the panel
    kernel (the switch off) computes the same product to the same bound, in another order."""
    assert native.amx_int8()
    torch.manual_seed(n)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    packed = native.pack_linear_q8(w)
    q, scale = dequantized(packed, n, k)
    x = torch.randn(40, k).to(torch.bfloat16)
    exact = (x.double() @ q.double().T) * scale.double() + b.double()
    bound = 2 ** -7 * exact.abs().max() + 1e-3
    try:
        tiles = torch.cat([native.linear(x[i:i + 1], packed, b, n) for i in range(40)])
        assert (tiles.double() - exact).abs().max() <= bound
        for rows in (2, 4, 5, 15, 16, 17, 33, 40):
            assert torch.equal(native.linear(x[:rows].view(1, rows, k), packed, b, n)[0], tiles[:rows]), rows
        assert not native.amx_int8(False)
        panels = native.linear(x.view(1, 40, k), packed, b, n)[0]
        assert (panels.double() - exact).abs().max() <= bound
    finally:
        native.amx_int8(True)
    assert native.amx_int8()


@needs_amx
@pytest.mark.parametrize("env", [{"CODECOMPLETE_AMX_INT8": "0"}, {"CODECOMPLETE_AMX": "0"}, {}])
def test_the_amx_int8_kernel_is_on_unless_turned_off(env):
    """``CODECOMPLETE_AMX_INT8=0`` (or ``CODECOMPLETE_AMX=0``, all tiles) keeps int8 weights on the
    panel kernel, as measured against it (bench/results/int8_weights_amx_panels.md)."""
    code = "from codecomplete.model import native; print(native.amx_int8())"
    base = {key: v for key, v in os.environ.items() if key not in ("CODECOMPLETE_AMX_INT8", "CODECOMPLETE_AMX")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(base, **env), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("False" if env else "True")


@needs_stack
def test_a_model_on_int8_weights_runs_its_stack_on_them_and_keeps_passes_exact():
    """``native_decode(weights="int8")``: the layers' four matrices in the int8 layout, the head
    bf16, the stack told so; a decode step's logits within bf16 noise of PyTorch's path over the
    same int8 numbers (the unpacked weights), and a causal 6-token pass with every row's bits
    equal to one-token steps' (what keeps speculation exactly greedy decoding on these weights).
    Back to bf16 from the checkpoint's weights gives the bf16 model again."""
    model = random_bf16_model(6, 0.08, tie=True, unit_norms=True, vocab_size=300, dim=128, n_layers=3, n_heads=4,
                              n_kv_heads=2, head_dim=32, hidden_dim=320)
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules() if hasattr(m, "native_weight")}
    assert model.native_decode(True, weights="int8")
    assert model.weights == "int8" and model.native_stack.q8
    mats = [m for b in model.layers for m in (b.attn.wqkv, b.attn.wo, b.mlp.w13, b.mlp.w2)]
    assert all(native.q8_layout(m.native_weight) for m in mats)
    assert not native.q8_layout(model.head.native_weight)
    prompt = torch.randint(0, 300, (1, 30))
    toks = torch.randint(0, 300, (6,)).tolist()
    with torch.no_grad():
        c = model.new_cache(64)
        model(prompt, [c])
        base = c.length
        steps = []
        for t in toks:
            steps.append(model(torch.tensor([[t]]), [c])[0])
        c.length = base
        together = model(torch.tensor([toks]), [c], logits_for="all")[0]
        for i in range(6):
            assert torch.equal(together[i], steps[i]), i
        # PyTorch's path over the int8 numbers (what the weights unpack to)
        int8_dense = {id(m): native.unpack_linear(m.native_weight, m.out_features, m.in_features) for m in mats}
        assert not model.native_decode(False)
        for m in mats:
            m.weight = torch.nn.Parameter(int8_dense[id(m)], requires_grad=False)
        c = model.new_cache(64)
        model(prompt, [c])
        ref = model(torch.tensor([[toks[0]]]), [c])[0]
        torch.testing.assert_close(steps[0].float(), ref.float(), atol=0.1, rtol=0.05)
        # the checkpoint's weights back, packed as bf16: not the int8 model
        for name, m in model.named_modules():
            if name in dense:
                m.weight = torch.nn.Parameter(dense[name], requires_grad=False)
        assert model.native_decode(True, weights="bf16") and model.weights == "bfloat16"
        assert not any(native.q8_layout(m.native_weight) for m in mats)
    with pytest.raises(ValueError, match="int4"):
        model.native_decode(True, weights="int4")


@needs_stack
def test_int8_weights_go_through_the_packed_weights_cache_under_their_own_key(tiny_model, tmp_path, monkeypatch):
    """A load with int8 weights writes a cache file of its own (the bf16 load's is another); a
    later int8 load adopts it and computes what the first computed; a bf16 load is unchanged."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model, ckpt)
    monkeypatch.setattr(packcache, "folder", lambda: tmp_path / "packed")
    monkeypatch.delenv("CODECOMPLETE_PACK_CACHE", raising=False)
    req = CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=12)

    def load(weights):
        lm = load_model(str(ckpt), dtype="bfloat16", weights=weights)
        packcache.wait()
        return lm

    def outputs(lm):
        ids = generate(lm, req, EngineSettings(dtype="bfloat16")).token_ids
        with torch.no_grad():
            logits = lm.model(torch.tensor([[1, 2, 3, 100, 200, 300]]), [lm.model.new_cache(16)], logits_for="all")
        return tuple(ids), logits.float()

    plain = load("bf16")
    first = load("int8")
    assert first.model.weights == "int8" and plain.model.weights == "bfloat16"
    assert len(list((tmp_path / "packed").glob("*.pack"))) == 2
    later = load("int8")
    assert later.prepacked and later.model.weights == "int8"
    a, b = outputs(first), outputs(later)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    again = load("bf16")
    assert again.prepacked and again.model.weights == "bfloat16"
    c, d = outputs(plain), outputs(again)
    assert c[0] == d[0] and torch.equal(c[1], d[1])
    assert not torch.equal(a[1], c[1])  # the int8 model is another model


@needs_stack
def test_the_engine_serves_int8_weights_and_speculation_stays_exact_on_them():
    """The default model with ``weights="int8"``: the stats say so, completions come, retrieval
    speculation gives greedy decoding's output on these weights (the same text with it off), and
    a switch back to bf16 reloads the model."""
    prefix = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef fib2(n):\n"
    texts = {}
    for spec in (False, True):
        eng = Engine(EngineSettings(model="default", weights="int8", speculation=SpecSettings(enabled=spec))).start()
        try:
            assert eng.ready.wait(300) and eng.stats()["weights"] == "int8"
            c = eng.complete(CompletionRequest(prefix, "", max_tokens=40, max_lines=8, time_budget_ms=60000))
            assert c.stop_reason != "error" and c.generated_tokens > 0
            texts[spec] = c.text
            if spec:
                assert eng.stats()["spec_steps"] > 0
                eng.configure(EngineSettings(model="default", weights="bf16", speculation=SpecSettings(enabled=spec)))
                eng.complete(CompletionRequest("x = ", "", max_tokens=2))
                assert eng.stats()["weights"] == "bfloat16"
        finally:
            eng.close(30)
    assert texts[True] == texts[False]


def test_int8_weights_where_the_native_bf16_stack_does_not_run_are_refused_with_a_warning(tiny_model, caplog):
    """An fp32 model (or a GPU's, or no C compiler) has no int8 path: it loads and serves as its
    dtype says, reports so, and the log says why."""
    with caplog.at_level("WARNING", logger="codecomplete.model.loader"):
        lm = load_model(str(tiny_model), dtype="float32", weights="int8")
    assert lm.model.weights == "float32"
    assert any("int8 layer weights need the native bf16 stack" in r.getMessage() for r in caplog.records)
    assert generate(lm, CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=4),
                    EngineSettings(dtype="float32")).stop_reason != "error"


@needs_amx
@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_the_amx_int8_widening_without_vbmi_gives_the_same_products(tmp_path):
    """An AMX CPU without AVX512-VBMI widens the int8 blocks with conversions instead of byte
    tables (linear.c's q8_widen): a build without VBMI, loaded beside this one, gives the products
    of the tiles bit for bit (the widening is exact either way), for a call of one row and of 20."""
    from codecomplete.model.loader import cpu_flags

    if "avx512vbmi" not in cpu_flags():
        pytest.skip("this build widens without VBMI already")
    flags = [*native._FLAGS, "-mno-avx512vbmi"]
    out = tmp_path / "lib-novbmi.so"
    proc = subprocess.run(["gcc", *flags, *map(str, native._SOURCES), "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lib = ctypes.CDLL(str(out))
    ptr = ctypes.c_void_p
    lib.q8_amx_set.restype = ctypes.c_int
    lib.q8_amx_set.argtypes = [ctypes.c_int]
    lib.linear_q8.restype = None
    lib.linear_q8.argtypes = [ctypes.c_int] * 3 + [ptr] * 4
    assert lib.q8_amx_set(1) == 1 and native.amx_int8()
    torch.manual_seed(3)
    n, k = 200, 576
    packed = native.pack_linear_q8(torch.randn(n, k).to(torch.bfloat16))
    b = torch.randn(n).to(torch.bfloat16)
    for rows in (1, 20):
        x = torch.randn(rows, k).to(torch.bfloat16)
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        lib.linear_q8(rows, n, k, x.data_ptr(), packed.data_ptr(), b.data_ptr(), y.data_ptr())
        assert torch.equal(y, native.linear(x.view(1, rows, k), packed, b, n)[0]), rows
