"""Combine ``bench/infill.py`` result files into one table shaped like EFIM's Table 1.

    python bench/infill_table.py LABEL=RESULT.json [LABEL=RESULT.json ...] --out bench/results/infill_table

Rows: model x prompt format; columns: pass@1 (EM, ES) per set.  Every number comes from
the named result files (each records its own command and machine).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402

SET_NAMES = {"single": "single-line", "multi": "multi-line", "light": "random-span light", "heldout": "held-out files"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=path/to/result.json")
    ap.add_argument("--out", default=str(RESULTS / "infill_table"))
    args = ap.parse_args()
    rows, sets = [], []
    for spec in args.runs:
        label, path = spec.split("=", 1)
        data = json.loads(Path(path).read_text())
        for key, r in data["results"].items():
            name, fmt = key.split("/")
            if name not in sets:
                sets.append(name)
            rows.append((label, fmt, name, r, path))
    order = []
    for label, fmt, *_ in rows:
        if (label, fmt) not in order:
            order.append((label, fmt))
    lines = [header("HumanEval-Infilling and held-out files: the models side by side"),
             "Cells: pass@1 / EM / ES (0-100); held-out files have no tests (EM / ES only). "
             "Sources: " + "; ".join(sorted({f"`{p}`" for *_, p in rows})) + ".", "",
             "| model | prompt | " + " | ".join(f"{SET_NAMES.get(s, s)} (n)" for s in sets) + " |",
             "|---|---|" + "---|" * len(sets)]
    for label, fmt in order:
        cells = []
        for s in sets:
            hit = [r for lb, f, n, r, _ in rows if lb == label and f == fmt and n == s]
            if not hit:
                cells.append("-")
                continue
            r = hit[0]
            p = "-" if r["pass@1"] is None else r["pass@1"]
            cells.append(f"{p} / {r['em']} / {r['es']} ({r['n']})")
        lines.append(f"| {label} | {fmt} | " + " | ".join(cells) + " |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
