"""Building the native kernels' shared library, torch-free.

``model.native`` loads the library with ctypes and needs torch; building it needs only the C
compiler (about 6 s, once per source version and CPU, cached).  The daemon starts the build
here (``prebuild``) before it imports torch, so that on a first start the compiler runs while
torch is imported and the checkpoint converted, rather than after the import
(docs/decisions.md).  ``build`` is what ``model.native`` calls: it waits for a build in flight
in this process and compiles only where the library for these sources, flags and CPU is not
in the cache yet.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_DIR = Path(__file__).resolve().parent / "native"
SOURCES = [_DIR / n for n in ("decode_attention.c", "step_ops.c", "linear.c")]
HEADERS = [_DIR / n for n in ("common.h", "attention.h")]  # included by the sources
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=fast", "-fno-math-errno",
         "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
_lock = threading.Lock()
_failed: dict[Path, str] = {}  # a build that failed in this process: not tried again
_compiling = 0  # compiles in flight in this process
BUILDING = "compiling the CPU kernels (once)"  # what the editor's progress report says meanwhile


def building() -> bool:
    """Whether this process is compiling the library now (a first start's longest step)."""
    return _compiling > 0


def stage() -> str:
    """``BUILDING`` while a compile runs in this process, else "" (the load's progress report)."""
    return BUILDING if building() else ""


def enabled() -> bool:
    return os.environ.get("CODECOMPLETE_NATIVE", "1") != "0"


@functools.lru_cache(maxsize=1)
def cpu_key() -> str:
    model = platform.processor()  # runs `uname -p`: once per process
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                model += line
    except OSError:
        pass
    return model


def cache_dir() -> Path:
    if os.environ.get("CODECOMPLETE_NATIVE_DIR"):
        return Path(os.environ["CODECOMPLETE_NATIVE_DIR"])
    from codecomplete.paths import cache_dir as shared

    return shared()


def library_path() -> Path:
    """Where the library for these sources, flags and CPU lives (built or not)."""
    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + cpu_key().encode()).hexdigest()[:16]
    return cache_dir() / f"codecomplete_native-{key}.so"


def build() -> Path:
    """The built library's path, compiling it first where it is not in the cache (raises
    RuntimeError with the compiler's message where that fails)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    out = library_path()
    with _lock:  # a build in flight in this process (the daemon's prebuild): wait for it
        if out.exists():
            return out
        if out in _failed:  # the prebuild's compile failed: the same sources fail the same way
            raise RuntimeError(_failed[out])
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(out.parent)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        global _compiling
        _compiling += 1
        try:
            error = _compile(cc, tmp)
            if error:
                _failed[out] = f"{cc} failed: {error[-2000:]}"
                raise RuntimeError(_failed[out])
            os.replace(tmp, out)  # atomic: a concurrent build by another process is harmless
        finally:
            _compiling -= 1
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def _compile(cc: str, target: str) -> str:
    """Compile SOURCES into the library ``target``.  Where more than two cores are free
    (``_jobs``), each source into an object file, several at once, then one link: the same
    library byte for byte as one command makes (that too compiles each source on its own), and
    decode_attention.c takes ~4 s of its ~6.5 s here, so the build takes about as long as that
    file (4.8 s on two idle cores).  On two cores, one command: a first start there was 0.6-0.8 s
    slower with both cores compiling (the imports and the conversion waited), and 0.2-0.4 s slower
    with the objects made one after another.  Returns the compilers' errors ("" on success)."""
    jobs = _jobs()
    if jobs == 1:  # one command: no link step of its own (0.2-0.4 s of a first start on two cores)
        proc = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", target, "-lm"], capture_output=True, text=True,
                              timeout=120)
        return _failure(proc.returncode, proc.stderr)
    compile_flags = [f for f in FLAGS if f != "-shared"]
    with tempfile.TemporaryDirectory(prefix="codecomplete-build-") as work:
        objects = [os.path.join(work, f"{src.stem}.o") for src in SOURCES]
        errors: list[str] = []
        running: list[subprocess.Popen] = []

        def finish(proc: subprocess.Popen) -> None:
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                err = f"{err}\ntimed out after 120 s"
            if proc.returncode != 0:
                errors.append(_failure(proc.returncode, err))

        # the longest first, so that the others run beside it
        order = sorted(range(len(SOURCES)), key=lambda i: -SOURCES[i].stat().st_size)
        for i in order:
            if len(running) >= jobs:
                finish(running.pop(0))
            running.append(subprocess.Popen([cc, *compile_flags, "-c", str(SOURCES[i]), "-o", objects[i]],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for proc in running:
            finish(proc)
        if errors:
            return "\n".join(errors)
        proc = subprocess.run([cc, *FLAGS, *objects, "-o", target, "-lm"], capture_output=True, text=True,
                              timeout=120)
        return _failure(proc.returncode, proc.stderr)


def _failure(returncode: int, stderr: str) -> str:
    """A compiler run's error ("" where it succeeded; never "" where it did not)."""
    if returncode == 0:
        return ""
    return stderr.strip() or f"exit status {returncode}"


def _jobs() -> int:
    """Compilers to run at once: the cores this process may use, less one, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(len(SOURCES), cores - 1))


def _remove_stale_partials(folder: Path, stale_s: float = 600.0) -> None:
    """Remove libraries left half-built by a process that exited while its compiler ran (the
    compiler finishes on its own, into a temporary name nothing renames): older than ``stale_s``."""
    now = time.time()
    for p in folder.glob("tmp*.so"):
        try:
            if now - p.stat().st_mtime > stale_s:
                p.unlink()
        except OSError:
            pass


def prebuild(device: str = "auto") -> threading.Thread | None:
    """Start ``build`` on a thread of its own, for a model on ``device`` (None where the kernels
    are turned off or the device is CUDA, which they do not serve); a failure is left for
    ``model.native.available`` to meet again and report.  With "auto" on a machine with CUDA they
    are built once and not used: the device is known only after torch's import."""
    if not enabled() or str(device).startswith("cuda"):
        return None

    def run():
        try:
            build()
        except Exception as exc:  # noqa: BLE001 - reported when the engine asks for the kernels
            log.debug("prebuilding the native kernels failed: %s", exc)

    thread = threading.Thread(target=run, name="native-prebuild", daemon=True)
    thread.start()
    return thread
