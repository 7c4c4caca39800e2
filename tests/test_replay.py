"""The replay harness: the session format, sessions from git history, the recorder
(an LSP proxy in front of the real daemon) and replay reports from the real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lsprotocol import types as T
from pytest_lsp import make_test_lsp_client

from codecomplete.daemon.replay import (PAUSE_MS, RequestResult, at_pauses, edit_similarity, parse_settings,
                                        pauses_after_requests, score, time_split)
from codecomplete.daemon.sessions import (Session, SessionError, documents_at_events, final_texts, make_header,
                                          read_sessions, rest_of_line_at_requests, sessions_from_git, utf16_offset,
                                          write_sessions)

from .lsp_client import insert, open_doc


def test_sessions_round_trip_and_bad_files_get_clear_errors(tmp_path: Path):
    s = Session(make_header("/r", "abc", "test"), [
        {"t": 0, "type": "open", "uri": "file:///r/a.py", "languageId": "python", "text": "x = 1\n"},
        {"t": 10, "type": "change", "uri": "file:///r/a.py", "changes": [
            {"range": {"start": {"line": 1, "character": 0}, "end": {"line": 1, "character": 0}}, "text": "y = 😀\n"}]},
        {"t": 20, "type": "request", "uri": "file:///r/a.py", "line": 1, "character": 6, "trigger": "automatic",
         "truth_line": "", "truth_hunk": ""},
        {"t": 25, "type": "cursor", "uri": "file:///r/a.py", "line": 0, "character": 2},
        {"t": 30, "type": "accept", "uri": "file:///r/a.py"}, {"t": 40, "type": "close", "uri": "file:///r/a.py"}])
    path = tmp_path / "s.jsonl"
    write_sessions(path, [s, s])
    back = read_sessions(path)
    assert len(back) == 2 and back[0].header == s.header and back[1].events == s.events
    assert final_texts(back[0]) == {"file:///r/a.py": "x = 1\ny = 😀\n"}
    for bad, why in (('{"t": 0, "type": "open"}', "before any header"),
                     ('{"type": "header", "format": "codecomplete-session", "version": 9}', "version 9"),
                     ("not json", "not JSON"),
                     (json.dumps(make_header()) + '\n{"t": 0, "type": "cursor", "uri": "file:///r/a.py"}',
                      "cursor needs 'line' and 'character'")):
        (tmp_path / "bad.jsonl").write_text(bad + "\n")
        with pytest.raises(SessionError, match=why):
            read_sessions(tmp_path / "bad.jsonl")
    lines = path.read_text().splitlines()
    (tmp_path / "back.jsonl").write_text("\n".join(lines[:3] + [lines[1]]) + "\n")  # time goes back
    with pytest.raises(SessionError, match="not decreasing"):
        read_sessions(tmp_path / "back.jsonl")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def history(tmp_path: Path) -> Path:
    repo = tmp_path / "hist"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    versions = [
        {"app.py": "import os\n\n\ndef main():\n    return 1\n", "util.py": "X = 1\n"},
        {"app.py": "import os\nimport sys\n\n\ndef main():\n    print('héllo 😀', sys.argv)\n    return 2\n",
         "util.py": "X = 1\n"},
        {"app.py": "import sys\n\n\ndef main():\n    print('héllo 😀', sys.argv)\n    return 2\n\n\n"
                   "def helper(values):\n    return [v * 2 for v in values]\n",
         "util.py": "X = 2\nY = X + 1\n"},
    ]
    for i, files in enumerate(versions):
        for name, text in files.items():
            (repo / name).write_text(text)
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", f"v{i}")
    return repo


def test_sessions_from_git_reproduce_each_commit_exactly(history: Path, tmp_path: Path):
    sessions = sessions_from_git(history, commits=5, seed=3)
    assert len(sessions) == 2  # the first commit has no parent
    for s in sessions:
        commit = s.header["commit"]
        assert s.header["parent"] and s.header["timing"] == "synthetic" and s.requests
        for uri, text in final_texts(s).items():
            name = uri.rsplit("/", 1)[1]
            assert text == git(history, "show", f"{commit}:{name}"), (commit, name)
        times = [e["t"] for e in s.events]
        assert times == sorted(times)
        for r in s.requests:
            assert r["truth_hunk"].startswith(r["truth_line"])
    # the command line writes the same thing
    out = tmp_path / "cli.jsonl"
    done = subprocess.run([sys.executable, "-m", "codecomplete.daemon", "sessions", "from-git", str(history),
                           "--commits", "5", "--seed", "3", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [x.events for x in read_sessions(out)] == [x.events for x in sessions]
    # --skip: older history, apart from the newest sessions
    older = sessions_from_git(history, commits=5, seed=3, skip=1)
    assert [x.header["commit"] for x in older] == [sessions[1].header["commit"]]
    done = subprocess.run([sys.executable, "-m", "codecomplete.daemon", "sessions", "from-git", str(history),
                           "--commits", "1", "--skip", "1", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [x.header["commit"] for x in read_sessions(out)] == [sessions[1].header["commit"]]


def test_sessions_open_a_line_before_typing_new_lines_as_editors_do(tmp_path: Path):
    """Lines added between existing ones are typed on a line opened for them (``open-line``, the
    default): at every request the rest of the cursor's line is empty and the code that follows
    stays below; ``in-place`` types them in front of that code, as before.  Both end at the
    commit's text, and the header says which typing made the session."""
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    body = "def f(x):\n    a = 1\n{}    return a\n\n\ndef g():\n    pass\n"
    for i, new in enumerate(("", "    b = compute(a, x)\n    c = b + a\n")):
        (repo / "m.py").write_text(body.format(new))
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", f"v{i}")
    final = (repo / "m.py").read_text()
    rests, asked = {}, {}
    for typing in ("open-line", "in-place"):
        (s,) = sessions_from_git(repo, commits=1, seed=1, typing=typing)
        assert s.header["typing"] == typing and list(final_texts(s).values()) == [final]
        rests[typing] = rest_of_line_at_requests(s)
        asked[typing] = [(r["line"], r["character"], r["truth_hunk"]) for r in s.requests]
        assert rests[typing] and all(r["truth_hunk"].startswith(r["truth_line"]) for r in s.requests)
    assert asked["open-line"] == asked["in-place"]  # the same requests (100 ms later): comparable one by one
    assert all(not rest.strip() for rest in rests["open-line"])
    assert any(rest.strip() == "return a" for rest in rests["in-place"])
    with pytest.raises(SessionError, match="typing must be one of"):
        sessions_from_git(repo, commits=1, typing="dictated")


def test_sessions_that_ask_after_every_key_type_the_same_and_ask_at_each_character(history: Path):
    """``asks="keys"`` (an editor that asks at each change, as VS Code does): the same typing as
    with requests at pauses (the same changes at the same times), and a request just after every
    character typed, at the cursor, whose truth is what the commit has from there."""
    (pauses,) = sessions_from_git(history, commits=1, seed=2)
    (keys,) = sessions_from_git(history, commits=1, seed=2, asks="keys")
    assert keys.header["asks"] == "keys" and "asks" not in pauses.header
    changes = [[e for e in s.events if e["type"] != "request"] for s in (pauses, keys)]
    assert changes[0] == changes[1]
    assert len(keys.requests) > 3 * len(pauses.requests)
    final = final_texts(keys)
    last = None
    for e, docs in documents_at_events(keys):
        if e["type"] == "change":
            last = e
        elif e["type"] == "request":
            assert last is not None and e["t"] == last["t"] + 30 and len(last["changes"]) == 1
            text = docs[e["uri"]]
            off = utf16_offset(text, e["line"], e["character"])
            start = last["changes"][0]["range"]["start"]
            assert off == utf16_offset(text, start["line"], start["character"]) + 1  # just after the key
            assert final[e["uri"]].startswith(text[:off]) and final[e["uri"]][off:].startswith(e["truth_hunk"])
    with pytest.raises(SessionError, match="asks must be one of"):
        sessions_from_git(history, commits=1, asks="always")


@pytest.mark.parametrize("idle_ms", [75, 200])
def test_sessions_that_ask_when_the_typing_stops_ask_after_each_key_no_key_follows_soon(history: Path, idle_ms: int):
    """``asks="idle"`` (an editor whose own timer asks ``idle_ms`` after the last key, as Neovim's
    clients do): the same typing as the other kinds, and a request ``idle_ms`` after exactly those
    characters typed that no change follows within that time, just after the key, with the
    commit's text from there as its truth."""
    (keys,) = sessions_from_git(history, commits=1, seed=2, asks="keys")
    (idle,) = sessions_from_git(history, commits=1, seed=2, asks="idle", idle_ms=idle_ms)
    assert idle.header["asks"] == "idle" and idle.header["idle_ms"] == idle_ms
    changes = [e for e in keys.events if e["type"] != "request"]
    assert changes == [e for e in idle.events if e["type"] != "request"]
    # keys asks after every character typed: idle asks after those of them no change follows soon
    expected = []
    for i, e in enumerate(keys.events):
        if e["type"] == "request":
            key_t = e["t"] - 30
            later = [c["t"] for c in keys.events[i + 1:] if c["type"] != "request"]
            if not later or later[0] > key_t + idle_ms:
                expected.append({**e, "t": key_t + idle_ms})
    assert idle.requests == expected
    assert 0 < len(idle.requests) < len(keys.requests)
    times = [e["t"] for e in idle.events]
    assert times == sorted(times)
    final = final_texts(idle)
    for e, docs in documents_at_events(idle):
        if e["type"] == "request":
            text = docs[e["uri"]]
            off = utf16_offset(text, e["line"], e["character"])
            assert final[e["uri"]].startswith(text[:off]) and final[e["uri"]][off:].startswith(e["truth_hunk"])
    with pytest.raises(SessionError, match="idle_ms must be"):
        sessions_from_git(history, commits=1, asks="idle", idle_ms=0)


def test_sessions_open_files_in_their_language_and_pass_over_commits_git_cannot_read(history: Path,
                                                                                     tmp_path: Path):
    """Each typed file is opened with the language its name implies (a .js file as javascript: the
    daemon's disabled languages go by it).  A commit whose diff git cannot read (a partial clone's
    missing objects) is passed over with git's message, the others still make sessions; the
    command says which it passed over."""
    (history / "web.js").write_text("function f(x) {\n  return x;\n}\n")
    git(history, "add", "-A")
    git(history, "commit", "-qm", "js")
    (history / "web.js").write_text("function f(x) {\n  const y = x * 2;\n  return y;\n}\n")
    (history / "util.py").write_text("X = 2\nY = X + 1\nZ = Y * 2\n")
    git(history, "add", "-A")
    git(history, "commit", "-qm", "js and py")
    (last,) = sessions_from_git(history, commits=1, seed=1, suffixes=(".py", ".js"))
    opened = {e["uri"].rsplit("/", 1)[1]: e["languageId"] for e in last.events if e["type"] == "open"}
    assert opened == {"web.js": "javascript", "util.py": "python"}
    # the blob of app.py that only v1 has: its two diffs (v0 -> v1, v1 -> v2) cannot be read
    blob = git(history, "rev-parse", "HEAD~3:app.py").strip()
    (history / ".git" / "objects" / blob[:2] / blob[2:]).unlink()
    skipped: list[tuple[str, str]] = []
    made = sessions_from_git(history, commits=5, seed=1, suffixes=(".py", ".js"), skipped=skipped)
    v = {git(history, "log", "-1", "--format=%s", sha).strip(): sha
         for sha in git(history, "log", "--format=%H").split()}
    assert [s.header["commit"] for s in made] == [v["js and py"]]  # "js" adds a file: nothing to type in
    assert [sha for sha, _ in skipped] == [v["v2"], v["v1"]]
    assert all(blob[:7] in why or "unable to read" in why or "bad object" in why for _, why in skipped), skipped
    out = tmp_path / "s.jsonl"
    proc = subprocess.run([sys.executable, "-m", "codecomplete.daemon", "sessions", "from-git", str(history),
                           "--commits", "5", "--suffix", ".py", "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and out.is_file(), proc.stderr
    assert proc.stderr.count("passed over") == 2 and v["v2"][:12] in proc.stderr


def test_score_counts_a_completion_line_by_line():
    r = RequestResult(0, 0, 0, "file:///a.py", 3, 4, truth_line="x = 1",
                      truth_hunk="x = 1\n    y = 2\n\n    return x + y\n")
    r.completion = "x = 1\n    y = 3\n\n    return x + y\n    return x + y"
    score(r)
    assert not r.accepted and r.exact and r.chars_saved == 0  # right first line, but not all of it
    assert (r.lines_shown, r.lines_right) == (4, 2)  # y = 3 is wrong; the second return is past what was typed
    r.completion = "x = 1\n    y = 2"
    score(r)
    assert r.accepted and (r.lines_shown, r.lines_right) == (2, 2)
    empty = RequestResult(0, 0, 0, "file:///a.py", 3, 4, truth_line="x", truth_hunk="x")
    score(empty)
    assert (empty.lines_shown, empty.lines_right) == (0, 0)


class _Recorder:
    """A client that records what a replay sends and answers every request with nothing
    (the harness's own logic under test, not the daemon)."""

    def __init__(self):
        self.sent = []

    def text_document_did_open(self, params):
        self.sent.append(("open", params.text_document.uri))

    def text_document_did_change(self, params):
        self.sent.append(("change", params.text_document.uri))

    async def text_document_inline_completion_async(self, params):
        self.sent.append(("request", params.text_document.uri))
        return T.InlineCompletionList(items=[])


def test_a_compressed_replay_stops_a_session_at_its_request_quota(tmp_path: Path):
    """Guards --max-requests with --speed 0: once a session's quota is answered, the rest of
    its events are not sent (they would reach the daemon as one burst that the next session's
    first request waits behind, inflating its latency by seconds); the next session plays
    from its start; without a quota every event is sent."""
    import asyncio

    from codecomplete.daemon.replay import drive_user

    def session(name: str) -> Session:
        uri = f"file:///r/{name}.py"
        change = {"t": 0, "type": "change", "uri": uri,
                  "changes": [{"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}},
                               "text": "x"}]}
        request = {"t": 0, "type": "request", "uri": uri, "line": 0, "character": 1, "truth_line": "x"}
        return Session(make_header(repo="/r"), [{"t": 0, "type": "open", "uri": uri, "text": ""},
                                                change, request, change, change, request, change])

    def play(max_requests: int) -> list:
        client = _Recorder()
        asyncio.run(drive_user(client, 0, [session("a"), session("b")], tmp_path, 0, [], max_requests,
                               lambda: None))
        return [kind for kind, _ in client.sent]

    one = ["open", "change", "request"]
    assert play(1) == one + one
    assert play(0) == 2 * ["open", "change", "request", "change", "change", "request", "change"]
    assert play(2) == 2 * ["open", "change", "request", "change", "change", "request"]


def test_a_real_time_replay_behind_schedule_sends_each_request_before_the_next_change(tmp_path: Path):
    """A replay running late (every event already due, so no sleep between them) still sends a
    request before the typing that follows it, and the request is measured against the version
    it was made at: the change after it makes it stale only if the daemon answers after it."""
    import asyncio

    from codecomplete.daemon.replay import drive_user

    uri = "file:///r/late.py"
    edit = {"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}}, "text": "x"}
    events = [{"t": 0, "type": "open", "uri": uri, "text": ""},
              {"t": 0, "type": "request", "uri": uri, "line": 0, "character": 0, "truth_line": "x"},
              {"t": 0, "type": "change", "uri": uri, "changes": [edit]},
              {"t": 0, "type": "request", "uri": uri, "line": 0, "character": 1, "truth_line": "x"},
              {"t": 0, "type": "change", "uri": uri, "changes": [edit]}]
    client, results = _Recorder(), []
    asyncio.run(drive_user(client, 0, [Session(make_header(repo="/r"), events)], tmp_path, 1.0, results, 0,
                           lambda: None))
    assert [kind for kind, _ in client.sent] == ["open", "request", "change", "request", "change"]
    assert [r.status for r in results] == ["empty", "empty"]  # answered (with nothing) before the change


def test_a_real_time_replay_ends_a_session_once_its_quota_is_answered(tmp_path: Path):
    """Guards --max-requests in real time: the typing after a session's last counted request is
    sent until that request is answered (it is what makes a request stale), then the session
    ends and the next one starts, instead of playing on for minutes that measure nothing."""
    import asyncio

    from codecomplete.daemon.replay import drive_user

    def session(name: str) -> Session:
        uri = f"file:///r/{name}.py"
        events = [{"t": 0, "type": "open", "uri": uri, "text": ""}]
        for t in range(10, 80, 10):
            kind = "request" if t in (20, 50) else "change"
            events.append({"t": t, "type": "change", "uri": uri, "changes": [{"range": {
                "start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}}, "text": "x"}]}
                if kind == "change" else {"t": t, "type": "request", "uri": uri, "line": 0, "character": 1,
                                          "truth_line": "x"})
        return Session(make_header(repo="/r"), events)

    def play(max_requests: int) -> list:
        client = _Recorder()
        asyncio.run(drive_user(client, 0, [session("a"), session("b")], tmp_path, 1.0, [], max_requests,
                               lambda: None))
        return [kind for kind, _ in client.sent]

    whole = ["open", "change", "request", "change", "change", "request", "change", "change"]
    assert play(0) == 2 * whole
    assert play(1) == 2 * ["open", "change", "request"]  # answered at once: no typing after it is needed
    assert play(2) == 2 * whole[:6]


def test_time_split_is_the_mean_of_each_part_and_the_rest_of_the_latency():
    reqs = [{"latency_ms": 100.0, "queue_ms": 10.0, "prefill_ms": 30.0, "decode_ms": 50.0, "generated_tokens": 4},
            {"latency_ms": 300.0, "queue_ms": 0.0, "prefill_ms": 200.0, "decode_ms": 60.0, "generated_tokens": 6},
            {"latency_ms": 3.0}]  # answered without the model (typed through): no engine record
    assert time_split(reqs) == {"requests": 3, "queue": 3.3, "prefill": 76.7, "decode": 36.7, "other": 17.7,
                                "generated_tokens": 3.3}
    assert time_split([]) == {}


def test_the_requests_a_user_waits_at_are_those_the_typing_stops_after():
    session = Session(make_header(), [
        {"t": 0, "type": "open", "uri": "file:///a.py", "text": ""},
        {"t": 100, "type": "request", "uri": "file:///a.py", "line": 0, "character": 0},
        {"t": 150, "type": "cursor", "uri": "file:///a.py", "line": 0, "character": 0},  # no edit
        {"t": 400, "type": "change", "uri": "file:///a.py", "changes": [{"text": "x"}]},
        {"t": 430, "type": "request", "uri": "file:///a.py", "line": 0, "character": 1},
        {"t": 500, "type": "change", "uri": "file:///a.py", "changes": [{"text": "xy"}]},
        {"t": 530, "type": "request", "uri": "file:///a.py", "line": 0, "character": 2},
        {"t": 900, "type": "save", "uri": "file:///a.py"}])
    assert pauses_after_requests(session) == {1: 300, 4: 70, 6: None}
    reqs = [{"pause_ms": 300, "status": "answered", "completion": "z = 1", "accepted": True, "latency_ms": 40.0,
             "chars_saved": 5},
            {"pause_ms": 70, "status": "answered", "completion": "w", "accepted": False, "latency_ms": 9.0},
            {"pause_ms": 600, "status": "answered", "completion": "", "accepted": False, "latency_ms": 80.0},
            {"pause_ms": 250, "status": "stale", "completion": "", "accepted": False, "latency_ms": 0.0},
            {"pause_ms": None, "status": "answered", "completion": "q", "accepted": False, "latency_ms": 5.0}]
    assert at_pauses(reqs) == {"requests": 3, "shown": 1, "accepted": 1, "chars_saved": 5,
                               "latency_ms": {"p50": 80.0, "p90": 80.0, "p99": 80.0, "max": 80.0}}
    assert at_pauses([]) == {"requests": 0, "shown": 0, "accepted": 0, "chars_saved": 0,
                             "latency_ms": {"p50": None, "p90": None, "p99": None, "max": None}}


def test_edit_similarity():
    assert edit_similarity("abc", "abc") == 1.0 and edit_similarity("", "") == 1.0
    assert edit_similarity("abcd", "abxd") == 0.75 and edit_similarity("a", "") == 0.0


def run_replay(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "codecomplete.daemon", "replay", *args],
                          capture_output=True, text=True, timeout=900)


def test_replay_set_gives_every_scheme_a_setting_and_rejects_a_malformed_one(history: Path, tiny_model: Path,
                                                                              tmp_path: Path):
    """Guards --set: the setting reaches the daemon (completions off: every request answered
    empty); keys are spelt as the schemes spell them, so one overrides a scheme's; a malformed
    one is refused before any daemon starts."""
    assert parse_settings(["completion.type_through=true", "completion.contextSnippets=4", "model.name=x y"]) == {
        "completion": {"typeThrough": True, "contextSnippets": 4}, "model": {"name": "x y"}}
    sessions = tmp_path / "s.jsonl"
    write_sessions(sessions, sessions_from_git(history, commits=1, seed=1))
    bad = run_replay(str(sessions), "--set", "enabled=false", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "SECTION.KEY=VALUE" in bad.stderr
    out = tmp_path / "off"
    done = run_replay(str(sessions), "--model", str(tiny_model), "--dtype", "float32", "--speed", "0",
                      "--scheme", "efim", "--max-requests", "2", "--set", "completion.enabled=false",
                      "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    (s,) = report["summary"]
    assert s["requests"] > 0 and s["status"]["empty"] == s["requests"]
    assert "--set completion.enabled=false" in report["meta"]["command"]


def test_replay_device_reaches_the_daemon(history: Path, tiny_model: Path, tmp_path: Path):
    """--device is passed to each scheme's daemon: asking for CUDA where there is none stops the
    replay with the daemon's own load error (on a GPU machine the device would be used)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the daemon would load there")
    sessions = tmp_path / "s.jsonl"
    write_sessions(sessions, sessions_from_git(history, commits=1, seed=1))
    done = run_replay(str(sessions), "--model", str(tiny_model), "--device", "cuda", "--speed", "0",
                      "--scheme", "efim", "--max-requests", "1", "--out", str(tmp_path / "cuda"))
    assert done.returncode == 1 and "CUDA is not available" in done.stderr, done.stderr[-2000:]


def test_replay_against_the_real_daemon_reports_every_field(history: Path, tiny_model: Path, tmp_path: Path):
    sessions = tmp_path / "s.jsonl"
    write_sessions(sessions, sessions_from_git(history, commits=2, seed=1))
    out = tmp_path / "report"
    done = run_replay(str(sessions), "--model", str(tiny_model), "--dtype", "float32", "--users", "2",
                      "--speed", "0", "--scheme", "baseline,efim,efim-nospec", "--max-requests", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    by = {s["scheme"]: s for s in report["summary"]}
    assert set(by) == {"baseline", "efim", "efim-nospec"}
    for s in by.values():
        assert s["requests"] == 2 * sum(min(4, len(x.requests)) for x in read_sessions(sessions))
        assert s["status"]["answered"] + s["status"]["empty"] > 0 and s["latency_ms"]["p50"] > 0
        for key in ("acceptance", "exact_match", "edit_similarity", "chars_saved", "reuse_rate", "reuse_by_round",
                    "lines_shown", "lines_right"):
            assert key in s
        assert s["typed_through"] == 0  # these schemes send every request to the model
    assert by["baseline"]["reuse_rate"] == 0.0  # no KV reuse in the baseline
    # the machine line names the CPU's cores and vector units, the GPU (or none), Python and torch
    assert all(w in report["meta"]["machine"] for w in ("cores (", "Python", "torch"))
    assert by["efim"]["reuse_rate"] > 0.3
    # speculation is on by default and lossless: the same completions in fewer decode passes
    assert by["efim"]["speculation"] is True and by["efim-nospec"]["speculation"] is False
    assert by["efim"]["decode_ms_per_token"] > 0 and by["efim-nospec"]["decode_ms_per_token"] > 0
    assert by["efim"]["tokens_per_pass"] >= by["efim-nospec"]["tokens_per_pass"]  # a pass yields >= 1 token
    runs = {r["scheme"]: r["requests"] for r in report["runs"]}
    key = lambda r: (r["user"], r["session"], r["ordinal"])  # noqa: E731
    spec, plain = sorted(runs["efim"], key=key), sorted(runs["efim-nospec"], key=key)
    assert [r["completion"] for r in spec] == [r["completion"] for r in plain]
    assert any(r["completion"] for r in spec)
    req = report["runs"][1]["requests"][0]
    for key in ("latency_ms", "status", "completion", "prompt_tokens", "reused_tokens", "accepted",
                "exact", "edit_similarity", "chars_saved", "truth_line", "user", "lines_shown", "lines_right",
                "pause_ms"):
        assert key in req
    assert {r["user"] for r in report["runs"][0]["requests"]} == {0, 1}
    # the engine's share of each request's time, from the daemon's own record: a request the model
    # answered spent time decoding its tokens, and no part of the split is longer than the request
    ran = [r for run in report["runs"] for r in run["requests"] if r["status"] == "answered" and r["generated_tokens"]]
    assert ran and all(r["decode_ms"] > 0 and r["prefill_ms"] >= 0 and r["queue_ms"] >= 0 for r in ran)
    assert all(r["queue_ms"] + r["prefill_ms"] + r["decode_ms"] <= r["latency_ms"] + 1 for r in ran)
    for s in by.values():
        split, slow = s["time_split"], s["time_split_slowest_tenth"]
        assert split["requests"] == s["status"]["answered"] + s["status"]["empty"] >= slow["requests"] >= 1
        assert split["decode"] > 0 and split["generated_tokens"] > 0
    assert (out / "report.md").read_text().count("| baseline |") == 3  # the table, the time split, at pauses
    # the requests the typing stopped after, as the sessions have them
    for run in report["runs"]:
        waited = [r for r in run["requests"] if r["pause_ms"] is not None and r["pause_ms"] >= PAUSE_MS]
        assert by[run["scheme"]]["at_pauses"]["requests"] == len(waited) > 0
    assert (out / "latency_cdf.png").stat().st_size > 1000 and (out / "reuse_per_round.png").exists()


@pytest.mark.asyncio(loop_scope="function")
async def test_recorder_passes_messages_through_and_writes_a_replayable_session(repo, tiny_model, tmp_path):
    out = tmp_path / "recorded.jsonl"
    client = make_test_lsp_client()
    await client.start_io(sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo),
                          "--record", str(out), "--model", str(tiny_model), "--dtype", "float32",
                          "--index-dir", str(tmp_path / "idx"))
    await client.initialize_session(T.InitializeParams(
        capabilities=T.ClientCapabilities(), root_uri=repo.as_uri(), client_info=T.ClientInfo(name="rec-test")))
    uri = (repo / "new.py").as_uri()
    open_doc(client, uri, "def add(a, b):\n")
    client.protocol.notify("codecomplete/didMoveCursor", {"textDocument": {"uri": uri},
                                                          "position": {"line": 1, "character": 0}})
    text = "def add(a, b):\n"
    for i, ch in enumerate("    return a + b"):
        insert(client, uri, 2 + i, 1, i, ch)
        text += ch
        if ch == " " and i > 4:
            params = T.InlineCompletionParams(
                context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Invoked),
                text_document=T.TextDocumentIdentifier(uri=uri), position=T.Position(1, i + 1))
            result = await client.text_document_inline_completion_async(params)
            assert result is not None  # answered through the proxy
    await client.shutdown_session()
    await client.stop()
    [session] = read_sessions(out)
    assert session.header["timing"] == "recorded" and session.header["client"].startswith("rec-test")
    assert final_texts(session) == {uri: text}
    reqs = session.requests
    assert reqs and reqs[0]["truth_line"] == "a + b"  # what was typed after the first request
    assert [(e["line"], e["character"]) for e in session.events if e["type"] == "cursor"] == [(1, 0)]
    done = run_replay(str(out), "--repo", str(repo), "--model", str(tiny_model), "--dtype", "float32",
                      "--speed", "0", "--out", str(tmp_path / "rep"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["summary"][0]["requests"] == len(reqs)


def test_sessions_with_pairs_close_brackets_as_editors_do(history: Path, tmp_path: Path):
    """``--pairs``: the editor closes a bracket as its opener is typed (one change inserts both) and
    typing the closer steps over it (no change); the sessions ask at the same places with the same
    truths, end at each commit's text, and the header says so."""
    plain = sessions_from_git(history, commits=5, seed=3)
    paired = sessions_from_git(history, commits=5, seed=3, pairs=True)
    assert [s.header["commit"] for s in paired] == [s.header["commit"] for s in plain]
    closed = 0
    for p, s in zip(paired, plain):
        assert p.header["pairs"] is True and "pairs" not in s.header
        assert final_texts(p) == final_texts(s)
        assert [(r["line"], r["character"], r["truth_hunk"]) for r in p.requests] == \
            [(r["line"], r["character"], r["truth_hunk"]) for r in s.requests]
        inserted = [c["text"] for e in p.events if e["type"] == "change" for c in e["changes"]]
        closed += sum(t in ("()", "[]", "{}") for t in inserted)
        assert sum(t in (")", "]", "}") for t in inserted) < sum(
            t in (")", "]", "}") for e in s.events if e["type"] == "change" for c in e["changes"] for t in [c["text"]])
    assert closed >= 2  # print('héllo 😀', sys.argv), [v * 2 for v in values]: each typed as a pair
    # a request after an opener the editor closed sees the closer after the cursor
    rests = [r for s in paired for r in rest_of_line_at_requests(s)]
    assert any(r.startswith((")", "]")) for r in rests)
    out = tmp_path / "pairs.jsonl"
    done = subprocess.run([sys.executable, "-m", "codecomplete.daemon", "sessions", "from-git", str(history),
                           "--commits", "5", "--seed", "3", "--pairs", "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [x.events for x in read_sessions(out)] == [x.events for x in paired]


def test_a_document_replayed_as_a_notebook_keeps_its_text_in_the_cells(history: Path):
    """--as-notebooks: the cells partition the document at its top-level paragraphs; each of a
    session's changes, applied by a real pygls workspace as the notebook's didChange, leaves
    the cells' texts joined equal to the document; a change within a cell is that cell's text
    change, one across cells (or one that would join a cell's last line to the next cell's
    first) merges them, one of the whole text leaves one cell."""
    from pygls.workspace import Workspace

    from codecomplete.daemon.notebooks import NotebookView, split_cells
    from codecomplete.daemon.sessions import apply_change

    assert split_cells("import os\n\n\ndef f():\n    x = 1\n\n    return x\n\nclass A:\n    pass\n") == [
        "import os\n\n\n", "def f():\n    x = 1\n\n    return x\n\n", "class A:\n    pass\n"]
    assert split_cells("") == [""] and split_cells("x = (\n\n)\n") == ["x = (\n\n)\n"]

    def check(view: NotebookView, ws: Workspace, text: str) -> None:
        nb = ws.get_notebook_document(notebook_uri=view.uri)
        cells = [ws.get_text_document(c.document).source for c in nb.cells]
        assert cells == [t for _, t in view.cells] and "".join(cells) == text == view.text
        assert all(t.endswith("\n") for t in cells[:-1])

    def rng(l0, c0, l1, c1):
        return {"start": {"line": l0, "character": c0}, "end": {"line": l1, "character": c1}}

    text = "import os\n\n\ndef f():\n    return 1\n\nclass A:\n    pass\n"
    ws, view = Workspace(None), NotebookView.open("file:///r/a.py", text, "python")
    assert view.uri == "file:///r/a.ipynb" and len(view.cells) == 3
    assert view.cells[0][0].startswith("vscode-notebook-cell:/r/a.ipynb#")
    ws.put_notebook_document(view.open_params())
    check(view, ws, text)
    for ch, kind in [({"range": rng(4, 12, 4, 12), "text": "0"}, "text"),  # in the second cell
                     ({"range": rng(5, 0, 5, 0), "text": "\n"}, "text"),  # a new line at its end
                     ({"range": rng(6, 0, 7, 0), "text": ""}, "text"),  # the blank line: a line of its own
                     ({"range": rng(1, 0, 3, 0), "text": ""}, "text"),  # the first cell's blank lines
                     ({"range": rng(0, 9, 1, 3), "text": ""}, "merge"),  # from the first cell into the second
                     ({"range": rng(1, 13, 3, 0), "text": ""}, "merge"),  # the line breaks the cell ends with
                     ({"range": rng(0, 0, 0, 0), "text": "# top\n"}, "text"),
                     ({"text": "x = 1\n"}, "merge")]:  # the whole text
        before = view.merges
        params = view.change(ch)
        text = apply_change(text, ch)
        ws.update_notebook_document(params)
        assert (params.change.cells.structure is not None) == (kind == "merge") == (view.merges == before + 1)
        check(view, ws, text)
    assert len(view.cells) == 1
    ws.remove_notebook_document(view.close_params())
    assert ws.get_notebook_document(notebook_uri=view.uri) is None

    # every change of real sessions (typing, deletions, new lines) keeps the cells and the document equal
    sessions = sessions_from_git(history, commits=3, seed=2)
    changes = 0
    for session in sessions:
        ws, views, docs = Workspace(None), {}, {}
        for e in session.events:
            if e["type"] == "open":
                docs[e["uri"]] = e["text"]
                views[e["uri"]] = NotebookView.open(e["uri"], e["text"], "python")
                ws.put_notebook_document(views[e["uri"]].open_params())
            elif e["type"] == "change":
                for ch in e["changes"]:
                    docs[e["uri"]] = apply_change(docs[e["uri"]], ch)
                    ws.update_notebook_document(views[e["uri"]].change(ch))
                    changes += 1
                check(views[e["uri"]], ws, docs[e["uri"]])
            elif e["type"] == "request":
                view = views[e["uri"]]
                cell, line = view.locate(e["line"])
                lines = docs[e["uri"]].split("\n")
                assert view.cells[cell][1].split("\n")[line] == lines[e["line"]]
    assert changes > 20


def test_replay_as_notebooks_syncs_notebooks_and_asks_in_their_cells(history: Path, tiny_model: Path, tmp_path: Path):
    """Guards --as-notebooks against the real daemon: the documents are synced as notebooks,
    each request asks in its cell, the daemon's record of it is joined (its prompt, its cell),
    nothing fails, and the report says the replay was one of notebooks."""
    sessions = tmp_path / "s.jsonl"
    write_sessions(sessions, sessions_from_git(history, commits=2, seed=1))
    out = tmp_path / "nb"
    done = run_replay(str(sessions), "--model", str(tiny_model), "--dtype", "float32", "--speed", "0",
                      "--scheme", "efim", "--max-requests", "4", "--as-notebooks", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    (s,), (run,) = report["summary"], report["runs"]
    assert report["meta"]["as_notebooks"] is True and run["notebook_cells_merged"] >= 0
    assert s["status"]["answered"] + s["status"]["empty"] == s["requests"] > 0
    assert all(r["cell"].startswith("vscode-notebook-cell:") and r["cell"].split("#")[0].endswith(".ipynb")
               for r in run["requests"])
    assert all(r["prompt_tokens"] > 0 for r in run["requests"])  # each request's record, joined by its cell
    assert any(r["completion"] for r in run["requests"])
    counters = run["daemon"]["counters"]
    assert counters["server_errors"] == 0 and counters["errors"] == 0
