"""Resident memory and load time of a loaded model: as shipped, with the packed weights' cache off
(the twentieth session's change: model/packcache.py), with the model first built on the
meta device the way it was before the seventeenth session (PyTorch's init and ``to_empty``, which
import torch._dynamo and sympy through torch._refs), also with the tokenizer and config read
through transformers instead of from their files, also read through Hugging Face's model
instead of straight from the safetensors, with PyTorch's dense weights kept beside the
native copy too (the state before the sixteenth session), then also without giving the freed
heap back, and also with oneDNN's prepacked copy where the native stack serves every pass (the
state before the fifteenth session).

Each arm runs in a fresh process: ``load_model`` on the default model, then one completion;
resident memory (``VmRSS``) is read after each. Arms alternate for ``--rounds`` rounds.

    python bench/memory.py [--rounds 3] [--out bench/results/memory]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, write_results  # noqa: E402

# the sixteenth session's code for a model built on the meta device (its rope line is the default
# model's: no rope scaling)
NO_PACK_CACHE = "import os\nos.environ['CODECOMPLETE_PACK_CACHE'] = '0'\n"
META_DETOUR = (NO_PACK_CACHE + "import torch\n"
               "T.Embedding.reset_parameters = torch.nn.Embedding.reset_parameters\n"
               "T.rope_frequencies = lambda a: (1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, "
               "dtype=torch.float64) / a.head_dim))).float()\n"
               "T._materialize = lambda m, dt, dev, skip=frozenset(): m.to_empty(device=dev).to(dt)\n")
VIA_TRANSFORMERS = META_DETOUR + ("from codecomplete.model.tokenizer import FastTokenizer\n"
                                  "FastTokenizer.load = classmethod(lambda cls, path: None)\n"
                                  "loader.config_from_json = lambda path: None\n")
VIA_HF = VIA_TRANSFORMERS + "T.from_safetensors = lambda *a, **k: None\n"
KEEP_DENSE = VIA_HF + "T.Transformer.release_dense = lambda self: 0\n"
ARMS = {
    "shipped": "",
    "the packed weights' cache off (read, converted and packed)": NO_PACK_CACHE,
    "built on the meta device through torch._refs": META_DETOUR,
    "tokenizer and config through transformers": VIA_TRANSFORMERS,
    "through Hugging Face": VIA_HF,
    "through Hugging Face, dense weights kept": KEEP_DENSE,
    "through Hugging Face, dense weights kept, no heap trim": KEEP_DENSE + "loader.trim_heap = lambda: False",
    "through Hugging Face, dense weights kept, no heap trim, oneDNN copy kept": (
        KEEP_DENSE + "loader.trim_heap = lambda: False\n"
        "T.Transformer.pack_where_read = lambda self, on=True: self.pack(on)"),
}

WORKER = """
import json, sys, torch
from codecomplete.model import loader
from codecomplete.model import transformer as T
{patch}
def rss(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
from codecomplete.model.api import CompletionRequest, EngineSettings
from codecomplete.model.engine import generate
import time
t0 = time.perf_counter()
lm = loader.load_model()
load_seconds = time.perf_counter() - t0
loaded, peak = rss(), rss("VmHWM")
dynamo = "torch._dynamo" in sys.modules
with torch.inference_mode():
    generate(lm, CompletionRequest("def add(a, b):\\n    return", "\\n", max_tokens=16), EngineSettings())
dense = sum(1 for m in lm.model.modules() if isinstance(m, T.Linear) and "weight" in m._parameters)
print(json.dumps({{"loaded": loaded, "after_completion": rss(), "onednn_copy": lm.model.packed, "dense": dense,
                  "load_seconds": load_seconds, "peak": peak, "dynamo": dynamo}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "memory"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    for _ in range(args.rounds):
        for arm, patch in ARMS.items():
            out = subprocess.run([sys.executable, "-c", WORKER.format(patch=patch)], capture_output=True,
                                 text=True, check=True).stdout
            runs[arm].append(json.loads(out.strip().splitlines()[-1]))
            print(arm, runs[arm][-1], file=sys.stderr)
    lines = [header("Resident memory of the loaded default model"), "",
             f"Fresh process per arm and round ({args.rounds} rounds, arms alternated): `load_model()` "
             "(the default model, the daemon's settings), then one 16-token completion. MB resident "
             "(VmRSS), each round's value, then the median; the peak (VmHWM) until loaded; "
             "`load_model()`'s wall time (the same modules "
             "imported before it in every arm), the median of the rounds.", "",
             "| arm | torch._dynamo imported | oneDNN copy | dense linear weights | after loading (MB) | median "
             "| after a completion (MB) | median | peak while loading (MB, median) | load_model s (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, rs in runs.items():
        loaded = [round(r["loaded"]) for r in rs]
        after = [round(r["after_completion"]) for r in rs]
        lines.append(f"| {arm} | {rs[0]['dynamo']} | {rs[0]['onednn_copy']} | {rs[0]['dense']} | "
                     f"{' / '.join(map(str, loaded))} | "
                     f"{statistics.median(loaded):.0f} | {' / '.join(map(str, after))} | "
                     f"{statistics.median(after):.0f} | {statistics.median(r['peak'] for r in rs):.0f} | "
                     f"{statistics.median(r['load_seconds'] for r in rs):.2f} |")
    write_results(args.out, lines, runs)


if __name__ == "__main__":
    main()
