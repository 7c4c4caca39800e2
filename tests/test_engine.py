"""The engine on the tiny real model, in fp32: each fast path against a slow reference."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from codecomplete.model.api import CompletionRequest, EngineSettings
from codecomplete.model.engine import (BRANCH_MIN_P, BRANCH_WINDOW, Engine, _Vocab, advance, generate, plan_prompt,
                                       PieceClock, release, start, step, warm, warm_ahead)
from codecomplete.model.kvstore import KVStore
from codecomplete.model.loader import load_model
from codecomplete.model import prompts
from codecomplete.model.prompts import SessionPool, Tokens, ahead_heads, window_start

POINT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self."
NO_HEAL = EngineSettings(token_healing=False)


@pytest.fixture(scope="module")
def lm(tiny_model):
    return load_model(str(tiny_model), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def greedy_without_cache(hf, stop_ids, ids: list[int], steps: int) -> list[int]:
    """The slow reference: transformers' model over the whole sequence at every step."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            token = int(hf(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if token in stop_ids:
                break
            out.append(token)
    return out


@pytest.mark.parametrize("prefix,suffix", [
    (POINT, "\n"),
    ("def mean(data):\n    total = 0\n    for x in data:\n        total", "\n    return total\n"),
    ("import os\nimport ", ""),
])
def test_engine_greedy_equals_transformers_recomputing_everything(lm, hf, prefix, suffix):
    """Guards the own forward + KV cache inside the engine against the HF reference."""
    request = CompletionRequest(prefix, suffix, mode="multi", max_tokens=24, max_lines=200)
    with torch.inference_mode():
        result = generate(lm, request, NO_HEAL)
    plan = plan_prompt(lm, request, NO_HEAL, None, None)
    assert result.generated_tokens > 0
    assert result.token_ids == greedy_without_cache(hf, lm.stop_ids, plan.ids, result.generated_tokens)


def edits(seed: int, n: int = 12):
    """A random editing session: typing, deleting, jumping elsewhere, editing the suffix."""
    rng = random.Random(seed)
    doc = POINT + "\n\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"
    cursor = len(POINT)
    for _ in range(n):
        r = rng.random()
        if r < 0.55:
            text = rng.choice(["x", "y", " = ", "(", "self", ".", "\n        ", "ab", "_"])
            doc, cursor = doc[:cursor] + text + doc[cursor:], cursor + len(text)
        elif r < 0.7 and cursor > 1:
            doc, cursor = doc[:cursor - 1] + doc[cursor:], cursor - 1
        elif r < 0.85:
            cursor = rng.randrange(len(doc) + 1)
        else:
            at = rng.randrange(cursor, len(doc) + 1)
            doc = doc[:at] + "# note\n" + doc[at:]
        yield doc[:cursor], doc[cursor:]


def run_plan(lm, request, plan, vocab, store):
    live = start(lm, request, plan, store)
    while advance(lm, live, vocab):
        step(lm, [live])
    release(live, store)
    return live.result


@pytest.mark.parametrize("seed,head_lines", [(0, 0), (1, 0), (2, 1), (3, 2)])
def test_reuse_never_changes_the_output(lm, seed, head_lines):
    """Guards KV reuse and EFIM sessions: the same plan with a store = without one."""
    vocab = _Vocab(lm.tokenizer)
    settings = EngineSettings(token_healing=True)
    store, pool = KVStore(64 * 2**20), SessionPool(inc_bound=16, head_lines=head_lines)
    reused, kinds = 0, set()
    with torch.inference_mode():
        for prefix, suffix in edits(seed):
            request = CompletionRequest(prefix, suffix, mode="multi", max_tokens=12, max_lines=200,
                                        session_key="doc")
            plan = plan_prompt(lm, request, settings, vocab, pool)
            fast = run_plan(lm, request, plan, vocab, store)
            slow = run_plan(lm, request, plan, vocab, None)
            assert fast.token_ids == slow.token_ids and fast.text == slow.text
            reused += fast.reused_tokens
            kinds.add(plan.kind)
    assert reused > 0 and kinds == ({"psm", "efim"} if head_lines == 0 else {"efim"}) | (kinds & {"psm"})


def test_efim_prompt_is_built_token_for_token(lm):
    """Guards EFIM: <P>prefix0<S>suffix<M>inc with each segment tokenized alone."""
    toks, t = Tokens(lm.tokenizer), lm.template.template
    pool = SessionPool(inc_bound=64)
    prefix0, suffix = "def area(r):\n    return 3.14 * r", "\n\nprint(area(2))\n"
    first = pool.plan( "doc", prefix0, suffix, t, toks, 1024, 256)
    sid = toks.special
    head = ([sid(t.prefix)] + toks.encode("def area(r):") + toks.encode("\n    return 3.14 * r")
            + [sid(t.suffix)] + toks.encode(suffix) + [sid(t.middle)])
    assert first.kind == "psm" and first.ids == head
    grown = pool.plan( "doc", prefix0 + " * r  # are", suffix, t, toks, 1024, 256)
    assert grown.kind == "efim" and grown.ids == head + toks.encode(" * r  # are")
    moved = pool.plan( "doc", prefix0[:-3], suffix, t, toks, 1024, 256)
    assert moved.kind == "psm" and moved.reason == "rebase"
    other = pool.plan( "other-doc", prefix0, suffix, t, toks, 1024, 256)
    assert other.kind == "psm" and other.reason == "new session"


def test_head_lines_put_the_last_lines_after_middle_from_the_first_request(lm):
    """Guards head_lines: a new session's prefix0 ends K lines before the cursor, the
    rest is EFIM's inc at once; typing on extends the same head."""
    toks, t = Tokens(lm.tokenizer), lm.template.template
    suffix = "\n\nprint(area(2))\n"
    prefix = "import math\n\ndef area(r):\n    return math.pi * r"
    for lines, cut in [(1, prefix.index("    return")), (2, prefix.index("def area")),
                       (9, 0)]:
        pool = SessionPool(inc_bound=64, head_lines=lines)
        first = pool.plan("doc", prefix, suffix, t, toks, 1024, 256)
        # no line that far back (9): the whole window goes after <M>, prefix0 is empty
        head = SessionPool().plan(None, prefix[:cut], suffix, t, toks, 1024, 256).ids
        assert first.kind == "efim" and first.ids[:len(head)] == head
        assert first.ids[len(head):] == toks.encode(prefix[cut:])
        grown = pool.plan("doc", prefix + " * r", suffix, t, toks, 1024, 256)
        assert grown.kind == "efim" and grown.ids == head + toks.encode(prefix[cut:] + " * r")
    at_line_start = SessionPool(inc_bound=64, head_lines=1).plan("d", prefix + "\n", suffix, t, toks, 1024, 256)
    assert at_line_start.kind == "efim" and at_line_start.ids[-len(toks.encode(prefix[cut:])):] != []
    assert SessionPool(head_lines=1).plan(None, prefix, suffix, t, toks, 1024, 256).kind == "psm"  # no session
    # the first inc obeys inc_bound: a long line moves prefix0's end forward, whole lines at a time
    long_line = "data = [" + ", ".join(str(i) for i in range(60)) + "]\n"
    wide = prefix.replace("def area", long_line + "def area")
    bound = len(toks.encode(wide[wide.index("def area"):])) + 1
    assert bound < len(toks.encode(wide[wide.index("data = ["):]))
    capped = SessionPool(inc_bound=bound, head_lines=3).plan("d", wide, suffix, t, toks, 1024, 256)
    head = SessionPool().plan(None, wide[:wide.index("def area")], suffix, t, toks, 1024, 256).ids
    assert capped.kind == "efim" and capped.ids[:len(head)] == head
    assert capped.ids[len(head):] == toks.encode(wide[wide.index("def area"):])
    tight = SessionPool(inc_bound=2, head_lines=3).plan("d", wide, suffix, t, toks, 1024, 256)
    assert tight.kind == "psm"  # even the cursor's line is over the bound


def test_context_opens_the_prefix_and_stays_through_efim(lm):
    """Guards prompt context: snippets are their own segment right after <P>; an EFIM
    continuation keeps the session's context (a new one waits for the next rebase)."""
    toks, t = Tokens(lm.tokenizer), lm.template.template
    pool = SessionPool(inc_bound=64)
    ctx = "# lib.py\ndef area(r):\n    return 3.14 * r * r\n\n"
    first = pool.plan("doc", "x = are", "", t, toks, 1024, 256, context=ctx)
    sid = toks.special
    assert first.ids[:1 + len(toks.encode(ctx))] == [sid(t.prefix)] + toks.encode(ctx)
    grown = pool.plan("doc", "x = area(", "", t, toks, 1024, 256, context="# other\n")
    assert grown.kind == "efim" and grown.ids[:len(first.ids)] == first.ids
    plain = SessionPool().plan(None, "x = are", "", None, toks, 1024, 256, context=ctx)
    assert plain.ids[:len(toks.encode(ctx))] == toks.encode(ctx)


def test_efim_inc_bound_rebases(lm):
    toks, t = Tokens(lm.tokenizer), lm.template.template
    pool = SessionPool(inc_bound=3)
    pool.plan( "d", "x = ", "", t, toks, 1024, 256)
    assert pool.plan( "d", "x = 1", "", t, toks, 1024, 256).kind == "efim"
    assert pool.plan( "d", "x = 1 + 2 + 3 + 4", "", t, toks, 1024, 256).reason == "inc bound"


def test_tiny_budget_evicts_without_corrupting(lm):
    """Guards eviction: a store that holds almost nothing still gives exact outputs."""
    store = KVStore(30_000)  # a few dozen tokens of KV
    with torch.inference_mode():
        for prefix, suffix in edits(7, 8):
            req = dict(mode="multi", max_tokens=8, max_lines=200)
            fast = generate(lm, CompletionRequest(prefix, suffix, **req), NO_HEAL, None, store)
            slow = generate(lm, CompletionRequest(prefix, suffix, **req), NO_HEAL)
            assert fast.token_ids == slow.token_ids
    snap = store.snapshot()
    assert snap["evictions"] > 0 and snap["bytes"] <= 30_000


def test_batched_engine_equals_unbatched(tiny_model, lm):
    """Guards iteration-level batching: concurrent requests = each one alone."""
    prompts = [(p, s) for p, s in edits(3, 6)]
    with torch.inference_mode():
        alone = [generate(lm, CompletionRequest(p, s, mode="multi", max_tokens=10, max_lines=200), NO_HEAL).token_ids
                 for p, s in prompts]
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32", token_healing=False,
                                   kv_budget_mb=0)).start()
    try:
        engine.ready.wait(60)
        futures = [engine.submit(CompletionRequest(p, s, mode="multi", max_tokens=10, max_lines=200))
                   for p, s in prompts]
        together = [f.result(timeout=60).token_ids for f in futures]
        assert together == alone
        assert engine.stats()["max_batch_seen"] > 1
    finally:
        engine.close()


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
    candidates = ["def f(x):\n    if x is None:\n        ", "import os\n\n\ndef main(", "for i in range(", POINT]
    with torch.inference_mode():
        prefix = next(p for p in candidates if generate(
            lm, CompletionRequest(p, "", mode="multi", max_tokens=200, max_lines=200), NO_HEAL).generated_tokens > 3)
        request = CompletionRequest(prefix, "", mode="multi", max_tokens=200, max_lines=200, cancel=TripAfter(4))
        result = generate(lm, request, NO_HEAL)
    assert result.stop_reason == "cancelled"
    # Checks: one before planning, then one before each token; the fifth check sees the
    # flag after token 3, so no forward pass follows.
    assert result.generated_tokens == 3


@pytest.mark.parametrize("checks", [None, 2])
def test_warm_prefill_is_what_the_request_reuses(lm, checks):
    """Guards warm-ups: the prompt prefilled ahead of its request (whole, or stopped by its
    cancel after two pieces) is in the store, the request reuses exactly that, and its
    completion is the one made without a store."""
    vocab = _Vocab(lm.tokenizer)
    settings = EngineSettings(token_healing=True)
    store, pool = KVStore(64 * 2**20), SessionPool(inc_bound=16)
    request = CompletionRequest(POINT * 3, "\n\n    def norm(self):\n        pass\n", mode="multi", max_tokens=10,
                                max_lines=200, session_key="doc")
    with torch.inference_mode():
        plan = plan_prompt(lm, request, settings, vocab, pool)
        n = len(plan.ids)
        cancel = TripAfter(checks) if checks else threading.Event()
        ran, had = warm(lm, plan.ids, store, cancel, piece=8)
        assert had == 0 and ran == (n if checks is None else 16) and n > 24
        if checks is None:
            assert warm(lm, plan.ids, store, threading.Event(), piece=8) == (0, n)  # nothing left to run
        fast = run_plan(lm, request, plan, vocab, store)
        slow = run_plan(lm, request, plan, vocab, None)
    assert fast.reused_tokens == min(ran, n - 1)
    assert fast.token_ids == slow.token_ids and fast.text == slow.text


def test_the_piece_clock_sizes_pieces_to_its_target():
    """Guards warm prefills' timed pieces: a small piece while the speed is unknown, then as many
    rows as take about the target at the last pieces' speed, in multiples of 32 between 32 and
    256; a short last piece says nothing about the speed; a target of 0 means pieces of 256."""
    clock = PieceClock(100)
    assert clock.rows() == 64
    clock.observe(64, 64 * 3.0)  # 3 ms a row (two AVX2 cores): 33 rows would take 100 ms
    assert clock.rows() == 32
    clock.observe(5, 1.0)  # a last piece of 5 rows: its fixed costs say nothing
    assert clock.ms_per_row == 3.0
    for _ in range(8):  # a faster machine (or the cores free again): the pieces grow, up to 256
        clock.observe(32, 32 * 0.1)
    assert clock.rows() == 256
    clock.observe(256, 256 * 1.1)  # slower again: 100 / ((0.1.. + 1.1) / 2) rows, rounded down to 32s
    assert clock.rows() % 32 == 0 and 32 <= clock.rows() < 256
    off = PieceClock(0)
    off.observe(64, 1000.0)
    assert off.rows() == 256


class CountingClock(PieceClock):
    """A PieceClock that records the pieces it was asked for and what they were said to take."""

    def __init__(self, target_ms):
        super().__init__(target_ms)
        self.seen = []

    def observe(self, rows, ms):
        self.seen.append(rows)
        super().observe(rows, ms)


@pytest.mark.parametrize("checks", [None, 2])
def test_warm_runs_the_pieces_its_clock_gives(lm, checks):
    """Guards warm-ups in timed pieces: ``warm`` asks its clock for each piece's rows and tells it
    how long the piece took; stopped by its cancel after two pieces it has run those two; the
    request after it reuses what ran and completes as without a store."""
    vocab = _Vocab(lm.tokenizer)
    settings = EngineSettings(token_healing=True)
    store, pool = KVStore(64 * 2**20), SessionPool(inc_bound=16)
    request = CompletionRequest(POINT * 12, "\n\n    def norm(self):\n        pass\n", mode="multi", max_tokens=8,
                                max_lines=200, session_key="doc")
    clock = CountingClock(1e-6)  # any speed: pieces of 32 after the first of 64
    with torch.inference_mode():
        plan = plan_prompt(lm, request, settings, vocab, pool)
        n = len(plan.ids)
        assert n > 160
        ran, had = warm(lm, plan.ids, store, TripAfter(checks) if checks else threading.Event(), clock)
        assert had == 0 and clock.seen[:2] == [64, 32]
        assert ran == (n if checks is None else 96) and sum(clock.seen) == ran
        assert clock.ms_per_row is not None and clock.ms_per_row > 0
        fast = run_plan(lm, request, plan, vocab, store)
        slow = run_plan(lm, request, plan, vocab, None)
    assert fast.reused_tokens == min(ran, n - 1)
    assert fast.token_ids == slow.token_ids and fast.text == slow.text


def test_a_prompt_is_in_the_store_once_prefilled(lm):
    """Guards requests admitted together (the next keystroke's, queued while this one
    prefilled): a request's prompt KV is in the store as soon as it is prefilled, before the
    request finishes, so the next request reuses it; both complete as they do without a store."""
    vocab = _Vocab(lm.tokenizer)
    settings = EngineSettings(token_healing=True)
    store = KVStore(64 * 2**20)
    suffix = "\n\n    def norm(self):\n        pass\n"
    first = CompletionRequest(POINT * 3, suffix, mode="multi", max_tokens=6, max_lines=200)
    second = CompletionRequest(POINT * 3 + "x", suffix, mode="multi", max_tokens=6, max_lines=200)
    with torch.inference_mode():
        plans = [plan_prompt(lm, r, settings, vocab, None) for r in (first, second)]
        lives = [start(lm, r, p, store) for r, p in zip((first, second), plans)]  # neither finished
        shared = common(*(p.ids for p in plans))
        assert lives[0].reused == 0 and lives[1].reused == shared > 30
        for live in lives:
            while advance(lm, live, vocab):
                step(lm, [live])
            release(live, store)
        for live, r, p in zip(lives, (first, second), plans):
            alone = run_plan(lm, r, p, vocab, None)
            assert live.result.token_ids == alone.token_ids and live.result.text == alone.text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_warm_up_leaves_the_next_prompt_as_it_would_be(lm, seed):
    """Guards warm-ups' neutrality: a warm request plans the prompt a request at its cursor
    would get, without touching the EFIM sessions, so every request plans the same prompt
    with warm-ups before it as without them (and gets the same completion)."""
    vocab = _Vocab(lm.tokenizer)
    settings = EngineSettings(token_healing=True)
    plain, warmed = SessionPool(inc_bound=16, head_lines=2), SessionPool(inc_bound=16, head_lines=2)
    for prefix, suffix in edits(seed):
        request = CompletionRequest(prefix, suffix, session_key="doc")
        plan_prompt(lm, CompletionRequest(prefix[:-1], suffix, session_key="doc", warm=True), settings, vocab, warmed)
        ahead = plan_prompt(lm, CompletionRequest(prefix, suffix, session_key="doc", warm=True), settings, vocab,
                            warmed)
        want = plan_prompt(lm, request, settings, vocab, plain)
        assert ahead.ids == want.ids  # a warm-up at the cursor: the request reuses all of it
        assert plan_prompt(lm, request, settings, vocab, warmed).ids == want.ids
    assert warmed.counts == plain.counts and warmed.sessions == plain.sessions


def test_engine_thread_warms_without_completing(tiny_model):
    """Guards the engine's warm requests: no completion, counted, and the request after
    finds the prompt in the store (its EFIM session moved there by the warm-up)."""
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32")).start()
    try:
        prefix, suffix = POINT * 2, "\n\n    def norm(self):\n        pass\n"
        got = engine.complete(CompletionRequest(prefix, suffix, session_key="doc", warm=True))
        assert got.stop_reason == "warm" and got.text == "" and got.generated_tokens == 0 and got.reused_tokens == 0
        stats = engine.stats()
        assert stats["warm_prefills"] == 1 and stats["warm_tokens"] == got.prompt_tokens > 0
        assert stats["completions"] == 0
        # its pieces were timed: the next ones are sized from that speed (the default 100 ms)
        assert stats["warm_piece"]["ms_per_row"] > 0 and stats["warm_piece"]["rows"] % 32 == 0
        real = engine.complete(CompletionRequest(prefix + "x", suffix, session_key="doc", max_tokens=4))
        assert real.error is None
        assert real.reused_tokens >= got.prompt_tokens - 2  # the warm prompt (its healed end aside), then "x"
        stopped = CompletionRequest("import os\n" * 40, "", session_key="other", warm=True)
        stopped.cancel.set()  # a request came before the engine took it: not run at all
        assert engine.complete(stopped).stop_reason == "cancelled"
        assert engine.stats()["warm_prefills"] == 1
    finally:
        engine.close()


LONG_BODY = "".join(f"    value_{i} = compute(value_{i - 1}, {i})  # step {i}\n" for i in range(1, 120))
LONG_SUFFIX = "\n    return value\n"


@pytest.fixture
def dense_window(monkeypatch):
    """The tiny model's tokenizer makes about 2 characters a token, not the 3 windows are
    sized for: a character a token keeps its windows under their token cap, as the real
    models' 3.5-4 do with 3."""
    monkeypatch.setattr(prompts, "CHARS_PER_TOKEN", 1)


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("scheme", ["efim", "psm", "prefix"])
def test_the_window_s_next_opening_is_planned_before_it_moves(lm, dense_window, scheme):
    """Guards the warm-up ahead of a window move: while a long file is typed on, every prompt
    whose window start moved (a full prefill without it) begins with an opening that
    ``ahead_heads`` gave from the text at least a keystroke and at most ``lookahead``
    characters before, all but its last token; with no lookahead there is none."""
    vocab, toks = _Vocab(lm.tokenizer), Tokens(lm.tokenizer)
    template = None if scheme == "prefix" else lm.template.template
    settings = EngineSettings(max_prefix_tokens=1200, max_suffix_tokens=64)
    pool = SessionPool(inc_bound=16, head_lines=2)
    head, typed, lookahead = "def run():\n" + LONG_BODY[:2000], LONG_BODY[2000:4000], 1000
    earlier: list[tuple[int, list[list[int]]]] = []
    moves, last = 0, None
    key = "doc" if scheme == "efim" else None
    for i in range(0, len(typed), 3):  # three characters a request
        prefix = head + typed[:i + 1]
        plan = pool.plan(key, prefix, LONG_SUFFIX, template, Tokens(lm.tokenizer, vocab), settings.max_prefix_tokens,
                         settings.max_suffix_tokens)
        window = plan.ids.index(lm.tokenizer.convert_tokens_to_ids("<fim_suffix>")) if template else len(plan.ids)
        if last is not None and common(last, plan.ids) < window // 2:  # the window moved: all of it is new
            moves += 1
            best = max((common(h, plan.ids) for at, hs in earlier if i - at <= lookahead for h in hs), default=0)
            assert best >= window * 0.9, (i, best, window)
        last = plan.ids
        earlier.append((i, ahead_heads(prefix, template, toks, settings.max_prefix_tokens, "", lookahead)))
        assert ahead_heads(prefix, template, toks, settings.max_prefix_tokens, "", 0) == []
    assert moves >= 2
    # the openings are of the start now and the next one, none farther: the first window, each one
    # moved to, and the one coming after the typing ends
    assert len({tuple(h[:40]) for _, hs in earlier for h in hs}) <= moves + 2


def test_idle_time_prefills_the_next_window_and_changes_no_completion(tiny_model, lm, dense_window):
    """Guards the engine's warm-up ahead (``ahead_chars``): after a request near a window move
    the idle engine prefills the next opening; the request after the move reuses it (most of
    its prompt instead of a few tokens) and completes as it does without the warm-up."""
    head = "def run():\n" + LONG_BODY[:2000]
    base = dict(model=str(tiny_model), dtype="float32", max_prefix_tokens=1200, max_suffix_tokens=64)
    # the first prefix past the window's move, and the same text two lines (about 100 characters) before
    k = next(k for k in range(2000, len(LONG_BODY)) if window_start(head + LONG_BODY[2000:k], 1200) !=
             window_start(head, 1200))
    moved, near = head + LONG_BODY[2000:k], head + LONG_BODY[2000:k - 100]
    results = {}
    for chars in (0, 600):
        engine = Engine(EngineSettings(**base, ahead_chars=chars)).start()
        try:
            first = engine.complete(CompletionRequest(near, LONG_SUFFIX, max_tokens=6))
            assert first.error is None
            assert wait_until(lambda: not engine.busy(), 60)
            stats = engine.stats()
            after = engine.complete(CompletionRequest(moved, LONG_SUFFIX, max_tokens=6))
            results[chars] = (stats, after)
        finally:
            engine.close()
    (off_stats, off), (on_stats, on) = results[0], results[600]
    nxt = ahead_heads(near, lm.template.template, Tokens(lm.tokenizer), 1200, "", 600)[-1]
    assert off_stats["ahead_prefills"] == 0 and on_stats["ahead_prefills"] == 1
    assert on_stats["ahead_tokens"] >= len(nxt) - 8 > 200  # all but its first tokens (the last prompt's too)
    assert off.reused_tokens < 10 and on.reused_tokens > 0.8 * (on.prompt_tokens - 64)  # the suffix is new
    assert on.token_ids == off.token_ids and on.text == off.text and on.prompt_tokens == off.prompt_tokens


def test_a_stopped_ahead_warm_up_keeps_what_ran(lm, dense_window):
    """Guards the ahead warm-up's cooperation: a request arriving stops it between pieces,
    and what ran is in the store (the next idle time goes on from there)."""
    settings = EngineSettings(max_prefix_tokens=1200, ahead_chars=600)
    prefix = "def run():\n" + LONG_BODY[:2900]
    store = KVStore(64 * 2**20)
    request = CompletionRequest(prefix, LONG_SUFFIX)
    with torch.inference_mode():
        heads = ahead_heads(prefix, lm.template.template, Tokens(lm.tokenizer), 1200, "", 600)
        assert len(heads) == 2 and heads[0] != heads[1]
        assert warm_ahead(lm, request, settings, store, TripAfter(1)) == (2, 256, 0)
        n, ran, had = warm_ahead(lm, request, settings, store, threading.Event())
    shared = common(*heads)  # the openings' first tokens, run with the first
    assert shared < 256 and (n, had) == (2, 256 + shared) and ran == sum(map(len, heads)) - 256 - shared
    assert all(store.match_prefix(h).length == len(h) for h in heads)


def test_token_healing_backs_up_one_token_and_regenerates_it(lm):
    """Guards token healing: the removed text is regenerated first, never duplicated."""
    vocab = _Vocab(lm.tokenizer)
    assert vocab.concatenative
    prefix = "def area(radius):\n    return radius * radi"
    plan = plan_prompt(lm, CompletionRequest(prefix, "\n"), EngineSettings(), vocab, None)
    assert plan.healed and prefix.endswith(plan.healed)
    with torch.inference_mode():
        result = generate(lm, CompletionRequest(prefix, "\n", max_tokens=8), EngineSettings(), vocab)
    produced = "".join(vocab.texts[i] for i in result.token_ids)
    assert produced.startswith(plan.healed)
    for candidate in vocab.candidates("  "):
        text = vocab.texts[int(candidate)]
        assert text.startswith("  ") or "  ".startswith(text)


def test_engine_thread_serves_and_counts(tiny_model):
    """Guards the engine thread: futures resolve, stats add up, close returns."""
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32")).start()
    try:
        # One after another: each finds the previous one's KV in the store.
        results = [engine.complete(CompletionRequest("import os\nimport ", "", max_tokens=4)) for _ in range(3)]
        assert len({r.text for r in results}) == 1  # greedy: the same answer each time
        stats = engine.stats()
        assert stats["completions"] == 3 and stats["ready"] and stats["template"] == "starcoder"
        assert stats["reused_tokens"] > 0 and stats["kv_store"]["cached_tokens"] > 0
        cancelled = CompletionRequest("import os\n", "")
        cancelled.cancel.set()
        assert engine.complete(cancelled).stop_reason == "cancelled"
    finally:
        engine.close()


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_engine_says_when_it_works_and_when_it_waits(tiny_model):
    """``Engine.busy`` (what background indexing yields to): set while the model loads and while a
    request is in flight, clear once the engine waits for the next one; the handle says busy
    while torch is imported, and not once the engine could not start."""
    from codecomplete.model.handle import EngineHandle

    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32"))
    assert engine.busy()  # the load comes first
    engine.start()
    try:
        from concurrent.futures import Future

        seen, fut = [], Future()
        fut.add_done_callback(lambda f: seen.append(engine.busy()))  # runs on the engine thread, in flight
        engine.submit(CompletionRequest("import os\nimport ", "", max_tokens=4), fut)
        assert fut.result(timeout=120).error is None
        assert seen == [True]
        assert wait_until(lambda: not engine.busy(), 10)
    finally:
        engine.close()
    handle = EngineHandle(EngineSettings(model=str(tiny_model), dtype="float32"))
    assert handle.busy()  # not started: torch and the load are still ahead
    handle.start()
    try:
        assert handle.complete(CompletionRequest("import os\nimport ", "", max_tokens=4)).error is None
        assert wait_until(lambda: not handle.busy(), 10)
    finally:
        handle.close()
    assert not handle.busy() and not engine.busy()  # closed
    broken = EngineHandle(EngineSettings(model=str(tiny_model)))
    broken.start_error = "the engine cannot start: ImportError: torch"
    assert not broken.busy()


def test_a_huge_line_is_windowed_like_a_long_file(tiny_model):
    """Guards minified files: a prefix that is one 400 kB line (no line to cut at), or
    dense text (more tokens per character than the window assumes), gets a prompt within
    its token budgets, not all of it."""
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32", max_prefix_tokens=128,
                                   max_suffix_tokens=64)).start()
    try:
        line = ",".join(f"k{i}:{i}" for i in range(50_000))
        for prefix, suffix in ((f"var a={{{line}", "};\n"), ("x = 1\n" * 60_000 + "y = ", line),
                               (line[:200_000] + "\n" + line[:100] + "\n" * 3 + line[:300], "")):
            got = engine.complete(CompletionRequest(prefix, suffix, max_tokens=4))
            assert got.error is None and got.stop_reason != "cancelled"
            assert 0 < got.prompt_tokens <= 128 + 64 + 8, got.prompt_tokens  # + FIM tokens, healing
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


def test_kv_dtype_setting_reloads_and_serves(tiny_model):
    """Guards engine.kv_dtype: auto is fp32 on a CPU; a bf16 cache under fp32
    weights serves, reuses across requests, and stays close to the fp32 cache's answer."""
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32")).start()
    try:
        engine.ready.wait()
        assert engine.lm.model.kv_dtype == torch.float32
        full = engine.complete(CompletionRequest("import os\nimport ", "", max_tokens=6, ignore_eos=True))
        engine.configure(EngineSettings(model=str(tiny_model), dtype="float32", kv_dtype="bfloat16"))
        first = engine.complete(CompletionRequest("import os\nimport ", "", max_tokens=6, ignore_eos=True))
        assert engine.lm.model.kv_dtype == torch.bfloat16 and engine.lm.model.new_cache().k.dtype == torch.bfloat16
        again = engine.complete(CompletionRequest("import os\nimport ", "", max_tokens=6, ignore_eos=True))
        assert first.generated_tokens == again.generated_tokens == full.generated_tokens > 0
        assert again.reused_tokens > 0 and again.text == first.text
    finally:
        engine.close()


ALTERNATIVE_PROMPTS = [
    (POINT, "\n"),
    ("def mean(data):\n    total = 0\n    for x in data:\n        total", "\n    return total\n"),
    ("import os\nimport ", ""),
    ("def f(x):\n    if x is None:\n        ", "\n"),
]


def branch_point(head: list[int], alt: list[int]) -> int:
    return next(i for i in range(len(alt)) if i >= len(head) or head[i] != alt[i])


@pytest.mark.parametrize("prefix,suffix", ALTERNATIVE_PROMPTS)
def test_alternatives_fork_where_unsure_and_decode_greedily(lm, hf, prefix, suffix):
    """Guards alternatives (an invoked request's other completions): the first completion
    is greedy decoding's, untouched; each alternative follows it to a branch within the
    first BRANCH_WINDOW tokens, takes another token there that is at least BRANCH_MIN_P
    likely (any, where greedy decoding stops), and from there is greedy decoding again,
    checked against transformers recomputing everything."""
    def request(n):
        return CompletionRequest(prefix, suffix, mode="multi", max_tokens=16, max_lines=200, alternatives=n)

    with torch.inference_mode():
        alone = generate(lm, request(1), NO_HEAL)
        got = generate(lm, request(4), NO_HEAL)
    plan = plan_prompt(lm, request(4), NO_HEAL, None, None)
    assert got.token_ids == alone.token_ids and got.text == alone.text
    assert 1 <= len(got.alternatives) <= 3
    seen = {tuple(got.token_ids)}
    for alt in got.alternatives:
        ids = alt.token_ids
        assert tuple(ids) not in seen
        seen.add(tuple(ids))
        b = branch_point(got.token_ids, ids)
        assert b < BRANCH_WINDOW
        with torch.inference_mode():
            probs = torch.softmax(hf(input_ids=torch.tensor([plan.ids + ids[:b]])).logits[0, -1].float(), -1)
        greedy = int(probs.argmax())
        assert ids[b] != greedy and ids[b] not in lm.stop_ids
        assert greedy in lm.stop_ids or float(probs[ids[b]]) >= BRANCH_MIN_P * 0.999
        assert ids[b + 1:] == greedy_without_cache(hf, lm.stop_ids, plan.ids + ids[:b + 1], len(ids) - b - 1)
    assert got.texts[0] == got.text or not got.text.strip()
    assert len(got.texts) == len(set(got.texts)) and all(t.strip() for t in got.texts)


def test_alternatives_with_healing_start_with_the_healed_text(lm):
    """Guards the branch under token healing: an alternative picks among the tokens that
    agree with the text backed up, so every one regenerates it."""
    vocab = _Vocab(lm.tokenizer)
    prefix = "def area(radius):\n    return radius * radi"
    plan = plan_prompt(lm, CompletionRequest(prefix, "\n"), EngineSettings(), vocab, None)
    assert plan.healed
    with torch.inference_mode():
        got = generate(lm, CompletionRequest(prefix, "\n", max_tokens=8, alternatives=4), EngineSettings(), vocab)
        alone = generate(lm, CompletionRequest(prefix, "\n", max_tokens=8), EngineSettings(), vocab)
    assert got.token_ids == alone.token_ids and got.alternatives
    for alt in got.alternatives:
        produced = "".join(vocab.texts[i] for i in alt.token_ids)
        assert produced.startswith(plan.healed) or plan.healed.startswith(produced)


def test_engine_serves_alternatives_batched_and_releases_every_node(tiny_model, lm):
    """Guards alternatives on the engine thread, decoded in a batch beside other requests,
    with retrieval speculation on: the same completions as each request alone, the
    alternatives counted apart, and no KV-store node left locked afterwards."""
    prompts = ALTERNATIVE_PROMPTS
    with torch.inference_mode():
        alone = [generate(lm, CompletionRequest(p, s, mode="multi", max_tokens=12, max_lines=200,
                                                alternatives=3 if i % 2 == 0 else 1), NO_HEAL)
                 for i, (p, s) in enumerate(prompts)]
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32", token_healing=False)).start()
    try:
        engine.ready.wait(60)
        for _ in range(2):  # the second round prefills from the store
            futures = [engine.submit(CompletionRequest(p, s, mode="multi", max_tokens=12, max_lines=200,
                                                       alternatives=3 if i % 2 == 0 else 1))
                       for i, (p, s) in enumerate(prompts)]
            together = [f.result(timeout=60) for f in futures]
            assert [c.token_ids for c in together] == [c.token_ids for c in alone]
            assert [[a.token_ids for a in c.alternatives] for c in together] == \
                [[a.token_ids for a in c.alternatives] for c in alone]
        stats = engine.stats()
        assert stats["completions"] == 2 * len(prompts)
        assert stats["alternatives"] == 2 * sum(len(c.alternatives) for c in alone) > 0
        assert stats["max_batch_seen"] > len(prompts)  # the forks decoded beside the others
        assert all(n.refs == 0 for n in engine.store._nodes())
        cancelled = CompletionRequest(POINT, "\n", alternatives=3)
        cancelled.cancel.set()
        assert engine.complete(cancelled).stop_reason == "cancelled"
    finally:
        engine.close()


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_incremental_decode_is_the_whole_decode(tiny_model, which):
    """``decoded`` appends each token's text instead of decoding the whole output again; after
    every token it must be exactly ``tokenizer.decode``: characters cut between byte-level tokens,
    special tokens (skipped) and text that needs a whole decode again."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from codecomplete.model.engine import decoded
    from codecomplete.model.loader import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(tiny_model if which == "tiny" else resolve_checkpoint("default")[1],
                                        local_files_only=True)
    vocab = _Vocab(tok)
    assert vocab.incremental
    text = "def f(x):\n    return 'héllo wörld ✓' + x  # 日本語 🙂\n\tpass\n"
    pieces = [tok.encode(text, add_special_tokens=False)]
    # byte-level tokens that hold a part of a character, alone: their texts are U+FFFD
    pieces.append([i for i in range(len(tok)) if "\ufffd" in vocab.texts[i]][:40])
    pieces.append(list(tok.all_special_ids))
    rng = random.Random(3)
    ids = [t for _ in range(60) for t in rng.choice(pieces)[: rng.randint(1, 6)]] + pieces[0]
    for k, seq in enumerate((pieces[0], ids, rng.sample(range(len(tok)), 200))):
        live = SimpleNamespace(generated=[], decoded="", decoded_n=0)
        lm = SimpleNamespace(tokenizer=tok)
        appended = 0
        for t in seq:
            before = live.decoded_n
            live.generated.append(t)
            assert decoded(lm, live, vocab) == tok.decode(live.generated, skip_special_tokens=True)
            appended += before == len(live.generated) - 1 > 0 and live.decoded_n == len(live.generated)
        if k == 0:  # plain text: most tokens were appended, not decoded again
            assert appended > len(seq) // 2


def test_a_run_the_user_types_along_stops_once_its_text_departs_from_the_typed(lm):
    """CompletionRequest.typed (the daemon keeps a run going while the user types what it
    writes): a run whose output agrees with the typed text is the run without it, its text so
    far readable in ``progress``; one whose output departs from it is cancelled at that token."""
    prefix, suffix = "def mean(data):\n    total = 0\n    for x in data:\n        total", "\n    return total\n"
    req = dict(mode="multi", max_tokens=24, max_lines=200)
    alone = generate(lm, CompletionRequest(prefix, suffix, **req), NO_HEAL)
    assert len(alone.text.strip()) >= 3 and len(alone.token_ids) >= 2, alone
    along = CompletionRequest(prefix, suffix, **req)
    along.typed = alone.text[:3]
    same = generate(lm, along, NO_HEAL)
    assert (same.text, same.token_ids, same.stop_reason) == (alone.text, alone.token_ids, alone.stop_reason)
    # the text so far as the last token left it (the completion is cut from it by the stop rules)
    assert not along.cancel.is_set() and along.progress.startswith(alone.text)
    other = CompletionRequest(prefix, suffix, **req)
    other.typed = alone.text[:1] + "\u00a7"  # its first character, then one it does not write
    gone = generate(lm, other, NO_HEAL)
    assert gone.cancelled and gone.text == "" and other.cancel.is_set()
    assert 1 <= gone.generated_tokens < len(alone.token_ids)  # stopped at the token that departed
