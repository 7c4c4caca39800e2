"""The native CPU decode-attention kernel (model/native) against the PyTorch path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from codecomplete.model import native
from codecomplete.model.transformer import SeqKV, attend

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: {native.error()}")


def each_way(request, switch, tiles: str):
    """A fixture's body for a kernel with two ways on a CPU with AMX: "default" leaves ``switch``
    as the machine set it, ``tiles`` turns the AMX way on, any other param turns it off (skipped
    where the CPU has only one way); the switch is restored after the test."""
    if request.param != "default" and not (native.available() and native.amx_cpu()):
        pytest.skip("one way on this machine")
    before = switch()
    if request.param != "default":
        switch(request.param == tiles)
    yield request.param
    switch(before)


@pytest.fixture(params=["default", "amx", "avx512", "fma"])
def attention_kernel(request, monkeypatch):
    """Attention's products as this machine runs them, and each way on its own where both exist
    (AMX tiles or AVX-512 dot products; decode_attention.c), and on an AVX512-BF16 CPU whose
    build takes the dot products, its bf16 pairs through FMAs (the build loaded with
    CODECOMPLETE_LINEAR=panels, as where vdpbf16ps is slow): each must give every row the bits
    of a one-token step."""
    if request.param == "fma":
        swap_in(request.getfixturevalue("panels_build"), monkeypatch, 3)
        yield request.param
        return
    yield from each_way(request, native.amx_attention, "amx")


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
def test_kernel_matches_torch_path(heads, kv_heads, head_dim, kv_dtype, attention_kernel):
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
@pytest.mark.parametrize("s", [9, 30])
def test_several_new_tokens_causal_or_masked(masked, kv_dtype, s, attention_kernel):
    """Verification-sized steps (S new tokens per sequence): causal without a mask, or a
    random mask over cache and new tokens (each row sees itself, as a tree mask does).
    3 x 30 query rows a KV head take six tiles of 16 on AMX."""
    torch.manual_seed(1)
    lengths = [0, 7, native.CHUNK - 3, 2 * native.CHUNK + 5]
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
    mine = random_caches(2, 64, lengths, kv_dtype, new=s)
    ref = random_caches(2, 64, lengths, kv_dtype, new=s)
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
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 6, 2), (128, 7, 1), (32, 6, 2)])
def test_a_pass_gives_each_row_the_bits_of_its_own_step(head_dim, heads, kv_heads, kv_dtype, attention_kernel):
    """Attention alone, fp32 outputs (no bf16 rounding to hide a last bit): each row of a causal
    pass of 16 new tokens equals, bit for bit, a one-token call at that row's position, for caches
    ending anywhere in a chunk, in particular where the pass's chunk is full and the step's ends in
    a partial block of 16 positions (1013 + 4 < 1024 <= 1013 + 16).  (The generic kernel's loops
    over a chunk's positions once ended in compiler-made scalar tails, which round otherwise than
    the vector body, so a step's last positions and a pass's differed: speculation in bf16 on an
    AVX2 CPU then left greedy output, 3 of 4 tasks identical.  Later the exp of a full block and of
    the padded last one were two inlined copies that could round otherwise: a last bit in a few rows
    in a thousand.)  Seven query heads a KV head: rows that the kernel takes three at a time fall
    into other groups in a step (7 rows) than in a pass (112)."""
    torch.manual_seed(head_dim)
    s = 16
    for length in (5, 250, 1000, 1013, 1020, 1500):
        c = random_caches(kv_heads, head_dim, [length], kv_dtype, layers=1, new=s)[0]
        q = torch.randn(1, heads, s, head_dim)
        k, v = torch.randn(1, kv_heads, s, head_dim), torch.randn(1, kv_heads, s, head_dim)
        together = native.decode_attention(q, k, v, [c], 0)
        for i in range(s):
            c.length = length + i
            alone = native.decode_attention(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], [c], 0)
            assert torch.equal(together[:, :, i], alone[:, :, 0]), (length, i)
        c.length = length


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


@needs_kernel
def test_the_sources_compiled_at_once_make_the_library_one_command_makes(tmp_path, monkeypatch):
    """``native_build`` compiles each source into an object, several at once where cores are
    free, then links: the library is the same bytes as one compiler command over every source
    makes."""
    import shutil
    import subprocess

    from codecomplete.model import native_build

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    one = tmp_path / "one.so"
    proc = subprocess.run([cc, *native_build.FLAGS, *map(str, native_build.SOURCES), "-o", str(one), "-lm"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert 1 <= native_build._jobs() <= len(native_build.SOURCES)  # here: the cores less one
    monkeypatch.setattr(native_build, "_jobs", lambda: len(native_build.SOURCES))
    at_once = tmp_path / "at_once.so"
    assert native_build._compile(cc, str(at_once)) == ""
    assert at_once.read_bytes() == one.read_bytes()
    failing, log = tmp_path / "cc", tmp_path / "runs"  # one source fails: its message, and no link
    failing.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                       'case "$*" in *linear.c*) echo "linear.c: boom" >&2; exit 1;; esac\n'
                       f'exec {cc} "$@"\n')
    failing.chmod(0o755)
    assert "linear.c: boom" in native_build._compile(str(failing), str(tmp_path / "failed.so"))
    runs = log.read_text().splitlines()
    assert len(runs) == len(native_build.SOURCES) and all(" -c " in r for r in runs)
    assert not (tmp_path / "failed.so").exists()
    silent = tmp_path / "silent-cc"  # a compiler that fails without a word fails the build all the same
    silent.write_text("#!/bin/sh\nexit 3\n")
    silent.chmod(0o755)
    for jobs in (1, len(native_build.SOURCES)):
        monkeypatch.setattr(native_build, "_jobs", lambda jobs=jobs: jobs)
        got = native_build._compile(str(silent), str(tmp_path / "silent.so"))
        assert set(got.split("\n")) == {"exit status 3"}


def test_a_source_that_fails_to_compile_is_reported_and_leaves_nothing(tmp_path):
    """A source that does not compile: the build fails with the compiler's message, and no
    half-built library is left in the cache folder (the model keeps its PyTorch path).  The
    daemon's prebuild met the failure first: the compiler is not run a second time (nor, where the
    sources compile at once, the link)."""
    cc = tmp_path / "cc"
    calls = tmp_path / "calls"
    cc.write_text(f'#!/bin/sh\necho run >> {calls}\n'
                  'case "$*" in *linear.c*) echo "linear.c: boom" >&2; exit 1;; esac\n'
                  'exec gcc "$@"\n')
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    code = ("from codecomplete.model import native_build\nnative_build.prebuild().join()\n"
            "from codecomplete.model import native\nprint(native.available(), '|', native.error())\n")
    env = dict(os.environ, CC=str(cc), CODECOMPLETE_NATIVE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    head, _, why = out.stdout.strip().partition(" | ")
    assert head == "False" and "linear.c: boom" in why
    assert list(cache.iterdir()) == []
    from codecomplete.model import native_build

    runs = 1 if native_build._jobs() == 1 else len(native._SOURCES)  # one command, or each source's compile
    assert calls.read_text().split() == ["run"] * runs
    # a library left half-built by a process that exited mid-compile is removed once stale
    stale, fresh = cache / "tmpabc123.so", cache / "tmpdef456.so"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")  # maybe another process's compile in progress: stays
    os.utime(stale, (1, 1))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in cache.iterdir()) == [fresh.name]


# --- the fused step ops and the native linear layer -------------------------------------------------

ACT = [torch.float32, torch.bfloat16]


@needs_kernel
@pytest.mark.parametrize("dtype", ACT, ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add+norm"])
def test_rms_norm_matches_the_module(dtype, residual):
    """HF Llama's order (normalise in fp32, round, scale); with a residual the sum is returned
    rounded exactly as PyTorch rounds ``x + h``."""
    from codecomplete.model.transformer import RMSNorm

    torch.manual_seed(2)
    norm = RMSNorm(200, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(200) * 0.5 + 1)
        x = (torch.randn(3, 5, 200) * 4).to(dtype)
        h = torch.randn(3, 5, 200).to(dtype)
        if residual:
            total, got = native.rms_norm(x, norm.weight, norm.eps, residual=h)
            assert torch.equal(total, x + h)
            want = norm(x + h)
        else:
            got, want = native.rms_norm(x, norm.weight, norm.eps), norm(x)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # within one bf16 rounding
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:  # the same roundings: mostly bit-identical
        assert (got == want).float().mean() > 0.95


@needs_kernel
@pytest.mark.parametrize("dtype", ACT, ids=["fp32", "bf16"])
def test_silu_mul_matches_torch(dtype):
    torch.manual_seed(3)
    gu = (torch.randn(4, 2, 2 * 96) * 6).to(dtype)
    gu[0, 0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # far tails and zeros
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = native.silu_mul(gu)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_kernel
def test_silu_lanes_and_tail_give_the_same_bits():
    """bf16 silu runs 16 lanes at a time and the rest of a row one by one: every bf16 gate, at a lane
    and in the tail, must give the same bits (the gate decides the roundings; the up factor comes after)."""
    gen = torch.Generator().manual_seed(4)
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ups = (torch.randn(gates.shape[0], generator=gen) * 3).to(torch.bfloat16)
    lane = torch.randint(0, 16, (gates.shape[0],), generator=gen)
    g = torch.randn(gates.shape[0], 17, generator=gen).to(torch.bfloat16)
    u = torch.randn(gates.shape[0], 17, generator=gen).to(torch.bfloat16)
    rows = torch.arange(gates.shape[0])
    g[rows, lane], g[:, 16] = gates, gates  # each gate at a lane of the vector part and as the tail
    u[rows, lane], u[:, 16] = ups, ups
    out = native.silu_mul(torch.cat([g, u], dim=1).view(-1, 1, 34))[:, 0]
    assert torch.equal(out[rows, lane].view(torch.int16), out[:, 16].view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["kv-fp32", "kv-bf16"])
@pytest.mark.parametrize("dtype", ACT, ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "tree-mask"])
@pytest.mark.parametrize("s", [5, 9])
def test_qkv_attention_matches_rope_then_attend(dtype, kv_dtype, masked, s):
    """Rotary embedding, cache writes and attention from the fused projection, at explicit
    (tree-depth) positions, against the PyTorch path: apply_rope, then the reference above.
    Nine new tokens make 27 query rows per KV head: with bf16 queries and keys the kernel then
    scores by bf16 pair dot products (16 rows or more), which this covers."""
    from codecomplete.model.transformer import ModelArgs, Transformer, apply_rope

    torch.manual_seed(4)
    h, kv, e = 6, 2, 64
    args = ModelArgs(vocab_size=10, dim=h * e, n_layers=3, n_heads=h, n_kv_heads=kv, head_dim=e, hidden_dim=8,
                     norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, qkv_bias=False, tie_embeddings=False,
                     max_positions=4096)
    model = Transformer(args).to(dtype)
    lengths = [0, 3, native.CHUNK + 9]
    parents = [-1, 0, 0, 1, 2, 1, 3, 6, 4][:s]  # a draft tree: row i's parent row
    depth, tree = [0] * s, torch.eye(s, dtype=torch.bool)
    for i, par in enumerate(parents[1:], 1):
        depth[i], tree[i] = depth[par] + 1, tree[par] | tree[i]
    positions = torch.tensor([[n + d for d in depth] for n in lengths])  # the tree's depths
    cos, sin = model.rope(positions)
    qkv = torch.randn(len(lengths), s, (h + 2 * kv) * e).to(dtype)
    masks = None
    if masked:
        masks = [torch.cat([torch.ones(s, n, dtype=torch.bool), tree], 1) for n in lengths]
        masks[0] = None
    mine = random_caches(kv, e, lengths, kv_dtype, new=s)
    ref = random_caches(kv, e, lengths, kv_dtype, new=s)
    for a, b in zip(mine, ref):
        b.k.copy_(a.k)
        b.v.copy_(a.v)
    got = native.qkv_attention(qkv, cos, sin, mine, 1, h, kv, masks)
    q, k, v = qkv.split([h * e, kv * e, kv * e], -1)
    q = apply_rope(q.view(len(lengths), s, h, e).transpose(1, 2), cos, sin)
    k = apply_rope(k.view(len(lengths), s, kv, e).transpose(1, 2), cos, sin)
    v = v.view(len(lengths), s, kv, e).transpose(1, 2)
    want = torch_decode(q, k, v, ref, layer=1, masks=masks).transpose(1, 2).reshape(len(lengths), s, h * e)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 2e-5 if dtype == kv_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for a, b in zip(mine, ref):  # the keys and values written are the PyTorch path's, rotary included
        if dtype == torch.bfloat16:  # the same roundings, bit for bit
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        else:  # fp32: the compiler may fuse x*cos + y*sin into one fma
            torch.testing.assert_close(a.k, b.k, atol=1e-6, rtol=1e-6)
            assert torch.equal(a.v, b.v)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (13, 70, True), (5, 33, True), (64, 1536, False)])
def test_native_linear_matches_f_linear(rows, n, k, bias):
    """The repacked layout with N and K padded, a bias, 1-7 input rows (groups of four and
    their tails), batch dimensions kept."""
    torch.manual_seed(5)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    x = torch.randn(1, rows, k).to(torch.bfloat16)
    got = native.linear(x, native.pack_linear(w), b, n)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, n)
    # fp32 sums in another order, rounded once to bf16: within a bf16 rounding of the exact sum
    torch.testing.assert_close(got.float(), want, atol=0.02 * want.abs().max().item(), rtol=1e-2)
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3


needs_amx = pytest.mark.skipif(not (native.available() and native.amx()), reason="no AMX tiles on this machine")


@needs_amx
@pytest.mark.parametrize("n,k,bias", [(960, 576, True), (13, 64, True), (48, 32, False), (64, 1536, False)])
def test_amx_linear_matches_f_linear_and_rows_stand_alone(n, k, bias):
    """The AMX layout (groups of 16 output rows, N padded to 32) with 1-40 input rows (one tile
    of up to 16 rows, then 16-row chunks and a remainder): within a bf16 rounding of the exact
    product, and each row's output bit for bit the same whatever the other rows are, so a
    verification pass's rows equal one-token steps' on AMX too."""
    torch.manual_seed(7)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    packed = native.pack_linear(w, amx=True)
    assert native.amx_layout(packed) and not native.amx_layout(native.pack_linear(w))
    x = torch.randn(40, k).to(torch.bfloat16)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    alone = torch.cat([native.linear(x[i:i + 1], packed, b, n) for i in range(40)])
    assert (alone.float() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3
    for rows in (2, 16, 17, 33, 40):
        got = native.linear(x[:rows].view(1, rows, k), packed, b, n)
        assert got.shape == (1, rows, n)
        assert torch.equal(got[0], alone[:rows])


@needs_kernel
def test_amx_layout_is_refused_where_it_cannot_hold_the_matrix():
    with pytest.raises(ValueError, match="multiple of 32"):
        native.pack_linear(torch.zeros(8, 70, dtype=torch.bfloat16), amx=True)
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert native.packed_rows(native.pack_linear(w, amx=True), 16) is None  # tiles go in pairs of 16 rows
    assert native.packed_rows(native.pack_linear(w, amx=True), 32).shape[0] == 2
    assert native.packed_rows(native.pack_linear(w, path=0), 16).shape[0] == 12  # groups of 4 rows
    panels = native.pack_linear(w, path=1)  # the AVX2 kernel's panels of 16 rows
    assert native.panel_layout(panels) and not native.panel_layout(native.pack_linear(w, path=0))
    assert native.packed_rows(panels, 8) is None and native.packed_rows(panels, 16).shape[0] == 3


@pytest.mark.parametrize("n,k", [(40, 64), (37, 70), (64, 96), (5, 32)])
def test_every_packed_layout_unpacks_to_the_same_weight(n, k):
    """``unpack_linear`` inverts ``pack_linear`` in each layout (the dense weight a model drops
    where the native copy serves comes back from it: ``Linear.dense``), padding dropped."""
    torch.manual_seed(n * k)
    w = torch.randn(n, k).to(torch.bfloat16)
    layouts = [native.pack_linear(w, path=0), native.pack_linear(w, path=1)]
    if k % 32 == 0:
        layouts.append(native.pack_linear(w, amx=True))
    for packed in layouts:
        back = native.unpack_linear(packed, n, k)
        assert back.shape == (n, k) and back.dtype == torch.bfloat16 and torch.equal(back, w)
        assert back.data_ptr() != packed.data_ptr()  # a copy: the packed weight stays as it was
        ids = torch.tensor([[0, n - 1, n // 2], [n - 1, 1 % n, 0]])  # repeated rows, a batch's shape
        assert torch.equal(native.lookup_rows(packed, ids, k), w[ids])


@needs_kernel
@pytest.mark.parametrize("n,k", [(40, 64), (37, 70), (49, 576), (5, 32)])
def test_native_row_lookup_matches_pytorch_indexing(n, k, monkeypatch):
    """step_ops.c's ``lookup_rows_bf16`` (the embedding's rows from a tied head's packed copy)
    gives PyTorch's indexing of every bf16 layout, for any ids (int32 too, every row, one), and
    refuses a row past the packed weight as the indexing does."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k).to(torch.bfloat16)
    layouts = [native.pack_linear(w, path=0), native.pack_linear(w, path=1)]
    if k % 32 == 0:
        layouts.append(native.pack_linear(w, amx=True))
    for packed in layouts:
        for ids in (torch.randint(0, n, (3, 17)), torch.arange(n, dtype=torch.int32), torch.tensor([n - 1])):
            fast = native.lookup_rows(packed, ids, k)
            with monkeypatch.context() as m:
                m.setattr(native, "available", lambda: False)  # PyTorch's indexing
                slow = native.lookup_rows(packed, ids, k)
            assert fast.shape == (*ids.shape, k) and torch.equal(fast, slow) and torch.equal(fast, w[ids.long()])
        with pytest.raises(IndexError):
            native.lookup_rows(packed, torch.tensor([0, packed.shape[0] * 64]), k)
        with pytest.raises(IndexError):
            native.lookup_rows(packed, torch.tensor([-1]), k)


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (13, 70), (40, 33), (8, 1)])
def test_native_linear_rows_have_the_bits_of_rows_alone(n, k):
    """Every row of a many-row product (1-70 rows: every tile shape, and past the AVX2 kernel's
    60-row chunks) has the bits of that row computed alone, so a verification pass's rows equal
    one-token steps'; partial panels and odd K included; and a weight packed for another build's
    kernel is refused instead of read as garbage."""
    torch.manual_seed(11)
    w, b = torch.randn(n, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    packed = native.pack_linear(w)
    x = torch.randn(70, k).to(torch.bfloat16)
    alone = torch.cat([native.linear(x[i:i + 1], packed, b, n) for i in range(70)])
    want = F.linear(x.float(), w.float(), b.float())
    assert (alone.float() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3
    for rows in (2, 3, 4, 5, 6, 8, 9, 13, 16, 61, 70):
        assert torch.equal(native.linear(x[:rows], packed, b, n), alone[:rows]), rows
    other = native.pack_linear(w, path=0 if native.panel_path() else 1)
    with pytest.raises(ValueError, match="another build"):
        native.linear(x[:1], other, b, n)


@needs_amx
def test_a_bf16_model_runs_its_matrices_on_amx_where_it_can():
    """Where the CPU has AMX, every matrix (the head's too) is packed for the tiles and the
    whole-step call uses them; a model with a matrix whose K is not a multiple of 32 keeps the
    AVX-512 layout throughout."""
    model = random_bf16_model(3, 0.08, tie=True, unit_norms=True, vocab_size=300, dim=128, n_layers=2, n_heads=4,
                              n_kv_heads=2, head_dim=32, hidden_dim=320)
    assert model.native_decode(True)
    assert model.native_stack.amx
    assert all(native.amx_layout(m.native_weight) for b in model.layers for m in (b.attn.wqkv, b.mlp.w2))
    assert native.amx_layout(model.head.native_weight)
    # long prompts: the pieces, faster than PyTorch's path (oneDNN on AMX) with attention on the tiles too
    assert model.native_prefill == native.amx_attention()
    odd = random_bf16_model(3, 0.08, tie=True, unit_norms=True, vocab_size=300, dim=128, n_layers=2, n_heads=4,
                            n_kv_heads=2, head_dim=32, hidden_dim=200)  # w2's K = 200: no AMX layout
    assert odd.native_decode(True)
    assert not odd.native_stack.amx and not native.amx_layout(odd.layers[0].attn.wqkv.native_weight)
    assert not odd.native_prefill  # the CPU has AMX: PyTorch's path, faster than the pieces with or without ours


def random_bf16_model(seed: int, std: float, tie: bool, unit_norms: bool, **dims):
    """A small bf16 Transformer with N(0, std) weights (qkv bias on), for the step tests."""
    from codecomplete.model.transformer import ModelArgs, Transformer

    torch.manual_seed(seed)
    args = ModelArgs(**dims, norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, qkv_bias=True, tie_embeddings=tie,
                     max_positions=512)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
        if unit_norms:
            for mod in model.modules():
                if hasattr(mod, "eps"):
                    mod.weight.fill_(1.0)
        if tie:
            model.head.weight = model.embed.weight
    return model.to(torch.bfloat16).eval()


@needs_kernel
def test_bf16_model_native_step_agrees_with_the_torch_path():
    """A bf16 model's prefill (40 rows), decode steps and a 6-token verification through the
    native kernels (every layer, the norm and the head in one call) against the same model in
    PyTorch, both fed the PyTorch path's greedy tokens: logits within bf16 noise, and the same
    greedy choice wherever PyTorch's best two logits are more than bf16 noise apart (a near-tie
    may break either way in bf16: ARCHITECTURE.md, exactness is tested in fp32)."""
    model = random_bf16_model(6, 0.08, tie=True, unit_norms=True, vocab_size=300, dim=128, n_layers=4, n_heads=4,
                              n_kv_heads=2, head_dim=32, hidden_dim=320)
    prompt = torch.randint(0, 300, (1, 40))

    def run(on: bool, feed: list[int] | None):
        assert model.native_decode(on) == on
        assert (model.layers[0].mlp.w13.native_weight is not None) == on
        assert (model.native_stack is not None) == on  # few-row steps: one call
        c = model.new_cache()
        toks, logits = [], []
        with torch.no_grad():
            out = model(prompt, [c])
            for i in range(12):
                logits.append(out.float())
                toks.append(int(out.argmax(-1)) if feed is None else feed[i])
                out = model(torch.tensor([[toks[-1]]]), [c])
            logits.append(model(torch.tensor([toks[:6]]), [c], logits_for="all").float()[0])
        return toks, logits

    toks, want = run(False, None)
    _, got = run(True, toks)
    decisive = 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
        top = b.topk(2, dim=-1).values
        sure = (top[..., 0] - top[..., 1]) > 0.05  # more than three bf16 steps at these logits
        assert torch.equal(a.argmax(-1)[sure], b.argmax(-1)[sure])
        decisive += int(sure.sum())
    assert decisive >= 15  # of 19 choices: the comparison is not vacuous


@needs_kernel
def test_whole_step_equals_layer_by_layer():
    """A step as one ``decode_stack`` call (every layer, the final norm and the head) against
    the same step through ``Block.forward`` (one native call per layer) and the native norm and
    head: identical logits and identical keys and values written, for decode steps of a batch
    and for a masked 5-token verification."""
    model = random_bf16_model(3, 0.1, tie=False, unit_norms=False, vocab_size=120, dim=96, n_layers=3, n_heads=6,
                              n_kv_heads=2, head_dim=16, hidden_dim=200)
    assert model.native_decode(True)
    lengths = [3, 40, 257]

    def caches():
        torch.manual_seed(4)
        out = []
        for n in lengths:
            c = model.new_cache(n + 8)
            c.k.normal_()
            c.v.normal_()
            c.length = n
            out.append(c)
        return out

    def layer_by_layer(tokens, cs, positions, masks):
        with torch.no_grad():
            cos, sin = model.rope(positions)
            x = model.embed(tokens)
            plan = native.StepCaches(cs)
            for i, block in enumerate(model.layers):
                x = block(x, cos, sin, i, plan, masks)
            for c in cs:
                c.length += tokens.shape[1]
            h = native.rms_norm(x, model.norm.weight, model.norm.eps)
            return native.linear(h, model.head.native_weight, None, model.args.vocab_size)

    for s, masked in ((1, False), (5, True)):
        tokens = torch.randint(0, 120, (3, s))
        positions = torch.tensor(lengths).view(3, 1) + torch.arange(s)
        masks = [torch.rand(s, n + s) > 0.3 if masked else None for n in lengths]
        for m in masks:
            if m is not None:
                m[:, -s:] |= torch.eye(s, dtype=torch.bool)
        one, per = caches(), caches()
        with torch.no_grad():
            got = model(tokens, one, positions, masks, logits_for="all")
        want = layer_by_layer(tokens, per, positions, [m.view(1, 1, *m.shape) if m is not None else None for m in masks])
        assert torch.equal(got, want)
        for a, b in zip(one, per):
            assert a.length == b.length and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@needs_kernel
def test_one_call_layer_equals_the_per_op_native_path():
    """``decode_layer`` (a whole block in C) against the same block through the separate
    native ops, batch of 3 one-token steps over caches of different lengths: identical output
    and identical keys and values written (the same kernels, in the same order)."""
    model = random_bf16_model(7, 0.1, tie=False, unit_norms=False, vocab_size=100, dim=96, n_layers=2, n_heads=6,
                              n_kv_heads=2, head_dim=16, hidden_dim=200)
    assert model.native_decode(True)
    block = model.layers[1]
    assert block.native_stack is not None
    lengths = [0, 5, 300]
    x = torch.randn(3, 1, 96).to(torch.bfloat16)
    cos, sin = model.rope(torch.tensor(lengths).view(3, 1))
    first = []
    for n in lengths:
        c = model.new_cache(n + 4)
        c.k.normal_()
        c.v.normal_()
        c.length = n
        first.append(c)
    second = []
    for c in first:
        d = model.new_cache(c.capacity)
        d.k.copy_(c.k)
        d.v.copy_(c.v)
        d.length = c.length
        second.append(d)
    saved = block.native_stack
    with torch.no_grad():
        one = block(x, cos, sin, 1, first, [None] * 3)
        block.native_stack = None  # the per-op native path
        try:
            per_op = block(x, cos, sin, 1, second, [None] * 3)
        finally:
            block.native_stack = saved
    assert torch.equal(one, per_op)
    for a, b in zip(first, second):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@needs_kernel
def test_bf16_rows_of_a_pass_do_not_depend_on_the_other_rows(attention_kernel):
    """In bf16 every row of a step is computed alone: the linear layers' sums and the
    attention's do not depend on how many rows a pass has or on what the other rows hold. Two
    verification passes whose trees share a path (same tokens at the same positions) but differ
    in every other node give that path's rows bit for bit the same logits, and those are the
    logits of one-token steps along the path (greedy decoding's)."""
    from codecomplete.model.speculate import Tree, tree_mask

    model = random_bf16_model(9, 0.08, tie=True, unit_norms=True, vocab_size=300, dim=128, n_layers=3, n_heads=4,
                              n_kv_heads=2, head_dim=64, hidden_dim=320)  # 64: the AVX-512 chunk kernel
    assert model.native_decode(True)
    prompt = torch.randint(0, 300, (1, 300))  # past one attention chunk
    path = [11, 22, 33, 44]
    with torch.no_grad():
        c = model.new_cache(400)
        root = int(model(prompt, [c]).argmax())
        start = c.length
        steps = torch.stack([model(torch.tensor([[t]]), [c])[0] for t in [root] + path])

        def verify(decoys: list[int]) -> torch.Tensor:
            tree, parent = Tree(), -1
            for d, (tok, other) in enumerate(zip(path, decoys), 1):  # a path node, then a decoy beside it
                tree.tokens += [tok, other]
                tree.parents += [parent, parent]
                tree.depths += [d, d]
                parent = len(tree.tokens) - 2
            c.length = start
            tokens = torch.tensor([[root] + tree.tokens])
            positions = torch.tensor([[start] + [start + d for d in tree.depths]])
            mask = tree_mask(tree, start, len(tree) + 1, "cpu")
            return model(tokens, [c], positions, [mask], logits_for="all")[0]

        one, two = verify([100, 101, 102, 103]), verify([200, 7, 250, 9])
    rows = [0, 1, 3, 5, 7]  # the root and the path
    assert torch.equal(one[rows], two[rows])
    assert not torch.equal(one[[2, 4, 6, 8]], two[[2, 4, 6, 8]])  # the decoys did differ
    assert torch.equal(one[rows], steps)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 32])
def test_bf16_tree_passes_give_every_node_the_bits_of_one_token_steps(head_dim, attention_kernel):
    """The property that makes bf16 speculation exactly greedy decoding: in a verification pass
    (a batch of random draft trees under their masks, caches ending anywhere around attention's
    chunk boundaries) and in a causal multi-token pass, every row's logits equal, bit for bit,
    those of one-token steps over its root and ancestors.  (Attention sums each row's visible
    positions as a step would: a row below a sibling is recomputed over its own positions.)
    head_dim 64 and 128 run the AVX-512 chunk kernel (products on AMX tiles or not), 32 the generic one."""
    from codecomplete.model.speculate import build_tree, tree_mask

    model = random_bf16_model(17, 0.08, tie=False, unit_norms=True, vocab_size=300, dim=128, n_layers=2, n_heads=4,
                              n_kv_heads=2, head_dim=head_dim, hidden_dim=256)
    assert model.native_decode(True)
    rng = torch.Generator().manual_seed(head_dim)

    def randint(hi: int, n: int = 1) -> list[int]:
        return torch.randint(0, hi, (n,), generator=rng).tolist()

    def copy(cache):
        out = model.new_cache(cache.capacity)
        out.k.copy_(cache.k)
        out.v.copy_(cache.v)
        out.length = cache.length
        return out

    checked = 0
    with torch.no_grad():
        for lengths in ((250, 3), (255, 511), (256, 40), (700, 497), (1, 1023)):
            bases, trees, roots = [], [], []
            for n in lengths:
                c = model.new_cache(n + 80)
                model(torch.tensor([randint(300, n)]), [c])
                bases.append(c)
                seqs = [(tuple(randint(6, 1 + randint(6)[0])), float(w)) for w in randint(9, 1 + randint(10)[0])]
                trees.append(build_tree(seqs, max_nodes=1 + randint(30)[0], max_depth=6))
                roots.append(randint(300)[0])
            width = 1 + max(len(t) for t in trees)
            tokens = torch.zeros(len(trees), width, dtype=torch.long)
            positions = torch.zeros(len(trees), width, dtype=torch.long)
            masks, caches = [], [copy(b) for b in bases]
            for b, (tree, root, c) in enumerate(zip(trees, roots, caches)):
                tokens[b, 0] = root
                tokens[b, 1:len(tree) + 1] = torch.tensor(tree.tokens)
                tokens[b, len(tree) + 1:] = root
                positions[b] = c.length
                positions[b, 1:len(tree) + 1] += torch.tensor(tree.depths)
                masks.append(tree_mask(tree, c.length, width, "cpu"))
            logits = model(tokens, caches, positions, masks, logits_for="all")
            for b, (tree, root, base) in enumerate(zip(trees, roots, bases)):
                # one-token steps along every node's path (a walk of the tree with a cache per node)
                kids = tree.children()
                stack = [(0, copy(base), root)]
                while stack:
                    row, cache, tok = stack.pop()
                    want = model(torch.tensor([[tok]]), [cache])[0]
                    assert torch.equal(logits[b, row], want), (lengths, b, row)
                    checked += 1
                    for ctok, child in kids[row].items():
                        stack.append((child, copy(cache), ctok))
            # a causal pass of several tokens against one-token steps
            toks = randint(300, 7)
            c = copy(bases[0])
            together = model(torch.tensor([toks]), [c], logits_for="all")[0]
            c = copy(bases[0])
            for i, t in enumerate(toks):
                assert torch.equal(together[i], model(torch.tensor([[t]]), [c])[0])
    assert checked >= 40


@needs_kernel
def test_bf16_batches_past_one_native_call_keep_every_rows_bits(attention_kernel):
    """A pass of more rows than one native call takes (sequences x tokens > STACK_ROWS: five
    draft trees of up to 20 nodes, or 70 one-token steps) gives each sequence, bit for bit,
    the logits it gets alone.  Such a pass ran through PyTorch's path before, whose sums round
    otherwise: a batch of five requests with one deep draft changed a greedy completion."""
    from codecomplete.model import native
    from codecomplete.model.speculate import Tree, tree_mask

    model = random_bf16_model(23, 0.08, tie=True, unit_norms=True, vocab_size=300, dim=128, n_layers=2, n_heads=4,
                              n_kv_heads=2, head_dim=64, hidden_dim=256)  # 64: the AVX-512 chunk kernel
    assert model.native_decode(True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (1, 20 + 37 * i), generator=gen) for i in range(70)]

    def prefilled(ps):
        out = []
        for p in ps:
            c = model.new_cache(p.shape[1] + 40)
            model(p, [c])
            out.append(c)
        return out

    with torch.no_grad():
        nodes = [3, 20, 0, 12, 7]
        trees = [Tree(torch.randint(0, 300, (n,), generator=gen).tolist(), list(range(-1, n - 1)),
                      list(range(1, n + 1))) for n in nodes]
        roots = torch.randint(0, 300, (5,), generator=gen).tolist()
        width = 1 + max(nodes)
        assert 5 * width > native.STACK_ROWS

        def pass_over(idx, caches):
            w = 1 + max(nodes[b] for b in idx)
            tokens = torch.tensor([[roots[b]] + trees[b].tokens + [roots[b]] * (w - 1 - nodes[b]) for b in idx])
            pad = [w - 1 - nodes[b] for b in idx]
            positions = torch.tensor([[c.length] + [c.length + d for d in trees[b].depths] + [c.length] * p
                                      for b, c, p in zip(idx, caches, pad)])
            masks = [tree_mask(trees[b], c.length, w, "cpu") for b, c in zip(idx, caches)]
            return model(tokens, caches, positions, masks, logits_for="all")

        together = pass_over(range(5), prefilled(prompts[:5]))
        for b in range(5):
            alone = pass_over([b], prefilled(prompts[b:b + 1]))[0]
            assert torch.equal(together[b, :nodes[b] + 1], alone), b
        tokens = torch.randint(0, 300, (70, 1), generator=gen)
        together = model(tokens, prefilled(prompts))
        for b in range(0, 70, 9):
            assert torch.equal(together[b], model(tokens[b:b + 1], prefilled(prompts[b:b + 1]))[0]), b


@needs_kernel
def test_long_bf16_prompt_runs_in_native_pieces(monkeypatch):
    """A bf16 prompt runs through the native step in pieces of ``native.PREFILL_ROWS`` rows,
    each attending to the cache and to itself: the same logits and caches, bit for bit, as
    calling the model piece by piece and as pieces of another multiple of 32 rows, and within
    bf16 noise of PyTorch's path over the whole prompt (the same greedy choice where PyTorch's
    best two logits are more than bf16 noise apart)."""
    model = random_bf16_model(11, 0.08, tie=True, unit_norms=True, vocab_size=300, dim=128, n_layers=3, n_heads=4,
                              n_kv_heads=2, head_dim=32, hidden_dim=320)
    step = native.PREFILL_ROWS
    n = step + 200  # two pieces, the second one partial
    assert n <= model.args.max_positions
    prompt = torch.randint(0, 300, (1, n))

    def whole(on: bool, logits_for: str, positions=None):
        assert model.native_decode(on) == on
        model.native_prefill = on  # native_decode's default depends on the CPU
        c = model.new_cache(n + 4)
        with torch.no_grad():
            out = model(prompt, [c], positions, logits_for=logits_for)
        return out, c

    def by_hand():
        assert model.native_decode(True)
        model.native_prefill = True
        c = model.new_cache(n + 4)
        with torch.no_grad():
            outs = [model(prompt[:, i:i + step], [c], logits_for="all") for i in range(0, n, step)]
        return torch.cat(outs, dim=1), c

    got, c1 = whole(True, "all")
    want, c2 = by_hand()
    assert got.shape == (1, n, 300) and torch.equal(got, want)
    assert c1.length == c2.length == n and torch.equal(c1.k[:, :, :n], c2.k[:, :, :n])
    assert torch.equal(c1.v[:, :, :n], c2.v[:, :, :n])
    last, _ = whole(True, "last")
    assert torch.equal(last, got[:, -1])
    placed, _ = whole(True, "all", torch.arange(n).unsqueeze(0))  # explicit positions, cut with the pieces
    assert torch.equal(placed, got)
    monkeypatch.setattr(native, "PREFILL_ROWS", 64)  # smaller pieces, still a multiple of 32: the same bits
    small, _ = whole(True, "all")
    assert torch.equal(small, got)
    monkeypatch.setattr(native, "PREFILL_ROWS", step)
    ref, c3 = whole(False, "all")  # PyTorch over the whole prompt
    torch.testing.assert_close(got.float(), ref.float(), atol=0.1, rtol=0.05)
    torch.testing.assert_close(c1.k[:, :, :n].float(), c3.k[:, :, :n].float(), atol=0.05, rtol=0.05)
    top = ref.float().topk(2, dim=-1).values
    sure = (top[..., 0] - top[..., 1]) > 0.05
    assert int(sure.sum()) >= n // 2
    assert torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])


@needs_kernel
@pytest.mark.parametrize("start", [0, 77])
def test_warm_pieces_give_the_bits_of_the_requests_own_prefill(start):
    """Guards warm-ups in timed pieces (engine.PieceClock): a prompt prefilled from ``start``
    (where the store's match ends) in pieces of 32, 64 or 96 rows, as a warm-up runs it, leaves
    the KV, bit for bit, that the request's own prefill from there leaves (pieces of
    ``native.PREFILL_ROWS``), and the last row's logits are the same."""
    model = random_bf16_model(12, 0.08, tie=True, unit_norms=True, vocab_size=300, dim=128, n_layers=3, n_heads=4,
                              n_kv_heads=2, head_dim=32, hidden_dim=320)
    assert model.native_decode(True)
    model.native_prefill = True
    n = native.PREFILL_ROWS + 90
    prompt = torch.randint(0, 300, (1, n))

    def run(piece: int | None):
        c = model.new_cache(n + 4)
        with torch.no_grad():
            if start:
                model(prompt[:, :start], [c])
            if piece is None:
                last = model(prompt[:, start:], [c])
            else:
                for i in range(start, n, piece):
                    last = model(prompt[:, i:i + piece], [c])
        return last, c

    want, ref = run(None)
    for piece in (32, 64, 96):
        got, c = run(piece)
        assert c.length == ref.length == n
        assert torch.equal(c.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(c.v[:, :, :n], ref.v[:, :, :n]), piece
        assert torch.equal(got, want), piece


needs_greedy_head = pytest.mark.skipif(not native.greedy_head_available(),
                                       reason="the greedy head needs AVX2 + FMA or AVX512-VNNI and AVX512-BF16")


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """A build of the kernels for AVX2 + FMA (``-march=haswell``: the panel layout, the greedy head
    on vpmaddwd), compiled once for the module: on a CPU with AVX512-BF16 that code is otherwise
    never run here.  Skips where it cannot run or is this machine's build already."""
    import platform
    import shutil

    from codecomplete.model.loader import cpu_flags

    if platform.machine() not in ("x86_64", "AMD64") or not shutil.which("gcc"):
        pytest.skip("needs gcc on x86-64")
    if not {"avx2", "fma", "bmi2", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    if native.linear_bf16_path() == 1:
        pytest.skip("this machine's build is the AVX2 build")
    flags = ["-march=haswell" if f == "-march=native" else f for f in native._FLAGS]
    out = tmp_path_factory.mktemp("avx2") / "lib-haswell.so"
    proc = subprocess.run(["gcc", *flags, *map(str, native._SOURCES), "-o", str(out), "-lm"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def panels_build(tmp_path_factory):
    """This machine's build loaded a second time with CODECOMPLETE_LINEAR=panels: on an AVX512-BF16
    CPU whose own choice is the dot products (linear.c's linear_choose), the panels on 512-bit tiles
    (path 3) are otherwise never run here.  Skips where this build has no such choice or takes it."""
    if not native.available() or native.amx():
        pytest.skip("no native kernels, or AMX tiles take every product")
    if native.linear_bf16_path() == 3:
        pytest.skip("this machine's build runs the panels on 512-bit tiles already")
    if native.linear_bf16_path() != 2:
        pytest.skip("a build without AVX512-BF16 has no dot products to swap for panels")
    out = tmp_path_factory.mktemp("panels") / "lib-panels.so"
    load_with_panels(out)
    return out


def load_with_panels(out: Path):
    """This machine's build copied to ``out`` and loaded there with CODECOMPLETE_LINEAR=panels
    (another file is loaded anew, so its constructor reads the switch); the switch is restored."""
    import ctypes
    import os
    import shutil

    shutil.copy(native._lib._name, out)
    old = os.environ.get("CODECOMPLETE_LINEAR")
    os.environ["CODECOMPLETE_LINEAR"] = "panels"
    try:
        return ctypes.CDLL(str(out))
    finally:
        os.environ.pop("CODECOMPLETE_LINEAR") if old is None else os.environ.__setitem__("CODECOMPLETE_LINEAR", old)


def swap_in(build: Path, monkeypatch, path: int = 1) -> None:
    """Load ``build`` in place of this machine's kernels for the rest of a test (models made after
    it pack their weights for its layout)."""
    import ctypes

    monkeypatch.setattr(native, "_lib", native.configure(ctypes.CDLL(str(build))))
    monkeypatch.setattr(native, "_path", None)
    monkeypatch.setattr(native, "_amx", None)
    assert native.linear_bf16_path() == path and not native.amx() and native.greedy_head_available()


@pytest.fixture(params=["default", "vpdpbusd", "tiles", "avx2", "panels"])
def greedy_bounds(request, monkeypatch):
    """The greedy head's int8 bounds as this machine computes them, each way on its own where
    both exist (AVX512-VNNI, or AMX's int8 tiles from 4 rows; linear.c), the AVX2 build's
    (vpmaddwd) on a CPU whose own build is another, and on an AVX512-BF16 CPU whose linear
    kernel is the dot products, the same build on the panels (path 3: its exact rows on them)."""
    if request.param in ("avx2", "panels"):
        swap_in(request.getfixturevalue(f"{request.param}_build"), monkeypatch, 1 if request.param == "avx2" else 3)
        yield request.param
        return
    yield from each_way(request, native.amx_greedy_head, "tiles")


@needs_greedy_head
def test_greedy_head_keeps_the_argmax_exactly(greedy_bounds, monkeypatch):
    """``greedy=True`` (the int8 copy of the head with its error bound): every logit it computes
    is the full head's, bit for bit; every maximum of the full head is among them (so the first
    index of the maximum, the greedy choice, is the same, ties included); and most of the
    vocabulary is skipped (-inf).  Steps of 1-16 rows, batches, a vocabulary that is not a
    multiple of 16 (an odd number of 16-row groups: the tiles' last pair is one group), an outlier
    in the hidden state, and two identical head rows made to win (an exact tie)."""
    model = random_bf16_model(13, 0.08, tie=False, unit_norms=True, vocab_size=1003, dim=128, n_layers=2, n_heads=4,
                              n_kv_heads=2, head_dim=32, hidden_dim=320)
    with torch.no_grad():
        model.norm.weight[5] = 12.0  # one large dimension in the normalised state, as real models have
        tied = model.head.weight[900].float() * 3
        model.head.weight[900] = tied.to(torch.bfloat16)
        model.head.weight[17] = tied.to(torch.bfloat16)  # identical to row 900: a tie the first index must win
    assert model.native_decode(True) and model.native_stack.qhead is not None
    for name in ("GREEDY_HEAD_ROWS", "GREEDY_HEAD_ROWS_AVX2"):  # every size through the greedy head, either way
        monkeypatch.setattr(native, name, 16)
    torch.manual_seed(2)
    checked = ties = 0
    for bsz, s in ((1, 1), (1, 2), (1, 4), (3, 1), (2, 2), (1, 7), (1, 16), (4, 4), (3, 5)):
        lengths = [int(n) for n in torch.randint(0, 200, (bsz,))]
        for trial in range(6):
            tokens = torch.randint(0, 1003, (bsz, s))
            positions = torch.tensor(lengths).view(bsz, 1) + torch.arange(s)
            out = {}
            for greedy in (False, True):
                caches = []
                torch.manual_seed(100 + trial)
                for n in lengths:
                    c = model.new_cache(n + s + 2)
                    c.k.normal_()
                    c.v.normal_()
                    c.length = n
                    caches.append(c)
                with torch.no_grad():
                    out[greedy] = model(tokens, caches, positions, logits_for="all", greedy=greedy).reshape(-1, 1003)
            full, got = out[False], out[True]
            kept = torch.isfinite(got)
            assert torch.equal(got[kept], full[kept])
            assert (got[~kept] == float("-inf")).all()
            at_max = full == full.max(dim=-1, keepdim=True).values
            assert kept[at_max].all()
            assert torch.equal(got.float().argmax(-1), full.float().argmax(-1))
            assert kept.float().mean() < 0.5  # the bound is tight enough to skip most rows
            checked += full.shape[0]
            ties += int((at_max[:, 17] & at_max[:, 900]).sum())
    assert checked >= 300 and ties >= 3  # the tie was really exercised


def test_greedy_heads_int8_copy_is_the_same_built_in_row_chunks():
    """``pack_greedy_head`` builds the int8 copy a chunk of rows at a time (the whole head's float
    temporaries were most of the model load's peak memory): the copy and each row's scale are the
    same bits whatever the chunk, the error bound's norms the same up to float64 rounding."""
    torch.manual_seed(3)
    w = (torch.randn(100, 70) * torch.rand(100, 1) * 3).to(torch.bfloat16)
    w[7] = 0  # a zero row: scale 0
    whole = native.pack_greedy_head(w, chunk=1 << 20)[1]
    for chunk in (16, 32, 48):
        got = native.pack_greedy_head(w, chunk=chunk)[1]
        assert [t.shape for t in got] == [t.shape for t in whole]
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1])
        assert torch.allclose(got[2], whole[2], rtol=1e-6) and torch.allclose(got[3], whole[3], rtol=1e-6)
    bad = w.clone()
    bad[90, 3] = float("nan")
    assert native.pack_greedy_head(bad, chunk=16) is None


@needs_greedy_head
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_greedy_head_is_off_where_it_would_not_help_or_is_not_wanted(build, request, monkeypatch):
    """More logit rows than ``native.greedy_head_rows`` (4; 16 on AMX's int8 tiles, 2 on an AVX2
    build), ``greedy_head`` off, or greedy not asked for: every logit is computed."""
    if build == "avx2":
        swap_in(request.getfixturevalue("avx2_build"), monkeypatch)
    model = random_bf16_model(5, 0.08, tie=True, unit_norms=True, vocab_size=500, dim=64, n_layers=1, n_heads=2,
                              n_kv_heads=1, head_dim=32, hidden_dim=128)
    assert model.native_decode(True)

    def finite(s: int, greedy: bool) -> bool:
        c = model.new_cache(16)
        with torch.no_grad():
            return bool(torch.isfinite(model(torch.randint(0, 500, (1, s)), [c], logits_for="all", greedy=greedy)).all())

    assert not finite(1, True)
    most = native.greedy_head_rows(model.native_stack)
    tiles = native.amx() and native.amx_greedy_head()
    assert most == (native.GREEDY_HEAD_ROWS_AMX if tiles else native.GREEDY_HEAD_ROWS
                    if native._lib.head_greedy_vnni() else native.GREEDY_HEAD_ROWS_AVX2)
    assert not finite(most, True)
    assert finite(most + 1, True) and finite(1, False)
    model.greedy_head = False
    assert finite(1, True)


@pytest.mark.skipif(not __import__("shutil").which("gcc"), reason="needs gcc")
@pytest.mark.parametrize("march", ["x86-64-v2", "haswell", "skylake-avx512"])
def test_the_library_links_and_loads_without_avx512_bf16(tmp_path, march):
    """The kernels' CPU-specific parts have fallbacks: a build for a CPU without AVX512-BF16/VNNI
    (AVX2 laptops, Skylake servers) must load, or such CPUs silently lose every native kernel.
    Where this CPU can run the build, its bf16 linear kernel (portable loop, AVX2 + FMA, or
    AVX-512F without BF16) must match an fp32 reference, and every row of a many-row call must
    have the bits of that row alone (a decode step's), for K and N that are and are not
    multiples of the kernel's blocks."""
    import ctypes
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets")
    flags = [f"-march={march}" if f == "-march=native" else f for f in native._FLAGS]
    out = tmp_path / f"lib-{march}.so"
    proc = subprocess.run(["gcc", *flags, *map(str, native._SOURCES), "-o", str(out), "-lm"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lib = ctypes.CDLL(str(out))  # an undefined symbol fails here
    # without AVX512-BF16: the portable loop, or AVX2 + FMA (haswell and skylake-avx512 have both),
    # whose greedy head bounds the logits with vpmaddwd
    simd = march != "x86-64-v2"
    # skylake-avx512: the same panels on 512-bit tiles (path 3)
    assert lib.head_greedy_native() == simd
    assert lib.linear_bf16_path() == (3 if march == "skylake-avx512" else int(simd))
    for name in ("decode_stack", "decode_attention", "argmax_bf16", "silu_mul", "head_greedy_team"):
        assert hasattr(lib, name)
    needs = {"x86-64-v2": {"sse4_2"}, "haswell": {"avx2", "fma", "bmi2", "f16c"},
             "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}[march]
    from codecomplete.model.loader import cpu_flags

    if not needs <= cpu_flags():
        return  # linked and loaded; this CPU cannot run its code
    ptr = ctypes.c_void_p
    lib.linear_bf16.restype = None
    lib.linear_bf16.argtypes = [ctypes.c_int] * 3 + [ptr] * 4
    torch.manual_seed(0)
    for n, k in ((37, 64), (64, 576), (13, 70), (8, 31)):
        w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
        wp = native.pack_linear(w, path=lib.linear_bf16_path())
        x = torch.randn(7, k).bfloat16()

        def run(rows):
            y = torch.empty(len(rows), n, dtype=torch.bfloat16)
            lib.linear_bf16(len(rows), n, k, rows.data_ptr(), wp.data_ptr(), b.data_ptr(), y.data_ptr())
            return y

        y = run(x)
        ref = x.float() @ w.float().T + b.float()
        torch.testing.assert_close(y.float(), ref, atol=0.03 * ref.abs().max().item(), rtol=0.02)
        assert torch.equal(y, torch.cat([run(x[i:i + 1].clone()) for i in range(len(x))])), (march, n, k)


@needs_kernel
def test_wide_panels_have_the_avx2_panels_bits(avx2_build, tmp_path):
    """The panels on 512-bit tiles (path 3: two panels a vector) give every output the bits the
    AVX2 build's 256-bit tiles give it (each output one chain of FMAs over k in order), for any
    number of rows (each tile shape, a pair and an odd last panel, the prefetching runs of 3-4
    blocks, more than PANEL_XROWS rows), odd K and N, with and without a bias."""
    import ctypes

    from codecomplete.model.loader import cpu_flags

    if not {"avx512f", "avx2", "fma"} <= cpu_flags():
        pytest.skip("needs AVX-512F")
    if native.linear_bf16_path() == 3:
        wide = native._lib
    elif native.linear_bf16_path() == 2:
        wide = load_with_panels(tmp_path / "lib-wide.so")
    else:
        pytest.skip("this build has no 512-bit panels")
    narrow = ctypes.CDLL(str(avx2_build))
    for lib in (wide, narrow):
        lib.linear_bf16.restype = None
        lib.linear_bf16.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4
    assert wide.linear_bf16_path() == 3 and narrow.linear_bf16_path() == 1
    torch.manual_seed(3)
    for n, k in ((37, 64), (64, 576), (13, 70), (8, 31), (96, 1536), (160, 33), (300, 128)):
        w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
        wp = native.pack_linear(w, path=1)
        for m in (1, 2, 3, 4, 5, 6, 8, 9, 13, 16, 17, 25, 64, 70):
            x = torch.randn(m, k).bfloat16()
            for bias in (b, None):
                ys = []
                for lib in (wide, narrow):
                    y = torch.empty(m, n, dtype=torch.bfloat16)
                    lib.linear_bf16(m, n, k, x.data_ptr(), wp.data_ptr(), bias.data_ptr() if bias is not None else None,
                                    y.data_ptr())
                    ys.append(y)
                assert torch.equal(ys[0], ys[1]), (n, k, m, bias is None)
        ref = x.float() @ w.float().T
        torch.testing.assert_close(ys[0].float(), ref, atol=0.03 * ref.abs().max().item(), rtol=0.02)


@needs_kernel
def test_linear_leaves_no_memory_behind_per_thread():
    """The AVX2 kernel keeps a per-thread fp32 copy of the input rows; a thread that exits frees
    it (a server may run each request on a thread of its own). Measured before the fix: 100
    threads of 60 x 1536 rows left ~72 MB behind."""
    import threading

    w = torch.randn(64, 1536).to(torch.bfloat16)
    packed, x = native.pack_linear(w), torch.randn(60, 1536).to(torch.bfloat16)

    def rss_kb() -> int:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])

    native.linear(x, packed, None, 64)
    before = rss_kb()
    for _ in range(100):
        t = threading.Thread(target=native.linear, args=(x, packed, None, 64))
        t.start()
        t.join()
    assert rss_kb() - before < 20_000
