"""The VS Code extension: its settings match the daemon's, and `npm ci && npm run
build` type-checks, bundles and packages it. (VS Code's own test harness downloads
VS Code at run time, which this project's machines cannot do.)"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from codecomplete.daemon.config import CompletionConfig, IndexConfig, SpeculationConfig, ModelConfig

EXT = Path(__file__).resolve().parents[1] / "editors" / "vscode"


def snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def test_every_daemon_setting_the_extension_offers_exists_with_its_default():
    props = json.loads((EXT / "package.json").read_text())["contributes"]["configuration"]["properties"]
    sections = {"model": ModelConfig(), "completion": CompletionConfig(), "index": IndexConfig(),
                "speculation": SpeculationConfig()}
    offered = 0
    for key, spec in props.items():
        _, section, *rest = key.split(".")
        if section not in sections:
            continue
        field = snake(rest[0])
        defaults = sections[section]
        assert field in {f.name for f in dataclasses.fields(defaults)}, key
        value = getattr(defaults, field)
        assert spec["default"] == (list(value) if isinstance(value, tuple) else value), key
        offered += 1
    assert offered == sum(len(dataclasses.fields(type(v))) for v in sections.values())


def test_npm_build_type_checks_bundles_and_packages(tmp_path):
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    work = tmp_path / "vscode"
    shutil.copytree(EXT, work, ignore=shutil.ignore_patterns("node_modules", "dist", "out", "*.vsix"))
    for step in (["ci", "--no-audit", "--no-fund"], ["run", "build"]):
        proc = subprocess.run([npm, *step], cwd=work, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with zipfile.ZipFile(work / "codecomplete.vsix") as vsix:
        names = set(vsix.namelist())
        manifest = json.loads(vsix.read("extension/package.json"))
    assert {"extension/package.json", "extension/dist/extension.js"} <= names
    assert manifest["main"] == "./dist/extension.js"
    bundle = (work / "dist" / "extension.js").read_text()
    assert "codecomplete/didShowCompletion" in bundle and "textDocument/inlineCompletion" in bundle
    assert "codecomplete/didMoveCursor" in bundle
    assert "editor.action.inlineSuggest.trigger" in bundle  # asks where the user typed before the client started
