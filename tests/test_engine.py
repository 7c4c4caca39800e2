"""The engine on the tiny real model, in fp32: each fast path against a slow reference."""

from __future__ import annotations

import threading

import pytest
import torch

from codecomplete.model.api import CompletionRequest, EngineSettings
from codecomplete.model.engine import Engine, _Vocab, build_prompt, encode, generate
from codecomplete.model.loader import load_model


@pytest.fixture(scope="module")
def lm(tiny_model):
    return load_model(str(tiny_model), device="cpu", dtype="float32")


def greedy_without_cache(lm, ids: list[int], steps: int) -> list[int]:
    """The slow reference: the whole sequence through the model at every step."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = lm.model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            token = int(logits.argmax())
            if token in lm.stop_ids:
                break
            out.append(token)
    return out


@pytest.mark.parametrize("prefix,suffix", [
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.", "\n"),
    ("def mean(data):\n    total = 0\n    for x in data:\n        total", "\n    return total\n"),
    ("import os\nimport ", ""),
])
def test_kv_cached_greedy_equals_recomputing_everything(lm, prefix, suffix):
    """Guards the KV cache: cached decoding must pick exactly the reference tokens."""
    settings = EngineSettings(token_healing=False)
    request = CompletionRequest(prefix, suffix, mode="multi", max_tokens=24, max_lines=200)
    with torch.inference_mode():
        result = generate(lm, request, settings)
    ids, _ = build_prompt(lm, prefix, suffix, settings, None)
    assert result.generated_tokens > 0
    assert result.token_ids == greedy_without_cache(lm, ids, result.generated_tokens)


def test_fim_prompt_is_built_segment_by_segment(lm):
    """Guards the PSM layout and separate tokenization of each segment."""
    tok = lm.tokenizer
    settings = EngineSettings(token_healing=False, max_prefix_tokens=5, max_suffix_tokens=3)
    prefix, suffix = "alpha = beta + gamma * delta", "\nreturn alpha  # done\n"
    ids, healed = build_prompt(lm, prefix, suffix, settings, None)
    sid = tok.convert_tokens_to_ids
    want = ([sid("<fim_prefix>")] + encode(tok, prefix)[-5:] + [sid("<fim_suffix>")]
            + encode(tok, suffix)[:3] + [sid("<fim_middle>")])
    assert ids == want and healed == ""


def test_token_healing_backs_up_one_token_and_regenerates_it(lm):
    """Guards token healing: the removed text is regenerated first, never duplicated."""
    vocab = _Vocab(lm.tokenizer)
    assert vocab.concatenative
    settings = EngineSettings(token_healing=True)
    prefix = "def area(radius):\n    return radius * radi"
    ids, healed = build_prompt(lm, prefix, "\n", settings, vocab)
    assert healed and prefix.endswith(healed)
    with torch.inference_mode():
        result = generate(lm, CompletionRequest(prefix, "\n", max_tokens=8), settings, vocab)
    produced = "".join(vocab.texts[i] for i in result.token_ids)
    assert produced.startswith(healed)
    assert produced[len(healed):].rstrip().startswith(result.text.rstrip()[:1] or "")
    for candidate in vocab.candidates("  "):
        text = vocab.texts[int(candidate)]
        assert text.startswith("  ") or "  ".startswith(text)


class TripAfter(threading.Event):
    """A cancel flag that turns on after ``n`` checks."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.calls = n, 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.n


def test_cancel_stops_within_one_decode_step(lm):
    """Guards cooperative cancellation: no forward pass after the flag is seen."""
    settings = EngineSettings(token_healing=False)
    candidates = ["def f(x):\n    if x is None:\n        ", "import os\n\n\ndef main(", "for i in range(",
                  "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self."]
    with torch.inference_mode():
        # A prompt the tiny model continues for more than three tokens when left alone.
        prefix = next(p for p in candidates if generate(
            lm, CompletionRequest(p, "", mode="multi", max_tokens=200, max_lines=200), settings).generated_tokens > 3)
        request = CompletionRequest(prefix, "", mode="multi", max_tokens=200, max_lines=200,
                                    cancel=TripAfter(4))
        result = generate(lm, request, settings)
    assert result.stop_reason == "cancelled"
    # Checks: one before prefill, one after each token; the fifth (after token 4) sees
    # the flag, so no forward pass follows token 4.
    assert result.generated_tokens == 4


def test_engine_thread_serves_and_counts(tiny_model):
    """Guards the engine thread: futures resolve, stats add up, close returns."""
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32")).start()
    try:
        futures = [engine.submit(CompletionRequest("import os\nimport ", "", max_tokens=4)) for _ in range(3)]
        results = [f.result(timeout=60) for f in futures]
        assert len({r.text for r in results}) == 1  # greedy: the same answer each time
        stats = engine.stats()
        assert stats["completions"] == 3 and stats["ready"] and stats["template"] == "starcoder"
        cancelled = CompletionRequest("import os\n", "")
        cancelled.cancel.set()
        assert engine.complete(cancelled).stop_reason == "cancelled"
    finally:
        engine.close()


def test_missing_model_gives_empty_completions_with_the_reason(tmp_path):
    """Guards a missing model: the engine stays up and says why."""
    engine = Engine(EngineSettings(model=str(tmp_path / "no-such-model"))).start()
    try:
        result = engine.complete(CompletionRequest("x = ", ""))
        assert result.text == "" and result.stop_reason == "model_unavailable"
        assert "not found" in result.error
        assert engine.stats()["load_error"] == result.error
    finally:
        engine.close()


def test_reload_switches_model(tiny_model, tmp_path):
    """Guards configure(): a new model name reloads on the engine thread."""
    engine = Engine(EngineSettings(model=str(tmp_path / "missing"))).start()
    try:
        assert engine.complete(CompletionRequest("x", "")).stop_reason == "model_unavailable"
        engine.configure(EngineSettings(model=str(tiny_model), dtype="float32"))
        assert engine.complete(CompletionRequest("import os\nimport ", "", max_tokens=4)).error is None
    finally:
        engine.close()
