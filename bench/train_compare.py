"""Side-by-side FIM fine-tuning runs (issue #3 part 5): partial vs LoRA, with and without
the early-exit loss, read from the runs' own histories.

    python bench/train_compare.py RUN_DIR [RUN_DIR...] [--out bench/results/train_compare]

Each RUN_DIR was written by ``python -m codecomplete.model.train`` (same seed, data and
steps); the table shows validation FIM loss, per-exit loss and top-1 agreement with the
last layer, training speed, and what would ship (adapter size, or the bf16 size of the
changed layers for partial fine-tuning).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402

LAYER_PARAMS_SMOLLM2 = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576  # q,o + k,v + mlp + norms


def describe(run: Path) -> dict:
    hist = json.loads((run / "model" / "history.json").read_text())
    state_args = {}
    card = (run / "model" / "README.md").read_text()
    m = re.search(r"hyperparameters: (\{.*\})", card)
    if m:
        state_args = json.loads(m.group(1))
    vals = [h for h in hist if "val_loss" in h]
    rates = [h["tok_per_s"] for h in hist if "tok_per_s" in h]
    if not rates:  # runs from before the history kept it: the log's last progress line
        log = run.with_suffix(".log")
        found = re.findall(r"([\d.]+) tok/s", log.read_text(errors="replace")) if log.is_file() else []
        rates = [float(found[-1])] if found else []
    adapter = run / "adapter" / "adapter.safetensors"
    if state_args.get("lora_rank"):
        ships = adapter.stat().st_size / 2**20 if adapter.is_file() else None
        trained = f"LoRA r{state_args['lora_rank']} on layers >= {state_args.get('freeze_layers', 0)}"
    else:
        layers = 30 - int(state_args.get("freeze_layers", 15))
        ships = layers * LAYER_PARAMS_SMOLLM2 * 2 / 2**20
        trained = f"layers >= {state_args.get('freeze_layers', 15)} (partial)"
    last = vals[-1] if vals else {}
    exits = sorted({int(k[4:-5]) for k in last if k.startswith("exit") and k.endswith("_loss")})
    return {"run": run.name, "trained": trained, "exit_weight": state_args.get("exit_weight", 0.0),
            "steps": hist[-1]["step"], "tokens": hist[-1]["tokens"], "val": [(h["step"], h["val_loss"]) for h in vals],
            "last": last, "exits": exits, "tok_per_s": rates[-1] if rates else None, "ships_mb": ships}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", default=str(RESULTS / "train_compare"))
    args = ap.parse_args()
    rows = [describe(r) for r in args.runs]
    exits = sorted({e for r in rows for e in r["exits"]})
    lines = [header("FIM fine-tuning: partial vs LoRA, early-exit loss"),
             "Same seed, data, batch (4 x 512) and steps; validation = FIM loss on the validation files "
             "(middle tokens only); exit columns: loss of the hidden state after that many layers through "
             "the shared norm and head, and its top-1 agreement with the last layer.", "",
             "| run | trained | exit loss weight | steps | tokens | val loss (by step) | "
             + " | ".join(f"exit {e}: loss / agree" for e in exits) + " | tokens/s | ships (MB, bf16) |",
             "|---|---|---|---|---|---|" + "---|" * len(exits) + "---|---|"]
    for r in rows:
        val = ", ".join(f"{s}: {v}" for s, v in r["val"])
        ex = " | ".join(f"{r['last'].get(f'exit{e}_loss', '-')} / {r['last'].get(f'exit{e}_agree', '-')}"
                        for e in exits)
        lines.append(f"| {r['run']} | {r['trained']} | {r['exit_weight']} | {r['steps']} | {r['tokens']:,} | {val} | "
                     f"{ex} | {r['tok_per_s']} | {r['ships_mb']:.1f} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
