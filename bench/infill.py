"""HumanEval-Infilling through the engine: pass@1 (executed), exact match, edit similarity.

    python bench/infill.py [--model default] [--sets single,light] [--limit 150] [--format fim,efim]
                           [--stop-rule NAME=0|1 ...] [--weights bf16|int8]

Sets: single (SingleLineInfilling), multi (MultiLineInfilling), light
(RandomSpanInfillingLight); ``--limit`` takes a fixed, evenly spaced sample of a set.
Prompt formats (EFIM §4.1): ``fim`` = PSM with the whole prefix; ``efim`` = the prefix is
split at a random character into prefix1 + prefix2, a session is opened with prefix1 and
the measured request is the EFIM continuation ``<P>prefix1<S>suffix<M>prefix2``;
``headK`` = the daemon's first request of a new session with ``engine.head_lines = K``
(prefix0 ends K lines before the cursor, those lines go after ``<M>``).  A
prefix-only model (no FIM tokens, like SmolLM2-135M) ignores the suffix: its row is the
"prefix-only" baseline of issue #3.  Greedy decoding; the program (prompt + completion +
suffix + test) runs in a subprocess with a timeout.  ``--stop-rule suffix_at_indentation=0`` turns
one of ``stops.StopRules``' switches off (an A/B of a stop rule: two runs, their JSON files hold
each task's completion).  Writes bench/results/infill.md/.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header  # noqa: E402

from codecomplete.daemon.replay import edit_similarity  # noqa: E402
from codecomplete.model.api import CompletionRequest, EngineSettings, SpecSettings  # noqa: E402
from codecomplete.model import stops  # noqa: E402
from codecomplete.model.engine import Engine  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "human-eval-infilling"
SETS = {"single": ("HumanEval-SingleLineInfilling.jsonl.gz", "single"),
        "multi": ("HumanEval-MultiLineInfilling.jsonl.gz", "multi"),
        "light": ("HumanEval-RandomSpanInfillingLight.jsonl.gz", "multi"),
        "heldout": (None, "single")}  # the fine-tune's held-out files: EM and ES only


def heldout(limit: int, seed: int = 0) -> list[dict]:
    """Single-line infilling on the fine-tune's held-out files (never trained on, split by
    path hash, duplicates of other files dropped): one non-blank line is the middle,
    up to 3,000 characters before it the prefix and 1,500 after it the suffix."""
    import site

    from codecomplete.model import fimdata as fd

    splits, _ = fd.load_corpus(fd.collect_sources(Path(site.getsitepackages()[0])))
    files = sorted(splits["held-out"], key=lambda x: x[0].path)
    rng = random.Random(seed)
    rows = []
    for src, text in rng.sample(files, min(limit, len(files))):
        lines = text.splitlines(keepends=True)
        cands = [i for i, ln in enumerate(lines) if ln.strip() and i > 2 and len(ln) < 120]
        if not cands:
            continue
        i = rng.choice(cands)
        head = "".join(lines[:i])
        rows.append({"task_id": f"{src.package}/{Path(src.path).name}:{i + 1}", "prompt": head[-3000:],
                     "suffix": "".join(lines[i + 1:])[:1500], "canonical_solution": lines[i]})
    return rows


def load(name: str, limit: int, offset: int = 0) -> list[dict]:
    """``limit`` evenly spaced tasks of a set, from ``offset`` on (another split: an offset
    below the spacing)."""
    if name == "heldout":
        return heldout(limit)
    rows = [json.loads(line) for line in gzip.open(DATA / SETS[name][0])]
    if limit and limit < len(rows):
        step = len(rows) / limit
        rows = [rows[min(len(rows) - 1, int(i * step) + offset)] for i in range(limit)]
    return rows


def passes(task: dict, middle: str, timeout: float = 5.0) -> bool:
    program = (task["prompt"] + middle + task["suffix"] + "\n\n" + task["test"]
               + f"\n\ncheck({task['entry_point']})\n")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(program)
    try:
        done = subprocess.run([sys.executable, f.name], capture_output=True, timeout=timeout)
        return done.returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        Path(f.name).unlink(missing_ok=True)


def run(engine: Engine, tasks: list[dict], mode: str, fmt: str, seed: int, outputs: list[str] | None = None) -> dict:
    """One set in one prompt format; ``outputs`` receives each completion's text."""
    rng = random.Random(seed)
    out = {"n": len(tasks), "pass": 0, "em": 0, "es": 0.0, "ms": 0.0, "kinds": {}}
    for i, t in enumerate(tasks):
        prefix, suffix = t["prompt"], t["suffix"]
        key = None
        engine.pool.head_lines = int(fmt[4:]) if fmt.startswith("head") else 0
        if fmt.startswith("head"):  # the daemon's first request of a session: its last K lines after <M>
            key = f"{t['task_id']}-{i}-{fmt}"
        if fmt == "efim" and len(prefix) > 1:
            key = f"{t['task_id']}-{i}"
            cut = rng.randrange(1, len(prefix))
            engine.complete(CompletionRequest(prefix[:cut], suffix, request_id="open", session_key=key,
                                              max_tokens=1, mode=mode))
        t0 = time.perf_counter()
        c = engine.complete(CompletionRequest(prefix, suffix, request_id=t["task_id"], session_key=key,
                                              mode=mode, max_tokens=128, max_lines=40, time_budget_ms=60000))
        out["ms"] += (time.perf_counter() - t0) * 1000
        out["kinds"][c.prompt_kind] = out["kinds"].get(c.prompt_kind, 0) + 1
        middle = c.text
        if outputs is not None:
            outputs.append(c.text)
        if not middle.endswith("\n"):  # the canonical middles end their last line; stop rules cut it
            middle += "\n"
        truth = t["canonical_solution"]
        out["pass"] += passes(t, middle) if "test" in t else 0
        out["em"] += middle.strip() == truth.strip()
        out["es"] += 100 * edit_similarity(middle.strip(), truth.strip())
        sys.stderr.write(f"\r{fmt} {i + 1}/{len(tasks)} pass {out['pass']}")
    sys.stderr.write("\n")
    n = max(1, out["n"])
    return {"n": out["n"], "pass@1": round(100 * out["pass"] / n, 1) if all("test" in t for t in tasks) else None, "em": round(100 * out["em"] / n, 1),
            "es": round(out["es"] / n, 1), "mean_ms": round(out["ms"] / n, 1), "prompt_kinds": out["kinds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "int8"], help="the layers' matrices (model.weights)")
    ap.add_argument("--sets", default="single,light")
    ap.add_argument("--limit", type=int, default=150)
    ap.add_argument("--format", default="fim,efim")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-healing", action="store_true",
                    help="turn token healing at the cursor off (issue #3 part 9 measures the difference)")
    ap.add_argument("--stop-rule", action="append", default=[], metavar="NAME=0|1",
                    help="set a switch of stops.StopRules for this run (suffix_at_indentation, "
                         "top_level_paragraphs, definition_paragraphs), or closer_rules (stops.CLOSER_RULES)")
    ap.add_argument("--out", default=str(RESULTS / "infill"))
    args = ap.parse_args()
    rules = {}
    for item in args.stop_rule:
        name, _, value = item.partition("=")
        if name == "closer_rules" and value in ("0", "1"):  # a module switch (stops.CLOSER_RULES)
            rules[name] = stops.CLOSER_RULES = value == "1"
            continue
        if not isinstance(getattr(stops.StopRules, name, None), bool) or value not in ("0", "1"):
            ap.error(f"--stop-rule {item!r}: expected one of StopRules' switches (or closer_rules) and 0 or 1")
        rules[name] = value == "1"
        setattr(stops.StopRules, name, rules[name])
    engine = Engine(EngineSettings(model=args.model, dtype=args.dtype, weights=args.weights, inc_bound=100000,
                                   token_healing=not args.no_healing, head_lines=0,
                                   speculation=SpecSettings(enabled=False))).start()  # plain greedy decoding
    engine.ready.wait()
    st = engine.stats()
    if st["load_error"]:
        raise SystemExit(st["load_error"])
    results, texts = {}, {}
    for name in args.sets.split(","):
        tasks = load(name, args.limit)
        for fmt in args.format.split(","):
            texts[f"{name}/{fmt}"] = []
            results[f"{name}/{fmt}"] = run(engine, tasks, SETS[name][1], fmt, args.seed, texts[f"{name}/{fmt}"])
    engine.close()
    out = Path(args.out)
    res = {"model": st["model"], "template": st["template"], "dtype": st["dtype"], "weights": st["weights"],
           "stop_rules": rules,
           "results": results, "texts": texts}
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    lines = [header("HumanEval-Infilling"),
             f"Model: {st['model']} (template {st['template']}, {st['dtype']}, layer weights {st['weights']}); "
             "greedy; "
             f"fixed evenly spaced samples of at most {args.limit} tasks per set; "
             f"token healing {'off' if args.no_healing else 'on'}"
             + "".join(f"; StopRules.{k} = {v}" for k, v in rules.items()) + ".", "",
             "| set / prompt format | tasks | pass@1 | EM | ES | mean ms | prompt kinds |", "|---|---|---|---|---|---|---|"]
    for k, r in results.items():
        lines.append(f"| {k} | {r['n']} | {r['pass@1']} | {r['em']} | {r['es']} | {r['mean_ms']} | {r['prompt_kinds']} |")
    if st["template"] == "prefix-only":
        lines += ["", "A prefix-only model ignores the suffix: fim and efim rows are the same prompt "
                  "(the prefix-only baseline of issue #3)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
