"""The completion engine: prompt building, prefill, greedy decoding, stop rules.

Contract: ``Engine.submit(request)`` returns a ``concurrent.futures.Future`` that always
resolves to a ``Completion`` (never raises): an empty text with ``stop_reason`` and
``error`` set when the model is unavailable or the request failed.  All torch work
happens on the engine's own thread, so callers on an asyncio loop never block.  A
request's ``cancel`` event is checked before every forward pass: cancelling stops a
generation within one decode step.  The engine knows nothing about LSP.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from functools import lru_cache

import torch

from .api import Completion, CompletionRequest, EngineSettings
from .loader import LoadedModel, ModelLoadError, load_model
from .stops import CompletionShape, StopRules

log = logging.getLogger(__name__)


class _Vocab:
    """Per-token text, used by token healing; built lazily, once per model."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        n = len(tokenizer)
        self.texts: list[str] = tokenizer.batch_decode([[i] for i in range(n)])
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for i in special:
            if 0 <= i < n:
                self.texts[i] = ""
        sample = " def foo(bar):\n    return bar  # ok\n"
        ids = tokenizer.encode(sample, add_special_tokens=False)
        # Healing compares token texts by concatenation; a tokenizer whose decode is
        # not concatenative (SentencePiece strips leading spaces) is not healed.
        self.concatenative = "".join(self.texts[i] for i in ids) == sample
        self.candidates = lru_cache(maxsize=256)(self._candidates)

    def _candidates(self, pending: str) -> torch.Tensor:
        ok = [i for i, s in enumerate(self.texts) if s and (s.startswith(pending) or pending.startswith(s))]
        return torch.tensor(ok, dtype=torch.long)


class Engine:
    """Owns the model; runs requests one at a time on its own thread."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.lm: LoadedModel | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self._vocab: _Vocab | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stats_lock = threading.Lock()
        self._stats = {"completions": 0, "failed": 0, "cancelled": 0, "prompt_tokens": 0,
                       "generated_tokens": 0, "prefill_ms": 0.0, "decode_ms": 0.0}

    # -- public API (any thread) -------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def submit(self, request: CompletionRequest) -> "Future[Completion]":
        fut: Future[Completion] = Future()
        self._jobs.put((request, fut))
        return fut

    def reload(self, settings: EngineSettings) -> None:
        """Load another model on the engine thread, after the requests already queued."""
        self._jobs.put(("reload", settings))

    def configure(self, settings: EngineSettings) -> None:
        """Apply new settings: a reload if the model changed, else at the next request."""
        old = self.settings
        if (old.model, old.device, old.dtype, old.template, old.threads) != (
                settings.model, settings.device, settings.dtype, settings.template, settings.threads):
            self.reload(settings)
        else:
            self.settings = settings

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> dict:
        with self._stats_lock:
            s = dict(self._stats)
        lm = self.lm
        s.update(model=lm.name if lm else None, device=str(lm.device) if lm else None,
                 dtype=str(lm.dtype).removeprefix("torch.") if lm else None,
                 template=lm.template.name if lm else None,
                 load_seconds=round(lm.load_seconds, 3) if lm else None,
                 ready=self.ready.is_set() and lm is not None, load_error=self.load_error)
        s["decode_tokens_per_s"] = (round(1000 * s["generated_tokens"] / s["decode_ms"], 2)
                                    if s["decode_ms"] else None)
        return s

    def complete(self, request: CompletionRequest) -> Completion:
        """Synchronous helper for scripts and the CLI."""
        return self.submit(request).result()

    # -- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        self._load(self.settings)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job[0] == "reload":
                self._load(job[1])
                continue
            request, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            fut.set_result(self._serve(request))

    def _load(self, settings: EngineSettings) -> None:
        self.ready.clear()
        self.settings = settings
        if settings.threads > 0:
            torch.set_num_threads(settings.threads)
        try:
            self.lm = load_model(settings.model, settings.device, settings.dtype, settings.template)
            self.load_error = None
            self._vocab = None
        except ModelLoadError as exc:
            self.lm, self.load_error = None, str(exc)
            log.error("model unavailable: %s", exc)
        except Exception as exc:  # a broken checkpoint must not kill the thread
            self.lm, self.load_error = None, f"{type(exc).__name__}: {exc}"
            log.exception("model failed to load")
        finally:
            self.ready.set()

    def _serve(self, request: CompletionRequest) -> Completion:
        queued_ms = (time.perf_counter() - request.submitted_at) * 1000
        if self.lm is None:
            return Completion("", "model_unavailable", error=self.load_error,
                              timings={"queue_ms": queued_ms})
        if request.cancel.is_set():
            self._count(cancelled=1)
            return Completion("", "cancelled", timings={"queue_ms": queued_ms})
        try:
            with torch.inference_mode():
                result = generate(self.lm, request, self.settings, self._healing_vocab())
        except Exception as exc:
            log.exception("[%s] completion failed", request.request_id)
            self._count(failed=1)
            return Completion("", "error", error=f"{type(exc).__name__}: {exc}",
                              timings={"queue_ms": queued_ms})
        result.timings["queue_ms"] = queued_ms
        self._count(completions=1, cancelled=int(result.cancelled),
                    prompt_tokens=result.prompt_tokens, generated_tokens=result.generated_tokens,
                    prefill_ms=result.timings.get("prefill_ms", 0.0),
                    decode_ms=result.timings.get("decode_ms", 0.0))
        log.info("[%s] %d prompt + %d generated tokens, prefill %.0f ms, decode %.0f ms, stop %s",
                 request.request_id, result.prompt_tokens, result.generated_tokens,
                 result.timings.get("prefill_ms", 0), result.timings.get("decode_ms", 0),
                 result.stop_reason)
        return result

    def _healing_vocab(self) -> "_Vocab | None":
        if not self.settings.token_healing or self.lm is None:
            return None
        if self._vocab is None:
            self._vocab = _Vocab(self.lm.tokenizer)
            if not self._vocab.concatenative:
                log.info("token healing off: the tokenizer's decode is not concatenative")
        return self._vocab if self._vocab.concatenative else None

    def _count(self, **deltas) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v


# -- the algorithm ---------------------------------------------------------------------

def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def build_prompt(lm: LoadedModel, prefix: str, suffix: str, settings: EngineSettings,
                 vocab: "_Vocab | None") -> tuple[list[int], str]:
    """Token ids of the prompt, and the text removed from the prefix by token healing.

    Segments are tokenized separately: special tokens, the prefix window, the suffix
    window.  The prefix keeps its last ``max_prefix_tokens`` ids, the suffix its first
    ``max_suffix_tokens``.
    """
    tok = lm.tokenizer
    # A character window first, so a 10 MB document costs no more than a small one.
    prefix_ids = encode(tok, prefix[-settings.max_prefix_tokens * 8:])[-settings.max_prefix_tokens:]
    healed = ""
    if vocab is not None and prefix_ids:
        last = vocab.texts[prefix_ids[-1]]
        if last and "\ufffd" not in last:
            healed = last
            prefix_ids = prefix_ids[:-1]
    bos = [tok.bos_token_id] if getattr(tok, "add_bos_token", False) and tok.bos_token_id is not None else []
    template = lm.template.template
    if template is None:
        return bos + prefix_ids, healed
    suffix_ids = encode(tok, suffix[: settings.max_suffix_tokens * 8])[: settings.max_suffix_tokens]
    special = tok.convert_tokens_to_ids
    ids = bos + [special(template.prefix)] + encode(tok, template.prefix_pad) + prefix_ids
    ids += [special(template.suffix)] + suffix_ids + [special(template.middle)]
    ids += encode(tok, template.middle_pad)
    return ids, healed


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    # ids: [1, S] -> logits of the last position: [V]
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def decode_one_token(model, token: int, cache, device) -> torch.Tensor:
    # token -> logits [V]
    ids = torch.tensor([[token]], device=device)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def pick_token(logits: torch.Tensor, pending: str, vocab: "_Vocab | None") -> int:
    """Greedy choice; while token healing has text pending, only tokens that agree
    with it are allowed."""
    if pending and vocab is not None:
        allowed = vocab.candidates(pending).to(logits.device)
        if len(allowed):
            return int(allowed[logits[allowed].argmax()])
    return int(logits.argmax())


def generate(lm: LoadedModel, request: CompletionRequest, settings: EngineSettings,
             vocab: "_Vocab | None" = None) -> Completion:
    """Greedy decoding with a KV cache until a stop rule fires."""
    t0 = time.perf_counter()
    shape = CompletionShape.at_cursor(request.prefix, request.suffix, request.mode)
    rules = StopRules(shape, request.max_lines)
    ids, healed = build_prompt(lm, request.prefix, request.suffix, settings, vocab)
    max_ctx = getattr(lm.model.config, "max_position_embeddings", 2048)
    budget = max(0, min(request.max_tokens + (1 if healed else 0), max_ctx - len(ids)))
    deadline = t0 + request.time_budget_ms / 1000
    timings: dict[str, float] = {}

    def done(text: str, reason: str, n: int) -> Completion:
        timings["decode_ms"] = (time.perf_counter() - t_decode) * 1000 if n else 0.0
        timings["total_ms"] = (time.perf_counter() - t0) * 1000
        return Completion(text, reason, len(ids), n, timings, multiline=shape.multiline,
                          token_ids=list(generated))

    generated: list[int] = []
    if request.cancel.is_set():
        t_decode = t0
        return done("", "cancelled", 0)
    cache = new_cache(lm.model)
    t_prefill = time.perf_counter()
    logits = prefill(lm.model, torch.tensor([ids], device=lm.device), cache)
    t_decode = time.perf_counter()
    timings["prefill_ms"] = (t_decode - t_prefill) * 1000
    pending = healed
    text = ""
    while True:
        token = pick_token(logits, pending, vocab)
        if token in lm.stop_ids:
            return done(rules.finish(text), "eos", len(generated))
        generated.append(token)
        if pending and vocab is not None:
            piece = vocab.texts[token]
            pending = "" if piece.startswith(pending) else pending[len(piece):]
        text = decode(lm, generated)
        if not pending:
            text = text[len(healed):]
            decision = rules.check(text)
            if decision.stop:
                return done(rules.finish(decision.text), decision.reason, len(generated))
        else:
            text = ""
        if len(generated) >= budget:
            return done(rules.finish(text), "max_tokens", len(generated))
        if time.perf_counter() > deadline:
            return done(rules.finish(text), "time_budget", len(generated))
        if request.cancel.is_set():
            return done("", "cancelled", len(generated))
        logits = decode_one_token(lm.model, token, cache, lm.device)


def decode(lm: LoadedModel, ids: list[int]) -> str:
    return lm.tokenizer.decode(ids, skip_special_tokens=True)
