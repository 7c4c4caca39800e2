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
