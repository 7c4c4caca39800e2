"""How many threads a CPU pass may use while other processes want the same cores.

The native kernels run a whole step in one OpenMP region whose threads meet at a few hundred
barriers, and OpenMP waits at a barrier by spinning.  Alone that is what makes a step fast (two
threads: 8.7 ms a step of the default model on a 2-core machine, one thread: 14.3 ms).  When
another process runs on those cores, a thread that waits for a descheduled partner spins
through the partner's time slice: against a second daemon doing the same, a step took
1,544 ms instead of 8.7, against one busy Python loop 21.8 ms, against a process busy a quarter
of the time 14.5 ms (one thread: 14.7, 15.5 and 13.2 ms; docs/decisions.md, bench/contention.py).

``ThreadGovernor`` measures the CPU time other processes took on this process's cores over the
last moments (``/proc/stat`` minus this process's own time) and gives a pass as many threads
as are left: ``cores - others``, rounded down with a margin, at least one, at most ``limit``.
Torch-free: the engine applies the count (``torch.set_num_threads`` on its thread, which sets
the OpenMP team size its native calls use too).  Where ``/proc/stat`` cannot be read (not
Linux), the governor always answers ``limit``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


class ProcStat:
    """Busy seconds of the given CPUs since boot (user, nice, system, irq, softirq: not idle,
    iowait or steal; guest time is inside user), from ``/proc/stat``."""

    def __init__(self, cpus: list[int], path: str = "/proc/stat"):
        self.names = {f"cpu{c}" for c in cpus}
        self.path = path
        try:
            self.hz = os.sysconf("SC_CLK_TCK")
        except (AttributeError, ValueError, OSError):
            self.hz = 100

    def __call__(self) -> float | None:
        try:
            with open(self.path, "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            return None
        busy, seen = 0, 0
        for line in data.splitlines():
            name, _, rest = line.partition(" ")
            if name in self.names:
                v = rest.split()
                if len(v) < 7:
                    return None
                busy += int(v[0]) + int(v[1]) + int(v[2]) + int(v[5]) + int(v[6])
                seen += 1
        return busy / self.hz if seen else None


@dataclass
class Sample:
    wall: float
    busy: float  # all processes' busy CPU seconds on our cores
    own: float  # this process's CPU seconds


class ThreadGovernor:
    """``threads()``: the thread count for the next pass; re-measured at most every
    ``interval`` seconds, over the time since the last measurement.

    Fewer threads once others take more than ``down`` of a core beyond what our threads leave
    free; more again only once they take less than ``up`` (hysteresis, so a load near the line
    does not flip the count every interval).  With 2 cores: one thread once others use more
    than 0.4 of a core, two again below 0.25 (measured: against a process busy a quarter of
    the time two threads and one were even, against one busy half the time one was faster)."""

    def __init__(self, limit: int = 0, interval: float = 0.2, down: float = 0.4, up: float = 0.25,
                 busy=None, own=None, clock=None, cores: int | None = None):
        cpus = _cores()
        self.cores = cores or len(cpus)
        self.limit = max(1, min(limit or self.cores, self.cores))
        self.interval, self.down, self.up = interval, down, up
        self._busy = busy if busy is not None else ProcStat(cpus)
        self._own = own or time.process_time
        self._clock = clock or time.monotonic
        self.current = self.limit
        self.others = 0.0  # cores other processes used over the last measured window
        self.changes = 0
        self.enabled = True
        self._last: Sample | None = None
        self._sample()
        if self._last is None:  # no /proc/stat: nothing to measure, all threads
            self.enabled = False

    def _sample(self) -> Sample | None:
        busy = self._busy()
        if busy is None:
            self._last = None
            return None
        s = Sample(self._clock(), busy, self._own())
        self._last = s
        return s

    def threads(self) -> int:
        if not self.enabled:
            return self.limit
        last = self._last
        now = self._clock()
        if last is not None and now - last.wall < self.interval:
            return self.current
        s = self._sample()
        if s is None or last is None:
            return self.current
        wall = s.wall - last.wall
        if wall <= 0:
            return self.current
        self.others = max(0.0, (s.busy - last.busy) - (s.own - last.own)) / wall
        self.current = self.choose(self.others, self.current)
        return self.current

    def choose(self, others: float, current: int) -> int:
        """The count for ``others`` cores in use elsewhere, starting from ``current``."""
        n = current
        while n > 1 and others > self.cores - n + self.down:  # our n threads would not fit
            n -= 1
        while n < self.limit and others < self.cores - (n + 1) + self.up:  # n + 1 would
            n += 1
        if n != current:
            self.changes += 1
        return n

    def snapshot(self) -> dict:
        return {"adaptive": self.enabled, "threads": self.current, "limit": self.limit, "cores": self.cores,
                "others_cores": round(self.others, 2), "changes": self.changes}
