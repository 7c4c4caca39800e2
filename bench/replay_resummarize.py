"""Rewrite a replay report with this version of the harness's summary.

    python bench/replay_resummarize.py SESSIONS.jsonl REPORT_DIR [REPORT_DIR ...]

For reports made before a derived field existed (``pause_ms``, the time from a request to
the user's next edit, and the ``at_pauses`` summary built on it): each request gets the field
from the sessions file the report was made from (matched by session and ordinal: the n-th
request of its session), then ``report.json``, ``report.md`` and the plots are written again
by ``daemon.replay.write_report``.  Nothing measured changes (latencies, completions and the
daemon's counters are kept as they were); the meta says the report was resummarized.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from codecomplete.daemon.replay import pauses_after_requests, write_report
from codecomplete.daemon.sessions import read_sessions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sessions", type=Path)
    ap.add_argument("reports", nargs="+", type=Path)
    args = ap.parse_args()
    sessions = read_sessions(args.sessions)
    pauses = []  # per session: the pause after its n-th request
    for s in sessions:
        after = pauses_after_requests(s)
        pauses.append([after[i] for i, e in enumerate(s.events) if e["type"] == "request"])
    for out in args.reports:
        report = json.loads((out / "report.json").read_text())
        for run in report["runs"]:
            for r in run["requests"]:
                r["pause_ms"] = pauses[r["session"]][r["ordinal"]]
        meta = report["meta"]
        meta["resummarized"] = f"bench/replay_resummarize.py {args.sessions.name} (pause_ms from the sessions)"
        summary = write_report(out, report["runs"], meta)["summary"]
        for s in summary:
            print(f"{out}: {s['scheme']}: at pauses {s['at_pauses']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
