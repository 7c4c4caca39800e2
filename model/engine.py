"""The completion engine: prompt plans, KV reuse, batched greedy decoding, stop rules.

Contract: ``Engine.submit(request)`` returns a ``concurrent.futures.Future`` that always
resolves to a ``Completion`` (never raises): an empty text with ``stop_reason`` and
``error`` set when the model is unavailable or the request failed.  All torch work
happens on the engine's own thread, so callers on an asyncio loop never block.

Each iteration of that thread admits new requests (prompt plan from the session pool,
the longest cached prefix from the KV store, prefill of the rest), then advances every
live request by one token in a single batched forward pass.  A request's ``cancel``
event is checked before each of its steps, so cancelling stops it within one decode
step; finished requests leave the batch and their prompt + output KV goes back into
the store.  The engine knows nothing about LSP.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from .api import Completion, CompletionRequest, EngineSettings, ExitSettings, engine_counters, engine_stats
from .early_exit import Exits, ExitPolicy, ExitsError, exit_forward, load_exits, self_spec
from .kvstore import KVStore, Node
from .loader import LoadedModel, ModelLoadError, load_model, load_stage, model_identity
from .native import STACK_ROWS
from .prompts import PromptPlan, SessionPool, Tokens, ahead_heads
from .sampling import greedy_tokens
from .speculate import Drafter, LiveIndex, Tree, datastore_min_match, pass_rows, verify
from .stops import CompletionShape, StopRules, agrees
from .threads import ThreadGovernor
from .transformer import SeqKV

log = logging.getLogger(__name__)


class _Vocab:
    """Per-token text, used by token healing; built lazily, once per model."""

    def __init__(self, tokenizer):
        n = len(tokenizer)
        self.texts: list[str] = tokenizer.batch_decode([[i] for i in range(n)])
        for i in set(getattr(tokenizer, "all_special_ids", []) or []):
            if 0 <= i < n:
                self.texts[i] = ""
        sample = " def foo(bar):\n    return bar  # ok\n"
        ids = tokenizer.encode(sample, add_special_tokens=False)
        # Healing compares token texts by concatenation; a tokenizer whose decode is
        # not concatenative (SentencePiece strips leading spaces) is not healed.
        self.concatenative = "".join(self.texts[i] for i in ids) == sample
        # ``decoded`` appends a token's text instead of decoding the whole output again: where
        # decode concatenates and no clean-up rewrites spaces across tokens (HF's option)
        self.incremental = self.concatenative and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.candidates = lru_cache(maxsize=256)(self._candidates)

    def _candidates(self, pending: str) -> torch.Tensor:
        ok = [i for i, s in enumerate(self.texts) if s and (s.startswith(pending) or pending.startswith(s))]
        return torch.tensor(ok, dtype=torch.long)


@dataclass(eq=False)  # identity: a fork starts equal to its head
class Live:
    """One request being decoded."""

    request: CompletionRequest
    future: Future | None
    plan: PromptPlan
    cache: SeqKV
    fed: list[int]  # token ids whose KV is in ``cache``
    rules: StopRules
    budget: int
    deadline: float
    t0: float
    reused: int = 0
    nodes: list[Node] = field(default_factory=list)
    logits: torch.Tensor | None = None
    generated: list[int] = field(default_factory=list)
    pending: str = ""
    text: str = ""
    decoded: str = ""  # the decode of ``generated[:decoded_n]`` (``decoded``)
    decoded_n: int = 0  # -1: a decode that ended in U+FFFD (a character cut between tokens)
    timings: dict = field(default_factory=dict)
    result: Completion | None = None
    spec_steps: int = 0
    accepted: int = 0
    passes: int = 0  # decode forward passes
    live: "LiveIndex | None" = None  # the request's own tokens indexed for drafting (speculation)
    layers: int = 0  # transformer layers run by decode steps
    # alternatives (CompletionRequest.alternatives): the request's greedy decode is the head;
    # where it is unsure it forks, and each fork takes another token there, then decodes greedily
    branches: int = 0  # forks the head may still make
    forced: int | None = None  # a fork's token at the branch (its next pick)
    pick: int | None = None  # the greedy token of ``logits`` where a verification pass computed it (spec_step)
    head: "Live | None" = None  # a fork's head
    forks: list["Live"] = field(default_factory=list)  # a head's forks, most likely first
    spawned: list["Live"] = field(default_factory=list)  # forks made by the last pick, not yet decoding
    open: int = 1  # a head's members (itself and its forks) not finished yet
    born: int = 0  # a fork's tokens taken from its head


# -- the algorithm ---------------------------------------------------------------------

def pick_token(logits: torch.Tensor, pending: str, vocab: "_Vocab | None") -> int:
    """Greedy choice; while token healing has text pending, only tokens that agree
    with it are allowed."""
    if pending and vocab is not None:
        allowed = vocab.candidates(pending).to(logits.device)
        if len(allowed):
            return int(allowed[greedy_tokens(logits[allowed])])
    return greedy_tokens(logits)


BRANCH_WINDOW = 16  # a head forks only at its first this many tokens
BRANCH_MIN_P = 0.05  # ... and only for tokens at least this likely there (any, where greedy would stop)
MAX_ALTERNATIVES = 8


def branch_tokens(logits: torch.Tensor, greedy: int, pending: str, vocab: "_Vocab | None",
                  stop_ids, n: int) -> list[int]:
    """Up to ``n`` tokens besides ``greedy`` to fork alternatives on, most likely first:
    no stop token, each at least BRANCH_MIN_P likely (normalised over what token healing
    allows); where the greedy choice is a stop token (the model would offer nothing) the
    likeliest others, however unlikely, since the user asked for a completion.  A token
    whose text starts the greedy one's (" " for " y": most often the same text, spelt in
    more tokens) is passed over."""
    allowed = vocab.candidates(pending).to(logits.device) if pending and vocab is not None else None
    if allowed is not None and not len(allowed):
        allowed = None
    x = logits.float() if allowed is None else logits[allowed].float()
    probs = torch.softmax(x, -1)
    top = torch.topk(probs, min(len(probs), n + 1 + len(stop_ids)))
    floor = 0.0 if greedy in stop_ids else BRANCH_MIN_P
    out = []
    for p, j in zip(top.values.tolist(), top.indices.tolist()):
        tok = int(allowed[j]) if allowed is not None else j
        if tok == greedy or tok in stop_ids or (
                vocab is not None and vocab.texts[greedy].startswith(vocab.texts[tok])):
            continue
        if p < floor or len(out) == n or not math.isfinite(p):
            break
        out.append(tok)
    return out


def fork(live: Live, token: int) -> Live:
    """A copy of ``live`` before its next pick that will pick ``token`` instead; its KV is
    its own (no store nodes: the copy holds what it needs).  At a pick, the KV holds the
    prompt and the tokens generated so far (a verification pass has put the accepted
    drafts' KV in already when their picks are replayed: the copy stops before them)."""
    n = len(live.plan.ids) + len(live.generated)
    cache = live.cache.clone()
    cache.length = n
    rules = StopRules(live.rules.shape, live.rules.max_lines)  # its own: the rules remember lines checked
    f = Live(live.request, None, live.plan, cache, live.fed[:n], rules, live.budget,
             live.deadline, live.t0, reused=live.reused, logits=live.logits, generated=list(live.generated),
             pending=live.pending, text=live.text, decoded=live.decoded, decoded_n=live.decoded_n,
             timings=dict(live.timings), forced=token, head=live,
             born=len(live.generated))
    f.timings["decode_start"] = time.perf_counter()  # its own decoding: from here
    live.forks.append(f)
    live.open += 1
    return f


def plan_prompt(lm: LoadedModel, request: CompletionRequest, settings: EngineSettings,
                vocab: "_Vocab | None", pool: SessionPool | None) -> PromptPlan:
    pool = pool or SessionPool()  # a fresh pool: a PSM prompt, as for a new document
    # a warm request plans what a request would get now and leaves the session as it is, so
    # that the request after it gets the prompt (and completion) it would have got without it
    return pool.plan(request.session_key, request.prefix, request.suffix,
                     lm.template.template, Tokens(lm.tokenizer, vocab), settings.max_prefix_tokens,
                     settings.max_suffix_tokens, efim=settings.efim, context=request.context, keep=not request.warm)


def start(lm: LoadedModel, request: CompletionRequest, plan: PromptPlan, store: KVStore | None) -> Live:
    """Prefill: take what the KV store has of the prompt, run the rest."""
    t0 = time.perf_counter()
    shape = CompletionShape.at_cursor(request.prefix, request.suffix, request.mode)
    ids = plan.ids
    max_ctx = lm.model.args.max_positions
    budget = max(0, min(request.max_tokens + (1 if plan.healed else 0), max_ctx - len(ids)))
    cache = lm.model.new_cache(len(ids) + budget + 1)
    live = Live(request, None, plan, cache, list(ids), StopRules(shape, request.max_lines), budget,
                t0 + request.time_budget_ms / 1000, t0, pending=plan.healed,
                branches=max(0, min(request.alternatives, MAX_ALTERNATIVES) - 1))
    if store is not None:
        match = store.match_prefix(ids)
        reuse = min(match.length, len(ids) - 1)  # at least one token runs: its logits start decoding
        if reuse > 0:
            cache.load(match.parts, reuse)
            live.nodes = match.nodes
            store.lock(match.nodes)
        live.reused = reuse
        store.record_reuse(reuse)
    t1 = time.perf_counter()
    rest = torch.tensor([ids[live.reused:]], device=lm.device)
    live.logits = lm.model(rest, [cache], greedy=not (live.pending or live.branches))[0]
    live.timings["prefill_ms"] = (time.perf_counter() - t1) * 1000
    if store is not None and len(ids) - live.reused > 1:
        # the prompt's KV goes to the store once prefilled, not only when the request ends: the
        # next keystroke's request, admitted before this one finishes (queued while it prefilled),
        # reuses it instead of prefilling the same prompt again; release adds the rest
        store.insert(ids, cache.k[:, :, :len(ids)], cache.v[:, :, :len(ids)])
    live.timings["decode_start"] = time.perf_counter()
    return live


WARM_PIECE = 256  # the most prompt tokens a warm prefill runs between checks of its cancel (native.PREFILL_ROWS)
PIECE_ROWS = 32  # a warm prefill's pieces are multiples of this: the native prefill's bits do not depend on them


class PieceClock:
    """How many prompt rows a warm prefill (a warm-up, the window's ahead prefill) runs between
    checks of its cancel: as many as take about ``target_ms`` at the speed its last pieces ran, a
    multiple of ``PIECE_ROWS`` up to ``WARM_PIECE`` (``target_ms`` 0: always ``WARM_PIECE``).  A
    request that arrives meanwhile waits for the piece in flight, and 256 rows take 0.5-0.9 s on
    two AVX2 cores against ~0.1 s with AMX (bench/results/warm_pieces_avx2.md).  On a GPU the
    time seen is the launch's (no synchronization), so the pieces stay at ``WARM_PIECE``."""

    def __init__(self, target_ms: float = 0.0):
        self.target_ms = target_ms
        self.ms_per_row: float | None = None  # the last pieces' speed, None before any

    def rows(self) -> int:
        if self.target_ms <= 0:
            return WARM_PIECE
        if self.ms_per_row is None:
            return 2 * PIECE_ROWS  # the speed unknown: a small piece first
        n = int(self.target_ms / self.ms_per_row) // PIECE_ROWS * PIECE_ROWS
        return max(PIECE_ROWS, min(WARM_PIECE, n))

    def snapshot(self) -> dict:
        """The pieces now: rows, and the speed (ms a row) they were sized by."""
        return {"rows": self.rows(), "ms_per_row": None if self.ms_per_row is None else round(self.ms_per_row, 3)}

    def observe(self, rows: int, ms: float) -> None:
        """A piece of ``rows`` rows ran in ``ms``; a short last piece (its fixed costs dominate) says nothing."""
        if rows >= PIECE_ROWS and ms > 0:
            rate = ms / rows
            self.ms_per_row = rate if self.ms_per_row is None else (self.ms_per_row + rate) / 2


def warm(lm: LoadedModel, ids: list[int], store: KVStore | None, cancel: threading.Event,
         piece: "int | PieceClock" = WARM_PIECE) -> tuple[int, int]:
    """Prefill ``ids`` into ``store`` ahead of a request for the same prompt, ``piece`` tokens
    at a time (a ``PieceClock``: as many as it says, timed for it), stopping between pieces once
    ``cancel`` is set (a request came, or the user moved on); what ran is stored either way.  The
    pieces start where the store's match ends, as a request's prefill does; on the native prefill
    pieces of any multiple of ``PIECE_ROWS`` rows give the bits the request's own pieces would
    (tests/test_native.py), so the request that reuses them finds the KV it would have computed
    itself.  Returns (tokens run, tokens the store already had)."""
    if store is None or not ids:
        return 0, 0
    match = store.match_prefix(ids, count=False)
    reused = min(match.length, len(ids))
    if reused >= len(ids) - 1:  # a request runs its last token itself
        return 0, reused
    clock = piece if isinstance(piece, PieceClock) else None
    store.lock(match.nodes)
    try:
        cache = lm.model.new_cache(len(ids))
        if reused:
            cache.load(match.parts, reused)
        i = reused
        while i < len(ids):
            if cancel.is_set() and i > reused:
                break
            rows = clock.rows() if clock is not None else piece
            t0 = time.perf_counter()
            lm.model(torch.tensor([ids[i:i + rows]], device=lm.device), [cache], greedy=True)
            if clock is not None:
                clock.observe(min(rows, len(ids) - i), (time.perf_counter() - t0) * 1000)
            i += rows
        n = cache.length
        store.insert(ids[:n], cache.k[:, :, :n], cache.v[:, :, :n])
    finally:
        store.unlock(match.nodes)
    return n - reused, reused


class Arrival:
    """A cancel flag that is set while a job waits in ``jobs`` (the engine's queue): idle
    work stops for the next request."""

    def __init__(self, jobs: queue.Queue):
        self.jobs = jobs

    def is_set(self) -> bool:
        return not self.jobs.empty()


def warm_ahead(lm: LoadedModel, request: CompletionRequest, settings: EngineSettings, store: KVStore | None,
               cancel, piece: "int | PieceClock" = WARM_PIECE) -> tuple[int, int, int]:
    """The prefix window's next openings (``prompts.ahead_heads``) for ``request``'s document
    prefilled into ``store``, stopping between pieces once ``cancel`` is set.  The prompts
    themselves are not changed: a request after the window moves plans what it would plan
    anyway and finds the opening cached.  Returns (openings, tokens run, tokens cached)."""
    if store is None or not settings.ahead_chars:
        return 0, 0, 0
    heads = ahead_heads(request.prefix, lm.template.template, Tokens(lm.tokenizer), settings.max_prefix_tokens,
                        request.context, settings.ahead_chars)
    ran = had = 0
    for ids in heads:
        if cancel.is_set():
            break
        r, h = warm(lm, ids, store, cancel, piece)
        ran, had = ran + r, had + h
    return len(heads), ran, had


def advance(lm: LoadedModel, live: Live, vocab: "_Vocab | None") -> bool:
    """Pick the next token from ``live.logits``; False when the request is finished."""
    request, rules = live.request, live.rules
    known, live.pick = live.pick, None  # the pass's own argmax of these logits, if it made one
    if request.cancel.is_set():
        return _finish(live, "", "cancelled")
    if live.forced is not None:
        token, live.forced = live.forced, None
    else:
        token = known if known is not None and not live.pending else pick_token(live.logits, live.pending, vocab)
        if live.branches:
            alts = branch_tokens(live.logits, token, live.pending, vocab, lm.stop_ids, live.branches)
            live.spawned.extend(fork(live, t) for t in alts)
            live.branches -= len(alts)
            if len(live.generated) + 1 >= BRANCH_WINDOW:
                live.branches = 0  # from here its steps may take the greedy head
    if token in lm.stop_ids and not (request.ignore_eos and not live.pending):
        return _finish(live, rules.finish(live.text), "eos")
    if not live.generated:
        live.timings["first_token_ms"] = (time.perf_counter() - live.t0) * 1000
    live.generated.append(token)
    if live.pending and vocab is not None:
        piece = vocab.texts[token]
        live.pending = "" if piece.startswith(live.pending) else live.pending[len(piece):]
    if not live.pending:
        live.text = decoded(lm, live, vocab)[len(live.plan.healed):]
        if live.head is None:  # the request's own completion (not an alternative's fork)
            request.set_progress(live.text, len(live.generated))
            if request.typed and not agrees(live.text, request.typed):
                request.cancel.set()  # the user typed something else than this run writes
                return _finish(live, "", "cancelled")
        if not request.ignore_eos:
            decision = rules.check(live.text)
            if decision.stop:
                return _finish(live, rules.finish(decision.text, reason=decision.reason), decision.reason)
    if len(live.generated) >= live.budget:
        return _finish(live, rules.finish(live.text, budget_cut=not request.ignore_eos), "max_tokens")
    if time.perf_counter() > live.deadline and not request.ignore_eos:
        return _finish(live, rules.finish(live.text, budget_cut=True), "time_budget")
    return True


def decoded(lm: LoadedModel, live: Live, vocab: "_Vocab | None") -> str:
    """The text of ``live.generated``, as ``tokenizer.decode`` gives it (special tokens skipped).
    After a token is added, the decode so far plus its text where both are whole characters (no
    U+FFFD: a byte-level token may hold part of one): ~1 us instead of a decode of the whole output
    on the cold caches after each forward pass (~0.05-0.1 ms a token here)."""
    n = len(live.generated)
    if vocab is not None and vocab.incremental and live.decoded_n == n - 1 > 0:
        piece = vocab.texts[live.generated[-1]]
        if "\ufffd" not in piece:
            live.decoded += piece
            live.decoded_n = n
            return live.decoded
    live.decoded = lm.tokenizer.decode(live.generated, skip_special_tokens=True)
    live.decoded_n = -1 if "\ufffd" in live.decoded else n
    return live.decoded


def _full(lv: Live) -> bool:
    """Whether the next pick reads every logit (not just the greedy one)."""
    return bool(lv.pending or lv.branches)


def step(lm: LoadedModel, lives: list[Live]) -> None:
    """One batched forward pass: each live request's last token -> its next logits."""
    tokens = torch.tensor([[lv.generated[-1]] for lv in lives], device=lm.device)
    # healing picks among the tokens that fit its pending text, and a head looking for a
    # branch ranks tokens: they need every logit
    logits = lm.model(tokens, [lv.cache for lv in lives], greedy=not any(_full(lv) for lv in lives))
    for lv, row in zip(lives, logits):
        lv.fed.append(lv.generated[-1])
        lv.logits = row
        lv.passes += 1
        lv.layers += lm.model.args.n_layers


@dataclass
class ExitRuntime:
    """Loaded exits and how to use them (``ExitSettings`` resolved)."""

    exits: Exits
    policy: ExitPolicy
    lossless: bool = False
    draft_layer: int = 0
    draft_tokens: int = 4
    draft_margin: float = 0.0  # lossless: the softmax margin below which drafting stops
    max_batch: int = 1  # lossy exits only for batches this small (lossless: one request)
    # lossless, what-if measurements only (bench/early_exit_ceiling.py): (request, draft index) ->
    # the token to draft instead of the exit head's, or None to stop drafting
    oracle: Callable[[Live, int], int | None] | None = None

    def takes(self, batch: int) -> bool:
        """Whether a decode step of ``batch`` requests goes through the exits.  Self-speculation
        is per request (a batch takes plain batched steps: the same output, far faster); lossy
        exits measured slower than the full model from batch 2 (a larger batch rarely has every
        row confident, and each check then costs every row)."""
        return batch <= (1 if self.lossless else self.max_batch)

    @classmethod
    def build(cls, exits: Exits, s: ExitSettings) -> "ExitRuntime":
        known = list(exits.layers) + ([exits.final] if exits.final else [])  # final: the last layer's check
        layers = [int(x) for x in s.layers.split(",") if x.strip()] or known
        unknown = [n for n in layers if n not in known]
        if unknown:
            raise ExitsError(f"exit layers {unknown} are not among the trained ones {known}")
        if s.lossless:  # drafts need no confidence: the full model checks every one
            thresholds = {}
        elif s.measure == "classifier" and not exits.trained:
            raise ExitsError("the classifier measure needs trained exits (python -m codecomplete.model.exit_train)")
        elif s.threshold > 0:
            thresholds = {n: s.threshold for n in layers}
        else:
            key = f"{s.measure}@{s.bound:g}"
            if key not in exits.thresholds:
                have = sorted(k for k in exits.thresholds if k.startswith(s.measure + "@"))
                raise ExitsError(f"no thresholds calibrated for {key} (have: {', '.join(have) or 'none'}); "
                                 "recalibrate with python -m codecomplete.model.exit_train --bounds ...")
            stored = exits.thresholds[key]
            thresholds = {n: stored[n] for n in layers if n in stored}
        draft = s.draft_layer or exits.layers[len(exits.layers) // 2]
        if s.lossless and draft not in exits.layers:  # the draft head is that exit's adapter
            raise ExitsError(f"draft_layer {draft} is not among the exits {exits.layers}")
        margin = 0.0
        if s.lossless and s.draft_bound > 0:  # a draft is worth its early layers only when likely accepted
            if s.threshold > 0:
                margin = s.threshold
            else:
                # the calibrated bound nearest draft_bound (exits are calibrated for a few bounds; none:
                # always draft); an exit left out at that bound is too rarely confident: it never drafts
                # (each exit's own thresholds: jointly chosen ones may leave the drafting exit out)
                table = exits.draft_thresholds or exits.thresholds
                bounds = [float(k.split("@")[1]) for k in table if k.startswith("softmax@")]
                if bounds:
                    near = min(bounds, key=lambda b: (abs(b - s.draft_bound), b))
                    margin = table[f"softmax@{near:g}"].get(draft, math.inf)
        return cls(exits, ExitPolicy(s.measure, thresholds, s.batch_rule, s.decay), s.lossless, draft,
                   max(1, s.draft_tokens), margin, max(1, s.max_batch))


def exit_step(lm: LoadedModel, lives: list[Live], rt: ExitRuntime) -> None:
    """``step`` with early exit: confident tokens leave the layer stack early; the KV of
    the layers they skip is filled from their exit state.  Healing steps run every layer."""
    rt.policy.max_len = max(lv.budget for lv in lives)
    logits, ran = exit_forward(lm.model, rt.exits, rt.policy, [lv.generated[-1] for lv in lives],
                               [lv.cache for lv in lives], [len(lv.generated) for lv in lives],
                               allow=[not lv.pending for lv in lives], greedy=True)
    for lv, row, n in zip(lives, logits, ran):
        lv.fed.append(lv.generated[-1])
        lv.logits = row
        lv.passes += 1
        lv.layers += n


def self_spec_step(lm: LoadedModel, lives: list[Live], rt: ExitRuntime, vocab: "_Vocab | None") -> list[Live]:
    """Lossless early exit: per request, the early layers draft and the full model
    verifies (LayerSkip's self-speculation); exactly greedy decoding's output.  Each request
    runs alone, so ``decode_step`` gives this one request at a time (``ExitRuntime.takes``;
    one by one, 16 requests decoded at 0.11-0.18x the batched speed)."""
    going = []
    n_layers = lm.model.args.n_layers
    for lv in lives:
        room = lv.budget - len(lv.generated)
        if lv.pending or room <= 1:
            step(lm, [lv])
            going.append(lv)
            continue
        root = lv.generated[-1]
        acc, logits, drafted = self_spec(lm.model, rt.exits, rt.draft_layer, root, lv.cache,
                                         min(rt.draft_tokens, room - 1), lm.stop_ids, rt.draft_margin,
                                         None if rt.oracle is None else (lambda j, lv=lv: rt.oracle(lv, j)))
        lv.layers += (drafted + 1) * rt.draft_layer + n_layers - rt.draft_layer
        lv.spec_steps += 1
        lv.accepted += len(acc)
        if _take(lm, lv, root, acc, logits, vocab):
            going.append(lv)
    return going


def _take(lm: LoadedModel, lv: Live, root: int, acc: list[int], logits: torch.Tensor,
          vocab: "_Vocab | None", bonus: int | None = None) -> bool:
    """Verified tokens through ``advance`` one by one (stop rules, budget), as if decoded
    one at a time; False when the request finished.  ``bonus`` (or None): the pass's greedy
    token after the last of them.  A retrieval pass (``bonus`` given) already took the argmax of
    every row: the accepted tokens are those argmaxes, so advance does not take them again
    (~30 us a row on the caches a pass leaves cold)."""
    lv.passes += 1
    lv.fed.append(root)
    lv.fed.extend(acc)
    for j, tok in enumerate(acc):
        lv.logits = logits[j]
        lv.pick = tok if bonus is not None else None
        if not advance(lm, lv, vocab):
            return False
        if lv.generated[-1] != tok:  # cannot happen with greedy picks; never emit a wrong token
            raise RuntimeError(f"speculation desynchronised: {lv.generated[-1]} != {tok}")
    lv.logits = logits[len(acc)]
    lv.pick = bonus
    return True


def spec_step(lm: LoadedModel, lives: list[Live], drafter: Drafter, vocab: "_Vocab | None",
              undrafted: Callable[[], list[Live]] | None = None) -> list[Live]:
    """``step`` with retrieval speculation: each request's last token and its draft tree
    run in one pass; the accepted tokens go through ``advance`` one by one (stop rules,
    budget) exactly as if decoded one at a time.  Returns the requests still going.
    ``undrafted``: what to run instead when no request has a draft (default: a plain step)."""
    trees = []
    rows = pass_rows(drafter.settings, lm.model)
    min_match = datastore_min_match(drafter.settings, lm.model)
    for lv in lives:
        room = lv.budget - len(lv.generated)
        if lv.pending or room <= 0 or lv.request.cancel.is_set():
            trees.append(Tree())  # healing constrains the choice: plain greedy steps
        else:
            if lv.live is None:
                lv.live = LiveIndex()
            trees.append(drafter.draft(lv.fed + [lv.generated[-1]], limit=min(room, rows - 1), live=lv.live,
                                       min_match=min_match))
    cap = rows - 1  # a tree wider than the cap (max_nodes > cap) keeps its best nodes (parents come first)
    if lm.model.native_stack is not None and len(lives) > 1:
        # one native call takes STACK_ROWS rows (sequences x (1 + nodes)); a larger pass
        # would run as several: past that, trees lose their last nodes instead
        cap = min(cap, max(0, STACK_ROWS // len(lives) - 1))
    trees = [t.first(cap) for t in trees]
    if not any(len(t) for t in trees):
        if undrafted is not None:
            return undrafted()
        step(lm, lives)
        return lives
    roots = [lv.generated[-1] for lv in lives]
    going = []
    for lv, root, tree, (acc, logits, bonus) in zip(lives, roots, trees,
                                                     verify(lm.model, roots, trees, [lv.cache for lv in lives],
                                                            greedy=not any(_full(lv) for lv in lives))):
        context = lv.fed[-4:] + [root]
        lv.layers += lm.model.args.n_layers
        if len(tree):
            lv.spec_steps += 1
            lv.accepted += len(acc)
        alive = _take(lm, lv, root, acc, logits, vocab, bonus)
        drafter.learn(context, acc)
        if alive:
            going.append(lv)
    return going


def decode_step(lm: LoadedModel, lives: list[Live], vocab: "_Vocab | None", exits: ExitRuntime | None = None,
                drafter: Drafter | None = None) -> list[Live]:
    """One decode step by whichever path is on; returns the requests still going.  Early
    exit (lossless or not) takes the batches it is faster for (``ExitRuntime.takes``); other
    batches decode as without it: retrieval speculation, else plain steps (both exactly the
    full model's greedy output).  With retrieval speculation on too, a step whose requests
    have retrieved drafts verifies them (they cost no layers to make, and measured far
    faster); early exit takes the steps with none."""
    if exits is not None and exits.takes(len(lives)) and not any(lv.branches for lv in lives):
        def early() -> list[Live]:
            if exits.lossless:
                return self_spec_step(lm, lives, exits, vocab)
            exit_step(lm, lives, exits)
            return lives

        return spec_step(lm, lives, drafter, vocab, early) if drafter is not None else early()
    if drafter is not None:
        return spec_step(lm, lives, drafter, vocab)
    else:
        step(lm, lives)
    return lives


def _finish(live: Live, text: str, reason: str) -> bool:
    n = len(live.generated)
    t = live.timings
    t["decode_ms"] = (time.perf_counter() - t.pop("decode_start", live.t0)) * 1000 if n else 0.0
    t["total_ms"] = (time.perf_counter() - live.t0) * 1000
    live.result = Completion(text if reason != "cancelled" else "", reason, len(live.plan.ids), n, t,
                             multiline=live.rules.shape.multiline, token_ids=list(live.generated),
                             reused_tokens=live.reused, prompt_kind=live.plan.kind,
                             spec_steps=live.spec_steps, accepted_tokens=live.accepted,
                             forward_passes=live.passes, layers_run=live.layers)
    return False


def release(live: Live, store: KVStore | None) -> None:
    """Give the request's KV (prompt and output) to the store; unlock what it used."""
    if store is None:
        return
    if live.nodes:
        store.unlock(live.nodes)
        live.nodes = []
    n = live.cache.length
    if n and live.result is not None and live.result.stop_reason != "error":
        store.insert(live.fed[:n], live.cache.k[:, :, :n], live.cache.v[:, :, :n])


def generate(lm: LoadedModel, request: CompletionRequest, settings: EngineSettings,
             vocab: "_Vocab | None" = None, store: KVStore | None = None,
             pool: SessionPool | None = None, drafter: Drafter | None = None,
             exits: ExitRuntime | None = None) -> Completion:
    """One request alone, start to finish (the unbatched path, used by tests and tools)."""
    plan = plan_prompt(lm, request, settings, vocab, pool)
    if request.cancel.is_set():
        return Completion("", "cancelled", len(plan.ids), prompt_kind=plan.kind)
    live = start(lm, request, plan, store)
    members, going = [live], [live]
    while going:
        going = advance_all(lm, going, vocab, members)
        if going:
            stepped = going
            going = decode_step(lm, going, vocab, exits, drafter)
            going += adopt(stepped, members)
    if drafter is not None:
        drafter.learn_output(live.plan.ids, live.generated)
    for lv in members:
        release(lv, store)
    return gathered(live)


def advance_all(lm: LoadedModel, lives: list[Live], vocab: "_Vocab | None", members: list[Live]) -> list[Live]:
    """``advance`` each of ``lives``; the forks a pick makes are added to ``members`` at
    once and take their own first pick.  Returns the ones still going."""
    going = []
    for lv in list(lives):
        if advance(lm, lv, vocab):
            going.append(lv)
        while lv.spawned:
            f = lv.spawned.pop(0)
            members.append(f)
            if advance(lm, f, vocab):
                going.append(f)
    return going


def adopt(lives: list[Live], members: list[Live]) -> list[Live]:
    """The forks made during a decode step (a verification pass replays its accepted
    tokens' picks, and a head forks there), added to ``members``; returns them.  Their
    first pick is the next ``advance``."""
    forks = []
    for lv in lives:
        forks += lv.spawned
        lv.spawned = []
    members += forks
    return forks


def gathered(head: Live) -> Completion:
    """The head's completion with its forks' as alternatives (once all have finished)."""
    head.result.alternatives = [f.result for f in head.forks if f.result is not None]
    return head.result


def kv_dtype(name: str, model) -> torch.dtype:
    """The KV cache's dtype for the setting ``name``; ``auto``: the model's default
    (``Transformer.default_kv_dtype``; docs/decisions.md)."""
    return model.default_kv_dtype if name == "auto" else getattr(torch, name)


def default_exits_path(lm: LoadedModel) -> Path | None:
    """Exit heads stored with the model: an ``exits/`` folder in its home (for the
    default model, the shipped adapter's package data)."""
    folder = Path(lm.home) / "exits" if lm.home else None
    return folder if folder is not None and (folder / "exits.json").is_file() else None


# -- the engine thread -----------------------------------------------------------------

class Engine:
    """Owns the model, the KV store and the session pool; serves requests on its thread."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.lm: LoadedModel | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.store: KVStore | None = None
        self.pool = SessionPool(inc_bound=settings.inc_bound, head_lines=settings.head_lines)
        self._vocab: _Vocab | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stats_lock = threading.Lock()
        self.on_load: list = []  # callables given the LoadedModel after each successful load
        self.drafter: Drafter | None = None
        self._exit_rt: tuple[ExitSettings, ExitRuntime | None] | None = None
        self._loaded_exits: tuple[str, Exits] | None = None
        self.exit_error: str | None = None
        self._retriever = None  # RepoIndex.lookup, given by the daemon (set_retriever)
        self._ahead: CompletionRequest | None = None  # the last request, for idle time's warm-up ahead
        self.pieces = PieceClock(settings.warm_piece_ms)  # warm prefills' pieces, timed on this machine
        self.governor: ThreadGovernor | None = None  # CPU passes' thread count under contention
        self._default_threads = 0
        self._stats = engine_counters()
        # set while the engine works (loading, a request or warm-up in flight), clear while it
        # waits for one: background work (the repository index) yields to it (``busy``)
        self._working = threading.Event()
        self._working.set()

    # -- public API (any thread) -------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def busy(self) -> bool:
        """Whether the engine is working now (loading, or a request or warm-up in flight) rather
        than waiting for one."""
        return self._working.is_set()

    def submit(self, request: CompletionRequest, fut: "Future[Completion] | None" = None) -> "Future[Completion]":
        """Queue ``request``; its future (``fut``, or a new one) resolves to a ``Completion``."""
        fut = Future() if fut is None else fut
        self._jobs.put((request, fut))
        return fut

    def reload(self, settings: EngineSettings) -> None:
        """Load another model on the engine thread, after the requests already queued."""
        self._jobs.put(("reload", settings))

    def configure(self, settings: EngineSettings) -> None:
        """Apply new settings: a reload if the model changed, else at the next request."""
        old = self.settings
        if (old.model, old.device, old.dtype, old.template, old.threads, old.adaptive_threads, old.pack_weights,
                old.kv_dtype, old.weights) != (settings.model, settings.device, settings.dtype, settings.template,
                                               settings.threads, settings.adaptive_threads, settings.pack_weights,
                                               settings.kv_dtype, settings.weights) \
                or (old.native_attention != settings.native_attention and settings.weights != "bf16"):
            # int8 weights are made from the checkpoint's at load: native_decode cannot pack them anew
            self.reload(settings)
        else:
            self.settings = settings
            if self.lm is not None and old.native_attention != settings.native_attention:
                # safe mid-iteration: both paths read and write the caches alike
                self.lm.model.native_decode(settings.native_attention)
                self.lm.model.pack_where_read(settings.pack_weights)
                self.lm.model.release_dense()
            self.pool.inc_bound = settings.inc_bound
            self.pool.head_lines = settings.head_lines
            self.pieces.target_ms = settings.warm_piece_ms
            if self.store is not None:
                self.store.budget = settings.kv_budget_mb * 2**20

    def set_retriever(self, retriever) -> None:
        """Where drafts come from besides the verified cache: ``RepoIndex.lookup`` (the
        repository with open buffers, and the common datastore)."""
        self._retriever = retriever
        if self.drafter is not None:
            self.drafter.retriever = retriever

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def complete(self, request: CompletionRequest) -> Completion:
        """Synchronous helper for scripts and the CLI."""
        return self.submit(request).result()

    def stats(self) -> dict:
        with self._stats_lock:
            counters = dict(self._stats)
        ready = self.ready.is_set()
        return engine_stats(counters, self.settings, self.lm, ready, self.load_error, self.exit_error,
                            self.drafter, self.store, self.pool.counts, self.governor,
                            loading=None if ready else load_stage(), pieces=self.pieces)

    # -- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        self._load(self.settings)
        live: list[Live] = []
        reload_to: EngineSettings | None = None
        while True:
            # Admit: block when idle; otherwise take what has arrived, up to max_batch.
            while reload_to is None and len(live) < max(1, self.settings.max_batch):
                try:
                    job = self._jobs.get(block=False)
                except queue.Empty:
                    if live:
                        break
                    if self._ahead is not None and reload_to is None:
                        self._run_ahead()
                        continue  # a job may have come meanwhile
                    self._working.clear()  # idle until the next job
                    job = self._jobs.get()
                    self._working.set()
                if job is None:
                    for lv in live:
                        lv.request.cancel.set()
                    self._drain(live)
                    self._working.clear()  # closed: nothing more to yield to
                    if self._default_threads and torch.get_num_threads() != self._default_threads:
                        # torch keeps the last count for threads started later (other engines in
                        # this process): leave the count this engine found
                        torch.set_num_threads(self._default_threads)
                    return
                if job[0] == "reload":
                    reload_to = job[1]
                    break
                lv = self._admit(*job)
                if lv is not None:
                    live.append(lv)
            if live:
                self._iterate(live)
            elif reload_to is not None:
                self._load(reload_to)
                reload_to = None

    def _drain(self, live: list[Live]) -> None:
        while live:
            self._iterate(live)

    def _admit(self, request: CompletionRequest, fut: Future) -> Live | None:
        if not fut.set_running_or_notify_cancel():
            return None
        queued_ms = (time.perf_counter() - request.submitted_at) * 1000
        if self.lm is None:
            fut.set_result(Completion("", "model_unavailable", error=self.load_error,
                                      timings={"queue_ms": queued_ms}))
            return None
        if request.cancel.is_set():
            self._count(cancelled=1)
            fut.set_result(Completion("", "cancelled", timings={"queue_ms": queued_ms}))
            return None
        if request.warm:
            self._warm(request, fut, queued_ms)
            return None
        try:
            with torch.inference_mode():
                plan = plan_prompt(self.lm, request, self.settings, self._healing_vocab(), self.pool)
                lv = start(self.lm, request, plan, self.store)
        except Exception as exc:
            log.exception("[%s] prefill failed", request.request_id)
            self._count(failed=1)
            fut.set_result(Completion("", "error", error=f"{type(exc).__name__}: {exc}",
                                      timings={"queue_ms": queued_ms}))
            return None
        lv.future = fut
        lv.timings["queue_ms"] = queued_ms
        request.run_info = {"prompt_tokens": len(plan.ids), "reused_tokens": lv.reused, "queue_ms": queued_ms,
                            "prefill_ms": lv.timings["prefill_ms"], "decode_start": lv.timings["decode_start"]}
        return lv

    def _warm(self, request: CompletionRequest, fut: Future, queued_ms: float) -> None:
        """A warm request (``CompletionRequest.warm``): the prompt a request would get now
        (the document's EFIM session left as it is) prefilled into the KV store; no decoding."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                plan = plan_prompt(self.lm, request, self.settings, self._healing_vocab(), self.pool)
                ran, had = warm(self.lm, plan.ids, self.store, request.cancel, self.pieces)
        except Exception as exc:
            log.exception("[%s] warm prefill failed", request.request_id)
            fut.set_result(Completion("", "error", error=f"{type(exc).__name__}: {exc}",
                                      timings={"queue_ms": queued_ms}))
            return
        ms = (time.perf_counter() - t0) * 1000
        stopped = request.cancel.is_set() and had + ran < len(plan.ids) - 1
        self._count(warm_prefills=1, warm_tokens=ran, warm_stopped=int(stopped), warm_ms=ms)
        log.info("[%s] warm %s prompt %d (%d cached), ran %d in %.0f ms%s", request.request_id, plan.kind,
                 len(plan.ids), had, ran, ms, ", stopped" if stopped else "")
        fut.set_result(Completion("", "cancelled" if stopped else "warm", len(plan.ids), reused_tokens=had,
                                  timings={"queue_ms": queued_ms, "prefill_ms": ms}, prompt_kind=plan.kind))

    def _run_ahead(self) -> None:
        """Idle time after a request: the prefix window's next opening for its document
        prefilled (``warm_ahead``), until a job arrives (what ran is kept)."""
        request, self._ahead = self._ahead, None
        if self.lm is None:
            return
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                heads, ran, had = warm_ahead(self.lm, request, self.settings, self.store, Arrival(self._jobs),
                                              self.pieces)
        except Exception:
            log.exception("[%s] ahead prefill failed", request.request_id)
            return
        if ran:
            ms = (time.perf_counter() - t0) * 1000
            self._count(ahead_prefills=1, ahead_tokens=ran, ahead_ms=ms)
            log.info("[%s] ahead: %d window opening(s), ran %d (%d cached) in %.0f ms%s", request.request_id,
                     heads, ran, had, ms, ", stopped" if Arrival(self._jobs).is_set() else "")

    def _iterate(self, live: list[Live]) -> None:
        """Advance every live request by one token; retire the finished ones."""
        vocab = self._healing_vocab()
        batch = 0
        try:
            with torch.inference_mode():
                going = advance_all(self.lm, live, vocab, live)
                batch = len(going)
                if going:
                    stepped = going
                    going = decode_step(self.lm, going, vocab, self._exits(), self._drafter())
                    going += adopt(stepped, live)
        except Exception as exc:
            log.exception("decode step failed for %d requests", len(live))
            adopt(list(live), live)  # forks made before the failure: their heads wait for them
            for lv in live:
                if lv.result is None:
                    lv.result = Completion("", "error", error=f"{type(exc).__name__}: {exc}")
            going = []
        self._count(iterations=1 if batch else 0, batched_tokens=batch)
        with self._stats_lock:
            self._stats["max_batch_seen"] = max(self._stats["max_batch_seen"], batch)
        for lv in [lv for lv in live if lv not in going]:
            live.remove(lv)
            self._retire(lv)

    def _retire(self, lv: Live) -> None:
        fork = lv.head is not None  # not greedy decoding's output: not learnt from
        if self.drafter is not None and not fork and lv.result is not None and lv.result.stop_reason != "error":
            self.drafter.learn_output(lv.plan.ids, lv.generated)
        try:
            release(lv, self.store)
        except Exception:
            log.exception("[%s] could not store KV", lv.request.request_id)
        r = lv.result
        # a fork's prompt and first tokens are its head's: counted once, there
        own = 0 if fork else 1
        self._count(completions=own, alternatives=1 - own, cancelled=int(r.cancelled),
                    failed=int(r.stop_reason == "error"), prompt_tokens=own * r.prompt_tokens,
                    reused_tokens=own * r.reused_tokens, generated_tokens=r.generated_tokens - lv.born,
                    prefill_ms=own * r.timings.get("prefill_ms", 0.0),
                    decode_ms=r.timings.get("decode_ms", 0.0), spec_steps=r.spec_steps,
                    accepted_tokens=r.accepted_tokens, layers_run=r.layers_run,
                    decode_passes=r.forward_passes)
        log.info("[%s]%s %s prompt %d (%d reused) + %d generated, prefill %.0f ms, decode %.0f ms, stop %s",
                 lv.request.request_id, " alternative" if fork else "", r.prompt_kind, r.prompt_tokens,
                 r.reused_tokens, r.generated_tokens,
                 r.timings.get("prefill_ms", 0), r.timings.get("decode_ms", 0), r.stop_reason)
        if not fork and self.settings.ahead_chars and r.stop_reason != "error":
            self._ahead = lv.request  # idle time next: the document's next window (_run_ahead)
        head = lv.head or lv
        head.open -= 1
        if head.open == 0 and head.future is not None:
            head.future.set_result(gathered(head))

    def _load(self, settings: EngineSettings) -> None:
        self.ready.clear()
        self.settings = settings
        self.pool = SessionPool(inc_bound=settings.inc_bound, head_lines=settings.head_lines)
        self.pieces = PieceClock(settings.warm_piece_ms)  # another model, device or thread count: timed anew
        if self._default_threads == 0:  # the engine thread's count before anything set it
            self._default_threads = torch.get_num_threads()
        if settings.threads > 0 or torch.get_num_threads() != self._default_threads:  # a governor's count undone
            torch.set_num_threads(settings.threads or self._default_threads)
        try:
            self.lm = load_model(settings.model, settings.device, settings.dtype, settings.template,
                                 pack=settings.pack_weights, native=settings.native_attention, busy=self.busy,
                                 weights=settings.weights)
            self.lm.model.kv_dtype = kv_dtype(settings.kv_dtype, self.lm.model)
            self._govern(settings)
            self.load_error = None
            self._vocab = None
            self.drafter = None  # its cache holds the old tokenizer's ids
            self._exit_rt, self._loaded_exits = None, None
            # self.settings, not the argument: configure() may have run while loading
            self.store = KVStore(self.settings.kv_budget_mb * 2**20)
            self.pool.inc_bound = self.settings.inc_bound
            self.pool.head_lines = self.settings.head_lines
            for callback in list(self.on_load):
                try:
                    callback(self.lm)
                except Exception:
                    log.exception("a model-load listener failed")
        except ModelLoadError as exc:
            self.lm, self.load_error = None, str(exc)
            log.error("model unavailable: %s", exc)
        except Exception as exc:  # a broken checkpoint must not kill the thread
            self.lm, self.load_error = None, f"{type(exc).__name__}: {exc}"
            log.exception("model failed to load")
        finally:
            self.ready.set()

    def _govern(self, settings: EngineSettings) -> None:
        """Passes on the CPU take as many threads as other processes leave free
        (``threads.ThreadGovernor``), checked before each pass on the engine thread."""
        self.governor = None
        self.lm.model.before_pass = None
        if not settings.adaptive_threads or self.lm.device.type != "cpu":
            return
        self.governor = ThreadGovernor(limit=torch.get_num_threads())  # settings.threads, or torch's default
        if self.governor.enabled:
            self.lm.model.before_pass = self._apply_threads

    def _apply_threads(self) -> None:
        gov = self.governor  # set with the hook, on this thread
        n = gov.threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
            log.debug("passes use %d of %d threads (other processes use %.2f cores)", n, gov.limit, gov.others)

    def _drafter(self) -> Drafter | None:
        spec = self.settings.speculation
        if not spec.enabled or self.lm is None:
            return None
        if self.drafter is None or self.drafter.settings != spec:
            old = self.drafter
            if self._vocab is None:
                self._vocab = _Vocab(self.lm.tokenizer)
            self.drafter = Drafter(spec, self._retriever, self._vocab.texts)
            if old is not None:  # new settings keep what was learnt
                self.drafter.cache = old.cache
        return self.drafter

    def _exits(self) -> ExitRuntime | None:
        """The early-exit runtime for the current settings; None when off or unusable
        (the reason is in ``exit_error`` and the stats; completions go on without)."""
        s = self.settings.early_exit
        if not s.enabled or self.lm is None:
            return None
        if self._exit_rt is not None and self._exit_rt[0] == s:
            return self._exit_rt[1]
        rt = None
        try:
            path = s.path or default_exits_path(self.lm)
            if path is None:
                raise ExitsError(f"no exit heads for model {self.lm.name}: train them with "
                                 "python -m codecomplete.model.exit_train and set early_exit.path")
            if self._loaded_exits is None or self._loaded_exits[0] != str(path):
                self._loaded_exits = (str(path), load_exits(path, self.lm.model, model_identity(self.lm.home)))
            rt = ExitRuntime.build(self._loaded_exits[1], s)
            self.exit_error = None
        except ExitsError as exc:
            self.exit_error = str(exc)
            log.error("early exit off: %s", exc)
        self._exit_rt = (s, rt)
        return rt

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
