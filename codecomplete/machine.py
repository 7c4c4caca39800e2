"""A one-line description of this machine for results files: the CPU (its name, family and
model, and vector units: "AMD EPYC" alone has named both an AVX2-only Zen 3 and an AVX-512
Zen 4), the cores, the GPU, Python, torch and the OS."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> str:
    import torch

    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        info = ""
    lines = info.splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
               platform.processor() or platform.machine() or "unknown CPU")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    # the vector units decide the native kernels' paths and speed
    isa = ("AMX" if "amx_bf16" in flags else "AVX-512 BF16, no AMX" if "avx512_bf16" in flags
           else "AVX-512, no AMX" if "avx512f" in flags else "AVX2, no AMX" if "avx2" in flags
           else "no AVX2, no AMX" if flags else "vector units unknown")
    ids = {k: ln.split(":", 1)[1].strip() for ln in lines for k in ("cpu family", "model")
           if ln.split(":", 1)[0].strip() == k}
    where = f" (family {ids['cpu family']}, model {ids['model']})" if len(ids) == 2 else ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}{where}, {os.cpu_count()} cores ({isa}), {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, {platform.system()} {platform.release()}")
