"""The command line: --version, `complete` with JSON, clear errors with exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from codecomplete import __version__
from codecomplete.daemon.cli import parse_location, parse_tcp


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "codecomplete.daemon", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"codecomplete-daemon {__version__}"


def test_complete_prints_json_with_timings(repo, tiny_model, model_cache):
    out = run("complete", "--repo", str(repo), "util.py:6:18", "--json",
              "--model", str(tiny_model), "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["file"].endswith("util.py") and (data["line"], data["column"]) == (6, 18)
    assert data["template"] == "starcoder" and data["dtype"] == "float32"
    assert data["prompt_tokens"] > 0 and data["stop_reason"]
    assert {"prefill_ms", "total_ms", "queue_ms"} <= set(data["timings_ms"])


def test_complete_text_output_matches_json(repo, tiny_model, model_cache):
    args = ("complete", "--repo", str(repo), "util.py:5:5", "--model", str(tiny_model), "--dtype", "float32")
    text = run(*args)
    data = json.loads(run(*args, "--json").stdout)
    assert text.returncode == 0 and text.stdout == data["text"] + "\n"


def test_complete_offers_alternatives(repo, tiny_model, model_cache):
    """Guards --alternatives: the greedy completion first (the same as without the flag),
    then the others, distinct, in JSON and as text; out of range is a usage error."""
    (repo / "point.py").write_text("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.\n")
    args = ("complete", "--repo", str(repo), "point.py:4:14", "--model", str(tiny_model), "--dtype", "float32")
    one = json.loads(run(*args, "--json").stdout)
    data = json.loads(run(*args, "--json", "--alternatives", "3").stdout)
    assert data["text"] == one["text"] and one["alternatives"] == []
    assert 1 <= len(data["alternatives"]) <= 2
    assert len({data["text"], *data["alternatives"]}) == 1 + len(data["alternatives"])
    text = run(*args, "--alternatives", "3")
    assert text.returncode == 0
    assert text.stdout == data["text"] + "\n" + "".join(
        f"--- alternative {i}\n{t}\n" for i, t in enumerate(data["alternatives"], 2))
    bad = run(*args, "--alternatives", "9")
    assert bad.returncode == 2 and "--alternatives" in bad.stderr


@pytest.mark.parametrize("location,message", [
    ("util.py:99:1", "line"), ("latin1.py:1:1", "UTF-8"), ("nope.py:1:1", "does not exist")])
def test_complete_bad_input_exits_2_with_a_reason(repo, tiny_model, location, message):
    out = run("complete", "--repo", str(repo), location, "--model", str(tiny_model))
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""


def test_complete_counts_lines_as_editors_do(repo, tiny_model):
    """Guards line numbers: LSP's line breaks only (a form feed does not end a line)."""
    (repo / "ff.py").write_text("x = 1\x0c  # page\ndef f(a, b):\n    return \n")
    out = run("complete", "--repo", str(repo), "ff.py:4:1", "--model", str(tiny_model))
    assert out.returncode == 2 and "line 4 is outside" in out.stderr and "(1-3)" in out.stderr
    out = run("complete", "--repo", str(repo), "ff.py:3", "--model", str(tiny_model), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["line"] == 3


def test_complete_takes_set_flags_and_refuses_a_malformed_one(repo, tiny_model, model_cache):
    """Guards --set on `complete`: a setting reaches the run (max_tokens 2: the completion the flag
    --max-tokens 2 gives), an unknown key is reported and the rest still runs, and a malformed
    flag is a usage error naming the form."""
    args = ("complete", "--repo", str(repo), "util.py:6:18", "--json", "--model", str(tiny_model), "--dtype", "float32",
            "--set", "completion.mode=multi")
    by_set = run(*args, "--set", "completion.max_tokens=2", "--set", "completion.bogus=1")
    assert by_set.returncode == 0, by_set.stderr
    assert "unknown setting 'completion.bogus'" in by_set.stderr
    by_flag = json.loads(run(*args, "--max-tokens", "2").stdout)
    data = json.loads(by_set.stdout)
    assert (data["text"], data["generated_tokens"]) == (by_flag["text"], by_flag["generated_tokens"])
    assert data["stop_reason"] == "max_tokens"
    bad = run("complete", "--repo", str(repo), "util.py:6:18", "--set", "max_tokens")
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr and bad.stdout == ""


def test_complete_missing_model_exits_1(repo, tmp_path):
    out = run("complete", "--repo", str(repo), "util.py:1:1", "--model", str(tmp_path / "gone"))
    assert out.returncode == 1 and "model not found" in out.stderr


def test_parsers():
    assert parse_tcp("9000") == ("127.0.0.1", 9000)
    assert parse_tcp("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert parse_tcp("[::1]:9000") == ("::1", 9000)
    assert parse_location("a/b.py:3:4")[1:] == (3, 4)
    assert parse_location("a/b.py:3")[1:] == (3, None)


@pytest.mark.parametrize("goodbye", ["eof", "shutdown-exit", "exit"])
def test_the_daemon_exits_cleanly_when_its_client_leaves_while_the_model_loads(repo, model_cache, goodbye):
    """Guards an editor closed at once: stdin's end (or exit) while the default model
    still loads ends the daemon with its status (0, or 1 for exit without shutdown), not
    SIGABRT from a loader thread torn down under the interpreter."""
    def frame(obj) -> bytes:
        body = json.dumps(obj).encode()
        return b"Content-Length: %d\r\n\r\n" % len(body) + body

    messages = [frame({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                       "params": {"processId": None, "rootUri": repo.as_uri(), "capabilities": {}}})]
    if goodbye == "shutdown-exit":
        messages.append(frame({"jsonrpc": "2.0", "id": 2, "method": "shutdown", "params": None}))
    if goodbye != "eof":
        messages.append(frame({"jsonrpc": "2.0", "method": "exit", "params": None}))
    proc = subprocess.run([sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo), "--model", "default"],
                          input=b"".join(messages), capture_output=True, timeout=120)
    assert proc.returncode == (1 if goodbye == "exit" else 0), proc.stderr.decode()[-2000:]
    assert b"terminate called" not in proc.stderr and b"Traceback" not in proc.stderr
    assert b'"id": 1' in proc.stdout or b'"id":1' in proc.stdout  # initialize was answered
