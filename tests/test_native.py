"""The native CPU decode-attention kernel (model/native) against the PyTorch path."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from codecomplete.model import native
from codecomplete.model.transformer import SeqKV, attend

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: {native.error()}")


def torch_decode(q, k, v, caches, layer, masks=None):
    """The reference: the model's PyTorch path for few new tokens, one sequence at a time."""
    outs, s = [], q.shape[2]
    for b, c in enumerate(caches):
        n = c.length
        c.k[layer, :, n:n + s] = k[b]
        c.v[layer, :, n:n + s] = v[b]
        m = None if masks is None or masks[b] is None else masks[b].view(1, 1, s, n + s)
        outs.append(attend(q[b:b + 1], c.k[layer, :, :n + s].unsqueeze(0), c.v[layer, :, :n + s].unsqueeze(0),
                           m, causal=s > 1))
    return torch.cat(outs)


def random_caches(kv_heads, head_dim, lengths, dtype, layers=3, new=9):
    args = SimpleNamespace(n_layers=layers, n_kv_heads=kv_heads, head_dim=head_dim)
    caches = []
    for n in lengths:
        c = SeqKV(args, n + new + (n % 5), dtype, "cpu")  # spare capacity differs per sequence
        c.k.normal_()
        c.v.normal_()
        c.length = n
        caches.append(c)
    return caches


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (14, 2, 64), (6, 2, 40)],
                         ids=["gqa3-64", "mha-128", "gqa7-64", "gqa3-40"])
def test_kernel_matches_torch_path(heads, kv_heads, head_dim, kv_dtype):
    """Lengths around the split-K chunk size, an empty cache, several sequences at once;
    the new K/V land in every cache exactly where the PyTorch path puts them."""
    torch.manual_seed(0)
    lengths = [0, 1, native.CHUNK - 1, native.CHUNK, native.CHUNK + 1, 3 * native.CHUNK + 17]
    q = torch.randn(len(lengths), heads, 1, head_dim)
    k = torch.randn(len(lengths), kv_heads, 1, head_dim)
    v = torch.randn(len(lengths), kv_heads, 1, head_dim)
    mine = random_caches(kv_heads, head_dim, lengths, kv_dtype)
    ref = random_caches(kv_heads, head_dim, lengths, kv_dtype)
    for a, b in zip(mine, ref):
        b.k.copy_(a.k)
        b.v.copy_(a.v)
    got = native.decode_attention(q, k, v, mine, layer=1)
    want = torch_decode(q, k, v, ref, layer=1)
    assert got.shape == want.shape and got.dtype == q.dtype
    tol = 2e-5 if kv_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for a, b in zip(mine, ref):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert a.length == b.length  # the caller advances lengths, as in the model


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "tree-mask"])
def test_several_new_tokens_causal_or_masked(masked, kv_dtype):
    """Verification-sized steps (S new tokens per sequence): causal without a mask, or a
    random mask over cache and new tokens (each row sees itself, as a tree mask does)."""
    torch.manual_seed(1)
    lengths, s = [0, 7, native.CHUNK - 3, 2 * native.CHUNK + 5], 9
    q = torch.randn(len(lengths), 6, s, 64)
    k = torch.randn(len(lengths), 2, s, 64)
    v = torch.randn(len(lengths), 2, s, 64)
    masks = None
    if masked:
        masks = []
        for n in lengths:
            m = torch.rand(s, n + s) < 0.6
            m[:, n:] &= torch.ones(s, s, dtype=torch.bool).tril()
            m[torch.arange(s), n + torch.arange(s)] = True
            masks.append(m)
        masks[1] = None  # sequences without a mask in the same batch are causal
    mine = random_caches(2, 64, lengths, kv_dtype)
    ref = random_caches(2, 64, lengths, kv_dtype)
    for a, b in zip(mine, ref):
        b.k.copy_(a.k)
        b.v.copy_(a.v)
    got = native.decode_attention(q, k, v, mine, layer=2, masks=masks)
    want = torch_decode(q, k, v, ref, layer=2, masks=masks)
    tol = 2e-5 if kv_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for a, b in zip(mine, ref):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@needs_kernel
def test_a_full_cache_is_refused_not_overrun():
    caches = random_caches(2, 64, [20], torch.float32, new=0)
    caches[0].length = caches[0].capacity - 1
    q, kv = torch.randn(1, 4, 2, 64), torch.randn(1, 2, 2, 64)
    with pytest.raises(ValueError, match="reserve first"):
        native.decode_attention(q, kv, kv, caches, layer=0)


@needs_kernel
def test_one_sharp_key_wins():
    """Softmax over a long cache: a key far more similar than the rest gets all the weight."""
    caches = random_caches(1, 64, [1000], torch.float32)
    c = caches[0]
    c.k[0].mul_(0.01)
    q = torch.zeros(1, 1, 1, 64)
    q[..., 0] = 1.0
    c.k[0, 0, 700] = 0.0
    c.k[0, 0, 700, 0] = 800.0  # score 100 after the 1/sqrt(64) scale; the rest ~0
    target = c.v[0, 0, 700].clone()
    out = native.decode_attention(q, torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64), caches, layer=0)
    torch.testing.assert_close(out.view(64), target, atol=1e-4, rtol=1e-4)


def test_without_a_compiler_the_model_keeps_its_torch_path(tmp_path):
    """No C compiler (or a failing build): ``available()`` is False with the reason, the
    model reports the kernel off and still decodes; CODECOMPLETE_NATIVE=0 turns it off."""
    code = (
        "import torch\n"
        "from codecomplete.model import native\n"
        "from codecomplete.model.transformer import ModelArgs, Transformer\n"
        "args = ModelArgs(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48,\n"
        "                 norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, qkv_bias=False, tie_embeddings=False,\n"
        "                 max_positions=64)\n"
        "m = Transformer(args)\n"
        "on = m.native_decode(True)\n"
        "c = m.new_cache()\n"
        "with torch.no_grad():\n"
        "    m(torch.tensor([[1, 2, 3]]), [c]); logits = m(torch.tensor([[4]]), [c])\n"
        "print(native.available(), on, c.length, tuple(logits.shape), '|', native.error())\n")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), CODECOMPLETE_NATIVE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    head, _, why = out.stdout.strip().partition(" | ")
    assert head == "False False 4 (1, 50)" and "no-such-cc" in why
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, CODECOMPLETE_NATIVE="0"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False 4 (1, 50) | disabled by CODECOMPLETE_NATIVE=0"
