"""Shared fixtures: the tiny real model (built once, cached by source hash) and
temporary repositories."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(request) -> Path:
    """A real two-layer Llama checkpoint with FIM tokens, built by the project."""
    src = (ROOT / "model" / "tiny.py").read_bytes()
    import torch
    import transformers

    key = hashlib.sha256(src + torch.__version__.encode() + transformers.__version__.encode()).hexdigest()[:12]
    out = Path(request.config.cache.mkdir("tiny-model")) / key
    if not (out / "config.json").is_file():
        from codecomplete.model.tiny import build_tiny_model

        build_tiny_model(out, log=lambda m: print(m, file=sys.stderr))
    return out


@pytest.fixture(scope="session")
def tiny_exits(tiny_model, tmp_path_factory) -> Path:
    """Exit heads at layer 1 of the tiny model, trained and calibrated by the project's
    command (python -m codecomplete.model.exit_train)."""
    from codecomplete.model.exit_train import main

    out = tmp_path_factory.mktemp("exits")
    assert main(["--model", str(tiny_model), "--out", str(out), "--layers", "1", "--batches", "3",
                 "--val-batches", "3", "--subset", "256", "--dtype", "float32", "--bounds", "0.5,0.02",
                 "--min-rate", "0"]) == 0
    return out


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory) -> Path:
    """Keep converted checkpoints, repository indexes and the common datastore out of
    the user's cache during tests (daemons started by tests inherit it)."""
    path = tmp_path_factory.mktemp("cache")
    os.environ["CODECOMPLETE_CACHE_DIR"] = str(path)
    return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "util.py").write_text(
        "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.readlines()\n")
    (root / "latin1.py").write_bytes("# caf\xe9 in latin-1\nx = 1\n".encode("latin-1"))
    return root
