"""The radix KV store and the stable prompt windows, on small fake tensors."""

from __future__ import annotations

import torch

from codecomplete.model.kvstore import KVStore
from codecomplete.model.prompts import CHARS_PER_TOKEN, GRID, cap_front, window_start


def kv(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake KV whose values encode the token id and position: [L=2, K=1, n, E=3]."""
    n = len(ids)
    base = torch.tensor(ids, dtype=torch.float32).view(1, 1, n, 1).expand(2, 1, n, 3).clone()
    pos = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
    return base + 1000 * pos, -(base + 1000 * pos)


def test_match_returns_the_kv_of_the_longest_cached_prefix():
    store = KVStore(10**9)
    store.insert([1, 2, 3, 4], *kv([1, 2, 3, 4]))
    m = store.match_prefix([1, 2, 3, 9, 9])
    assert m.length == 3
    torch.testing.assert_close(m.k, kv([1, 2, 3])[0])
    assert store.match_prefix([7, 1]).length == 0


def test_diverging_insert_splits_an_edge_and_keeps_both_branches():
    store = KVStore(10**9)
    store.insert([1, 2, 3, 4], *kv([1, 2, 3, 4]))
    added = store.insert([1, 2, 3, 9, 8], *kv([1, 2, 3, 9, 8]))
    assert added == 2
    for ids in ([1, 2, 3, 4], [1, 2, 3, 9, 8]):
        m = store.match_prefix(ids)
        assert m.length == len(ids)
        torch.testing.assert_close(m.k, kv(ids)[0])
        torch.testing.assert_close(m.v, kv(ids)[1])
    assert store.snapshot()["cached_tokens"] == 6


def test_budget_evicts_least_recently_used_unlocked_leaves():
    one_token = 2 * 1 * 3 * 4 * 2  # L * K * E * 4 bytes * (k and v)
    store = KVStore(7 * one_token)
    store.insert([1, 2, 3], *kv([1, 2, 3]))
    held = store.match_prefix([1, 2, 3])
    store.lock(held.nodes)
    store.insert([5, 6, 7], *kv([5, 6, 7]))
    store.match_prefix([5, 6, 7])  # recently used
    store.insert([8, 9], *kv([8, 9]))  # over budget: the LRU unlocked leaf goes
    snap = store.snapshot()
    assert snap["bytes"] <= 7 * one_token and snap["evictions"] >= 1
    assert store.match_prefix([1, 2, 3]).length == 3  # locked: kept
    store.unlock(held.nodes)


def test_a_locked_edge_split_by_an_insert_is_released_whole():
    """Guards locks across splits: a request holding a matched edge while another sequence is
    inserted through the middle of it (a request's own prompt, or another's output) leaves no
    lock behind once it unlocks, so every node can be evicted again."""
    one_token = 2 * 1 * 3 * 4 * 2
    store = KVStore(100 * one_token)
    store.insert([1, 2, 3, 4, 5], *kv([1, 2, 3, 4, 5]))
    held = store.match_prefix([1, 2, 3, 9])  # ends inside the edge [1..5]
    store.lock(held.nodes)
    store.insert([1, 2, 3, 7, 8], *kv([1, 2, 3, 7, 8]))  # splits it after [1, 2, 3]
    assert store.match_prefix([1, 2, 3, 4, 5]).length == 5 and store.match_prefix([1, 2, 3, 7, 8]).length == 5
    store.unlock(held.nodes)
    assert all(n.refs == 0 for n in store._nodes())
    store.budget = one_token
    store.insert([6], *kv([6]))  # an insert evicts down to the budget: all of [1..5] and [7, 8] can go
    assert store.match_prefix([1]).length == 0 and store.snapshot()["bytes"] <= one_token


def test_zero_budget_stores_nothing():
    store = KVStore(0)
    assert store.insert([1, 2], *kv([1, 2])) == 0
    assert store.match_prefix([1, 2]).length == 0


def test_reuse_rate_counts_prompt_and_reused_tokens():
    store = KVStore(10**9)
    store.match_prefix([1, 2, 3, 4])
    store.record_reuse(3)
    assert store.snapshot()["reuse_rate"] == 0.75


def test_prefix_window_start_moves_only_on_the_line_grid():
    """Guards KV reuse for long files: typing must not shift the window's start."""
    lines = [f"x{i} = {i}\n" for i in range(400)]
    doc = "".join(lines)
    starts = set()
    for cut in range(len(doc) - 300, len(doc)):
        starts.add(window_start(doc[:cut], max_tokens=100))
    assert len(starts) <= 2 + 300 // (len(lines[0]) * GRID)  # one start per GRID lines crossed
    for s in starts:
        assert s == 0 or doc[s - 1] == "\n"
        assert doc[:s].count("\n") % GRID == 0
    assert window_start("short", 100) == 0


def test_a_line_longer_than_the_window_is_cut_on_a_character_grid():
    """Guards minified files: with no line start near the budget the window is still
    bounded (1.25 budgets), and its start moves only in steps while the user types."""
    line = "a=[" + ",".join(str(i) for i in range(100_000))
    budget = 100 * CHARS_PER_TOKEN
    starts = set()
    for cut in range(len(line) - 2000, len(line)):
        start = window_start(line[:cut], max_tokens=100)
        assert budget <= cut - start <= budget * 5 // 4
        starts.add(start)
    assert len(starts) <= 2 + 2000 // (budget // 4)
    long_lines = ("x" * 5000 + "\n") * 40  # GRID lines of these would be far over the budget
    assert len(long_lines) - window_start(long_lines, 100) <= budget * 5 // 4


def test_prefix_ids_over_the_budget_are_cut_in_steps():
    """Guards dense text (3 characters per token is only an estimate): the prefix keeps at
    most ``cap`` ids, the last ones, and the cut moves once per cap // 4 ids typed."""
    cap = 100
    firsts = set()
    for n in range(1, 1001):
        ids = list(range(n))
        kept = cap_front(ids, cap)
        assert kept == ids[len(ids) - len(kept):] and len(kept) <= cap
        assert len(kept) > cap - cap // 4 or n < cap
        firsts.add(kept[0])
    assert len(firsts) <= 1 + (1000 - cap) // (cap // 4) + 1
