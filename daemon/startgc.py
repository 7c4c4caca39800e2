"""The garbage collector off while the daemon starts.

A start imports torch (on the engine's thread) and the LSP's modules (pygls, lsprotocol: on the
main thread) at once, and both hold the GIL while they do. Those imports allocate hundreds of
thousands of objects, and the collector ran ~450 times over that growing heap meanwhile:
0.17-0.21 s of the ~1.4 s the imports took in one process (a throwaway probe), each run with the
GIL held, so the other thread's import waited too. So ``pause`` turns the collector off at the
start, and ``resume_after`` turns it on again once the model has loaded (or after ``MAX_PAUSE``
seconds, whatever the load does), first moving every object alive then, the imported modules'
above all, into the permanent generation (``gc.freeze``): later collections do not walk them
again. Measured with the real daemon and a real client, later starts: first completion
2.78-3.45 s (median 3.16) -> 2.65-3.18 s (median 2.80) in seven alternating pairs, and
3.02-3.51 -> 2.66-2.81 s in three more with this module (`initialize` 1.04-1.60 -> 0.89-0.94 s).
The cost: ~10 MB more resident (the start's cyclic garbage, frozen with the rest: 569 against
559 MB after loading the default model, two runs each).
"""

from __future__ import annotations

import gc
import logging
import threading

log = logging.getLogger(__name__)

MAX_PAUSE = 60.0  # seconds at most without the collector (a first start's conversion included)
_paused = False


def pause() -> None:
    """Turn the collector off for the start (where it is on)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume(reason: str = "") -> None:
    """Freeze what is alive now and turn the collector on again (once; where ``pause`` turned
    it off)."""
    global _paused
    if not _paused:
        return
    _paused = False
    gc.freeze()
    gc.enable()
    log.debug("garbage collector on again%s: %d objects frozen", f" ({reason})" if reason else "",
              gc.get_freeze_count())


def resume_after(ready: threading.Event, timeout: float = MAX_PAUSE) -> threading.Thread:
    """``resume`` once ``ready`` is set, or after ``timeout`` seconds, on a thread of its own."""

    def run():
        resume("the model loaded" if ready.wait(timeout) else f"{timeout:.0f} s after the start")

    thread = threading.Thread(target=run, name="gc-after-start", daemon=True)
    thread.start()
    return thread


def resume_once_loaded(engine, timeout: float = MAX_PAUSE) -> threading.Thread:
    """``resume_after`` the first model ``engine`` loads (an ``Engine`` or ``EngineHandle`` not
    started yet: its ``on_load`` listeners)."""
    loaded = threading.Event()
    engine.on_load.append(lambda lm: loaded.set())
    return resume_after(loaded, timeout)
