"""The packed weights' cache (model/packcache.py): a later load takes the native copies an
earlier load made, reads none of the linear weights, and computes what a load without the
cache computes; a changed checkpoint, a damaged or foreign file, a folder that cannot be
written: the load packs as before."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import torch

from codecomplete.model import native, packcache
from codecomplete.model.api import CompletionRequest, EngineSettings
from codecomplete.model.engine import generate
from codecomplete.model.loader import load_model
from codecomplete.model.transformer import Linear, _Tensors

REQ = CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=12)

pytestmark = pytest.mark.skipif(not native.available() or not native.linear_bf16_simd(),
                                reason="the native bf16 stack is not built here")


@pytest.fixture
def ckpt(tiny_model, tmp_path, monkeypatch):
    """A copy of the tiny checkpoint, and a packed weights' folder of this test's own."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_model, out)
    monkeypatch.setattr(packcache, "folder", lambda: tmp_path / "packed")
    monkeypatch.delenv("CODECOMPLETE_PACK_CACHE", raising=False)
    return out


@pytest.fixture
def reads(monkeypatch):
    """The checkpoint tensors each load reads (names)."""
    seen: list[str] = []
    real = _Tensors.__getitem__

    def spy(self, key):
        seen.append(key)
        return real(self, key)

    monkeypatch.setattr(_Tensors, "__getitem__", spy)
    return seen


def load(path):
    lm = load_model(str(path), dtype="bfloat16")
    packcache.wait()
    return lm


def outputs(lm) -> tuple:
    """What a load computes: a greedy completion's tokens, and a forward's logits of every row."""
    ids = generate(lm, REQ, EngineSettings(dtype="bfloat16")).token_ids
    with torch.no_grad():
        logits = lm.model(torch.tensor([[1, 2, 3, 100, 200, 300, 1000]]), [lm.model.new_cache(16)], logits_for="all")
    return tuple(ids), logits.float()


def same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


def packed_files(ckpt):
    where = packcache.folder()
    return sorted(where.glob("*.pack")) if where.is_dir() else []


def test_a_later_load_reads_the_packed_weights_and_computes_the_same(ckpt, reads, monkeypatch):
    monkeypatch.setenv("CODECOMPLETE_PACK_CACHE", "0")
    off = load(ckpt)
    assert not packed_files(ckpt)  # turned off: nothing written
    monkeypatch.delenv("CODECOMPLETE_PACK_CACHE")
    first = load(ckpt)
    assert first.model.native_stack is not None
    assert len(packed_files(ckpt)) == 1
    reads.clear()
    later = load(ckpt)
    assert later.prepacked and not first.prepacked and not off.prepacked
    # nothing of the linear layers (nor the embedding, tied to the head) was read from the checkpoint
    assert reads and not [k for k in reads if k.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight"))]
    assert {k for k in reads} >= {"model.norm.weight", "model.layers.0.input_layernorm.weight"}
    want = outputs(off)
    assert same(outputs(first), want) and same(outputs(later), want)
    # every dense weight a reader asks for is the checkpoint's, unpacked from the native copy
    plain = dict(off.model.named_modules())
    for name, mod in later.model.named_modules():
        if isinstance(mod, Linear):
            assert torch.equal(mod.weight, plain[name].weight), name
    assert later.model.embed.weight is later.model.head.weight  # still tied once read
    assert torch.equal(later.model.embed.weight, off.model.embed.weight)


def test_an_untied_head_and_its_embedding(ckpt, reads):
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    torch.manual_seed(0)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 0.01 * torch.randn_like(
        tensors["model.embed_tokens.weight"])
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (ckpt / "config.json").write_text(json.dumps(cfg))
    first = load(ckpt)
    assert first.model.head.weight is not first.model.embed.weight
    reads.clear()
    later = load(ckpt)
    assert "model.embed_tokens.weight" in reads and "lm_head.weight" not in reads
    assert same(outputs(later), outputs(first))
    assert torch.equal(later.model.head.weight, first.model.head.weight)


def test_a_changed_checkpoint_is_packed_again(ckpt, reads):
    from safetensors.torch import load_file, save_file

    load(ckpt)
    (before,) = packed_files(ckpt)
    stamp = before.stat().st_mtime_ns
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] *= 2
    time.sleep(0.01)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    reads.clear()
    changed = load(ckpt)
    assert "model.layers.1.mlp.down_proj.weight" in reads  # read again, not taken from the old pack
    (after,) = packed_files(ckpt)
    assert after == before and after.stat().st_mtime_ns != stamp  # the same entry, written anew
    plain = load_model(str(ckpt), dtype="bfloat16", native=False)  # PyTorch's path: no native copies at all
    assert torch.equal(changed.model.layers[1].mlp.w2.weight, plain.model.layers[1].mlp.w2.weight)
    reads.clear()
    later = load(ckpt)
    assert not [k for k in reads if k.endswith("proj.weight")]
    assert same(outputs(later), outputs(changed))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "header", "foreign key", "wrong shapes",
                                    "a folder", "read error"])
def test_a_damaged_or_foreign_file_is_packed_again(damage, ckpt, reads, caplog, monkeypatch):
    real_read_into = packcache._read_into
    want = outputs(load(ckpt))
    (path,) = packed_files(ckpt)
    data = path.read_bytes()
    n = int.from_bytes(data[8:16], "little")
    meta = json.loads(data[16:16 + n])
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "header":
        path.write_bytes(data[:16] + b"{not json" + data[16 + 9:])
    elif damage == "a folder":
        path.unlink()
        path.mkdir()
    elif damage == "read error":  # the header whole, its bytes not (a disk error, the file cut meanwhile)
        def failing(f, t, room):
            raise OSError("input/output error")

        monkeypatch.setattr(packcache, "_read_into", failing)
    else:  # whole files that are not for this load: another key, or the right key with other shapes
        if damage == "foreign key":
            meta["key"]["code"] = "0" * 16
        else:
            meta["shapes"][0][0] += 1
        lm = load(ckpt)
        packcache._write(path, meta, lm.model.native_arena, list(lm.model.native_stack._qkeep or []))
    reads.clear()
    with caplog.at_level(logging.INFO, logger="codecomplete.model"):
        got = load(ckpt)
    assert "model.layers.0.mlp.down_proj.weight" in reads  # packed again from the checkpoint
    assert same(outputs(got), want)
    assert not got.prepacked
    monkeypatch.setattr(packcache, "_read_into", real_read_into)
    if damage != "a folder":
        assert "packed weights" in caplog.text
        reads.clear()
        assert same(outputs(load(ckpt)), want) and not [k for k in reads if k.endswith("proj.weight")]  # rewritten


def test_a_folder_that_cannot_be_written_costs_nothing(ckpt, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the folder would be")
    monkeypatch.setattr(packcache, "folder", lambda: blocked / "packed")
    with caplog.at_level(logging.WARNING, logger="codecomplete.model"):
        lm = load(ckpt)
    assert "packed weights not kept" in caplog.text
    assert outputs(lm)[0]


def test_files_of_vanished_checkpoints_and_stale_partials_are_removed(ckpt, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    load(other)
    (gone,) = packed_files(ckpt)
    shutil.rmtree(other)
    stale = packcache.folder() / ".abc.1.2.tmp"
    stale.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = packcache.folder() / ".def.1.2.tmp"  # a write in flight elsewhere: kept
    fresh.write_bytes(b"x")
    load(ckpt)
    files = packed_files(ckpt)
    assert len(files) == 1 and files[0] != gone
    assert not stale.exists() and fresh.exists()


def test_float32_and_pytorch_loads_write_nothing(ckpt):
    load_model(str(ckpt), dtype="float32")
    load_model(str(ckpt), dtype="bfloat16", native=False)
    packcache.wait()
    assert not packed_files(ckpt)


def test_the_write_waits_for_the_engine_to_rest(ckpt, monkeypatch):
    import threading

    monkeypatch.setattr(packcache, "PIECE", 4096)  # many pieces, each after a look at the engine
    working = threading.Event()
    working.set()
    lm = load_model(str(ckpt), dtype="bfloat16", busy=working.is_set)
    time.sleep(0.4)
    assert not packed_files(ckpt)  # the engine works: not yet
    working.clear()
    packcache.wait()
    assert len(packed_files(ckpt)) == 1
    assert load(ckpt).prepacked and same(outputs(load(ckpt)), outputs(lm))


@pytest.mark.parametrize("probe", ["always busy", "broken"])
def test_an_engine_that_never_rests_or_a_broken_probe_still_gets_the_file_written(probe, ckpt, monkeypatch):
    def broken():
        raise RuntimeError("probe failed")

    monkeypatch.setattr(packcache, "MAX_WAIT", 0.3)
    load_model(str(ckpt), dtype="bfloat16", busy=(lambda: True) if probe == "always busy" else broken)
    packcache.wait()
    assert len(packed_files(ckpt)) == 1 and load(ckpt).prepacked


def test_a_process_that_ends_while_the_engine_works_still_writes_the_file(ckpt, tmp_path):
    """The write waits for an engine at rest; a process that ends first (the ``complete``
    command, a daemon whose editor closed soon) finishes it on the way out instead of leaving
    a partial file and no cache."""
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "from codecomplete.model import packcache\n"
        "from codecomplete.model.loader import load_model\n"
        f"packcache.folder = lambda: __import__('pathlib').Path({str(packcache.folder())!r})\n"
        f"lm = load_model({str(ckpt)!r}, dtype='bfloat16', busy=lambda: True)\n"
        "time.sleep(0.3)\n"
        "assert not list(packcache.folder().glob('*.pack'))\n"  # still waiting for the engine
        "print('loaded')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr
    files = sorted(p.name for p in packcache.folder().iterdir())
    assert len(files) == 1 and files[0].endswith(".pack"), files
    assert load(ckpt).prepacked


def test_the_daemon_reads_the_file_ahead_and_the_load_takes_it(ckpt, tmp_path):
    """pack_prefetch: the file the last load of the same settings used, read before torch's
    import; the load takes those bytes where the file is still the one read."""
    from codecomplete.model import pack_prefetch

    want = outputs(load(ckpt))  # writes the file and the hint
    assert pack_prefetch.start(str(ckpt), "auto", "bfloat16") is not None
    got = load_model(str(ckpt), dtype="bfloat16")
    assert got.prepacked and got.read_ahead
    assert same(outputs(got), want)
    assert pack_prefetch.start(str(ckpt), "auto", "float32") is None  # settings no load used: nothing to read
    # the file rewritten after it was read ahead: those bytes are not taken
    assert pack_prefetch.start(str(ckpt), "auto", "bfloat16") is not None
    pack_prefetch.take(tmp_path / "none")  # (waits for the read)
    (path,) = packed_files(ckpt)
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)  # the same bytes, another inode
    again = load_model(str(ckpt), dtype="bfloat16")
    assert again.prepacked and not again.read_ahead and same(outputs(again), want)
    # read ahead and never taken (the load was of another model): dropped, its memory back
    assert pack_prefetch.start(str(ckpt), "auto", "bfloat16") is not None
    pack_prefetch.take(tmp_path / "none")
    assert pack_prefetch._got
    load_model(str(ckpt), dtype="float32")
    assert not pack_prefetch._got
    # and a load that fails drops it too
    from codecomplete.model.loader import ModelLoadError

    assert pack_prefetch.start(str(ckpt), "auto", "bfloat16") is not None
    pack_prefetch.take(tmp_path / "none")
    assert pack_prefetch._got
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "no-such-model"), dtype="bfloat16")
    assert not pack_prefetch._got


@pytest.mark.parametrize("hint", ["missing file", "not a pack", "garbage hints"])
def test_a_read_ahead_that_finds_nothing_costs_nothing(hint, ckpt, tmp_path):
    from codecomplete.model import pack_prefetch

    want = outputs(load(ckpt))
    (path,) = packed_files(ckpt)
    hints = pack_prefetch.hints_file()
    saved = hints.read_text()
    try:
        if hint == "garbage hints":
            hints.write_text("[1, 2")
        else:
            other = tmp_path / "other.pack"
            if hint == "not a pack":
                other.write_bytes(os.urandom(1 << 16))
            pack_prefetch.remember(str(ckpt), "auto", "bfloat16", other)
        pack_prefetch.start(str(ckpt), "auto", "bfloat16")
        got = load_model(str(ckpt), dtype="bfloat16")
        assert got.prepacked and not got.read_ahead and same(outputs(got), want)
        assert not pack_prefetch._got
    finally:
        hints.write_text(saved)


def test_the_read_ahead_does_not_import_torch(ckpt):
    """It runs beside torch's import (the daemon starts it first): it must not wait for it."""
    import subprocess
    import sys

    load(ckpt)
    code = ("import sys\n"
            "from codecomplete.model import pack_prefetch\n"
            f"t = pack_prefetch.start({str(ckpt)!r}, 'auto', 'bfloat16')\n"
            "assert t is not None\n"
            "t.join()\n"
            "assert pack_prefetch._got, 'nothing read'\n"
            "assert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_hints_of_removed_files_are_pruned(tmp_path):
    from codecomplete.model import pack_prefetch

    hints = pack_prefetch.hints_file()
    saved = hints.read_text() if hints.is_file() else None
    try:
        kept, gone = tmp_path / "kept.pack", tmp_path / "gone.pack"
        kept.write_bytes(b"x")
        pack_prefetch.remember("a", "auto", "auto", gone)
        pack_prefetch.remember("b", "auto", "auto", kept)
        got = json.loads(hints.read_text())
        assert got[pack_prefetch.hint_key("b", "auto", "auto")] == str(kept)
        assert pack_prefetch.hint_key("a", "auto", "auto") not in got  # its file is not there
    finally:
        if saved is not None:
            hints.write_text(saved)
