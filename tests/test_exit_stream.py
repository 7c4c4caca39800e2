"""Exit adapters trained at scale on the frozen model (#9, model/exit_stream.py), on the tiny
model: the block adapter starts as the model's own layer, a short run moves every kind of
adapter towards the full model, and exit_train serves the run's linear adapters as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_layerskip import _texts


def _hf(tiny_model: Path):
    from transformers import AutoModelForCausalLM

    from codecomplete.model.loader import resolve_checkpoint

    return AutoModelForCausalLM.from_pretrained(resolve_checkpoint(str(tiny_model))[1], dtype=torch.float32).eval()


def test_block_adapter_starts_as_the_models_layer(tiny_model: Path):
    from codecomplete.model.exit_stream import BlockAdapter

    model = _hf(tiny_model)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = model.model(input_ids=ids, output_hidden_states=True).hidden_states
        got = states[0] + BlockAdapter(model, 0)(states[0])
    torch.testing.assert_close(got, states[1], atol=1e-5, rtol=1e-4)  # attention over earlier positions included


def test_a_short_run_trains_each_kind_and_exit_train_serves_its_linear_adapters(tiny_model, tiny_exits, tmp_path):
    from codecomplete.model import exit_stream, exit_train
    from codecomplete.model.early_exit import load_exits
    from codecomplete.model.loader import load_model

    out = tmp_path / "run"
    texts = _texts(tmp_path / "t.json")
    assert exit_stream.main(["--model", str(tiny_model), "--out", str(out), "--texts", str(texts), "--exits", "1",
                             "--subset-from", str(tiny_exits), "--max-steps", "80", "--minutes", "10", "--batch", "4",
                             "--seq", "64", "--workers", "0", "--eval-batches", "4", "--eval-every", "1000",
                             "--lr", "3e-3", "--lr-linear", "1e-2", "--lr-block", "1e-5", "--device", "cpu"]) == 0
    history = json.loads((out / "history.json").read_text())
    first, last = history["evals"][0], history["evals"][-1]
    assert last["step"] == 80 and last["positions"] > 0 and history["subset"] == 256
    assert first["linear_1_all"] == first["mlp_1_all"]  # both start at zero: the plain logit lens
    for kind in ("linear", "mlp", "block"):
        assert 0 <= last[f"{kind}_1_mid"] <= 1
    for kind in ("linear", "mlp"):  # towards the full model on held-out samples
        assert last[f"{kind}_1_all"] > first[f"{kind}_1_all"] + 0.01, (kind, first, last)
    # the block starts as the model's last layer here (the tiny model has two), so it trained
    # away from its start only a little; its weights moved
    block = exit_stream.load_adapters(out, "block")
    start = _hf(tiny_model).model.layers[1].mlp.down_proj.weight
    assert not torch.equal(block["exit_1.layer.mlp.down_proj.weight"].float(), start.bfloat16().float())
    # the shipped (here: the fixture's) adapters are the reference row at the first and last evaluation
    assert first["shipped_1_all"] == last["shipped_1_all"]

    linear = exit_stream.load_adapters(out, "linear")
    assert set(linear) == {"exit_1.weight"}
    assert {k.split(".")[0] for k in block} == {"exit_1"}

    exits_dir = tmp_path / "exits"
    assert exit_train.main(["--model", str(tiny_model), "--out", str(exits_dir), "--layers", "1", "--batches", "2",
                            "--val-batches", "2", "--adapters", str(out), "--subset-from", str(tiny_exits),
                            "--dtype", "float32", "--bounds", "0.5", "--min-rate", "0"]) == 0
    meta = json.loads((exits_dir / "exits.json").read_text())
    assert meta["adapters_from"] == str(out)
    model = load_model(str(tiny_model), device="cpu", dtype="float32").model
    exits = load_exits(exits_dir, model)
    # served as trained (the exits file stores bf16), on the subset the run trained them for
    torch.testing.assert_close(exits.adapters[0].weight.float(), linear["exit_1.weight"].bfloat16().float())
    fixture = load_exits(tiny_exits, model)
    assert torch.equal(exits.subset, fixture.subset)

    # calibrated again on another dtype's states: the same adapters and classifiers, new thresholds
    again = tmp_path / "again"
    assert exit_train.main(["--model", str(tiny_model), "--out", str(again), "--recalibrate", str(exits_dir),
                            "--val-batches", "2", "--dtype", "bfloat16", "--bounds", "0.5,0.2", "--min-rate", "0"]) == 0
    meta2 = json.loads((again / "exits.json").read_text())
    assert meta2["recalibrated_from"] == str(exits_dir) and meta2["dtype"] == "bfloat16"
    assert meta2["adapters_from"] == str(out) and meta2["bounds"] == [0.5, 0.2]
    assert {"softmax@0.5", "softmax@0.2"} <= set(meta2["thresholds"])
    reloaded = load_exits(again, model)
    assert torch.equal(reloaded.adapters[0].weight, exits.adapters[0].weight)
    assert torch.equal(reloaded.classifiers[0][0].weight, exits.classifiers[0][0].weight)

    # its MLP adapters served instead (--adapter-kind mlp): stored as trained (bf16), the kind recorded
    mlp_dir = tmp_path / "mlp_exits"
    assert exit_train.main(["--model", str(tiny_model), "--out", str(mlp_dir), "--layers", "1", "--batches", "2",
                            "--val-batches", "2", "--adapters", str(out), "--adapter-kind", "mlp",
                            "--subset-from", str(tiny_exits), "--dtype", "float32", "--bounds", "0.5",
                            "--min-rate", "0"]) == 0
    mlp = exit_stream.load_adapters(out, "mlp")
    served = load_exits(mlp_dir, model)
    assert served.adapter_kind == "mlp" and served.adapter_hidden == mlp["exit_1.w1.weight"].shape[0]
    assert json.loads((mlp_dir / "exits.json").read_text())["adapter_kind"] == "mlp"
    for name in ("w1", "w2"):
        torch.testing.assert_close(getattr(served.adapters[0], name).weight.float(),
                                   mlp[f"exit_1.{name}.weight"].float())
    with pytest.raises(SystemExit, match="needs --adapters"):
        exit_train.main(["--model", str(tiny_model), "--out", str(tmp_path / "x"), "--layers", "1",
                         "--adapter-kind", "mlp"])

    # a run continued from this one (--init) starts where it ended: linear saved in fp32 exactly,
    # the mlp (saved in bf16) to rounding; a saved adapter of another shape is refused
    more = tmp_path / "more"
    common = ["--model", str(tiny_model), "--texts", str(texts), "--exits", "1", "--subset-from", str(tiny_exits),
              "--kinds", "linear,mlp", "--max-steps", "1", "--batch", "4", "--seq", "64", "--workers", "0",
              "--eval-batches", "4", "--lr", "0", "--lr-linear", "0", "--device", "cpu"]
    assert exit_stream.main(common + ["--out", str(more), "--init", str(out)]) == 0
    resumed = json.loads((more / "history.json").read_text())["evals"][0]
    assert resumed["linear_1_all"] == last["linear_1_all"]
    assert abs(resumed["mlp_1_all"] - last["mlp_1_all"]) <= 0.02 and resumed["mlp_1_all"] > first["mlp_1_all"]
    with pytest.raises(SystemExit, match="does not fit"):
        exit_stream.main(common + ["--out", str(tmp_path / "odd"), "--init", str(out), "--mlp-hidden", "8"])

    # a layer the run did not train is refused (before any collection) rather than served untrained
    try:
        exit_train.main(["--model", str(tiny_model), "--out", str(tmp_path / "bad"), "--layers", "1",
                         "--adapters", str(tmp_path), "--dtype", "float32"])
    except SystemExit as exc:
        assert "no linear adapter at layer(s) [1]" in str(exc)
    else:
        raise AssertionError("an adapters folder without the layer was accepted")
