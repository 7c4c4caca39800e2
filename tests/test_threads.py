"""The thread governor: fewer threads for a pass while other processes use the cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from codecomplete.model.api import CompletionRequest, EngineSettings
from codecomplete.model.engine import Engine
from codecomplete.model.threads import ProcStat, ThreadGovernor


class Fake:
    """A clock, the machine's busy CPU seconds and this process's, moved by the test."""

    def __init__(self):
        self.t, self.busy, self.own = 0.0, 0.0, 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        """``seconds`` pass with our threads busy ``ours`` cores and others ``others``."""
        self.t += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


def governor(fake: Fake, cores: int, limit: int = 0, **kw) -> ThreadGovernor:
    return ThreadGovernor(limit=limit, busy=lambda: fake.busy, own=lambda: fake.own, clock=lambda: fake.t,
                          cores=cores, **kw)


def test_alone_all_threads_and_a_busy_neighbour_takes_one_away():
    fake = Fake()
    g = governor(fake, cores=2)
    assert g.enabled and g.limit == 2 and g.threads() == 2
    fake.run(0.5, ours=2.0, others=0.02)  # background noise
    assert g.threads() == 2
    fake.run(0.5, ours=1.0, others=1.0)  # a second daemon, a build
    assert g.threads() == 1 and g.others == pytest.approx(1.0)
    assert g.snapshot() == {"adaptive": True, "threads": 1, "limit": 2, "cores": 2, "others_cores": 1.0,
                            "changes": 1}
    fake.run(0.5, ours=1.0, others=0.0)  # it stopped
    assert g.threads() == 2 and g.changes == 2


def test_hysteresis_between_the_thresholds():
    fake = Fake()
    g = governor(fake, cores=2)  # down above 0.4 of a core, up below 0.25
    fake.run(0.5, 2.0, 0.3)
    assert g.threads() == 2  # under the line to go down
    fake.run(0.5, 2.0, 0.5)
    assert g.threads() == 1
    fake.run(0.5, 1.0, 0.3)
    assert g.threads() == 1  # over the line to come back
    fake.run(0.5, 1.0, 0.2)
    assert g.threads() == 2


def test_many_cores_give_up_what_others_take_and_keep_one():
    fake = Fake()
    g = governor(fake, cores=8)
    fake.run(1.0, 8.0, 2.5)
    assert g.threads() == 5  # 8 - 2.5 leaves 5.5: five fit with the margin
    fake.run(1.0, 5.0, 12.0)  # more than the machine: still one
    assert g.threads() == 1
    fake.run(1.0, 1.0, 3.3)
    assert g.threads() == 4  # back up as far as fits, in one measurement
    limited = governor(Fake(), cores=8, limit=3)
    assert limited.limit == 3 and limited.threads() == 3


def test_measured_at_most_every_interval():
    fake = Fake()
    g = governor(fake, cores=2, interval=0.2)
    fake.run(0.1, 1.0, 1.0)
    assert g.threads() == 2  # too soon to measure
    fake.run(0.1, 1.0, 1.0)
    assert g.threads() == 1  # over the whole 0.2 s since the last measurement


def test_without_proc_stat_all_threads():
    g = ThreadGovernor(limit=2, busy=lambda: None, cores=2)
    assert not g.enabled and g.threads() == 2 and g.snapshot()["adaptive"] is False


def test_proc_stat_counts_only_our_cpus_and_only_busy_time(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  900 0 900 9000 0 0 0 0 0 0\n"
                    "cpu0 100 10 50 1000 500 5 5 70 40 0\n"
                    "cpu1 200 0 100 1000 0 0 0 0 0 0\n"
                    "cpu2 999 0 999 0 0 0 0 0 0 0\n"
                    "intr 12345\n")
    read = ProcStat([0, 1], str(stat))
    assert read() == pytest.approx((100 + 10 + 50 + 5 + 5 + 200 + 100) / read.hz)
    assert ProcStat([7], str(stat))() is None  # none of our CPUs listed
    assert ProcStat([0], str(tmp_path / "missing"))() is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc/stat")
def test_real_busy_processes_are_measured():
    """Real processes spinning on every core this process may use: the governor measures them as
    others' time, not ours, and gives a pass one thread."""
    g = ThreadGovernor(interval=0.0)
    if g.cores < 2:
        pytest.skip("one core: nothing to give up")
    spin = "import time\nt = time.time()\nwhile time.time() - t < 20: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(g.cores)]
    try:
        time.sleep(0.3)
        g.threads()  # a measurement from here
        time.sleep(0.6)
        n = g.threads()
        assert g.others >= 0.5, g.snapshot()  # their time is others', not ours
        if g.others < g.cores - 1:
            pytest.skip(f"the spinners got {g.others:.2f} of {g.cores} cores (a CPU quota?)")
        assert n == 1, g.snapshot()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_thread_count_leaves_completions_unchanged(tiny_model):
    """A pass at one thread gives what it gives at the default count: the governor changes speed only."""
    prompts = ("def add(a, b):\n    return", "import os\n\nclass Config:\n    def __init__(self", "x = [")
    got, before = [], torch.get_num_threads()
    try:
        for threads in (1, 0):  # one engine after the other (two loading at once in one process race)
            engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32", threads=threads,
                                           adaptive_threads=False)).start()
            try:
                got.append([engine.complete(CompletionRequest(p, "\n", max_tokens=24)).token_ids for p in prompts])
            finally:
                engine.close()
    finally:
        torch.set_num_threads(before)  # torch gives threads started later the last count set
    assert got[0] == got[1] and all(got[0])


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc/stat")
def test_engine_passes_take_fewer_threads_while_others_spin(tiny_model):
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32")).start()
    try:
        first = engine.complete(CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=16))
        snap = engine.stats()["threads"]
        assert snap is not None and snap["adaptive"] and snap["limit"] == torch.get_num_threads()
        if snap["cores"] < 2 or snap["limit"] < 2:
            pytest.skip("one core or one thread: nothing to give up")
        spin = "import time\nt = time.time()\nwhile time.time() - t < 30: pass\n"
        procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(snap["cores"])]
        try:
            deadline = time.time() + 15
            while engine.stats()["threads"]["threads"] != 1 and time.time() < deadline:
                time.sleep(0.3)  # let the others' time build up, then passes measure it
                again = engine.complete(CompletionRequest("def add(a, b):\n    return", "\n", max_tokens=16))
                assert again.text == first.text
            snap = engine.stats()["threads"]
            if snap["threads"] != 1 and snap["others_cores"] < snap["cores"] - 1:
                pytest.skip(f"the spinners got {snap['others_cores']} of {snap['cores']} cores (a CPU quota?)")
            assert snap["threads"] == 1, snap
        finally:
            for p in procs:
                p.kill()
                p.wait()
    finally:
        engine.close()
