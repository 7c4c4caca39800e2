"""Helpers shared by the benchmarks: machine description and results files."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    from codecomplete.machine import describe

    return describe()


def command_line() -> str:
    """The command as typed, with the CODECOMPLETE_* variables in force before it (they switch
    kernels and caches: a result without them would not say how it was made)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("CODECOMPLETE_"))
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    return f"{env} {cmd}" if env else cmd


def git_commit() -> str:
    """HEAD, and which tracked files (results aside) differed from it when the run started."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=RESULTS.parent).stdout.strip() or "unknown"
        changed = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", ".", ":!bench/results"],
                                 capture_output=True, text=True, cwd=RESULTS.parent.parent).stdout.split()
    except OSError:
        return "unknown"
    return f"{head} with uncommitted changes to {', '.join(changed)}" if changed else head


def source_files(root: Path, exts: tuple[str, ...], skip=None):
    """(path, text) of the files under ``root`` with these extensions (sorted), 200 B to 200 kB of
    UTF-8; ``skip(path)``: leave the file out."""
    for path in sorted(p for ext in exts for p in root.rglob(f"*.{ext}")):
        if skip is not None and skip(path):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if 200 < len(text) < 200_000:
            yield path, text


def file_label(name: str) -> str:
    """``name`` (a model's, say) as one file-name part: the whole of it, runs of other characters as "_"
    (the default model's name starts like its base's, so a first word is not enough)."""
    import re

    return re.sub(r"[^A-Za-z0-9.+-]+", "_", name).strip("_")


def header(title: str) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"# {title}\n\n- command: `{command_line()}`\n- machine: {machine()}\n"
            f"- commit: {git_commit()}, run {now}\n{kernels()}")


def kernels() -> str:
    """A line naming the bf16 linear kernel the run's native library chose (linear.c's
    linear_bf16_path; on AVX512-BF16 CPUs a timing at load picks 2 or 3), where the run loaded
    the library; else nothing."""
    native = sys.modules.get("codecomplete.model.native")
    if native is None or not native.available():
        return ""
    path = native.linear_bf16_path()
    name = {0: "portable loop", 1: "panels on AVX2 FMAs", 2: "vdpbf16ps dot products",
            3: "panels on AVX-512F FMAs"}.get(path, "unknown")
    probe = native.linear_probe()
    rates = (f"; probe at load: {probe['dot_per_s'] / 1e9:.2f} G vdpbf16ps/s, "
             f"{probe['fma_per_s'] / 1e9:.2f} G FMA/s a core" if probe["dot_per_s"] else "")
    return f"- bf16 linear kernel: path {path} ({name}{', AMX tiles for the layers' if native.amx() else ''}){rates}\n"


def native_model(spec: str = "default"):
    """The loaded model ``spec`` ("default": the embedded one), or exit when its steps do not run
    through the native CPU kernels (a bf16 model and a C compiler are needed)."""
    from codecomplete.model.loader import load_model

    lm = load_model() if spec == "default" else load_model(spec)
    if lm.model.native_stack is None:
        sys.exit("needs a bf16 model on the native CPU path (dtype bf16, a C compiler)")
    return lm


def decode_ms(model, prompts, steps: int, warm: int = 1) -> float:
    """Mean ms per decode step of ``model`` (the own Transformer) at batch ``len(prompts)``:
    each row of ``prompts`` [B, T] is prefilled into its own cache, then the same one-token
    step is timed ``steps`` times after ``warm`` untimed ones.  Call under no_grad."""
    import time

    import torch

    caches = []
    for row in prompts:
        c = model.new_cache(prompts.shape[1] + warm + steps + 4)
        model(row.view(1, -1), [c])
        caches.append(c)
    tok = torch.full((len(caches), 1), 5, dtype=torch.long, device=prompts.device)
    for _ in range(warm):
        model(tok, caches)
    t = time.perf_counter()
    for _ in range(steps):
        model(tok, caches)
    return (time.perf_counter() - t) / steps * 1000


def median_ms(fn, reps: int) -> float:
    """The median of ``reps`` timed calls of ``fn``, in ms."""
    import statistics
    import time

    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def ratio_in_rounds(a: list[float], b: list[float]) -> float:
    """The median over rounds of a[i] / b[i]: two cells timed in the same rounds compared within
    each round (this machine's speed drifts between rounds, not within one)."""
    import statistics

    return statistics.median(x / y for x, y in zip(a, b))


# rows of arm_table that the stop-rule benchmarks (repetition.py, top_level.py) share, over their summaries
STOP_REASONS_ROW = ("stop reasons", lambda s: ", ".join(f"{k} {v}" for k, v in s["stop_reasons"].items()))
LINES_ROWS = [("lines shown", lambda s: s["lines_shown"]),
              ("  the truth's line at that place", lambda s: s["lines_right"]),
              ("  other lines", lambda s: s["lines_wrong"]),
              ("accepted (the truth starts with it)", lambda s: s["accepted"]),
              ("characters saved by accepted ones", lambda s: s["chars_saved"])]


def arm_table(keys: list, summary: dict, arms) -> list[str]:
    """A Markdown table with a column per arm and a row per (label, value of an arm's summary)."""
    md = ["| | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    return md + [f"| {label} | " + " | ".join(str(f(summary[a])) for a in arms) + " |" for label, f in keys]


def write_results(out: str | Path, lines: list[str], data) -> None:
    """``out``.md (the lines) and ``out``.json (``data``), and the table on stdout."""
    import json

    Path(out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    Path(out).with_suffix(".json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))


def run(cmd: list[str]) -> str:
    """Run a command (printed on stderr first), exit with its stderr's tail if it fails;
    the command line, for a results file."""
    print("+", " ".join(cmd), file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return " ".join(cmd)


def replay_settings(git: str, work: Path, setting: str, values, commits: int, seed: int, model: str,
                    sessions_args: tuple[str, ...] = (), replay_args: tuple[str, ...] = ()) -> tuple[str, dict]:
    """Real-time replays of one repository's ``sessions from-git`` through the daemon as
    shipped (``efim-through``, one user, ``--speed 1``), once per value of ``setting``
    (``SECTION.KEY``), in that order.  Returns (the repository's name, {value: report.json})."""
    name = Path(git).resolve().parent.name if Path(git).name == "repo" else Path(git).name
    sessions = work / f"{name}.sessions.jsonl"
    daemon = [sys.executable, "-m", "codecomplete.daemon"]
    run(daemon + ["sessions", "from-git", git, "--commits", str(commits), "--seed", str(seed), *sessions_args,
                  "--out", str(sessions)])
    reports = {}
    for value in values:
        out = work / f"{name}-{setting.rsplit('.', 1)[-1]}{value}"
        run(daemon + ["replay", str(sessions), "--scheme", "efim-through", "--model", model, "--speed", "1",
                      "--users", "1", *replay_args, "--set", f"{setting}={value}", "--out", str(out)])
        reports[value] = json.loads((out / "report.json").read_text())
    return name, reports


def build_revision(rev: str, out_dir: Path):
    """The native library of git revision ``rev`` (its model/native sources), compiled with this
    checkout's flags into ``out_dir`` and configured as this checkout's (``native.configure``),
    for a benchmark that times it beside this checkout's build."""
    import ctypes

    from codecomplete.model import native

    root = RESULTS.parents[1]
    for name in (p.name for p in (*native._SOURCES, *native._HEADERS)):
        src = subprocess.run(["git", "show", f"{rev}:model/native/{name}"], cwd=root, capture_output=True)
        if src.returncode:
            raise SystemExit(f"{rev} has no model/native/{name}: {src.stderr.decode().strip()}")
        (out_dir / name).write_bytes(src.stdout)
    lib_path = out_dir / f"native-{rev}.so"
    sources = [str(out_dir / p.name) for p in native._SOURCES]
    proc = subprocess.run(["gcc", *native._FLAGS, *sources, "-o", str(lib_path), "-lm"], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return native.configure(ctypes.CDLL(str(lib_path)))
