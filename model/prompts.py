"""Prompt plans: which text goes into the prompt, tokenized so that KV can be reused.

Two rules make consecutive keystrokes share token ids, so the KV store can serve them:

* **Stable windows.**  A long prefix is cut at a line boundary taken from a coarse grid
  (every ``GRID`` lines), so the window's start does not move with each keystroke.
* **Segments.**  Each piece is tokenized alone: the prefix as (text before the cursor's
  line) + (newline and the cursor's line), the suffix, the FIM tokens, and EFIM's ``inc``.
  Typing on a line only changes the last segment's ids.

The ``SessionPool`` is EFIM's §3.1: per (client, document) it remembers the prefix and
suffix of the last PSM prompt.  While the prefix only grows and the suffix stays, the
prompt is ``<P>prefix0<S>suffix<M>inc`` (EFIM), so the KV of prefix0 *and* suffix stays
valid; anything else rebuilds a PSM prompt and rebases the session.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

GRID = 16  # lines: the window's start moves in steps of this many lines
CHARS_PER_TOKEN = 3  # a cautious estimate for code, used only to size windows
PROMPT_KINDS = ("psm", "efim", "prefix", "rebase")  # what SessionPool.counts counts


@dataclass
class PromptPlan:
    ids: list[int]
    healed: str  # text removed from the prompt's end by token healing
    kind: str  # "prefix" | "psm" | "efim"
    reason: str = ""


@dataclass
class Session:
    prefix0: str  # the whole prefix text at the last rebase
    suffix: str
    head: list[int]  # the ids of that PSM prompt: <P>prefix0<S>suffix<M>
    healed: str  # what healing took off prefix0's end there (it starts every inc)


def window_start(prefix: str, max_tokens: int) -> int:
    """Start offset of the prefix window: a line start on the GRID, so it is stable.

    Rounding down keeps at most GRID lines more than the budget; the start moves only
    when the cursor crosses GRID lines.  Where those lines are too long for that (a
    minified file, one huge line), the start is on a grid of characters instead (a
    quarter of the budget), so the window stays under 1.25 budgets and still moves
    only in steps.
    """
    budget = max_tokens * CHARS_PER_TOKEN
    if len(prefix) <= budget:
        return 0
    over = len(prefix) - budget
    newlines = prefix.count("\n", 0, over)
    line = newlines // GRID * GRID
    start = 0
    if line:  # the start of line `line`: walk back from `over` (fewer than GRID + 1 finds)
        nl = over
        for _ in range(newlines - line + 1):
            nl = prefix.rfind("\n", 0, nl)
        start = nl + 1
    if len(prefix) - start > 2 * budget:
        step = max(1, budget // 4)
        start = max(start, over // step * step)
    return start


def cap_front(ids: list[int], cap: int) -> list[int]:
    """The end of a prefix's ids within ``cap`` tokens.  The window above is sized in
    characters at an estimated 3 per token; dense text (minified code, numbers) has
    fewer, so its window can hold 2-3x ``cap`` tokens.  The cut is rounded to steps of
    ``cap // 4`` tokens, so while the user types it moves once per step, not per key."""
    if len(ids) <= cap:
        return ids
    step = max(1, cap // 4)
    return ids[-(-(len(ids) - cap) // step) * step:]


def suffix_window(suffix: str, max_tokens: int) -> str:
    budget = max_tokens * CHARS_PER_TOKEN
    if len(suffix) <= budget:
        return suffix
    cut = suffix.rfind("\n", 0, budget)
    return suffix[: cut + 1] if cut > 0 else suffix[:budget]


def head_cut(prefix: str, start: int, lines: int) -> int:
    """Where a new session's prefix0 ends: at the start of the line ``lines`` lines
    before the cursor's (0: the cursor, a plain PSM head; the cursor's own partial line
    always goes after ``<M>`` otherwise), never before the window's start: a window with
    fewer lines puts all of them after ``<M>``."""
    if lines <= 0:
        return len(prefix)
    cut = len(prefix)
    for _ in range(lines):
        nl = prefix.rfind("\n", start, cut - 1) if cut - 1 > start else -1
        if nl < start:
            return start
        cut = nl + 1
    return cut


def ahead_heads(prefix: str, template, toks: "Tokens", max_prefix_tokens: int, context: str = "",
                lookahead: int = 0) -> list[list[int]]:
    """The openings of the prompts the prefix window will have once it moves: one for the
    window's start now and, where the start moves within ``lookahead`` more characters
    typed at the cursor, one for the start it moves to.  Each is the prompt up to the
    cursor's line (``<P>`` + the window's lines before it, as its own segment), so the
    prompt of a later request or EFIM rebase with that start begins with it, give or take
    the last token, whatever the user types on the cursor's line and after it.  A window
    whose tokens may pass ``max_prefix_tokens`` (dense text, whose front ``cap_front``
    cuts by its length) gives none: its start in tokens is not known ahead.

    Prefilled while the engine is idle (``Engine`` ``ahead_chars``), they turn the move's
    full prefill (every prompt token shifts) into the prefill of the lines typed since."""
    budget = max_prefix_tokens * CHARS_PER_TOKEN
    if lookahead <= 0 or len(prefix) + lookahead <= budget:
        return []
    now = window_start(prefix, max_prefix_tokens)
    to_move, soon = next_start(prefix, max_prefix_tokens, lookahead)
    line = prefix.rfind("\n")
    head = opening(toks, template, context)
    heads = []
    for start in dict.fromkeys((now, soon)):
        if line <= start:
            continue
        text = toks.encode(prefix[start:line])
        if len(text) * (len(prefix) + to_move - start) > max_prefix_tokens * (line - start):
            continue  # at this text's density, the window would pass the cap before it moves
        heads.append(head + text)
    return heads


def next_start(prefix: str, max_tokens: int, lookahead: int) -> tuple[int, int]:
    """(characters typed at the cursor until the window's start moves, the start it moves to),
    the first move within ``lookahead`` characters; (lookahead, the start now) if none."""
    now = window_start(prefix, max_tokens)
    if window_start(prefix + " " * lookahead, max_tokens) == now:
        return lookahead, now
    lo, hi = 0, lookahead  # the start is `now` after lo more characters and moved after hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if window_start(prefix + " " * mid, max_tokens) == now:
            lo = mid
        else:
            hi = mid
    return hi, window_start(prefix + " " * hi, max_tokens)


def opening(toks: "Tokens", template, context: str = "") -> list[int]:
    """A prompt's ids before its prefix text: BOS where the tokenizer adds one, ``<P>`` and
    its pad (FIM templates), the repository snippets."""
    tok = toks.tok
    bos = [tok.bos_token_id] if getattr(tok, "add_bos_token", False) and tok.bos_token_id is not None else []
    if template is None:
        return bos + toks.encode(context)
    return bos + [toks.special(template.prefix)] + toks.encode(template.prefix_pad) + toks.encode(context)


class Tokens:
    """Tokenizing by segments, and token healing of the last one."""

    def __init__(self, tokenizer, vocab=None):
        self.tok = tokenizer
        self.vocab = vocab  # a healing vocabulary (engine._Vocab) or None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) if text else []

    def prefix_ids(self, text: str) -> list[int]:
        """(text before the last newline) + (the rest), tokenized apart."""
        cut = text.rfind("\n")
        if cut <= 0:
            return self.encode(text)
        return self.encode(text[:cut]) + self.encode(text[cut:])

    def heal(self, ids: list[int]) -> tuple[list[int], str]:
        if self.vocab is None or not ids:
            return ids, ""
        last = self.vocab.texts[ids[-1]]
        if not last or "\ufffd" in last:
            return ids, ""
        return ids[:-1], last

    def special(self, token: str) -> int:
        return self.tok.convert_tokens_to_ids(token)


class SessionPool:
    """EFIM sessions per key (client and document), least recently used dropped."""

    def __init__(self, max_sessions: int = 256, inc_bound: int = 64, head_lines: int = 0):
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.max_sessions = max_sessions
        self.inc_bound = inc_bound
        self.head_lines = head_lines  # a new session's prefix0 ends this many lines back
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(PROMPT_KINDS, 0)

    def plan(self, key: str | None, prefix: str, suffix: str, template, toks: Tokens,
             max_prefix_tokens: int, max_suffix_tokens: int, efim: bool = True,
             context: str = "", keep: bool = True) -> PromptPlan:
        """``context`` (repository snippets) opens the prefix, tokenized as its own
        segment; an EFIM continuation keeps the session's context, so the head's KV
        stays valid while the user types.  ``keep=False``: the prompt a request would get
        now, the sessions and counts left as they are (a warm-up's: the request after it
        plans from the same state as without it, so its prompt is the same)."""
        head = opening(toks, template, context)
        if template is None:
            start = window_start(prefix, max_prefix_tokens)
            ids, healed = toks.heal(cap_front(toks.prefix_ids(prefix[start:]), max_prefix_tokens))
            if keep:
                self._count("prefix")
            return PromptPlan(head + ids, healed, "prefix")
        with self._lock:
            session = self.sessions.get(key) if key and efim else None
            if session is not None:
                self.sessions.move_to_end(key)
        reason = "new session" if session is None else "rebase"
        if session is not None and prefix.startswith(session.prefix0) and suffix == session.suffix:
            inc_ids = toks.encode(session.healed + prefix[len(session.prefix0):])
            if len(inc_ids) <= self.inc_bound:
                return self._efim(session, inc_ids, toks, count=keep)
            reason = "inc bound"
        elif session is not None and prefix == session.prefix0 and suffix.endswith(session.suffix):
            reason = "suffix grew"
        start = window_start(prefix, max_prefix_tokens)
        cut = head_cut(prefix, start, self.head_lines) if key and efim else len(prefix)
        # the first inc obeys the bound too: fewer lines after <M> (long lines), none if
        # even the cursor's line is over it
        while cut < len(prefix) and len(toks.encode(prefix[cut:])) > self.inc_bound:
            nl = prefix.find("\n", cut)
            cut = nl + 1 if nl >= 0 else len(prefix)
        head_prefix = prefix[:cut]
        prefix_ids, healed = toks.heal(cap_front(toks.prefix_ids(head_prefix[start:]), max_prefix_tokens))
        ids = (head + prefix_ids + [toks.special(template.suffix)]
               + toks.encode(suffix_window(suffix, max_suffix_tokens))[:max_suffix_tokens]
               + [toks.special(template.middle)] + toks.encode(template.middle_pad))
        if key and efim:
            session = Session(head_prefix, suffix, ids, healed)
            if keep:
                with self._lock:
                    self.sessions[key] = session
                    self.sessions.move_to_end(key)
                    while len(self.sessions) > self.max_sessions:
                        self.sessions.popitem(last=False)
                if reason != "new session":
                    self._count("rebase")
            if cut < len(prefix):  # the last lines go after <M>: EFIM from the first request
                return self._efim(session, toks.encode(healed + prefix[cut:]), toks, reason, count=keep)
        if keep:
            self._count("psm")
        return PromptPlan(ids, healed, "psm", reason)

    def _efim(self, session: Session, inc_ids: list[int], toks: Tokens, reason: str = "",
              count: bool = True) -> PromptPlan:
        """``<P>prefix0<S>suffix<M>inc``: the session's head and its inc, healed."""
        inc_ids, healed = toks.heal(inc_ids)
        if count:
            self._count("efim")
        return PromptPlan(session.head + inc_ids, healed, "efim", reason)

    def drop(self, key: str) -> None:
        with self._lock:
            self.sessions.pop(key, None)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1
