"""Editing sessions: the v1 JSONL format, applying edits, and sessions from git history.

A file holds one or more sessions; each starts with a header line and continues with
events in time order (format documented in ``docs/sessions.md``):

    {"type": "header", "format": "codecomplete-session", "version": 1, "repo": ..., "commit": ...,
     "client": ..., "timing": "recorded" | "synthetic", "created": ...}
    {"t": 0, "type": "open", "uri": "file:///...", "languageId": "python", "text": "..."}
    {"t": 120, "type": "change", "uri": ..., "changes": [{"range": {...}, "text": "a"}]}
    {"t": 480, "type": "request", "uri": ..., "line": 3, "character": 8, "trigger": "automatic",
     "truth_line": "rest of the line typed next", "truth_hunk": "rest of the hunk"}
    {"t": 700, "type": "cursor", "uri": ..., "line": 9, "character": 4}   (codecomplete/didMoveCursor)
    {"t": 900, "type": "accept" | "reject", "uri": ...}
    {"t": 950, "type": "save" | "close", "uri": ...}

Positions are LSP positions in UTF-16 code units (the LSP default), ranges as LSP
``Range`` objects.  ``t`` is milliseconds from the session's start.
"""

from __future__ import annotations

import difflib
import json
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..indexer.files import language_of
from ..model.stops import PAIRS as EDITOR_PAIRS

FORMAT = "codecomplete-session"
VERSION = 1
EVENT_TYPES = {"open", "change", "request", "cursor", "accept", "reject", "save", "close"}


class SessionError(ValueError):
    pass


@dataclass
class Session:
    header: dict
    events: list[dict] = field(default_factory=list)

    @property
    def requests(self) -> list[dict]:
        return [e for e in self.events if e["type"] == "request"]


def make_header(repo: str = "", commit: str = "", client: str = "", timing: str = "synthetic", **extra) -> dict:
    return {"type": "header", "format": FORMAT, "version": VERSION, "repo": repo, "commit": commit,
            "client": client, "timing": timing, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **extra}


def write_sessions(path: Path, sessions: list[Session]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for s in sessions:
            f.write(json.dumps(s.header, ensure_ascii=False) + "\n")
            for e in s.events:
                f.write(json.dumps(e, ensure_ascii=False) + "\n")


def read_sessions(path: Path) -> list[Session]:
    """Parse and validate a session file; errors name the line."""
    sessions: list[Session] = []
    last_t = 0
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SessionError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise SessionError(f"{path}:{n}: expected an object")
            if obj.get("type") == "header":
                if obj.get("format") != FORMAT:
                    raise SessionError(f"{path}:{n}: not a {FORMAT} header")
                if obj.get("version") != VERSION:
                    raise SessionError(f"{path}:{n}: format version {obj.get('version')} (this reads {VERSION})")
                sessions.append(Session(obj))
                last_t = 0
                continue
            if not sessions:
                raise SessionError(f"{path}:{n}: event before any header")
            kind = obj.get("type")
            if kind not in EVENT_TYPES:
                raise SessionError(f"{path}:{n}: unknown event type {kind!r}")
            t = obj.get("t")
            if not isinstance(t, (int, float)) or t < last_t:
                raise SessionError(f"{path}:{n}: 't' must be a number of ms, not decreasing")
            if not isinstance(obj.get("uri"), str):
                raise SessionError(f"{path}:{n}: 'uri' missing")
            if kind == "open" and not isinstance(obj.get("text"), str):
                raise SessionError(f"{path}:{n}: open needs 'text'")
            if kind == "change" and not isinstance(obj.get("changes"), list):
                raise SessionError(f"{path}:{n}: change needs 'changes'")
            if kind in ("request", "cursor") and not all(isinstance(obj.get(k), int) for k in ("line", "character")):
                raise SessionError(f"{path}:{n}: {kind} needs 'line' and 'character'")
            last_t = t
            sessions[-1].events.append(obj)
    if not sessions:
        raise SessionError(f"{path}: no session in it")
    return sessions


# -- applying edits ------------------------------------------------------------------------

def utf16_offset(text: str, line: int, character: int) -> int:
    """Offset in ``text`` of an LSP position (UTF-16 code units); clamped like editors do."""
    start = 0
    for _ in range(line):
        nl = text.find("\n", start)
        if nl < 0:
            return len(text)
        start = nl + 1
    end = text.find("\n", start)
    end = len(text) if end < 0 else end
    units = 0
    i = start
    while i < end and units < character:
        units += 2 if ord(text[i]) > 0xFFFF else 1
        i += 1
    return i


def position_of(text: str, offset: int) -> tuple[int, int]:
    """LSP position (UTF-16) of an offset."""
    line = text.count("\n", 0, offset)
    start = text.rfind("\n", 0, offset) + 1
    return line, sum(2 if ord(c) > 0xFFFF else 1 for c in text[start:offset])


def apply_change(text: str, change: dict) -> str:
    rng = change.get("range")
    if rng is None:
        return change["text"]
    a = utf16_offset(text, rng["start"]["line"], rng["start"]["character"])
    b = utf16_offset(text, rng["end"]["line"], rng["end"]["character"])
    return text[:a] + change["text"] + text[b:]


def documents_at_events(session: Session):
    """Each event with every document's text once that event is applied (one dict, updated)."""
    docs: dict[str, str] = {}
    for e in session.events:
        if e["type"] == "open":
            docs[e["uri"]] = e["text"]
        elif e["type"] == "change":
            for ch in e["changes"]:
                docs[e["uri"]] = apply_change(docs.get(e["uri"], ""), ch)
        yield e, docs


def final_texts(session: Session) -> dict[str, str]:
    """Every document's text after all the session's edits."""
    docs: dict[str, str] = {}
    for _, docs in documents_at_events(session):
        pass
    return docs


def rest_of_line_at_requests(session: Session) -> list[str]:
    """For each request, the text after the cursor on its line as the daemon sees it then."""
    rests = []
    for e, docs in documents_at_events(session):
        if e["type"] == "request":
            text = docs.get(e["uri"], "")
            rests.append(text[utf16_offset(text, e["line"], e["character"]):].split("\n", 1)[0])
    return rests


def fill_truth(session: Session) -> None:
    """Derive ``truth_line`` for requests that lack it (recorded sessions): what the user
    typed at the cursor afterwards, up to an edit elsewhere or a newline."""
    docs: dict[str, str] = {}
    pending: list[tuple[dict, int, str]] = []  # request, cursor offset, typed so far
    for e in session.events:
        uri = e.get("uri")
        if e["type"] == "open":
            docs[uri] = e["text"]
        elif e["type"] == "request" and uri in docs:
            if "truth_line" not in e:
                pending.append((e, utf16_offset(docs[uri], e["line"], e["character"]), ""))
        elif e["type"] == "change" and uri in docs:
            for ch in e["changes"]:
                text = docs[uri]
                rng = ch.get("range")
                keep = []
                for req, cur, typed in pending:
                    if req["uri"] != uri:
                        keep.append((req, cur, typed))
                        continue
                    a = utf16_offset(text, rng["start"]["line"], rng["start"]["character"]) if rng else -1
                    b = utf16_offset(text, rng["end"]["line"], rng["end"]["character"]) if rng else -1
                    if a == b == cur + len(typed) and "\n" not in typed:
                        keep.append((req, cur, typed + ch["text"]))  # typing on
                    elif b == cur + len(typed) and a >= cur:
                        keep.append((req, cur, typed[:a - cur] + ch["text"]))  # backspace
                    else:
                        req["truth_line"] = typed.split("\n")[0]
                docs[uri] = apply_change(text, ch)
                pending = keep
    for req, _, typed in pending:
        req["truth_line"] = typed.split("\n")[0]


# -- sessions from git history -----------------------------------------------------------

def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SessionError(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _show(repo: Path, commit: str, path: str) -> str | None:
    out = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True)
    if out.returncode != 0:
        return None
    try:
        return out.stdout.decode("utf-8")
    except UnicodeDecodeError:
        return None


class Typist:
    """Human-like keystroke timing: per-character delay, pauses at word and line
    boundaries, occasional typos corrected with backspace."""

    def __init__(self, rng: random.Random, typo_rate: float = 0.02, request_rate: float = 0.35):
        self.rng = rng
        self.typo_rate = typo_rate
        self.request_rate = request_rate

    def key_ms(self) -> float:
        return self.rng.uniform(60, 140)

    def pause_ms(self, boundary: str) -> float:
        return self.rng.uniform(250, 700) if boundary == "word" else self.rng.uniform(500, 1500)


def _change(text: str, a: int, b: int, new: str) -> dict:
    sl, sc = position_of(text, a)
    el, ec = position_of(text, b)
    return {"range": {"start": {"line": sl, "character": sc}, "end": {"line": el, "character": ec}},
            "text": new}


TYPING = ("open-line", "in-place")
# when the editor asks for a completion: "pauses" where the typing stops at a word or line boundary
# (some of them, at random: an editor with a long debounce, or a user's invoked requests), "keys"
# after every character typed (VS Code asks at each change; the daemon debounces), "idle" once
# no key came for ``idle_ms`` after one (an editor that debounces itself: Neovim 0.12's built-in
# client asks 200 ms after the last key, the Neovim plugin's own client 75 ms)
ASKS = ("pauses", "keys", "idle")
IDLE_MS = 200
# --pairs: the brackets an editor closes as their opener is typed (VS Code's autoClosingBrackets,
# Neovim's autopairs; the daemon's own table, quotes left out), before these characters (VS Code's
# autoCloseBefore, in part) or a line's end
PAIRS = {k: v for k, v in EDITOR_PAIRS.items() if k in "([{"}
_CLOSE_BEFORE = frozenset(" \t\r\n)]};:,.")


def _closes_on_line(added: str, k: int) -> bool:
    """Whether the bracket at ``added[k]`` is closed later on its line of ``added``."""
    depth = 0
    for ch in added[k:]:
        if ch == "\n":
            return False
        if ch == added[k]:
            depth += 1
        elif ch == PAIRS[added[k]]:
            depth -= 1
            if depth == 0:
                return True
    return False


def type_file(uri: str, old: str, new: str, typist: Typist, t0: float = 0.0,
              max_hunk_chars: int = 2000, typing: str = "open-line", pairs: bool = False,
              asks: str = "pauses", idle_ms: int = IDLE_MS) -> tuple[list[dict], float]:
    """Events that turn ``old`` into ``new`` hunk by hunk, typing the new lines.  ``typing``:
    "open-line" (what an editor's user does) first opens an empty line where the new lines go
    (Enter at the end of the line above, or Vim's ``O``: one change inserting a line break in
    front of the code that follows) and types the lines there, so the code below stays on a line
    of its own while they are typed; "in-place" types the new lines, their breaks included, in
    front of that code (``new te|def existing():``), as sessions were made before.  ``pairs``: the
    editor closes brackets (``PAIRS``) as their opener is typed, where the bracket closes later on
    its line and the next character allows it (``_CLOSE_BEFORE``): one change inserts both, and
    typing the closer later steps over the one the editor put there (no change); the same random
    draws and requests as without, the file ending the same.  ``asks`` (``ASKS``): where requests
    come, at some pauses, after every character typed, or ``idle_ms`` after a character when no key
    follows within that time ("idle"); the same random draws, so the same typing."""
    events: list[dict] = []
    delay = idle_ms if asks == "idle" else 30  # from a key to the request after it ("keys", "idle")
    t = t0
    text = old
    a_lines = old.splitlines(keepends=True)
    b_lines = new.splitlines(keepends=True)
    sm = difflib.SequenceMatcher(a=a_lines, b=b_lines, autojunk=False)
    shift = 0  # lines added minus removed so far
    rng = typist.rng
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        line = i1 + shift
        start = sum(len(x) for x in text.splitlines(keepends=True)[:line])
        removed = "".join(a_lines[i1:i2])
        if removed:  # select the old lines and delete them
            t += typist.pause_ms("line")
            events.append({"t": round(t), "type": "change", "uri": uri,
                           "changes": [_change(text, start, start + len(removed), "")]})
            text = text[:start] + text[start + len(removed):]
        added = "".join(b_lines[j1:j2])
        if len(added) > max_hunk_chars:  # a pasted block: one change
            t += typist.pause_ms("line")
            events.append({"t": round(t), "type": "change", "uri": uri, "changes": [_change(text, start, start, added)]})
            text = text[:start] + added + text[start:]
        else:
            pos = start
            asked = False
            auto: list[int] = []  # where the closers the editor put after the cursor stand
            opened = typing == "open-line" and added.endswith("\n") and start < len(text)
            if opened:  # one keystroke of a fixed length (no random draw: see below)
                t += 100
                events.append({"t": round(t), "type": "change", "uri": uri,
                               "changes": [_change(text, start, start, "\n")]})  # the cursor stays in front of it
                text = text[:start] + "\n" + text[start:]
            for k, ch in enumerate(added):
                prev = added[k - 1] if k else "\n"
                boundary = "line" if prev == "\n" else "word" if (prev in " .(,:=" and ch not in " ") else None
                if boundary and k:
                    # The editor asks when the typing stops; the pause is the user's wait.
                    if (rng.random() < typist.request_rate or not asked) and asks == "pauses":  # one per hunk at least
                        asked = True
                        rest = added[k:]
                        events.append({"t": round(t + 30), "type": "request", "uri": uri,
                                       **dict(zip(("line", "character"), position_of(text, pos))),
                                       "trigger": "automatic", "truth_line": rest.split("\n")[0],
                                       "truth_hunk": rest})
                    t += typist.pause_ms(boundary)
                if ch.isalpha() and rng.random() < typist.typo_rate:  # a typo, then backspace
                    wrong = rng.choice("asdfghjkl")
                    t += typist.key_ms()
                    events.append({"t": round(t), "type": "change", "uri": uri, "changes": [_change(text, pos, pos, wrong)]})
                    text = text[:pos] + wrong + text[pos:]
                    t += typist.key_ms() * 2
                    events.append({"t": round(t), "type": "change", "uri": uri, "changes": [_change(text, pos, pos + 1, "")]})
                    text = text[:pos] + text[pos + 1:]  # the closers after the cursor are back where they were
                t += typist.key_ms()
                if opened and k == len(added) - 1:
                    # the hunk's last line break is already there: this keystroke leaves the line.  Both
                    # typings draw the same random numbers, so they ask at the same places
                    break
                if auto and auto[-1] == pos and text[pos] == ch:  # step over the closer the editor put there
                    auto.pop()
                    pos += 1
                    if asks != "pauses":
                        events.append(_ask(t, uri, text, pos, added[k + 1:], delay))
                    continue
                typed = ch
                if pairs and ch in PAIRS and (pos == len(text) or text[pos] in _CLOSE_BEFORE) \
                        and _closes_on_line(added, k):
                    typed = ch + PAIRS[ch]
                events.append({"t": round(t), "type": "change", "uri": uri,
                               "changes": [_change(text, pos, pos, typed)]})
                text = text[:pos] + typed + text[pos:]
                auto = [a + len(typed) for a in auto] + ([pos + 1] if len(typed) > 1 else [])
                pos += 1
                if asks != "pauses":
                    events.append(_ask(t, uri, text, pos, added[k + 1:], delay))
        shift += (j2 - j1) - (i2 - i1)
    return (_asked_when_idle(events) if asks == "idle" else events), t


def _ask(t: float, uri: str, text: str, pos: int, rest: str, delay: float = 30) -> dict:
    """A request at ``pos`` ``delay`` ms after a keystroke at ``t`` (``asks`` "keys" or "idle");
    ``rest``: what the user types from there."""
    line, character = position_of(text, pos)
    return {"t": round(t + delay), "type": "request", "uri": uri, "line": line, "character": character,
            "trigger": "automatic", "truth_line": rest.split("\n")[0], "truth_hunk": rest}


def _asked_when_idle(events: list[dict]) -> list[dict]:
    """``events`` without the requests that a change comes before (``asks="idle"``: the editor's
    timer, restarted by every key, fires only once the typing stops for its time)."""
    out: list[dict] = []
    next_change = float("inf")
    for e in reversed(events):
        if e["type"] != "request":
            next_change = e["t"]
        elif e["t"] >= next_change:
            continue
        out.append(e)
    return out[::-1]


def sessions_from_git(repo: Path, commits: int = 5, seed: int = 0, max_files: int = 3,
                      suffixes: tuple[str, ...] = (".py",), max_file_bytes: int = 200_000,
                      max_added_lines: int = 200, root_uri: str | None = None, skip: int = 0,
                      typing: str = "open-line", pairs: bool = False, asks: str = "pauses",
                      idle_ms: int = IDLE_MS, skipped: list[tuple[str, str]] | None = None) -> list[Session]:
    """One session per commit: its changed files, typed from the parent's text (``typing``: see
    ``type_file``), each opened with the language its name implies.  ``skip``: pass over the newest
    ``skip`` commits that would make a session (older history, for a set of sessions apart from an
    earlier one's).  ``pairs``: the editor closes brackets as they are typed, ``asks`` and ``idle_ms``:
    where the editor asks (``type_file``).  A
    commit git cannot diff (objects missing from a partial clone) is passed over, and with
    ``skipped`` its sha and git's message are appended there."""
    if typing not in TYPING:
        raise SessionError(f"typing must be one of {', '.join(TYPING)}, not {typing!r}")
    if asks not in ASKS:
        raise SessionError(f"asks must be one of {', '.join(ASKS)}, not {asks!r}")
    if asks == "idle" and not 0 < idle_ms <= 1000:  # a file is closed 1 s after its last key
        raise SessionError(f"idle_ms must be 1-1000, not {idle_ms}")
    repo = Path(repo).resolve()
    rng = random.Random(seed)
    typist = Typist(rng)
    shas = git(repo, "log", "--no-merges", "--format=%H", "-n", str((commits + skip) * 5)).split()
    base_uri = root_uri or repo.as_uri()
    out: list[Session] = []
    for sha in shas:
        if len(out) >= commits + skip:
            break
        parents = git(repo, "rev-list", "--parents", "-n", "1", sha).split()[1:]
        if len(parents) != 1:
            continue
        parent = parents[0]
        try:
            changed = [ln.split("\t") for ln in git(repo, "diff", "--numstat", parent, sha).splitlines()]
        except SessionError as exc:
            if skipped is not None:
                skipped.append((sha, str(exc)))
            continue
        files = [(int(a), p) for a, d, p in changed
                 if a.isdigit() and p.endswith(suffixes) and 0 < int(a) <= max_added_lines]
        if not files:
            continue
        session = Session(make_header(str(repo), sha, "git-history", "synthetic", parent=parent,
                                      subject=git(repo, "log", "-1", "--format=%s", sha).strip(), typing=typing,
                                      **({"pairs": True} if pairs else {}),
                                      **({"asks": asks} if asks != "pauses" else {}),
                                      **({"idle_ms": idle_ms} if asks == "idle" else {})))
        t = 0.0
        for _, path in files[:max_files]:
            old, new = _show(repo, parent, path), _show(repo, sha, path)
            if old is None or new is None or len(old) > max_file_bytes or len(new) > max_file_bytes:
                continue
            uri = f"{base_uri}/{path}"
            session.events.append({"t": round(t), "type": "open", "uri": uri, "languageId": language_of(path),
                                   "text": old})
            events, t = type_file(uri, old, new, typist, t, typing=typing, pairs=pairs, asks=asks, idle_ms=idle_ms)
            session.events += events
            t += 1000
            session.events.append({"t": round(t), "type": "save", "uri": uri})
            session.events.append({"t": round(t), "type": "close", "uri": uri})
        if session.requests:
            session.header["files"] = [p for _, p in files[:max_files]]
            out.append(session)
    return out[skip:]
