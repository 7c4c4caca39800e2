"""LayerSkip-style exit training (model/layerskip.py) against exits on the frozen model (#9).

    python bench/layerskip.py --runs RUN_DIR[,RUN_DIR] --exits NEW_EXITS --baseline OLD_EXITS [--out ...]

Reads what the GPU runs wrote (history.json: validation before, during and after training)
and the calibration that ``exit_train`` wrote for both models (exits.json: per exit, agreement
with the model's own last layer and the share of tokens that may exit at each disagreement
bound), and puts them side by side.  The early-exit benchmark (bench/early_exit.py) measures
what the exits then buy in decode speed and quality.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import header  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def run_table(name: str, hist: dict) -> list[str]:
    evals = hist["evals"]
    exits = sorted(int(k.split("_")[1]) for k in evals[0] if k.startswith("agree_"))
    a = hist["args"]
    lines = [f"### {name}: exits {a['exits']}, weight {a['exit_weight']} each, LoRA rank {a['rank']}, "
             f"lr {a['lr']} (exit adapters {a['exit_lr']}), batch {a['batch']} x {a['seq']}, "
             f"{hist.get('train_s', '?')} s on {hist.get('gpu')}", "",
             "| step | tokens | last layer = teacher's top-1 | KL(teacher, last layer) | FIM loss (teacher) | "
             + " | ".join(f"exit {e} = teacher" for e in exits) + " |",
             "|---|---|---|---|---|" + "---|" * len(exits)]
    for e in evals:
        agree = " | ".join(str(e[f"agree_{x}"]) for x in exits)
        lines.append(f"| {e['step']} | {e['tokens']} | {e['final_agree']} | {e['final_kl']} | "
                     f"{e['fim_loss']} ({e['teacher_fim_loss']}) | {agree} |")
    return lines + [""]


def calibration_table(old: dict, new: dict) -> list[str]:
    bounds = new.get("bounds", [0.02, 0.05, 0.1])
    lines = ["| exit | agree: frozen / LayerSkip | "
             + " | ".join(f"exit rate @{b}: frozen / LayerSkip" for b in bounds) + " |",
             "|---|---|" + "---|" * len(bounds)]
    for key in new["calibration"]:
        if not key.startswith("softmax/"):
            continue
        o, n = old["calibration"].get(key, {}), new["calibration"][key]

        def rate(c: dict, b) -> str:
            got = c.get(f"@{b}")
            if not got:
                return "-"
            return f"{got['exit_rate']}{'' if got.get('used', True) else ' (unused)'}"

        lines.append(f"| {key.split('/')[1]} | {o.get('agree', '-')} / {n['agree']} | "
                     + " | ".join(f"{rate(o, b)} / {rate(n, b)}" for b in bounds) + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="GPU run folders (history.json), comma-separated")
    ap.add_argument("--exits", required=True, help="exit_train's output on the LayerSkip-trained model")
    ap.add_argument("--baseline", required=True, help="exit_train's output on the model as it ships")
    ap.add_argument("--out", default=str(RESULTS / "layerskip"))
    args = ap.parse_args()
    out = Path(args.out)
    runs = {}
    for i, d in enumerate(x for x in args.runs.split(",") if x):
        runs[f"run {i + 1}"] = json.loads((Path(d) / "history.json").read_text())
        shutil.copyfile(Path(d) / "history.json", out.parent / f"{out.name}_run{i + 1}_history.json")
    old = json.loads((Path(args.baseline) / "exits.json").read_text())
    new = json.loads((Path(args.exits) / "exits.json").read_text())
    lines = [header("LayerSkip-style exit training (model/layerskip.py)"),
             "Self-distillation on a GPU: the teacher is the model as it ships, the student the same model with a new "
             "LoRA on every projection and a residual adapter per exit; loss KL(teacher, last layer) + sum of "
             "weight x KL(teacher, exit) at every position of FIM/EFIM samples. Validation (16 batches of the "
             "fine-tune's validation split, every position, full vocabulary) during the runs:", ""]
    for name, hist in runs.items():
        lines += run_table(name, hist)
    lines += ["## Exits trained and calibrated by exit_train on each model (validation split, subset head)", "",
              f"- frozen (the model as it ships): `{old.get('command')}`, "
              f"{old.get('positions_val')} validation positions",
              f"- LayerSkip-trained: `{new.get('command')}`, {new.get('positions_val')} validation positions",
              "- agreement is with each model's own last layer; exit rate = share of tokens whose margin passes the "
              "threshold calibrated for that bound (unused: below min_rate)", ""]
    lines += calibration_table(old, new)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"runs": {k: v["evals"] for k, v in runs.items()},
                                                    "baseline": old, "layerskip": new}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
