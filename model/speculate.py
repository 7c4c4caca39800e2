"""Retrieval speculative decoding (FastCoder / REST) with tree-attention verification (issue #8).

Per decode step of a request whose last picked token is ``t0``:

1. **Draft**: continuations of the context's suffix from the sources, queried together:
   the request's own tokens so far (its prompt and its output: where the last three tokens
   occurred before, what followed; prompt-lookup decoding's source, and what catches a
   model repeating itself within one completion), the verified cache (consulted first once
   it holds more than ``tau`` sequences), the
   repository datastore (open buffers included) and the common datastore (both through
   the retriever the daemon gives the engine: ``RepoIndex.lookup``).  At a *skip token*
   (the first non-whitespace token of a line, where code is least predictable) the
   datastores are asked only with probability ``p``; a *missing table* remembers context
   suffixes that returned nothing and skips them.
2. **Trie**: every continuation is inserted; a node's weight adds ``alpha`` x its
   repository share, ``beta`` x its common share and ``gamma`` x its cache share (each
   source's counts normalised to 1).  The best ``max_nodes`` nodes are kept best-first,
   so every kept node's parent is kept.
3. **Verify**: ``t0`` and the nodes run in one forward pass: node i sits at position
   ``L + depth(i)`` and attends the cache and its own ancestors (a tree mask).  The
   longest path whose every token equals the greedy choice at its parent is accepted;
   its KV is compacted into place and the rest dropped.  The output is the greedy
   output token for token: a drafted token is kept only if greedy decoding picks it.
4. **Learn**: the accepted tokens with their context go into the verified cache, and
   the model's outputs are added in pieces of 20 tokens when a request finishes.

The engine calls ``Drafter.draft`` and ``verify``; nothing here knows about LSP.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .api import SpecSettings
from .sampling import greedy_tokens

# What a retriever returns per source: objects with .source ("repository" | "common"),
# .length (matched context tokens) and .continuations [(tokens, count)] (indexer.suffix.Match).
Retriever = Callable[..., list]


@dataclass
class Tree:
    """Draft nodes in breadth-first order (a parent before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: a child of the root (t0)
    depths: list[int] = field(default_factory=list)  # 1 for the root's children

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> "Tree":
        """The first ``n`` nodes (every kept node's parent comes before it): a tree cut to a pass's rows."""
        return self if len(self) <= n else Tree(self.tokens[:n], self.parents[:n], self.depths[:n])

    def children(self) -> list[dict[int, int]]:
        """Per node (index 0 = the root, i + 1 = node i): token -> child node index + 1."""
        out: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (tok, par) in enumerate(zip(self.tokens, self.parents)):
            out[par + 1].setdefault(tok, i + 1)
        return out


# auto max_rows where bf16 products run on the panels (bench/results/: AVX2 spec_rows_avx2_tiles6.md,
# AVX-512F spec_rows_panels512.md)
AVX2_ROWS = 8


def _cpu_linear_path(model) -> int | None:
    """The native bf16 linear kernel's path (linear.c's linear_bf16_path) that ``model`` runs on:
    None for another device or dtype, without the native kernels, or with AMX tiles."""
    if model.device.type == "cpu" and model.dtype == torch.bfloat16 and model.native_stack is not None:
        from . import native

        return None if native.amx() else native.linear_bf16_path()
    return None


def costly_passes(model) -> bool:
    """Whether a verification pass of several rows costs several one-row steps for ``model``: a
    bf16 model on a CPU whose linear kernel is the panels (AVX2 or AVX-512F FMAs) or the portable
    loop (a 16-row pass's linear layers ~2.4 steps with the AVX2 kernel, bench/results/linear_avx2.md,
    ~2.2 with the AVX-512F panels on an AVX512-BF16 Xeon without AMX, bench/results/pass_cost_panels512.md,
    against ~1.2 on AMX tiles)."""
    return _cpu_linear_path(model) in (0, 1, 3)


def costly_short_matches(model) -> bool:
    """Whether the datastores' short matches draft more than they pay for ``model``: measured so on
    the AVX2 kernel (bench/results/spec_min_match_avx2.md), not on the AVX-512F panels, where a pass
    is as costly but matches of 2 tokens won (bench/results/spec_rows_panels512.md)."""
    return _cpu_linear_path(model) in (0, 1)


def pass_rows(settings, model) -> int:
    """The most rows a verification pass of ``model`` takes under ``settings``: its
    ``max_rows``, or (0, auto) ``AVX2_ROWS`` where passes are costly (``costly_passes``; measured:
    shorter chains won there), else no cap (the largest tree the settings draw, plus the root)."""
    if settings.max_rows > 0:
        return settings.max_rows
    if costly_passes(model):
        return AVX2_ROWS
    return max(settings.max_nodes, settings.depth) + 1


def datastore_min_match(settings, model) -> int:
    """The shortest context match the datastores draft from: ``min_match``, raised to
    ``costly_min_match`` where short matches cost more than they pay (``costly_short_matches``;
    measured on the AVX2 CPU: their drafts cost a wider pass, bench/results/spec_min_match_avx2.md)."""
    if settings.costly_min_match and costly_short_matches(model):
        return max(settings.min_match, settings.costly_min_match)
    return settings.min_match


def build_tree(weighted: list[tuple[tuple[int, ...], float]], max_nodes: int, max_depth: int) -> Tree:
    """The best ``max_nodes`` nodes of the trie of ``weighted`` sequences, best-first."""
    trie: dict = {}  # token -> [weight, children]
    for seq, w in weighted:
        level = trie
        for tok in seq[:max_depth]:
            node = level.setdefault(tok, [0.0, {}])
            node[0] += w
            level = node[1]
    tree = Tree()
    heap = [(-node[0], i, tok, -1, 1, node[1]) for i, (tok, node) in enumerate(trie.items())]
    heapq.heapify(heap)
    order = len(heap)
    while heap and len(tree) < max_nodes:
        _, _, tok, parent, depth, kids = heapq.heappop(heap)
        idx = len(tree)
        tree.tokens.append(tok)
        tree.parents.append(parent)
        tree.depths.append(depth)
        for ctok, cnode in kids.items():
            order += 1
            heapq.heappush(heap, (-cnode[0], order, ctok, idx, depth + 1, cnode[1]))
    # breadth-first order is not guaranteed by best-first popping; a parent always comes
    # before its child, which is all the mask and the walk need.
    return tree


def validate_tree(tree: Tree) -> None:
    """Raise ``ValueError`` unless every parent precedes its child one level up."""
    for i, (par, d) in enumerate(zip(tree.parents, tree.depths)):
        if par >= i or (par < 0 and d != 1) or (par >= 0 and d != tree.depths[par] + 1):
            raise ValueError(f"node {i}: parent {par}, depth {d}")


def tree_mask(tree: Tree, cached: int, width: int, device) -> torch.Tensor:
    """Boolean [width, cached + width]: row 0 is the root t0, row i + 1 node i; each sees
    the cache, the root and its ancestors; rows past the tree (batch padding, never read)
    see the cache and the root, a prefix, which the attention kernel computes with the
    other rows (a row below a sibling is recomputed over its own positions)."""
    # numpy, then one tensor: right after a native pass every PyTorch op runs on cold caches
    # (~10x its warm cost here), and a verification pass makes this mask
    mask = np.ones((width, cached + width), dtype=np.bool_)
    block = mask[:, cached:]
    block[:, 1:] = False  # every row sees the root
    for i, par in enumerate(tree.parents):
        block[i + 1] = block[par + 1]  # the parent's row: the root and its ancestors (par = -1: the root)
        block[i + 1, i + 1] = True
    return torch.from_numpy(mask).to(device)


def accept(tree: Tree, greedy: list[int]) -> list[int]:
    """Rows (1-based node indices) of the longest accepted path; ``greedy[r]`` is the
    greedy token after row r (0 = the root)."""
    kids = tree.children()
    path, row = [], 0
    while True:
        nxt = kids[row].get(greedy[row])
        if nxt is None:
            return path
        path.append(nxt)
        row = nxt


class VerifiedCache:
    """Token sequences the model verified, indexed by their last 1-4 context tokens:
    FastCoder's context- and LLM-preference-aware cache.  ``lookup`` returns the
    continuations of the longest indexed context suffix, with counts."""

    KEYS = (4, 3, 2)

    def __init__(self, capacity: int = 4096, depth: int = 8):
        self.capacity, self.depth = capacity, depth
        self.table: OrderedDict[tuple, Counter] = OrderedDict()
        self.sequences = 0

    def add(self, context: list[int], tokens: list[int]) -> None:
        if not tokens:
            return
        seq = list(context[-max(self.KEYS):]) + list(tokens)
        start = len(seq) - len(tokens)
        for i in range(max(1, start), len(seq)):
            cont = tuple(seq[i:i + self.depth])
            for k in self.KEYS:
                if i - k < 0:
                    continue
                key = tuple(seq[i - k:i])
                c = self.table.get(key)
                if c is None:
                    c = self.table[key] = Counter()
                else:
                    self.table.move_to_end(key)
                c[cont] += 1
        self.sequences += 1
        while len(self.table) > self.capacity * 8:
            self.table.popitem(last=False)

    def lookup(self, context: list[int], top_k: int) -> list[tuple[tuple[int, ...], int]]:
        for k in self.KEYS:
            if len(context) < k:
                continue
            c = self.table.get(tuple(context[-k:]))
            if c:
                self.table.move_to_end(tuple(context[-k:]))
                return c.most_common(top_k)
        return []


class LiveIndex:
    """One request's own tokens (prompt, then output) indexed by their trigrams: where the
    last three tokens occurred before and what followed them.  ``update`` takes the whole
    sequence so far (it only grows while a request decodes); ``lookup`` ranks the earlier
    occurrences by how far back they match (then by recency) and returns their distinct
    continuations with counts."""

    N = 3
    SCAN = 64  # most recent occurrences looked at per lookup
    BACK = 16  # longest match measured

    def __init__(self):
        self.longest = 0  # how far back the last lookup's best occurrence matched
        self.seq: list[int] = []
        self.ends: dict[tuple, list[int]] = {}  # trigram -> positions just after its occurrences

    def update(self, context: list[int]) -> None:
        n = len(self.seq)
        if n > len(context) or (n and context[n - 1] != self.seq[-1]):  # not an extension: start again
            self.seq, self.ends, n = [], {}, 0
        for i in range(n, len(context)):
            self.seq.append(context[i])
            if i + 1 >= self.N:
                self.ends.setdefault(tuple(self.seq[i + 1 - self.N:i + 1]), []).append(i + 1)

    def continuations(self, end: int, depth: int) -> list[tuple[int, ...]]:
        """What to draft from the earlier occurrence ending at ``end``: the tokens after it
        (bench/spec_live_corrected.py tries others)."""
        return [tuple(self.seq[end:end + depth])]

    def lookup(self, depth: int, top_k: int) -> list[tuple[tuple[int, ...], int]]:
        seq, n = self.seq, len(self.seq)
        if n < self.N + 1:
            return []
        scored = []
        for end in reversed(self.ends.get(tuple(seq[-self.N:]), [])[-self.SCAN - 1:]):
            if end >= n:  # the suffix itself
                continue
            back = self.N
            while back < self.BACK and end - back - 1 >= 0 and seq[end - back - 1] == seq[n - back - 1]:
                back += 1
            scored.append((back, end))
        counts: Counter = Counter()
        best: dict[tuple, tuple] = {}
        for back, end in sorted(scored, reverse=True):
            for cont in self.continuations(end, depth):
                if cont:
                    counts[cont] += 1
                    best.setdefault(cont, (back, end))
        ranked = sorted(counts, key=lambda c: best[c], reverse=True)[:top_k]
        self.longest = best[ranked[0]][0] if ranked else 0
        return [(c, counts[c] * best[c][0]) for c in ranked]


class Drafter:
    """Draft trees for one engine (one model/tokenizer); keeps the verified cache."""

    def __init__(self, settings: SpecSettings, retriever: Retriever | None = None,
                 token_texts: list[str] | None = None, seed: int = 0):
        self.settings = settings
        self.retriever = retriever
        self.texts = token_texts
        self.cache = VerifiedCache(settings.cache_sequences, settings.depth)
        self.missing: OrderedDict[tuple, None] = OrderedDict()
        self.rng = random.Random(seed)
        self.stats = Counter()

    def _is_skip_token(self, context: list[int]) -> bool:
        """The last token is the first non-whitespace token of its line."""
        if self.texts is None or len(context) < 2:
            return False
        cur, prev = self.texts[context[-1]], self.texts[context[-2]]
        if not cur.strip() or "\n" in cur:
            return False
        head = cur[: len(cur) - len(cur.lstrip())]
        return not head.strip() and prev.rstrip(" \t").endswith("\n")

    def draft(self, context: list[int], limit: int | None = None, live: LiveIndex | None = None,
              min_match: int | None = None) -> Tree:
        """A draft tree for what follows ``context`` (the last token is t0); ``live``: the
        request's own index of its tokens (updated here with ``context``); ``min_match``: the
        datastores' shortest match (default: the settings')."""
        t0 = time.perf_counter()
        try:
            return self._draft(context, limit, live, min_match or self.settings.min_match)
        finally:
            self.stats["drafts"] += 1
            self.stats["draft_ms"] += (time.perf_counter() - t0) * 1000

    def _draft(self, context: list[int], limit: int | None, live: LiveIndex | None, min_match: int) -> Tree:
        s = self.settings
        depth = max(1, min(s.depth, limit if limit is not None else s.depth))
        weighted: list[tuple[tuple[int, ...], float]] = []
        if live is not None and s.use_live:
            live.update(context)
            own = live.lookup(depth, s.top_k)
            if own:
                total = sum(n for _, n in own)
                weighted += [(seq, s.delta * n / total) for seq, n in own]
                self.stats["live_hits"] += 1
        from_cache = s.use_cache and self.cache.lookup(context, s.top_k)
        if from_cache:
            total = sum(n for _, n in from_cache)
            weighted += [(seq, s.gamma * n / total) for seq, n in from_cache]
        consult = not (from_cache and self.cache.sequences > s.tau)  # the cache first, once it is full enough
        if consult and self.retriever is not None and (s.use_repository or s.use_common):
            if s.skip_tokens and self._is_skip_token(context) and self.rng.random() >= s.p:
                consult = False
                self.stats["skipped_at_skip_token"] += 1
            key = tuple(context[-4:])
            if consult and s.missing_table and key in self.missing:
                consult = False
                self.stats["skipped_missing"] += 1
            if consult:
                self.stats["retrievals"] += 1
                found = False
                for m in self.retriever(context, draft_len=depth, top_k=s.top_k, min_len=min_match):
                    weight = s.alpha if m.source == "repository" else s.beta
                    if (m.source == "repository" and not s.use_repository) or (
                            m.source == "common" and not s.use_common):
                        continue
                    total = sum(c.count for c in m.continuations) or 1
                    for c in m.continuations:
                        weighted.append((tuple(c.tokens), weight * c.count / total))
                        found = True
                if not found and s.missing_table:
                    self.missing[key] = None
                    if len(self.missing) > 65536:
                        self.missing.popitem(last=False)
        if not weighted:
            return Tree()
        nodes = s.max_nodes
        if live is not None and s.use_live and s.live_chain and live.longest >= s.live_chain:
            nodes = max(nodes, depth)  # the request repeats a stretch of itself: room for a whole chain
        return build_tree(weighted, nodes, depth)

    def learn(self, context: list[int], accepted: list[int]) -> None:
        if self.settings.use_cache and accepted:
            self.cache.add(context, accepted)

    def learn_output(self, context: list[int], output: list[int], piece: int = 20) -> None:
        """A finished request's output, in pieces of ``piece`` tokens."""
        if not self.settings.use_cache:
            return
        ctx = list(context)
        for i in range(0, len(output), piece):
            self.cache.add(ctx, output[i:i + piece])
            ctx = ctx + output[i:i + piece]
        self.missing.clear()  # new text: suffixes that found nothing may find something


def in_place(rows: list[int]) -> bool:
    """Whether accepted rows (1-based node indices) are the pass's first rows: a path down first
    children, already where ``compact`` would put it."""
    return rows == list(range(1, len(rows) + 1))


def compact(cache, start: int, rows: list[int]) -> None:
    """Keep the root (at ``start``) and the accepted rows, contiguously after it."""
    if not in_place(rows):
        idx = torch.tensor([start + r for r in rows], device=cache.k.device)
        cache.k[:, :, start + 1:start + 1 + len(rows)] = cache.k[:, :, idx]
        cache.v[:, :, start + 1:start + 1 + len(rows)] = cache.v[:, :, idx]
    cache.length = start + 1 + len(rows)


def verify(model, roots: list[int], trees: list[Tree], caches: list,
           greedy: bool = False) -> list[tuple[list[int], torch.Tensor, int]]:
    """One forward pass over each sequence's root token and draft tree.  ``greedy``: the
    caller takes only greedy choices from the returned logits (see ``Transformer.forward``).

    Returns per sequence (accepted tokens, logits [1 + accepted, V] at the root and
    along the accepted path, in the model's dtype, and the greedy token after the last of
    them: the pass's next pick); each cache then holds the root and the accepted tokens.
    The logits are a view of the pass's where the path runs down first children (a chain's
    always does), else a copy of its rows."""
    width = 1 + max(len(t) for t in trees)
    dev = model.device
    tokens = np.empty((len(trees), width), dtype=np.int64)
    positions = np.empty((len(trees), width), dtype=np.int64)
    masks = []
    for b, (root, tree, cache) in enumerate(zip(roots, trees, caches)):
        n = len(tree)
        tokens[b] = root  # the root, then the nodes; padding repeats the root
        positions[b] = cache.length
        if n:
            tokens[b, 1:n + 1] = tree.tokens
            positions[b, 1:n + 1] += tree.depths
        chain = n + 1 == width and tree.parents == list(range(-1, n - 1))
        # a chain sees what a causal pass sees: no mask for the kernel to read per row and position
        masks.append(None if chain else tree_mask(tree, cache.length, width, dev))
    starts = [c.length for c in caches]
    logits = model(torch.from_numpy(tokens).to(dev), caches, torch.from_numpy(positions).to(dev), masks,
                   logits_for="all", greedy=greedy)
    greedy_all = greedy_tokens(logits)  # in the logits' dtype: no fp32 copy of every row
    out = []
    for b, (tree, cache) in enumerate(zip(trees, caches)):
        rows = accept(tree, greedy_all[b][: len(tree) + 1])
        compact(cache, starts[b], rows)
        # in place: a view, no gather (~0.2 ms for 16 rows of 49k logits on cold caches)
        picked = logits[b, :len(rows) + 1] if in_place(rows) else logits[b, [0] + rows]
        out.append(([tree.tokens[r - 1] for r in rows], picked, greedy_all[b][rows[-1] if rows else 0]))
    return out
