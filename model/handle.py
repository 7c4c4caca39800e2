"""The engine as the daemon holds it: started at once, with torch imported on a thread of its own.

Importing torch took 1.1-1.9 s of the daemon's start on the project's 2-core machines, and the
daemon imported it (through ``model.engine``) before it read the client's first message: the
client waited that long for ``initialize``, and for the progress that says the model loads.
``EngineHandle`` has the ``Engine``'s API, is torch-free, and imports and starts the real engine
on its own thread. What comes before the engine exists is kept and handed over when it does:
requests (answered once the model has loaded, as they would have been), settings, the
draft retriever and the load listeners. ``stats`` reports the engine as not ready meanwhile.
Where the engine cannot even be imported (a broken torch install), every request is answered
``model_unavailable`` with the reason, and the daemon keeps serving.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from .api import Completion, CompletionRequest, EngineSettings, engine_counters, engine_stats
from .prompts import PROMPT_KINDS

log = logging.getLogger(__name__)


def prestart(settings: EngineSettings) -> None:
    """What a start begins before torch's import, on threads of their own (torch-free): the
    kernels' build (a first start's longest step) and the read of the packed weights the last
    load of these settings used (a later start's longest read, model/pack_prefetch.py)."""
    from . import native_build

    native_build.prebuild(settings.device)
    if native_build.enabled() and settings.native_attention:
        from . import pack_prefetch

        pack_prefetch.start(settings.model, settings.device, settings.dtype)


class EngineHandle:
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.on_load: list = []  # callables given the LoadedModel after each load (Engine.on_load)
        self.start_error: str | None = None  # why the engine could not be started
        self._engine = None  # model.engine.Engine, once imported
        self._retriever = None
        self._pending: list[tuple[CompletionRequest, Future]] = []  # submitted before the engine existed
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._start_engine, name="engine-start", daemon=True)

    @property
    def engine(self):
        """The real engine, or None while torch is still being imported."""
        return self._engine

    @property
    def lm(self):
        return self._engine.lm if self._engine is not None else None

    def start(self) -> "EngineHandle":
        prestart(self.settings)
        self._thread.start()
        return self

    def wait_started(self, timeout: float | None = None) -> bool:
        """Whether the engine exists (or failed to) within ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _start_engine(self) -> None:
        try:
            from .engine import Engine  # imports torch
        except BaseException as exc:  # noqa: BLE001 - a broken install: each request says why
            log.exception("the engine cannot start")
            with self._lock:
                self.start_error = f"the engine cannot start: {type(exc).__name__}: {exc}"
                pending, self._pending = self._pending, []
            for _, fut in pending:
                self._unavailable(fut)
            return
        with self._lock:
            pending, self._pending = self._pending, []
            if self._closed:
                for _, fut in pending:
                    self._answer(fut, Completion("", "cancelled"))
                return
            engine = Engine(self.settings)
            engine.on_load = self.on_load  # the same list: listeners added later are seen
            if self._retriever is not None:
                engine.set_retriever(self._retriever)
            for request, fut in pending:
                engine.submit(request, fut)
            self._engine = engine
            engine.start()

    @staticmethod
    def _answer(fut: Future, completion: Completion) -> None:
        if fut.set_running_or_notify_cancel():
            fut.set_result(completion)

    def _unavailable(self, fut: Future) -> None:
        self._answer(fut, Completion("", "model_unavailable", error=self.start_error))

    # -- Engine's API (any thread) -------------------------------------------------------
    def submit(self, request: CompletionRequest, fut: "Future[Completion] | None" = None) -> "Future[Completion]":
        fut = Future() if fut is None else fut
        with self._lock:
            engine = self._engine
            if engine is None:
                if self.start_error is None:
                    self._pending.append((request, fut))
                    return fut
        if engine is not None:
            return engine.submit(request, fut)
        self._unavailable(fut)
        return fut

    def complete(self, request: CompletionRequest) -> Completion:
        return self.submit(request).result()

    def configure(self, settings: EngineSettings) -> None:
        with self._lock:
            engine = self._engine
            if engine is None:  # the engine starts with these
                self.settings = settings
                return
        engine.configure(settings)
        self.settings = settings

    def reload(self, settings: EngineSettings) -> None:
        with self._lock:
            engine = self._engine
            if engine is None:
                self.settings = settings
                return
        engine.reload(settings)

    def set_retriever(self, retriever) -> None:
        with self._lock:
            self._retriever = retriever
            engine = self._engine
        if engine is not None:
            engine.set_retriever(retriever)

    def busy(self) -> bool:
        """Whether the engine is working (``Engine.busy``); while torch is still being imported,
        it is: the model's load comes next, and the first completion waits for it."""
        engine = self._engine
        if engine is None:
            return self.start_error is None and not self._closed
        return engine.busy()

    def stats(self) -> dict:
        engine = self._engine
        if engine is not None:
            return engine.stats()
        from . import native_build

        return engine_stats(engine_counters(), self.settings, load_error=self.start_error,
                            prompts=dict.fromkeys(PROMPT_KINDS, 0),
                            loading=None if self.start_error else native_build.stage() or "starting the engine")

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            engine = self._engine
        if engine is not None:
            engine.close(timeout)
