"""Completions the engine made, by the exact text they were made for.

A request for a document whose text around the cursor is what an earlier request saw
(the user typed a character and deleted it, moved the cursor away and back, dismissed a
suggestion and asked again) is answered with the earlier completion at once, without the
model, as Copilot's and Tabby's clients and llama.vim do.  Greedy decoding is deterministic,
so the answer is what the model gave for that text; retrieval speculation is lossless, so it
does not change it.

The key is everything the prompt is built from: the document, the text before and after
the cursor (notebook cells and a selected menu item included), the repository snippets at
the prompt's head, and the settings that shape the completion.  Texts are hashed, so an
entry costs its completion, not its document.  Only completions that ended by a rule of the
text (end token, a line or block end, the token budget...) are kept: one cut by the time
budget, cancelled or failed would be different next time.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import replace

from codecomplete.model.api import Completion

# Stop reasons that depend only on the prompt (and the model): the same request gives the
# same completion.  ``time_budget``, ``cancelled``, ``error``, ``model_unavailable`` do not.
DETERMINISTIC = frozenset({"eos", "max_tokens", "line_end", "block_end", "blank_lines", "max_lines",
                           "suffix_overlap", "repetition"})


def _digest(*parts: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        b = p.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def cacheable(completion: Completion) -> bool:
    return (not completion.error
            and all(c.stop_reason in DETERMINISTIC and not c.error for c in [completion, *completion.alternatives]))


class CompletionCache:
    """A bounded LRU map from (document, prompt inputs) to the completion made for them."""

    def __init__(self, entries: int):
        self.entries = entries
        self._map: OrderedDict[tuple[str, bytes], Completion] = OrderedDict()
        self.hits = 0
        # bumped by clear(): a request that started before (under other settings, perhaps
        # another model) must not put its completion in after
        self.generation = 0

    def __len__(self) -> int:
        return len(self._map)

    @staticmethod
    def key(uri: str, prefix: str, suffix: str, context: str, shape: tuple) -> tuple[str, bytes]:
        """``shape``: the settings the completion depends on (mode, budgets, alternatives)."""
        return uri, _digest(prefix, suffix, context, repr(shape))

    def __contains__(self, key: tuple[str, bytes]) -> bool:
        """Whether ``get`` would find ``key`` (not counted as a hit)."""
        return self.entries > 0 and key in self._map

    def get(self, key: tuple[str, bytes]) -> Completion | None:
        """The cached completion, marked as such (no prompt, no tokens: nothing ran), or None."""
        if self.entries <= 0:
            return None
        hit = self._map.get(key)
        if hit is None:
            return None
        self._map.move_to_end(key)
        self.hits += 1
        return _served(hit)

    def put(self, key: tuple[str, bytes], completion: Completion, generation: int | None = None) -> bool:
        """Keep ``completion`` if it would be the same next time and (``generation``: the
        cache's generation when its request started) nothing cleared the cache since; True
        if kept."""
        if self.entries <= 0 or not cacheable(completion) or generation not in (None, self.generation):
            return False
        self._map[key] = completion
        self._map.move_to_end(key)
        while len(self._map) > self.entries:
            self._map.popitem(last=False)
        return True

    def drop(self, uri: str) -> None:
        """Forget a document's entries (it was closed)."""
        for k in [k for k in self._map if k[0] == uri]:
            del self._map[k]

    def clear(self) -> None:
        self._map.clear()
        self.generation += 1

    def resize(self, entries: int) -> None:
        self.entries = entries
        while len(self._map) > max(entries, 0):
            self._map.popitem(last=False)


def _served(c: Completion) -> Completion:
    return replace(c, prompt_tokens=0, generated_tokens=0, reused_tokens=0, timings={}, spec_steps=0,
                   accepted_tokens=0, forward_passes=0, layers_run=0, prompt_kind="cached",
                   alternatives=[_served(a) for a in c.alternatives])
