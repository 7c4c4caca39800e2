"""The daemon's engine handle (model/handle.py): torch is imported on the engine's own thread,
and what the daemon asks before the engine exists is handed over when it does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest

from codecomplete.model.api import CompletionRequest, EngineSettings
from codecomplete.model.handle import EngineHandle

PROMPTS = ["import os\nimport ", "def add(a, b):\n    return ", "class Point:\n    def __init__(self, "]


def test_what_comes_before_the_engine_is_handed_over(tiny_model):
    """Requests, settings, the retriever and load listeners given before the engine exists (the
    handle not started yet, so they surely come first) reach it: the requests are answered in
    order with what an engine started directly answers."""
    from codecomplete.model.engine import Engine

    settings = EngineSettings(model=str(tiny_model), dtype="float32")
    ref = Engine(settings).start()
    try:
        want = [ref.complete(CompletionRequest(p, "", max_tokens=6)).text for p in PROMPTS]
    finally:
        ref.close()
    handle = EngineHandle(EngineSettings(model="no-such-model"))
    assert handle.engine is None and handle.lm is None
    before = handle.stats()
    assert before["ready"] is False and before["model"] is None and before["completions"] == 0
    loaded, lookups = [], []
    handle.on_load.append(loaded.append)
    handle.set_retriever(lambda *a, **k: lookups.append(a) or [])
    handle.configure(settings)  # before the engine exists: it starts with these, not the first
    futures = [handle.submit(CompletionRequest(p, "", max_tokens=6)) for p in PROMPTS]
    handle.start()
    try:
        got = [f.result(timeout=300) for f in futures]
        assert [c.error for c in got] == [None] * 3
        assert [c.text for c in got] == want
        assert handle.engine is not None and handle.engine.settings.model == str(tiny_model)
        assert len(loaded) == 1 and loaded[0] is handle.lm
        assert handle.engine._retriever is not None
        after = handle.stats()
        assert after["ready"] and after["completions"] == 3
        assert set(after) == set(before) | {"drafter"} or set(after) == set(before)
        # once it exists, the handle passes straight through
        assert handle.complete(CompletionRequest(PROMPTS[0], "", max_tokens=6)).text == want[0]
    finally:
        handle.close()


def test_an_engine_that_cannot_be_imported_answers_why(monkeypatch):
    """A broken install (here: model.engine made unimportable) does not take the daemon down:
    each request, before and after, is answered ``model_unavailable`` with the reason, and the
    stats say it."""
    monkeypatch.setitem(sys.modules, "codecomplete.model.engine", None)
    handle = EngineHandle(EngineSettings())
    early = handle.submit(CompletionRequest("x = ", ""))
    handle.start()
    assert handle.wait_started(60)
    first = early.result(timeout=5)
    assert first.stop_reason == "model_unavailable" and "cannot start" in first.error
    late = handle.complete(CompletionRequest("y = ", ""))
    assert late.stop_reason == "model_unavailable" and late.error == first.error
    stats = handle.stats()
    assert stats["ready"] is False and stats["load_error"] == first.error
    handle.close()


def test_closed_before_the_engine_exists_cancels_what_waits(tiny_model):
    gate = threading.Event()
    handle = EngineHandle(EngineSettings(model=str(tiny_model), dtype="float32"))
    fut = handle.submit(CompletionRequest("import ", ""))
    fut.add_done_callback(lambda _f: gate.set())
    handle.close()
    handle.start()
    assert handle.wait_started(300)
    assert gate.wait(5) and fut.result().stop_reason == "cancelled"
    assert handle.engine is None


def test_the_daemon_reads_its_client_before_importing_torch():
    """The daemon's modules up to serving (the CLI, the LSP server, the handle) import no torch:
    the engine's thread does."""
    code = ("import sys\n"
            "import codecomplete.daemon.cli, codecomplete.lsp.server, codecomplete.model.handle\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "[]"


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")),
                    reason="no C compiler: the kernels are not built (the model keeps PyTorch's path)")
def test_the_handle_starts_the_kernels_build_before_torch_and_it_runs_once(tmp_path):
    """A first start compiles the native kernels (~6 s): the handle starts that before importing
    torch, and the engine's own request for the kernels waits for that build instead of compiling
    a second time."""
    code = (
        "import sys, time\n"
        "from codecomplete.model import native_build\n"
        "from codecomplete.model.api import EngineSettings\n"
        "from codecomplete.model.handle import EngineHandle\n"
        "calls = []  # the compiler's runs: one command, or each source's compile and the link\n"
        "real, real_popen = native_build.subprocess.run, native_build.subprocess.Popen\n"
        "def run(cmd, *a, **k):\n"
        "    if '-shared' in cmd:  # (platform.processor() runs uname through here too)\n"
        "        calls.append(time.monotonic())\n"
        "    return real(cmd, *a, **k)\n"
        "def popen(cmd, *a, **k):\n"
        "    if '-c' in cmd:\n"
        "        calls.append(time.monotonic())\n"
        "    return real_popen(cmd, *a, **k)\n"
        "native_build.subprocess.run = run\n"
        "native_build.subprocess.Popen = popen\n"
        "h = EngineHandle(EngineSettings(model=sys.argv[1], device='cpu')).start()\n"
        "while h.engine is None and h.start_error is None:\n"
        "    time.sleep(0.005)\n"
        "t_engine = time.monotonic()  # torch imported and the engine made\n"
        "h.wait_started(300)\n"
        "deadline = time.monotonic() + 300\n"
        "while h.engine.stats()['load_error'] is None and time.monotonic() < deadline:\n"
        "    time.sleep(0.1)\n"
        "from codecomplete.model import native\n"
        "runs = 1 if native_build._jobs() == 1 else len(native_build.SOURCES) + 1\n"
        "print(native.available(), native_build.library_path().exists(), len(calls) == runs, calls[0] < t_engine)\n"
        "h.close()\n"
    )
    env = {**os.environ, "CODECOMPLETE_NATIVE_DIR": str(tmp_path / "native"),
           "CODECOMPLETE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("CODECOMPLETE_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "no-such-model")], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    available, built, one_build, before = out.stdout.split()
    assert (available, built) == ("True", "True")
    assert one_build == "True"  # the prebuild's; the engine's load waited for it
    assert before == "True"  # the compiler started before torch was imported and the engine made
