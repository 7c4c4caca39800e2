"""Values that cross the engine's boundary: requests in, completions out.

Torch-free, so ``lsp/`` and ``daemon/`` can build requests without importing torch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)


@dataclass
class CompletionRequest:
    prefix: str
    suffix: str
    request_id: str = "-"
    mode: str = "auto"  # auto | single | multi
    max_tokens: int = 64
    max_lines: int = 12
    time_budget_ms: int = 3000
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    session_key: str | None = None  # (client, document): EFIM sessions are kept per key
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens
    context: str = ""  # repository code for the prompt's head (retrieved snippets, rendered)
    alternatives: int = 1  # >1: also up to this many - 1 other completions (Completion.alternatives)
    # prefill only (the daemon warming the KV store at the user's edit before a request comes):
    # no completion; cancel stops it between pieces of the prompt, keeping what ran
    warm: bool = False
    # While in flight: the completion's text so far (the engine sets it after each token), and
    # the text the user has typed at the cursor since the request was made (the daemon keeps a
    # run going while the user types along it, ``lsp/server.py``): once the text so far departs
    # from what was typed the engine cancels the run.  "" typed: nothing to check.
    progress: str = ""
    progress_tokens: int = 0  # the tokens generated for ``progress``
    typed: str = ""
    # Set by the engine once the prompt is prefilled: prompt_tokens, reused_tokens, queue_ms,
    # prefill_ms and decode_start (perf_counter), for an answer made from ``progress`` before
    # the run ends (the daemon's first lines) to say where its time went.
    run_info: dict | None = None
    # Called on the engine's thread when ``progress`` gains a line break (``set_progress``): the
    # daemon waits on it for a slow block's first whole lines (completion.first_lines_ms) instead
    # of polling; it must only hand the news on (a loop's call_soon_threadsafe), never block.
    on_line: Callable[[], None] | None = None

    def set_progress(self, text: str, tokens: int = 0) -> None:
        """The completion's text so far, of ``tokens`` generated tokens (the engine, after each
        token); tells ``on_line`` when it has more line breaks than before."""
        grew = self.on_line is not None and text.count("\n") > self.progress.count("\n")
        self.progress, self.progress_tokens = text, tokens
        if grew:
            try:
                self.on_line()
            except Exception as exc:  # a listener's failure must not stop the run
                log.warning("[%s] on_line failed: %s", self.request_id, exc)


@dataclass
class Completion:
    text: str
    stop_reason: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    multiline: bool = False
    token_ids: list[int] = field(default_factory=list)  # generated ids, healing included
    reused_tokens: int = 0  # prompt tokens whose KV came from the KV store
    prompt_kind: str = ""  # prefix | psm | efim
    spec_steps: int = 0  # verification passes (retrieval speculation)
    accepted_tokens: int = 0  # drafted tokens the model accepted
    forward_passes: int = 0  # decode passes (generated_tokens / forward_passes: tokens per pass)
    layers_run: int = 0  # transformer layers run for the generated tokens (early exit: fewer than tokens x layers)
    alternatives: list["Completion"] = field(default_factory=list)  # other completions, most likely first

    @property
    def texts(self) -> list[str]:
        """This completion's text, then its alternatives' (none empty, none twice)."""
        out = []
        for c in [self, *self.alternatives]:
            if c.text.strip() and c.text not in out:
                out.append(c.text)
        return out

    @property
    def cancelled(self) -> bool:
        return self.stop_reason == "cancelled"


@dataclass(frozen=True)
class SpecSettings:
    """Retrieval speculation (``codecomplete.model.speculate``); this project's tuned defaults."""

    enabled: bool = True
    max_nodes: int = 3  # draft tokens verified per step (the tree's size; 3: the pass takes the greedy head)
    depth: int = 15  # longest draft sequence (a chain's pass: 16 rows, one tile of rows)
    # a verification pass's rows at most (the last token and its draft nodes); 0: auto, see
    # speculate.pass_rows (8 where bf16 products run on AVX2 or the portable loop, where a 16-row
    # pass costs ~2.5 steps; else no cap)
    max_rows: int = 0
    top_k: int = 8  # continuations taken per source
    alpha: float = 1.0  # repository weight
    beta: float = 0.5  # common datastore weight
    gamma: float = 1.5  # verified cache weight
    delta: float = 1.0  # weight of the request's own tokens (prompt and output so far)
    tau: int = 8  # the cache is consulted first once it holds more than tau sequences
    p: float = 1.0  # retrieval probability at a skip token
    min_match: int = 2  # shortest context suffix a datastore match may have
    # where short matches cost more than they pay (speculate.costly_short_matches: bf16 on the AVX2
    # kernel or the portable loop), the datastores draft only from matches at least this long
    # (0: min_match everywhere)
    costly_min_match: int = 8
    cache_sequences: int = 4096  # the verified cache's size (sequences, LRU)
    use_repository: bool = True
    use_common: bool = True
    use_cache: bool = True
    use_live: bool = True
    live_chain: int = 3  # when the own tokens match this far back, verify up to ``depth`` nodes (0: never)
    skip_tokens: bool = True
    missing_table: bool = True


@dataclass
class ExitSettings:
    """Early exit (issue #9).  Off by default: it trades output quality for speed
    unless ``lossless``."""

    enabled: bool = False
    measure: str = "softmax"  # softmax | cosine | classifier (only softmax has the last layer's check)
    threshold: float = 0.0  # >0: one threshold at every exit; 0: the calibrated ones
    bound: float = 0.02  # which calibrated thresholds: the token disagreement they allow
    layers: str = ""  # exit points to use ("12,20"); "": every calibrated exit
    batch_rule: str = "all"  # all: an iteration exits only when all are confident (measured better); each: alone
    max_batch: int = 1  # lossy exits only while at most this many requests decode together (measured: slower above 1)
    decay: float = 0.0  # CALM's schedule (strict first, relaxing along the output); 0: constant thresholds
    lossless: bool = False  # self-speculation: the early layers draft, the full model verifies (exact output)
    draft_layer: int = 0  # lossless: the exit that drafts (0: the middle exit point)
    draft_tokens: int = 4  # lossless: most drafts per verification
    draft_bound: float = 0.02  # lossless: draft while the draft exit is confident at this calibrated bound (0: always)
    path: str = ""  # exit heads (exit_train's output); "": the ones stored with the model


@dataclass
class EngineSettings:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    template: str = "auto"
    threads: int = 0  # 0: torch's default; with adaptive_threads, the most a pass uses
    # fewer threads while other processes use the cores (threads.ThreadGovernor; CPU only)
    adaptive_threads: bool = True
    pack_weights: bool = True  # oneDNN-prepacked linear weights on CPU (faster, same results)
    native_attention: bool = True  # decode attention through the native CPU kernel (model/native)
    # the layers' matrices: "bf16" as the checkpoint has them, or "int8" with a scale per output row
    # (half the bytes a decode step reads; the native bf16 stack on the CPU only)
    weights: str = "bf16"
    max_prefix_tokens: int = 1024
    max_suffix_tokens: int = 256
    token_healing: bool = True
    kv_budget_mb: int = 512  # the KV store's budget; 0 disables reuse across requests
    efim: bool = True  # EFIM prompts while the prefix grows (FIM models)
    inc_bound: int = 256  # tokens of EFIM's inc before the session is rebased
    head_lines: int = 8  # a new session's last lines go after <M> (EFIM at once); 0: a PSM head
    # idle time after a request prefills the prefix window's next opening when its start moves
    # within this many more characters typed (prompts.ahead_heads); 0: off
    ahead_chars: int = 600
    # a warm prefill (warm-up, ahead) runs pieces of about this many ms between checks for a request
    # (engine.PieceClock); 0: pieces of 256 tokens
    warm_piece_ms: float = 100.0
    max_batch: int = 16  # requests decoded together per iteration
    kv_dtype: str = "auto"  # the KV cache's dtype: auto | float32 | bfloat16 | float16
    speculation: SpecSettings = field(default_factory=SpecSettings)  # retrieval drafts, verified exactly
    early_exit: ExitSettings = field(default_factory=ExitSettings)  # the steps speculation has no draft for


def engine_counters() -> dict:
    """The engine's counters, all zero (``Engine.stats``)."""
    return {"completions": 0, "failed": 0, "cancelled": 0, "prompt_tokens": 0,
            "reused_tokens": 0, "generated_tokens": 0, "prefill_ms": 0.0, "decode_ms": 0.0,
            "iterations": 0, "batched_tokens": 0, "max_batch_seen": 0,
            "spec_steps": 0, "accepted_tokens": 0, "layers_run": 0, "decode_passes": 0,
            "alternatives": 0, "warm_prefills": 0, "warm_tokens": 0, "warm_stopped": 0,
            "warm_ms": 0.0, "ahead_prefills": 0, "ahead_tokens": 0, "ahead_ms": 0.0}


def _native_report(lm, settings: EngineSettings) -> dict | None:
    """Whether a CPU model's native kernels are loaded, and why not where something the user can
    fix stopped them (none where ``native_attention`` is off: turned off on purpose)."""
    if lm is None or str(lm.device).split(":")[0] != "cpu":
        return None
    from .native import problem, ready  # torch is imported once a model is loaded

    return {"loaded": ready(), "problem": problem() if settings.native_attention else None}


def engine_stats(counters: dict, settings: EngineSettings, lm=None, ready: bool = False,
                 load_error: str | None = None, exit_error: str | None = None, drafter=None, store=None,
                 prompts: dict | None = None, governor=None, loading: str | None = None,
                 pieces=None) -> dict:
    """What ``Engine.stats`` reports, from its parts (torch-free: the daemon reports it before
    the engine has started too, ``model.handle``)."""
    s = dict(counters)
    s.update(model=lm.name if lm else None, device=str(lm.device) if lm else None,
             dtype=str(lm.dtype).removeprefix("torch.") if lm else None,
             weights=getattr(lm.model, "weights", None) if lm else None,  # the layers' matrices as they run
             template=lm.template.name if lm else None,
             load_seconds=round(lm.load_seconds, 3) if lm else None,
             load_prepacked=lm.prepacked if lm else None,  # the packed weights' cache served the load
             load_read_ahead=lm.read_ahead if lm else None,  # its file read before torch's import
             ready=ready and lm is not None, load_error=load_error,
             loading=loading or None)  # what a load in progress is doing where it takes seconds
    s["decode_tokens_per_s"] = (round(1000 * s["generated_tokens"] / s["decode_ms"], 2)
                                if s["decode_ms"] else None)
    s["reuse_rate"] = round(s["reused_tokens"] / s["prompt_tokens"], 4) if s["prompt_tokens"] else None
    s["mean_batch"] = round(s["batched_tokens"] / s["iterations"], 2) if s["iterations"] else None
    # tokens per verification pass: the accepted drafts plus the token every pass yields
    s["mean_acceptance_length"] = (round(1 + s["accepted_tokens"] / s["spec_steps"], 3)
                                   if s["spec_steps"] else None)
    s["speculation"] = settings.speculation.enabled
    s["early_exit"] = {"enabled": settings.early_exit.enabled, "error": exit_error,
                       "mean_layers": (round(s["layers_run"] / s["decode_passes"], 2)  # per decode pass
                                       if s["decode_passes"] else None)}
    if drafter is not None:
        s["drafter"] = dict(drafter.stats, cache_sequences=drafter.cache.sequences)
    s["native"] = _native_report(lm, settings)
    s["kv_store"] = store.snapshot() if store else None
    s["prompts"] = dict(prompts or {})
    s["threads"] = governor.snapshot() if governor is not None else None
    s["warm_piece"] = pieces.snapshot() if pieces is not None else None  # a warm prefill's pieces (PieceClock)
    return s
