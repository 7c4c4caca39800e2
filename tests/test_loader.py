"""Finding and loading checkpoints."""

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
