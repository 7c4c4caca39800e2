"""Packed weights on transparent huge pages (native.huge_empty / huge_views)."""

import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from codecomplete.model import native


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside, flags = False, []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
    return flags


def test_copies_keep_values_shapes_and_alignment():
    torch.manual_seed(0)
    ts = [torch.randn(300, 577).to(torch.bfloat16), torch.randn(5, 3), torch.randn(2048, 1024).to(torch.bfloat16)]
    out = native.huge_views(ts)
    for view, t in zip(out, ts):
        view.copy_(t)
    for a, b in zip(ts, out):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous() and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0
    # one buffer, in order, not overlapping
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in out]
    assert all(e <= n.data_ptr() for e, n in zip(ends, out[1:]))
    if native.huge_pages():
        assert out[0].data_ptr() % native.HUGE_PAGE == 0


def test_small_or_switched_off_buffers_are_plain(monkeypatch):
    small = native.huge_empty((16, 16), torch.float32)
    assert small.shape == (16, 16) and small.dtype == torch.float32
    monkeypatch.setenv("CODECOMPLETE_HUGE_PAGES", "0")
    assert not native.huge_pages()
    big = native.huge_empty((1024, 1024), torch.float32)
    assert big.shape == (1024, 1024) and big.untyped_storage().nbytes() == 1024 * 1024 * 4


@pytest.mark.skipif(platform.system() != "Linux" or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                    reason="madvise's huge-page advice needs a Linux kernel built with transparent huge pages")
def test_a_large_buffer_is_advised_for_huge_pages(monkeypatch):
    """The mapping that holds a large huge_empty buffer carries the huge-page advice ("hg"), so the
    kernel may back it with 2 MB pages (whether it does depends on its THP setting and free memory)."""
    monkeypatch.delenv("CODECOMPLETE_HUGE_PAGES", raising=False)
    t = native.huge_empty((3 * native.HUGE_PAGE,), torch.uint8)
    t.fill_(1)
    assert t.data_ptr() % native.HUGE_PAGE == 0
    assert "hg" in vm_flags(t.data_ptr())
    # switched off: no advice at all (the mapping's flags are not the test here: glibc may hand out
    # heap memory an earlier, freed huge buffer advised, and its "hg" stays with the heap)
    advised = []
    monkeypatch.setattr(native, "_libc", SimpleNamespace(madvise=lambda *a: advised.append(a) or 0))
    monkeypatch.setenv("CODECOMPLETE_HUGE_PAGES", "0")
    plain = native.huge_empty((3 * native.HUGE_PAGE,), torch.uint8)
    plain.fill_(1)
    assert not advised and plain.untyped_storage().nbytes() == 3 * native.HUGE_PAGE
    monkeypatch.delenv("CODECOMPLETE_HUGE_PAGES")
    native.huge_empty((3 * native.HUGE_PAGE,), torch.uint8)
    assert len(advised) == 1  # the spy sees the advice when it is on


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
def test_native_model_steps_run_on_the_huge_buffer(monkeypatch):
    """A bf16 model's packed weights all live in one huge_views buffer, and its native steps give
    the logits of a model packed on plain pages."""
    from codecomplete.model.transformer import ModelArgs, Transformer

    args = ModelArgs(vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                     norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, qkv_bias=False, tie_embeddings=False,
                     max_positions=128)
    torch.manual_seed(0)
    model = Transformer(args).to(torch.bfloat16)
    logits = {}
    for env in ("0", "1"):
        monkeypatch.setenv("CODECOMPLETE_HUGE_PAGES", env)
        if not model.native_decode(True) or model.native_stack is None:
            pytest.skip("no native bf16 stack on this machine")
        ws = [m.native_weight for m in model.modules() if getattr(m, "native_weight", None) is not None]
        ptrs = sorted(w.data_ptr() for w in ws)
        span = ptrs[-1] - ptrs[0]
        assert span < sum(w.numel() * w.element_size() + 64 for w in ws)  # one buffer, back to back
        c = model.new_cache()
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4, 5]]), [c])
            logits[env] = model(torch.tensor([[6]]), [c]).float()
    assert torch.equal(logits["0"], logits["1"])
