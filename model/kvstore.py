"""The KV store: one owner of cached KV tensors, indexed by a radix tree over token ids.

SGLang's design on a small scale.  Each edge holds a run of token ids and their KV
(``k, v: [L, K, n, E]``).  ``match_prefix(ids)`` returns how many leading tokens have
cached KV and the KV itself; ``insert(ids, k, v)`` stores what is not cached yet (the
prompt and the generated tokens of a finished request), splitting an edge where the new
sequence diverges inside it.  A byte budget is kept by evicting least recently used
leaves that no live request holds (``lock``/``unlock``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    k: torch.Tensor | None  # [L, K, len(key), E]
    v: torch.Tensor | None
    parent: "Node | None"
    children: dict[int, "Node"] = field(default_factory=dict)
    last_access: int = 0
    refs: int = 0

    @property
    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class Match:
    length: int  # tokens with cached KV
    nodes: list[Node]  # the path, for lock/unlock
    parts: list[tuple[torch.Tensor, torch.Tensor]]  # per edge: views k, v [L, K, n, E]

    @property
    def k(self) -> torch.Tensor | None:  # [L, K, length, E]: a copy, for inspection
        return torch.cat([k for k, _ in self.parts], 2) if self.parts else None

    @property
    def v(self) -> torch.Tensor | None:
        return torch.cat([v for _, v in self.parts], 2) if self.parts else None


class KVStore:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.root = Node((), None, None, None)
        self.bytes = 0
        self._lock = threading.Lock()
        self.stats = {"lookups": 0, "prompt_tokens": 0, "reused_tokens": 0, "inserted_tokens": 0,
                      "evicted_tokens": 0, "evictions": 0}

    # -- lookup --------------------------------------------------------------------------
    def _descend(self, ids: list[int], split: bool) -> tuple[list[tuple[Node, int]], Node, int]:
        """Follow ``ids`` down from the root, stamping each edge as used.  Returns the
        edges with how many of their tokens matched, the last fully matched node and the
        matched length.  With ``split`` a partly matched edge is cut at the divergence."""
        node, pos, path = self.root, 0, []
        stamp = next(_clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common(child.key, ids, pos)
            child.last_access = stamp
            if n < len(child.key):
                if not split:
                    path.append((child, n))
                    pos += n
                    break
                child = self._split(child, n)
            path.append((child, n))
            pos += n
            node = child
        return path, node, pos

    def match_prefix(self, ids: list[int], count: bool = True) -> Match:
        with self._lock:
            path, _, pos = self._descend(ids, split=False)
            if count:
                self.stats["lookups"] += 1
                self.stats["prompt_tokens"] += len(ids)
            parts = [(c.k[:, :, :n], c.v[:, :, :n]) for c, n in path]
            return Match(pos, [c for c, _ in path], parts)

    def record_reuse(self, reused: int) -> None:
        with self._lock:
            self.stats["reused_tokens"] += reused

    def lock(self, nodes: list[Node]) -> None:
        with self._lock:
            for n in nodes:
                n.refs += 1

    def unlock(self, nodes: list[Node]) -> None:
        with self._lock:
            for n in nodes:
                n.refs -= 1

    # -- insert --------------------------------------------------------------------------
    def insert(self, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> int:
        """Store KV for ``ids`` (``k, v: [L, K, len(ids), E]`` from position 0); only the
        part not cached yet is copied.  Returns the number of tokens added."""
        if self.budget <= 0 or not ids:
            return 0
        with self._lock:
            _, node, pos = self._descend(ids, split=True)
            added = len(ids) - pos
            if added:
                leaf = Node(tuple(ids[pos:]), k[:, :, pos:len(ids)].clone(), v[:, :, pos:len(ids)].clone(),
                            node, last_access=next(_clock))
                node.children[ids[pos]] = leaf
                self.bytes += leaf.nbytes
                self.stats["inserted_tokens"] += added
            self._evict_to(self.budget)
            return added

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node.  Whoever locked
        ``child`` holds its lower part (the same object) and unlocks that: the upper node takes
        no locks of its own (a copy would never be released), and is not evicted while it
        has the lower one under it (only leaves are)."""
        upper = Node(child.key[:n], child.k[:, :, :n].clone(), child.v[:, :, :n].clone(), child.parent,
                     last_access=child.last_access)
        child.parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.k = child.k[:, :, n:].clone()
        child.v = child.v[:, :, n:].clone()
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # -- eviction ------------------------------------------------------------------------
    def _evict_to(self, budget: int) -> None:
        while self.bytes > budget:
            leaves = [n for n in self._nodes() if not n.children and n.refs <= 0]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_access)
            del victim.parent.children[victim.key[0]]
            self.bytes -= victim.nbytes
            self.stats["evictions"] += 1
            self.stats["evicted_tokens"] += len(victim.key)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def clear(self) -> None:
        with self._lock:
            self.root.children.clear()
            self.bytes = 0

    def snapshot(self) -> dict:
        with self._lock:
            s = dict(self.stats)
            s.update(bytes=self.bytes, budget_bytes=self.budget,
                     cached_tokens=sum(len(n.key) for n in self._nodes()),
                     reuse_rate=round(s["reused_tokens"] / s["prompt_tokens"], 4) if s["prompt_tokens"] else None)
            return s


def _common(key: tuple[int, ...], ids: list[int], pos: int) -> int:
    n = 0
    limit = min(len(key), len(ids) - pos)
    while n < limit and key[n] == ids[pos + n]:
        n += 1
    return n
