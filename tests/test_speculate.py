"""Retrieval speculation (#8): the draft trie, the tree mask, the verified cache, and the
property that matters: output identical to greedy decoding, with FIM and EFIM prompts,
with a real suffix-array datastore, alone and batched."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from codecomplete.indexer.suffix import DraftIndex, width_for
from codecomplete.model.api import CompletionRequest, EngineSettings, SpecSettings
from codecomplete.model.engine import Engine, _Vocab, advance, generate, plan_prompt, spec_step, start, step
from codecomplete.model.loader import load_model
from codecomplete.model.prompts import SessionPool, Tokens
from codecomplete.model.speculate import (Drafter, LiveIndex, Tree, VerifiedCache, accept, build_tree,
                                          validate_tree, tree_mask)

NO_HEAL = EngineSettings(token_healing=False)


@pytest.fixture(scope="module")
def lm(tiny_model):
    return load_model(str(tiny_model), device="cpu", dtype="float32")


def test_tree_keeps_the_heaviest_nodes_and_parents_first():
    seqs = [((1, 2, 3, 4), 5.0), ((1, 2, 9), 3.0), ((7, 8), 1.0), ((1, 5), 0.5)]
    tree = build_tree(seqs, max_nodes=5, max_depth=8)
    assert len(tree) == 5
    validate_tree(tree)
    paths = set()
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        paths.add(tuple(reversed(path)))
    # weights: 1 -> 8.5, 1,2 -> 8, 1,2,3 -> 5, 1,2,3,4 -> 5, 1,2,9 -> 3, 7 -> 1
    assert paths == {(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 9)}
    shallow = build_tree(seqs, max_nodes=64, max_depth=2)
    validate_tree(shallow)
    assert max(shallow.depths) == 2 and len(shallow) == 5  # 1, 7, (1,2), (1,5), (7,8)


def test_tree_mask_sees_cache_root_and_ancestors_only():
    tree = Tree(tokens=[10, 11, 12, 13], parents=[-1, 0, -1, 1], depths=[1, 2, 1, 3])
    m = tree_mask(tree, cached=3, width=6, device="cpu")
    assert m.shape == (6, 9) and m[:, :3].all()
    block = m[:, 3:].int().tolist()
    assert block[0] == [1, 0, 0, 0, 0, 0]  # root
    assert block[1] == [1, 1, 0, 0, 0, 0]  # node 0
    assert block[2] == [1, 1, 1, 0, 0, 0]  # node 1 under node 0
    assert block[3] == [1, 0, 0, 1, 0, 0]  # node 2 under the root
    assert block[4] == [1, 1, 1, 0, 1, 0]  # node 3 under node 1
    assert block[5] == [1, 0, 0, 0, 0, 0]  # batch padding sees the cache and the root (a prefix: cheap)


def test_accept_walks_the_longest_greedy_path():
    tree = Tree(tokens=[10, 11, 20, 12], parents=[-1, 0, -1, 1], depths=[1, 2, 1, 3])
    # rows: 0 root, 1 node0(10), 2 node1(11), 3 node2(20), 4 node3(12)
    assert accept(tree, [10, 11, 12, 0, 5]) == [1, 2, 4]
    assert accept(tree, [20, 0, 0, 7, 0]) == [3]
    assert accept(tree, [99, 0, 0, 0, 0]) == []


def test_verified_cache_answers_the_longest_known_context():
    cache = VerifiedCache(depth=4)
    cache.add([1, 2, 3], [4, 5, 6, 7])
    cache.add([9, 2, 3], [8, 8])
    assert cache.lookup([1, 2, 3], 4)[0][0] == (4, 5, 6, 7)  # the 3-gram (1, 2, 3)
    got = dict(cache.lookup([7, 2, 3], 4))
    assert (4, 5, 6, 7) in got and (8, 8) in got  # the 2-gram (2, 3) is shared
    assert cache.lookup([0, 0], 4) == []


def test_live_index_finds_what_followed_the_last_three_tokens():
    """The request's own tokens: the longest earlier match (then the most recent) ranks first;
    the suffix itself is never a match; an update that is not an extension starts again."""
    live = LiveIndex()
    seq = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4, 7, 8, 0, 1, 2, 3, 4]
    live.update(seq)
    got = live.lookup(depth=3, top_k=4)
    # (2, 3, 4) occurred twice before: after 1 2 3 4 (a 4-token match, "1 2 3 4" again) and after 9 2 3 4
    assert [c for c, _ in got] == [(5, 6, 9), (7, 8, 0)]
    assert got[0][1] > got[1][1]
    live.update(seq + [5])  # an extension: incremental
    assert live.lookup(depth=2, top_k=4)[0][0] == (6, 9)
    live.update([7, 7, 7])  # another sequence: rebuilt, and nothing before its suffix matches
    assert live.lookup(depth=2, top_k=4) == []
    assert LiveIndex().lookup(4, 4) == []


def test_a_completion_repeating_itself_is_drafted_from_its_own_output(lm):
    """With no datastore and no cache, the request's own tokens still give drafts: a prompt
    whose text repeats is drafted from, the output stays the greedy output, and drafts are
    accepted."""
    vocab = _Vocab(lm.tokenizer)
    prefix = "x = [\n" + "    'abc',\n" * 12
    request = CompletionRequest(prefix, "", mode="multi", max_tokens=24, max_lines=200, ignore_eos=True)
    with torch.inference_mode():
        plan = plan_prompt(lm, request, NO_HEAL, None, None)
        slow = greedy_plain(lm, request, plan, None)
        drafter = Drafter(SpecSettings(use_cache=False, use_repository=False, use_common=False), None, vocab.texts)
        live = greedy_spec(lm, request, plan, drafter, None)
    assert live.result.token_ids == slow.token_ids
    assert drafter.stats["live_hits"] > 0 and live.accepted > 0
    off = Drafter(SpecSettings(use_cache=False, use_repository=False, use_common=False, use_live=False), None,
                  vocab.texts)
    assert len(off.draft(plan.ids, live=LiveIndex())) == 0


def test_a_long_own_match_gets_a_whole_chain():
    """When the request's own tokens match far back, the draft may hold up to ``depth`` nodes
    (a chain) instead of ``max_nodes``; otherwise ``max_nodes`` bounds it."""
    seq = list(range(100, 130)) + list(range(100, 112))  # the last 12 tokens occurred before
    spec = SpecSettings(max_nodes=4, depth=10, use_cache=False, use_repository=False, use_common=False)
    assert len(Drafter(spec).draft(seq, live=LiveIndex())) == 10
    assert len(Drafter(replace(spec, live_chain=0)).draft(seq, live=LiveIndex())) == 4
    assert len(Drafter(replace(spec, live_chain=13)).draft(seq, live=LiveIndex())) == 4


def test_max_rows_caps_every_verification_pass(lm, tiny_model, monkeypatch):
    """``max_rows`` bounds a pass's rows (the last token and its draft nodes), chains and wide
    trees alike, and the output stays greedy; 0 (auto) caps bf16 passes at ``AVX2_ROWS`` only
    where bf16 products run on AVX2 or the portable loop, and never an fp32 model's."""
    from codecomplete.model import engine, native
    from codecomplete.model.speculate import AVX2_ROWS, pass_rows

    vocab = _Vocab(lm.tokenizer)
    prefix = "x = [\n" + "    'abc', 'def',\n" * 12
    request = CompletionRequest(prefix, "", mode="multi", max_tokens=24, max_lines=200, ignore_eos=True)
    sizes = []
    real = engine.verify

    def spy(lm_, lives, trees, *a, **kw):
        sizes.extend(len(t) for t in trees)
        return real(lm_, lives, trees, *a, **kw)

    monkeypatch.setattr(engine, "verify", spy)
    with torch.inference_mode():
        plan = plan_prompt(lm, request, NO_HEAL, None, None)
        slow = greedy_plain(lm, request, plan, None)
        for rows, nodes in ((3, 3), (3, 12), (6, 12)):
            sizes.clear()
            spec = SpecSettings(max_nodes=nodes, depth=10, use_cache=False, use_repository=False, use_common=False,
                                max_rows=rows)
            drafter = Drafter(spec, None, vocab.texts)
            live = greedy_spec(lm, request, plan, drafter, None)
            assert live.result.token_ids == slow.token_ids
            assert sizes and max(sizes) <= rows - 1 and live.accepted > 0, (rows, nodes, sizes)
            if rows == 6:
                assert max(sizes) == 5  # the repeated text drafts chains up to the cap
    spec = SpecSettings()
    assert pass_rows(spec, lm.model) == spec.depth + 1  # fp32: no cap
    assert pass_rows(SpecSettings(max_nodes=24, depth=6), lm.model) == 25  # wide trees keep their nodes
    assert pass_rows(SpecSettings(max_rows=7), lm.model) == 7
    lm16 = load_model(str(tiny_model), device="cpu", dtype="bfloat16")
    if lm16.model.native_stack is not None:
        slow_rows = native.linear_bf16_path() in (0, 1, 3) and not native.amx()
        assert pass_rows(spec, lm16.model) == (AVX2_ROWS if slow_rows else spec.depth + 1)
        assert pass_rows(replace(spec, max_rows=2), lm16.model) == 2


def test_costly_passes_draft_only_long_datastore_matches(lm, monkeypatch):
    """Where short matches cost more than they pay, the datastores are asked for matches of
    ``costly_min_match`` tokens at least (0 turns it off); elsewhere ``min_match``; the output
    stays greedy."""
    from codecomplete.model import speculate
    from codecomplete.model.speculate import costly_passes, costly_short_matches, datastore_min_match

    assert not costly_passes(lm.model) and not costly_short_matches(lm.model)  # fp32: what the CPU's GEMM costs
    vocab = _Vocab(lm.tokenizer)
    prefix, suffix = PROMPTS[3]
    request = CompletionRequest(prefix, suffix, mode="multi", max_tokens=12, max_lines=200, ignore_eos=True)
    with torch.inference_mode():
        plan = plan_prompt(lm, request, NO_HEAL, None, None)
        slow = greedy_plain(lm, request, plan, None)
        for costly, spec, want in ((False, SpecSettings(), 2), (True, SpecSettings(), 8),
                                   (True, SpecSettings(costly_min_match=0), 2),
                                   (True, SpecSettings(min_match=10), 10)):
            monkeypatch.setattr(speculate, "costly_short_matches", lambda model, c=costly: c)
            asked = []

            def retriever(context, **kw):
                asked.append(kw["min_len"])
                return []

            assert datastore_min_match(spec, lm.model) == want
            drafter = Drafter(replace(spec, missing_table=False, use_cache=False), retriever, vocab.texts)
            live = greedy_spec(lm, request, plan, drafter, None)
            assert live.result.token_ids == slow.token_ids
            assert asked and set(asked) == {want}, (costly, spec, set(asked))


def greedy_plain(lm, request, plan, vocab):
    live = start(lm, request, plan, None)
    while advance(lm, live, vocab):
        step(lm, [live])
    return live.result


def greedy_spec(lm, request, plan, drafter, vocab):
    """The request decoded with speculation (verification passes while there are drafts); its Live."""
    live = start(lm, request, plan, None)
    while advance(lm, live, vocab):
        if not spec_step(lm, [live], drafter, vocab):
            break
    return live


def random_datastore(lm, rng: random.Random, outputs: list[list[int]]) -> DraftIndex:
    """True continuations (so drafts get accepted), corrupted copies and noise."""
    vocab = len(lm.tokenizer)
    docs = []
    for i, out in enumerate(outputs):
        docs.append((f"true{i}", np.array(out, dtype=np.int64)))
        bad = list(out)
        for j in rng.sample(range(len(bad)), k=max(1, len(bad) // 4)):
            bad[j] = rng.randrange(vocab)
        docs.append((f"bad{i}", np.array(bad, dtype=np.int64)))
    for i in range(5):
        docs.append((f"noise{i}", np.array([rng.randrange(vocab) for _ in range(200)], dtype=np.int64)))
    return DraftIndex.from_documents(docs, width_for(vocab))


def retriever_of(index: DraftIndex):
    def lookup(context, **kw):
        m = index.lookup(context, **kw)
        return [m] if m else []
    return lookup


PROMPTS = [("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return ", "\n"),
           ("for i in range(10):\n    print(i)\nfor j in range(", ""),
           ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.", "\n\np = Point(1, 2)\n"),
           ("import os\nimport sys\n\n\ndef main(argv):\n    ", "\n\nif __name__ == '__main__':\n    main(sys.argv)\n")]


@pytest.mark.parametrize("seed", range(3))
def test_speculation_equals_greedy_with_fim_and_efim_prompts(lm, seed):
    rng = random.Random(seed)
    vocab = _Vocab(lm.tokenizer)
    settings = EngineSettings(token_healing=True)
    outputs, cases = [], []
    with torch.inference_mode():
        for prefix, suffix in PROMPTS:
            pool = SessionPool(inc_bound=64)
            cut = rng.randrange(1, len(prefix))
            pool.plan("doc", prefix[:cut], suffix, lm.template.template, Tokens(lm.tokenizer, vocab), 1024, 256)
            for session in (None, "doc"):  # a PSM prompt, then the EFIM continuation
                request = CompletionRequest(prefix, suffix, mode="multi", max_tokens=24, max_lines=200,
                                            session_key=session)
                plan = plan_prompt(lm, request, settings, vocab, pool if session else None)
                slow = greedy_plain(lm, request, plan, vocab)
                cases.append((request, plan, slow))
                outputs.append(plan.ids[-8:] + slow.token_ids)
        index = random_datastore(lm, rng, outputs)
        accepted = 0
        for spec in (SpecSettings(), SpecSettings(max_nodes=5, depth=3, use_cache=False),
                     SpecSettings(skip_tokens=False, tau=0)):
            drafter = Drafter(spec, retriever_of(index), vocab.texts, seed=seed)
            for request, plan, slow in cases:
                live = greedy_spec(lm, request, plan, drafter, vocab)
                fast = live.result
                assert fast.token_ids == slow.token_ids and fast.text == slow.text
                assert live.cache.length == len(live.fed)
                accepted += fast.accepted_tokens
                if plan.kind == "efim":
                    assert fast.prompt_kind == "efim"
        assert accepted > 0


def test_bf16_speculation_is_exactly_greedy_decoding(tiny_model):
    """In bf16 on the native path a verification pass gives every tree row the bits a one-token
    step gives it (tests/test_native.py), so speculation's output is greedy decoding's token for
    token in bf16 too, with wide trees whose rows sit below siblings, FIM and EFIM prompts."""
    lm16 = load_model(str(tiny_model), device="cpu", dtype="bfloat16")
    if lm16.model.native_stack is None:
        pytest.skip("needs the native bf16 path")
    rng = random.Random(11)
    vocab = _Vocab(lm16.tokenizer)
    settings = EngineSettings(token_healing=True)
    cases, outputs = [], []
    with torch.inference_mode():
        for prefix, suffix in PROMPTS:
            request = CompletionRequest(prefix, suffix, mode="multi", max_tokens=32, max_lines=200, ignore_eos=True)
            plan = plan_prompt(lm16, request, settings, vocab, None)
            slow = greedy_plain(lm16, request, plan, vocab)
            cases.append((request, plan, slow))
            outputs.append(plan.ids[-8:] + slow.token_ids)
        index = random_datastore(lm16, rng, outputs)
        accepted = 0
        for spec in (SpecSettings(use_cache=False),
                     SpecSettings(max_nodes=24, depth=6, top_k=8, use_cache=False, max_rows=25)):  # wide on any CPU
            drafter = Drafter(spec, retriever_of(index), vocab.texts, seed=3)
            for request, plan, slow in cases:
                live = greedy_spec(lm16, request, plan, drafter, vocab)
                assert live.result.token_ids == slow.token_ids
                accepted += live.result.accepted_tokens
        assert accepted > 0


def test_speculative_kv_equals_recomputed_kv(lm):
    """Compaction leaves exactly the accepted tokens' KV at their positions."""
    vocab = _Vocab(lm.tokenizer)
    prefix, suffix = PROMPTS[0]
    request = CompletionRequest(prefix, suffix, mode="multi", max_tokens=20, max_lines=200, ignore_eos=True)
    with torch.inference_mode():
        plan = plan_prompt(lm, request, NO_HEAL, None, None)
        slow = greedy_plain(lm, request, plan, None)
        index = random_datastore(lm, random.Random(5), [plan.ids[-6:] + slow.token_ids])
        drafter = Drafter(SpecSettings(use_cache=False), retriever_of(index), vocab.texts)
        live = greedy_spec(lm, request, plan, drafter, None)
        assert live.result.token_ids == slow.token_ids and live.accepted > 0
        fresh = lm.model.new_cache(len(live.fed))
        lm.model(torch.tensor([live.fed]), [fresh])
        n = live.cache.length
        assert n == len(live.fed) == fresh.length
        torch.testing.assert_close(live.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(live.cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-4, rtol=1e-4)


def test_batched_speculation_equals_unbatched_greedy(tiny_model, lm):
    prompts = PROMPTS + [(p + "x", s) for p, s in PROMPTS]
    with torch.inference_mode():
        alone = [generate(lm, CompletionRequest(p, s, mode="multi", max_tokens=16, max_lines=200), NO_HEAL)
                 for p, s in prompts]
    vocab = len(lm.tokenizer)
    rng = random.Random(1)
    docs = [(f"d{i}", np.array(c.token_ids + [rng.randrange(vocab) for _ in range(5)], dtype=np.int64))
            for i, c in enumerate(alone)]
    index = DraftIndex.from_documents(docs, width_for(vocab))
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32", token_healing=False,
                                   kv_budget_mb=0, speculation=SpecSettings(use_cache=False)))
    engine.set_retriever(retriever_of(index))
    engine.start()
    try:
        engine.ready.wait(60)
        futures = [engine.submit(CompletionRequest(p, s, mode="multi", max_tokens=16, max_lines=200))
                   for p, s in prompts]
        together = [f.result(timeout=60) for f in futures]
        assert [c.token_ids for c in together] == [c.token_ids for c in alone]
        stats = engine.stats()
        assert stats["max_batch_seen"] > 1 and stats["spec_steps"] > 0 and stats["accepted_tokens"] > 0
        assert stats["mean_acceptance_length"] > 1
    finally:
        engine.close()


def test_greedy_head_changes_no_output(tiny_model, monkeypatch):
    """A bf16 model on the native path asks for the greedy head (exact argmax, -inf elsewhere)
    on plain steps, prefills and verification passes, but not while token healing picks among
    the tokens that fit its pending text (that pick reads those tokens' logits): outputs with
    the greedy head equal outputs without it, with and without speculation and healing."""
    from codecomplete.model import native

    lm = load_model(str(tiny_model), device="cpu", dtype="bfloat16")
    if lm.model.native_stack is None or lm.model.native_stack.qhead is None:
        pytest.skip("the greedy head needs the native bf16 path with AVX512-VNNI")
    vocab = _Vocab(lm.tokenizer)
    asked = []
    real = native.decode_stack

    def spy(*a, **kw):
        asked.append(kw.get("greedy", False))
        return real(*a, **kw)

    monkeypatch.setattr(native, "decode_stack", spy)
    prefix = "def area(radius):\n    x = [1, 2, 3, 1, 2, 3, 1, 2, 3]\n    return radius * radi"
    settings = EngineSettings(token_healing=True)
    outputs = {}
    for on in (True, False):
        lm.model.greedy_head = on
        for spec in (None, SpecSettings(use_repository=False, use_common=False)):
            drafter = Drafter(spec, None, vocab.texts) if spec else None
            request = CompletionRequest(prefix, "\n", mode="multi", max_tokens=24, max_lines=200, ignore_eos=True)
            with torch.inference_mode():
                outputs[on, spec is not None] = generate(lm, request, settings, vocab, drafter=drafter).token_ids
    lm.model.greedy_head = True
    assert outputs[True, False] == outputs[False, False] and outputs[True, True] == outputs[False, True]
    assert plan_prompt(lm, CompletionRequest(prefix, "\n"), settings, vocab, None).healed  # healing was on
    assert True in asked and False in asked  # greedy asked for, and not while healing
