"""Suffix-match draft retrieval over token ids (REST / FastCoder).

Given the token ids before the cursor, find the longest suffix of them (``MAX_QUERY``
tokens down to ``min_len``) that occurs in the datastore and return what followed it
there, with counts.  The speculation engine turns those continuations into a draft trie.

A ``Segment`` is an immutable suffix array over the token ids of some documents: the ids
are concatenated with a sentinel after each document (so no match crosses a file) and
stored big-endian, which makes byte order equal token order, so a binary search can
compare plain ``bytes`` slices in C.  Suffixes are sorted by their first ``MAX_QUERY``
tokens only (prefix doubling with numpy; ties in longer suffixes never matter to a
query of at most ``MAX_QUERY`` tokens).  Memory per token: the ids (2 bytes when the
vocabulary fits 16 bits, else 4) plus a 4-byte suffix-array entry.

``DraftIndex`` is a base segment plus a small delta segment (LSM style): updating a file
marks its old copy dead and rebuilds only the delta; when the delta grows past a share
of the base, ``compact`` folds everything into a new base.  Readers take an immutable
snapshot, so queries never wait for writers.  A segment can be saved and memory-mapped
(the common datastore).
"""

from __future__ import annotations

import json
import mmap
import threading
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_QUERY = 16  # longest context suffix looked up
MAX_DRAFT = 32  # longest continuation returned
PAD = MAX_QUERY + MAX_DRAFT
FORMAT = "codecomplete-suffix-v1"


@dataclass(frozen=True)
class Continuation:
    tokens: tuple[int, ...]
    count: int


@dataclass(frozen=True)
class Match:
    """The longest context suffix found and what followed it."""

    length: int  # tokens of context matched
    occurrences: int  # live occurrences of that suffix
    continuations: list[Continuation]
    source: str = ""


def width_for(vocab_size: int) -> int:
    return 2 if vocab_size < 0xFFFF else 4


def _dense_rank(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    flag = np.empty(len(keys), dtype=np.uint64)
    flag[0] = 0
    np.not_equal(sk[1:], sk[:-1], out=flag[1:], casting="unsafe")
    ranks_sorted = np.cumsum(flag, dtype=np.uint64)
    del sk, flag
    rank = np.empty_like(ranks_sorted)
    rank[order] = ranks_sorted
    return rank, order


def build_suffix_array(tok: np.ndarray, width: int, sentinel: int) -> np.ndarray:
    """Positions of ``tok`` (not sentinels, not the padding) sorted by their first
    ``MAX_QUERY`` tokens.  ``tok`` must end with ``PAD`` sentinels."""
    m = len(tok) - PAD
    if m <= 0:
        return np.zeros(0, dtype=np.uint32)
    t = tok.astype(np.uint64)
    per = 64 // (8 * width)  # tokens packed in one 64-bit key: 4 or 2
    key = np.zeros(m + MAX_QUERY, dtype=np.uint64)
    for j in range(per):
        key |= t[j:j + m + MAX_QUERY] << np.uint64(8 * width * (per - 1 - j))
    del t
    rank, order = _dense_rank(key)
    span = per
    while span < MAX_QUERY:
        n = len(rank) - span
        key = (rank[:n] << np.uint64(32)) | rank[span:span + n]
        rank, order = _dense_rank(key)
        span *= 2
    order = order[order < m]
    keep = tok[order] != sentinel
    return order[keep].astype(np.uint32)


class Segment:
    """An immutable suffix array over some documents' token ids."""

    def __init__(self, buf, tok: np.ndarray, sa: np.ndarray, starts: np.ndarray,
                 keys: list, width: int):
        self.buf = buf  # bytes-like whose slices are bytes (bytes or mmap)
        self.tok = tok  # big-endian view of buf
        self.sa = sa
        self._sa = memoryview(sa) if len(sa) else sa
        self.starts = starts  # start offset of each document, ascending
        self.keys = keys  # the document key at each index
        self.width = width
        self.sentinel = (1 << (8 * width)) - 1
        self.alive = np.ones(len(keys), dtype=bool)
        self.dead = 0  # documents marked dead

    def kill(self, index: int) -> None:
        if self.alive[index]:
            self.alive[index] = False
            self.dead += 1

    @classmethod
    def build(cls, docs: list[tuple[object, np.ndarray]], width: int) -> "Segment":
        sentinel = (1 << (8 * width)) - 1
        dtype = np.dtype(">u2" if width == 2 else ">u4")
        total = sum(len(ids) + 1 for _, ids in docs) + PAD
        tok = np.full(total, sentinel, dtype=dtype)
        starts = np.zeros(len(docs), dtype=np.int64)
        pos = 0
        for i, (_, ids) in enumerate(docs):
            starts[i] = pos
            tok[pos:pos + len(ids)] = ids
            pos += len(ids) + 1
        buf = tok.tobytes()
        tok = np.frombuffer(buf, dtype=dtype)
        sa = build_suffix_array(tok, width, sentinel)
        return cls(buf, tok, sa, starts, [k for k, _ in docs], width)

    # -- persistence (the common datastore) -----------------------------------------------
    def save(self, folder: Path, meta: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokens.bin").write_bytes(self.buf)
        (folder / "sa.bin").write_bytes(np.ascontiguousarray(self.sa, dtype="<u4").tobytes())
        np.save(folder / "starts.npy", self.starts)
        info = dict(meta, format=FORMAT, width=self.width, tokens=self.tokens,
                    documents=len(self.keys), keys=[str(k) for k in self.keys])
        (folder / "meta.json").write_text(json.dumps(info))

    @classmethod
    def load(cls, folder: Path) -> tuple["Segment", dict]:
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{folder}: not a {FORMAT} datastore")
        width = int(meta["width"])
        maps = []
        for name in ("tokens.bin", "sa.bin"):
            with open(folder / name, "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        tok = np.frombuffer(maps[0], dtype=">u2" if width == 2 else ">u4")
        sa = np.frombuffer(maps[1], dtype="<u4")
        if len(tok) != meta["tokens"] + len(meta["keys"]) + PAD or len(sa) > len(tok):
            raise ValueError(f"{folder}: datastore files do not match their metadata")
        starts = np.load(folder / "starts.npy")
        return cls(maps[0], tok, sa, starts, meta["keys"], width), meta

    # -- queries --------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return len(self.tok) - PAD - len(self.keys)

    def nbytes(self) -> int:
        return len(self.buf) + self.sa.nbytes + self.starts.nbytes + self.alive.nbytes

    def doc_ids(self, key_index: int) -> np.ndarray:
        start = int(self.starts[key_index])
        end = int(self.starts[key_index + 1]) - 1 if key_index + 1 < len(self.starts) else len(self.tok) - PAD - 1
        return self.tok[start:end].astype(np.int64)

    def find(self, query: bytes) -> tuple[int, int]:
        """The suffix-array range whose suffixes start with ``query`` (encoded ids)."""
        if not len(self.sa):
            return 0, 0
        w, n = self.width, len(query)
        buf = self.buf

        def key(p: int) -> bytes:
            return buf[p * w:p * w + n]

        lo = bisect_left(self._sa, query, key=key)
        hi = bisect_right(self._sa, query, lo=lo, key=key)
        return lo, hi

    def positions(self, lo: int, hi: int, limit: int) -> np.ndarray:
        """Live positions in an SA range, an even sample of at most ``limit``."""
        step = max(1, (hi - lo) // limit)
        pos = self.sa[lo:hi:step].astype(np.int64)
        if self.dead:
            doc = np.searchsorted(self.starts, pos, side="right") - 1
            pos = pos[self.alive[doc]]
        return pos

    def continuations(self, pos: np.ndarray, skip: int, length: int, top: int | None = None) -> Counter:
        """Distinct token sequences that follow the positions, cut at a document's end;
        ``top``: only the ``top`` most frequent (ties in the order of the full count's
        ``most_common``), which spares building the rest."""
        idx = pos[:, None] + skip + np.arange(length)[None, :]
        rows = self.tok[idx].astype(np.int64)
        ended = np.maximum.accumulate(rows == self.sentinel, axis=1)
        rows[ended] = -1
        items = sorted(Counter(map(tuple, rows.tolist())).items())  # distinct rows in ascending order
        if top is not None and len(items) > top + 1:  # + 1: an all-ended row is dropped below
            items = sorted(items, key=lambda it: -it[1])[:top + 1]  # stable: ties keep the row order
        out: Counter = Counter()
        for row, n in items:
            seq = tuple(t for t in row if t >= 0)
            if seq:
                out[seq] += n
        return out


def encode(ids, width: int) -> bytes:
    return np.asarray(ids, dtype=">u2" if width == 2 else ">u4").tobytes()


def lookup(segments: list[Segment], context: list[int], *, min_len: int = 2,
           max_len: int = MAX_QUERY, draft_len: int = 8, top_k: int = 8,
           max_positions: int = 256) -> Match | None:
    """The longest suffix of ``context`` found in any segment, with its continuations.

    Existence is monotone in the length (a suffix that occurs has shorter suffixes that
    occur), so the longest length is found by a binary search: four probes for 16."""
    if not segments or not context:
        return None
    width = segments[0].width
    limit = (1 << (8 * width)) - 1
    draft_len = max(1, min(draft_len, MAX_DRAFT))
    max_len = min(max_len, MAX_QUERY, len(context))
    tail = [int(t) for t in context[-max_len:]]
    for i in range(len(tail) - 1, -1, -1):  # ids a segment cannot hold end the query
        if not 0 <= tail[i] < limit:
            tail = tail[i + 1:]
            break
    max_len = len(tail)
    min_len = max(1, min_len)

    def ranges(length: int) -> list:
        query = encode(tail[-length:], width)
        out = []
        for seg in segments:
            lo, hi = seg.find(query)
            if hi > lo:
                out.append((seg, lo, hi))
        return out

    def live(found: list) -> list:
        out = []
        for seg, lo, hi in found:
            pos = seg.positions(lo, hi, max_positions)
            if len(pos):
                out.append((seg, pos, hi - lo))
        return out

    lo, hi, best = min_len, max_len, None
    while lo <= hi:  # the largest length with live occurrences
        mid = (lo + hi) // 2
        found = ranges(mid)
        if found and any(seg.dead for seg, _, _ in found):
            found = live(found)  # dead copies do not count
        else:
            found = [(seg, None, (a, b)) for seg, a, b in found]
        if found:
            best, lo = (mid, found), mid + 1
        else:
            hi = mid - 1
    while best is not None:
        length, found = best
        counts: Counter = Counter()
        occurrences = 0
        for seg, pos, n in found:
            if pos is None:  # a range not yet sampled
                pos, n = seg.positions(n[0], n[1], max_positions), n[1] - n[0]
            occurrences += len(pos) if seg.dead else n
            # one segment: its top_k are the answer; several: counts add up across them
            counts.update(seg.continuations(pos, length, draft_len, top_k if len(found) == 1 else None))
        if counts:
            return Match(length, occurrences, [Continuation(t, c) for t, c in counts.most_common(top_k)])
        # every occurrence ends its document: a shorter suffix may have a continuation
        best = (length - 1, live(ranges(length - 1))) if length - 1 >= min_len else None
        if best is not None and not best[1]:
            best = None
    return None


@dataclass
class _State:
    segments: list  # [base, small segments...], oldest first
    where: dict  # key -> (segment, index) of its live copy


class DraftIndex:
    """The repository's token datastore: a base segment and small segments (LSM style).

    An update builds a segment of just the changed documents (milliseconds) and marks
    their old copies dead.  More than ``max_small`` small segments are merged into one;
    when the small ones hold more than ``delta_share`` of the base (and at least
    ``delta_min_tokens``), everything is folded into a new base on a background thread
    while updates keep arriving; documents changed meanwhile stay live where they are.
    """

    def __init__(self, width: int, delta_share: float = 0.1, delta_min_tokens: int = 200_000,
                 max_small: int = 8, background: bool = True):
        self.width = width
        self.delta_share = delta_share
        self.delta_min_tokens = delta_min_tokens
        self.max_small = max_small
        self.background = background
        self._state = _State([Segment.build([], width)], {})
        self._lock = threading.Lock()  # writers only; readers use the snapshot
        self._generation = 0
        self._changed: dict = {}  # key -> generation of its last change
        self._compacting: threading.Thread | None = None
        self.compactions = 0

    @classmethod
    def from_documents(cls, docs: list[tuple[object, np.ndarray]], width: int, **kw) -> "DraftIndex":
        index = cls(width, **kw)
        base = Segment.build(docs, width)
        index._state = _State([base], {k: (base, i) for i, k in enumerate(base.keys)})
        return index

    @classmethod
    def from_segment(cls, base: Segment, **kw) -> "DraftIndex":
        """Around a saved (memory-mapped) base segment."""
        index = cls(base.width, **kw)
        index._state = _State([base], {k: (base, i) for i, k in enumerate(base.keys)})
        return index

    def base(self) -> Segment:
        return self._state.segments[0]

    # -- writers ----------------------------------------------------------------------
    def update(self, key, ids) -> None:
        """Make ``ids`` the live tokens of document ``key`` (new or changed)."""
        self.update_many({key: ids}, [])

    def remove(self, key) -> None:
        self.update_many({}, [key])

    def update_many(self, docs: dict, removed: list) -> None:
        docs = {k: np.asarray(v, dtype=np.int64) for k, v in docs.items()}
        with self._lock:
            st = self._state
            where = dict(st.where)
            self._generation += 1
            for key in list(docs) + list(removed):
                self._changed[key] = self._generation
                old = where.pop(key, None)
                if old is not None:
                    old[0].kill(old[1])
            segments = list(st.segments)
            if docs:
                seg = Segment.build(list(docs.items()), self.width)
                segments.append(seg)
                for i, k in enumerate(seg.keys):
                    where[k] = (seg, i)
            if len(segments) - 1 > self.max_small:
                segments = self._merge_small(segments, where)
            self._state = _State(segments, where)
            small = sum(seg.tokens for seg in segments[1:])
            big = small > max(self.delta_min_tokens, self.delta_share * segments[0].tokens)
        if big:
            self.compact(wait=not self.background)

    def _merge_small(self, segments: list, where: dict) -> list:
        """One segment from the live documents of every small segment (lock held)."""
        small = segments[1:]
        docs = [(k, seg.doc_ids(i)) for seg in small for i, k in enumerate(seg.keys)
                if seg.alive[i] and where.get(k) == (seg, i)]
        merged = Segment.build(docs, self.width)
        for i, k in enumerate(merged.keys):
            where[k] = (merged, i)
        return [segments[0], merged]

    def compact(self, wait: bool = True) -> None:
        """Fold all live documents into one new base segment."""
        if self._compacting is not None and self._compacting.is_alive():
            if wait:
                self._compacting.join()
            return
        self._compacting = threading.Thread(target=self._compact, name="draft-compaction", daemon=True)
        self._compacting.start()
        if wait:
            self._compacting.join()

    def _compact(self) -> None:
        with self._lock:
            st = self._state
            since = self._generation
        docs = [(k, seg.doc_ids(i)) for k, (seg, i) in st.where.items()]
        base = Segment.build(docs, self.width)  # the long part, without the lock
        with self._lock:
            now = self._state
            where = dict(now.where)
            changed = {k for k, g in self._changed.items() if g > since}
            for i, k in enumerate(base.keys):
                if k in changed:
                    base.kill(i)  # changed or removed while we built: keep the newer copy
                else:
                    where[k] = (base, i)
            kept = [seg for seg in now.segments[1:] if seg not in st.segments]
            for seg in kept:  # a merge may have copied documents that the base now holds
                for i, k in enumerate(seg.keys):
                    if where.get(k) != (seg, i):
                        seg.kill(i)
            self._state = _State([base] + kept, where)
            self._changed = {k: g for k, g in self._changed.items() if g > since}
            self.compactions += 1

    # -- readers ------------------------------------------------------------------------
    def segments(self) -> list[Segment]:
        return [s for s in self._state.segments if len(s.sa)]

    def lookup(self, context: list[int], **kw) -> Match | None:
        m = lookup(self.segments(), context, **kw)
        return Match(m.length, m.occurrences, m.continuations, "repository") if m else None

    def __contains__(self, key) -> bool:
        return key in self._state.where

    def stats(self) -> dict:
        st = self._state
        return {"documents": len(st.where), "base_tokens": st.segments[0].tokens,
                "delta_tokens": sum(seg.tokens for seg in st.segments[1:]),
                "segments": len(st.segments), "compactions": self.compactions,
                "bytes": sum(seg.nbytes() for seg in st.segments),
                "dead_documents": int(sum((~seg.alive).sum() for seg in st.segments))}
