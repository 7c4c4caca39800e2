"""The FIM fine-tuning command (#3) on the tiny model: it trains, saves a checkpoint the
daemon loads, and resumes exactly where it stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def train(out: Path, model: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "codecomplete.model.train", "--out", str(out), "--base", str(model),
                           "--corpus", "stdlib", "--steps", str(steps), "--batch", "2", "--seq", "64",
                           "--freeze-layers", "1", "--eval-every", "2", "--eval-steps", "1", "--save-every", "2",
                           *extra], capture_output=True, text=True, timeout=600)


def test_train_saves_a_loadable_checkpoint_and_resumes(tiny_model: Path, tmp_path: Path):
    out = tmp_path / "run"
    done = train(out, tiny_model, 4)
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.loads((out / "model" / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4] and "val_loss" in history[-1]
    card = (out / "model" / "README.md").read_text()
    assert "tokens seen: 512" in card and (out / "model" / "loss.png").stat().st_size > 1000
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["split_files"]["train"] > 100 and "python-stdlib: PSF-2.0" in manifest["licences"]
    again = train(out, tiny_model, 6, "--resume")
    assert again.returncode == 0 and "resumed at step 4" in again.stderr
    history = json.loads((out / "model" / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6] and history[-1]["tokens"] == 6 * 2 * 64
    from codecomplete.model.loader import load_model

    lm = load_model(str(out / "model"), dtype="float32")
    assert lm.template.name == "starcoder"
    from safetensors.torch import load_file

    fim = [lm.tokenizer.convert_tokens_to_ids(t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")]
    key = "model.embed_tokens.weight"
    before, after = load_file(tiny_model / "model.safetensors")[key], load_file(out / "model" / "model.safetensors")[key]
    assert not (before[fim] == after[fim]).all()  # the FIM rows trained
    other = [i for i in range(before.shape[0]) if i not in fim]
    assert (before[other] == after[other]).all()  # the rest of the matrix did not


def test_lora_run_with_exit_loss_ships_an_adapter_the_loader_applies(tiny_model: Path, tmp_path: Path):
    import torch

    from codecomplete.model.loader import load_model

    out = tmp_path / "lora"
    done = train(out, tiny_model, 2, "--freeze-layers", "0", "--lora-rank", "4", "--exit-layers", "1",
                 "--exit-weight", "0.5")
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads((out / "model" / "history.json").read_text())[-1]
    assert {"val_loss", "exit1_loss", "exit1_agree"} <= set(last) and 0 <= last["exit1_agree"] <= 1
    assert (out / "snapshots" / "step-2" / "adapter.json").is_file()
    meta = json.loads((out / "adapter" / "adapter.json").read_text())
    assert meta["rank"] == 4 and meta["base"] == str(tiny_model) and meta["fragments"] is True
    merged = load_model(str(out / "model"), dtype="float32")
    applied = load_model(str(out / "adapter"), dtype="float32")  # base + adapter, merged into the cache
    assert applied.template.name == "starcoder"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, applied.tokenizer.convert_tokens_to_ids("<fim_middle>")]])
    with torch.no_grad():
        a = applied.model(ids, [applied.model.new_cache()], logits_for="all")
        b = merged.model(ids, [merged.model.new_cache()], logits_for="all")
    assert (a - b).abs().max() < 0.02 * b.abs().max()  # bf16 factors vs the fp32 merge
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_broken_adapter_is_a_clear_load_error(tiny_model: Path, tmp_path: Path):
    import pytest

    from codecomplete.model.loader import ModelLoadError, load_model

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="adapter.json"):
        load_model(str(bad))
    (bad / "adapter.json").write_text(json.dumps({"format": "codecomplete-adapter/1", "base": str(tiny_model)}))
    with pytest.raises(ModelLoadError, match="adapter.safetensors is missing"):
        load_model(str(bad))
    from safetensors.torch import save_file
    import torch

    save_file({"model.layers.0.self_attn.q_proj.lora_a": torch.zeros(2, 7),
               "model.layers.0.self_attn.q_proj.lora_b": torch.zeros(5, 2)}, str(bad / "adapter.safetensors"))
    with pytest.raises(ModelLoadError, match="q_proj is"):
        load_model(str(bad))
