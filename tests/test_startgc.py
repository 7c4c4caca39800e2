"""daemon/startgc.py: the collector off while the daemon starts, on again (with the start's
objects frozen) once the model has loaded, or after a time limit whatever the load does."""

from __future__ import annotations

import gc
import threading

import pytest

from codecomplete.daemon import startgc


@pytest.fixture(autouse=True)
def collector():
    was = gc.isenabled()
    yield
    startgc._paused = False
    gc.unfreeze()
    if was:
        gc.enable()


def test_off_at_the_start_and_on_again_once_the_model_has_loaded():
    gc.enable()
    gc.unfreeze()
    startgc.pause()
    assert not gc.isenabled()
    loaded = threading.Event()
    thread = startgc.resume_after(loaded, timeout=60)
    thread.join(0.2)
    assert thread.is_alive() and not gc.isenabled()  # still loading
    loaded.set()
    thread.join(5)
    assert gc.isenabled() and gc.get_freeze_count() > 0  # the start's objects frozen


def test_on_again_after_the_limit_when_no_load_comes():
    gc.enable()
    startgc.pause()
    startgc.resume_after(threading.Event(), timeout=0.1).join(5)
    assert gc.isenabled()


def test_a_collector_someone_turned_off_stays_off():
    gc.disable()
    startgc.pause()  # not ours to turn on later
    startgc.resume_after(threading.Event(), timeout=0.05).join(5)
    assert not gc.isenabled() and gc.get_freeze_count() == 0
