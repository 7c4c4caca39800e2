"""LayerSkip-style continual training of the exits (#9) on the tiny model: a short run
pulls the exit towards the full model, and the adapter it ships is exactly the student."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.test_train import train


def _texts(path: Path) -> Path:
    """A small train/validation corpus from the standard library, as --texts reads it."""
    import os

    src = sorted(Path(os.__file__).parent.glob("*.py"))
    texts = [p.read_text(errors="replace") for p in src[:60]]
    path.write_text(json.dumps({"train": texts[:50], "validation": texts[50:]}))
    return path


def _run(model: Path, out: Path, texts: Path, steps: int, *extra: str) -> int:
    """layerskip.main on the tiny model's scale: exit 1, rank 4, batches of 2 x 64 on the CPU."""
    from codecomplete.model import layerskip

    return layerskip.main(["--model", str(model), "--out", str(out), "--texts", str(texts), "--exits", "1",
                           "--rank", "4", "--max-steps", str(steps), "--minutes", "10", "--batch", "2", "--seq", "64",
                           "--workers", "0", "--eval-batches", "2", "--device", "cpu", *extra])


def test_valid_positions_end_at_each_rows_last_real_token():
    from codecomplete.model.layerskip import valid_positions

    ids = torch.tensor([[5, 0, 7, 0, 0], [1, 2, 3, 4, 5], [0, 0, 0, 0, 0]])
    assert valid_positions(ids, eos=0).tolist() == [[True, True, True, False, False], [True] * 5, [False] * 5]


def test_a_short_run_trains_the_exit_and_its_adapter_is_the_student(tiny_model: Path, tmp_path: Path):
    from safetensors.torch import load_file

    from codecomplete.model import layerskip
    from codecomplete.model.loader import load_model, resolve_checkpoint

    done = train(tmp_path / "ft", tiny_model, 1, "--freeze-layers", "0", "--lora-rank", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    shipped = tmp_path / "ft" / "adapter"  # the fine-tune's adapter, as the default model ships one
    out = tmp_path / "ls"
    assert _run(shipped, out, _texts(tmp_path / "t.json"), 16, "--lr", "3e-3", "--exit-lr", "3e-2") == 0
    history = json.loads((out / "history.json").read_text())
    first, last = history["evals"][0], history["evals"][-1]
    assert last["step"] == 16 and last["tokens"] > 0
    assert last["exit_kl_1"] < first["exit_kl_1"]  # the exit moved towards the teacher on held-out samples
    assert 0 <= last["agree_1"] <= 1 and 0 <= last["final_agree"] <= 1
    assert first["final_kl"] < 0.05  # step 0: the student is the teacher (bf16 rounding apart)

    combined = tmp_path / "combined"
    assert layerskip.main(["--model", str(shipped), "--combine", str(out), "--out", str(combined)]) == 0
    meta = json.loads((combined / "adapter.json").read_text())
    assert meta["rank"] == 8 and meta["layerskip"]["rank"] == 4 and meta["base"] == str(tiny_model)
    new = {}
    for f in sorted(out.glob("lora-*.safetensors")):
        new.update(load_file(str(f)))
    assert new and all(k.startswith("model.layers.") for k in new)

    # expected: the shipped model (base + the fine-tune's LoRA) with every new B A added
    from transformers import AutoModelForCausalLM

    _, merged = resolve_checkpoint(str(shipped))
    ref = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        for key in new:
            if key.endswith(".lora_a"):
                name = key.removesuffix(".lora_a")
                ref.get_submodule(name).weight += new[f"{name}.lora_b"].float() @ new[key].float()
    lm = load_model(str(combined), dtype="float32", pack=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, lm.tokenizer.convert_tokens_to_ids("<fim_middle>")]])
    with torch.no_grad():
        got = lm.model(ids, [lm.model.new_cache()], logits_for="all")
        want = ref(ids).logits[0]
    assert torch.allclose(got.reshape(want.shape), want, atol=1e-4, rtol=1e-4)
    assert any((new[k].float().abs() > 0).any() for k in new if k.endswith(".lora_b"))  # B trained off zero


def test_own_target_runs_and_the_lora_splits_into_parts(tiny_model: Path, tmp_path: Path):
    """``--target own`` (the exits learn the student's own last layer, detached) trains and reports
    each exit's agreement with that layer; ``save`` cuts the LoRA into files of whole layers that
    together hold every module once (a device call brings back files of at most 16 MiB)."""
    from safetensors.torch import load_file

    from codecomplete.model import layerskip
    from codecomplete.model import train as tr

    out = tmp_path / "own"
    assert _run(tiny_model, out, _texts(tmp_path / "t.json"), 4, "--target", "own", "--final-weight", "2") == 0
    history = json.loads((out / "history.json").read_text())
    assert history["args"]["target"] == "own" and history["evals"][-1]["step"] == 4
    assert all(0 <= e["own_1"] <= 1 for e in history["evals"])

    _, student, _ = tr.load_base(str(tiny_model))
    tr.add_lora(student, 4, 4.0, 0)
    mods = tr.lora_modules(student)
    size = sum(2 * (m.lora_a.numel() + m.lora_b.numel()) for m in mods.values())
    split = tmp_path / "split"
    split.mkdir()
    layerskip.save(student, torch.nn.ModuleList([torch.nn.Linear(4, 4)]), [1], split,
                   student.config.num_hidden_layers, part_bytes=size // 2 + 1)
    files = sorted(split.glob("lora-*.safetensors"))
    assert len(files) == 2
    keys = [set(load_file(str(f))) for f in files]
    assert not keys[0] & keys[1]
    assert keys[0] | keys[1] == {f"{n}.{t}" for n in mods for t in ("lora_a", "lora_b")}


def test_the_layer_loop_is_the_models_forward_and_a_dropped_layer_passes_its_input_on(tiny_model: Path):
    """``forward_all`` runs the model's own decoder layers: without drops it gives HF's hidden states
    to the bit's tolerance; a dropped layer leaves the state as its input was."""
    from codecomplete.model import layerskip
    from codecomplete.model import train as tr

    _, model, _ = tr.load_base(str(tiny_model))
    model.eval()
    n = model.config.num_hidden_layers
    ids = torch.randint(5, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        ref = model.model(input_ids=ids, output_hidden_states=True)
        last, at = layerskip.forward_all(model, ids, list(range(1, n + 1)))
        torch.testing.assert_close(last, ref.last_hidden_state)
        for e, h in zip(range(1, n), at):
            torch.testing.assert_close(h, ref.hidden_states[e])
        torch.testing.assert_close(model.model.norm(at[-1]), ref.hidden_states[n])  # HF's last entry is normed
        _, dropped = layerskip.forward_all(model, ids, [1, 2], drop=frozenset({1}))
        torch.testing.assert_close(dropped[1], dropped[0])  # layer index 1 skipped: after 2 layers = after 1
        assert not torch.allclose(dropped[1], ref.hidden_states[2])


def test_layer_dropout_rates_rise_from_nothing_to_p_max():
    from codecomplete.model.layerskip import draw_drop, dropout_rates

    rates = dropout_rates(30, 0.2)
    assert rates[0] == 0 and abs(rates[-1] - 0.2) < 1e-12 and rates == sorted(rates)
    assert dropout_rates(30, 0.0) == [0.0] * 30
    import random

    draws = [draw_drop(rates, random.Random(i)) for i in range(400)]
    assert all(0 not in d for d in draws)
    late = sum(29 in d for d in draws) / len(draws)
    assert 0.1 < late < 0.3


def test_a_run_with_layer_dropout_and_the_hard_exit_loss_trains(tiny_model: Path, tmp_path: Path):
    out = tmp_path / "ld"
    assert _run(tiny_model, out, _texts(tmp_path / "t.json"), 3, "--layer-dropout", "0.5", "--exit-loss", "ce") == 0
    history = json.loads((out / "history.json").read_text())
    assert history["args"]["layer_dropout"] == 0.5 and history["args"]["exit_loss"] == "ce"
    assert [e["step"] for e in history["evals"]] == [0, 3]
    assert all(r["loss"] == r["loss"] for r in history["steps"])  # finite, not NaN
    assert list(out.glob("lora-*.safetensors"))
