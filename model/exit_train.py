"""Train and calibrate early exits for a model (issue #9).

    python -m codecomplete.model.exit_train --model default --out DIR \\
        [--layers 16,20,24,27] [--batches 120] [--epochs 6] [--bounds 0.02,0.05,0.1]
        [--positions all|outputs] [--untrained]

1. Runs the model (frozen) over FIM/EFIM training samples (the fine-tune's pipeline and
   train split) and keeps, at every position (``--positions all``, the default) or only
   where a model output is predicted (FIM middles), the hidden state at and before each
   exit and the full model's top token.  Every position is a distillation target; using
   them all gives the adapters six times the data, which they need (measured on 40 batches:
   trained on the middles alone they fit their data, layer 24 0.96 train and 0.65 held-out
   agreement; on every position of the same samples 0.69 held out, layer 20 0.42 -> 0.50).
2. Trains per exit a residual linear adapter (zero-initialised, ``h + A h`` before the
   shared norm and head) to predict the full model's token over the vocabulary subset
   (the most frequent tokens of the collected text; LayerSkip's exits, trained after the
   fact instead of during fine-tuning), then a small classifier per exit that predicts
   whether the exit's top token equals the full model's.
3. Calibrates, on the validation split, a threshold per exit, confidence measure and
   bound: the lowest one at which exited tokens disagree with the full model at most
   that share of the time (no threshold: that exit is never taken).

Writes DIR/exits.json (layers, thresholds, agreement and exit rates, data sizes) and
DIR/exits.safetensors.  ``--untrained`` keeps the adapters at zero (the plain logit
lens) and only calibrates: the untrained baseline of the early-exit benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import fimdata as fd
from .early_exit import ADAPTER_KINDS, MEASURES, Exits
from .loader import load_model, model_identity


@functools.lru_cache(maxsize=1)
def _splits() -> dict:
    import site

    return fd.load_corpus(fd.collect_sources(Path(site.getsitepackages()[0])))[0]


@torch.no_grad()
def collect(lm, batches: int, layers: list[int], split: str, seed: int, batch: int = 4, seq: int = 512,
            final: bool = False, every: bool = False) -> dict:
    """Hidden states at and before each exit (and after the last layer when ``final``)
    and the full model's top token, at every position whose next token is a model output
    (labels set), or at every position (``every``: the full model's top token is a target
    anywhere; the prompt's positions are six times the outputs'); token counts of the input."""
    from .train import batches as make_batches
    from .train import special_ids

    model, tok = lm.model, lm.tokenizer
    special = special_ids(tok)
    texts = [t for _, t in _splits()[split]]
    if any(v is None or v == tok.unk_token_id for v in special.values()):
        data = plain_batches(texts, tok, random.Random(seed), batch, seq)  # no FIM tokens: plain code
    else:
        data = make_batches(texts, tok, special, random.Random(seed), batch, seq)
    want = sorted({n for e in layers for n in (e - 1, e)} | ({model.args.n_layers} if final else set()))
    states: dict[int, list[torch.Tensor]] = {n: [] for n in want}
    top, counts = [], torch.zeros(model.args.vocab_size, dtype=torch.long)
    t0 = time.perf_counter()
    for i in range(batches):
        ids, labels = next(data)
        counts += torch.bincount(ids.flatten(), minlength=model.args.vocab_size)
        keep = labels[:, 1:] != -100  # position t predicts labels[t + 1]
        keep = torch.cat([keep, torch.zeros(keep.shape[0], 1, dtype=torch.bool)], 1)
        if every:
            keep = torch.ones_like(keep)
        caches = [model.new_cache(seq) for _ in range(ids.shape[0])]
        for c in caches:
            c.reserve(seq)
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
        cos, sin = model.rope(pos.to(model.device))
        x = model.embed(ids.to(model.device))
        for j, layer in enumerate(model.layers):
            if j in states:
                states[j].append(x[keep].cpu())
            x = layer(x, cos, sin, j, caches, [None] * len(caches))
        if final:
            states[model.args.n_layers].append(x[keep].cpu())
        h = model.norm(x[keep])
        top.append(torch.cat([model.head(part).argmax(-1) for part in h.split(1024)]).cpu())
        sys.stderr.write(f"\r{split}: batch {i + 1}/{batches}, {sum(len(t) for t in top)} positions, "
                         f"{(i + 1) * batch * seq / (time.perf_counter() - t0):.0f} tok/s")
    sys.stderr.write("\n")
    return {"states": {n: torch.cat(v) for n, v in states.items()}, "top": torch.cat(top), "counts": counts}


def plain_batches(texts: list[str], tok, rng: random.Random, batch: int, seq: int):
    """Windows of plain code, every position predicted (for models without FIM tokens)."""
    while True:
        ids_b = []
        while len(ids_b) < batch:
            text = rng.choice(texts)
            start = rng.randrange(0, max(1, len(text) - seq * 4))
            ids = tok.encode(text[start:start + seq * 4], add_special_tokens=False)[:seq]
            if len(ids) == seq:
                ids_b.append(ids)
        ids = torch.tensor(ids_b)
        yield ids, ids.clone()


def fit_adapter(adapter, head, h_all, y_all, h_dev, y_dev, n: int, epochs: int, lr: float, bs: int) -> float:
    """Fit one exit's adapter on the subset head ``head`` (``exit_stream.SubsetHead``); keeps the
    epoch with the best held-out agreement (returned)."""
    opt = torch.optim.AdamW(adapter.parameters(), lr=lr, weight_decay=0.0)
    best, best_w = -1.0, adapter.weight.detach().clone()
    for ep in range(epochs):
        perm = torch.randperm(len(h_all))
        total = 0.0
        for i in range(0, len(perm), bs):
            idx = perm[i:i + bs]
            h = h_all[idx]
            loss = F.cross_entropy(head(h + adapter(h)), y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        dev = head.agreement(adapter, h_dev, y_dev)
        if dev > best:
            best, best_w = dev, adapter.weight.detach().clone()
        sys.stderr.write(f"\rexit {n}: epoch {ep + 1}/{epochs} loss {total / len(perm):.3f} "
                         f"held-out agreement {dev:.3f}")
    with torch.no_grad():
        adapter.weight.copy_(best_w)
    return best


def train_exits(lm, exits: Exits, data: dict, epochs: int, lr: float = 1e-3, bs: int = 512, seed: int = 0,
                fit_adapters: bool = True) -> dict:
    """Adapters by distillation on the subset head (unless ``fit_adapters`` is off: the
    adapters come trained, from ``exit_stream``), then classifiers on agreement."""
    from .exit_stream import SubsetHead

    model = lm.model
    torch.manual_seed(seed)
    exits.float()
    head = SubsetHead(model.head.weight, model.norm.weight, model.norm.eps, exits.subset, model.args.vocab_size)
    target = head.where[data["top"]]
    inside = target >= 0
    report = {"targets_in_subset": round(float(inside.float().mean()), 4)}

    # a tenth of the training positions (by sample order) picks the epoch: the adapters
    # overfit otherwise (measured: train agreement 0.90 at layer 24, validation 0.67)
    n_pos = int(inside.sum())
    split = n_pos - max(1, n_pos // 10)
    for k, n in enumerate(exits.layers):
        h_in = data["states"][n].float()[inside]
        y_in = target[inside]
        h_all, y_all, h_dev, y_dev = h_in[:split], y_in[:split], h_in[split:], y_in[split:]
        exits.trained = True
        if fit_adapters:
            best = fit_adapter(exits.adapters[k], head, h_all, y_all, h_dev, y_dev, n, epochs, lr, bs)
        else:
            best = head.agreement(exits.adapters[k], h_dev, y_dev)
        report[f"dev_agree_{n}"] = round(best, 4)
        sys.stderr.write("\n")
        # the classifier: does this exit's full-head top token equal the full model's?
        with torch.no_grad():  # the exit's token: the subset head's top one
            tops = [exits.subset[head(h + exits.adapters[k](h)).argmax(-1)]
                    for h in data["states"][n].float().split(2048)]
            agree = torch.cat(tops) == data["top"]
        clf = exits.classifiers[k]
        copt = torch.optim.AdamW(clf.parameters(), lr=lr)
        feats = head.norm(exits.state(n, data["states"][n].float())).detach()
        for ep in range(epochs * 2):
            perm = torch.randperm(len(feats))
            for i in range(0, len(perm), bs):
                idx = perm[i:i + bs]
                loss = F.binary_cross_entropy_with_logits(clf(feats[idx])[:, 0], agree[idx].float())
                copt.zero_grad()
                loss.backward()
                copt.step()
        report[f"train_agree_{n}"] = round(float(agree.float().mean()), 4)
    return report


@dataclasses.dataclass(frozen=True)
class ExitCost:
    """A token's cost in layers under the lossy policy: every exit it reaches costs a check;
    leaving early costs the KV filling of the skipped layers (``fill_a + fill_b`` x skipped);
    staying costs the full head unless the last layer's check skips it.  The defaults are
    the AVX2 EPYC's measurements (docs/decisions.md, fifth session: a check 0.48 ms, a layer
    ~0.31 ms, the head ~8 layers of products, a token leaving at 8 / 16 / 24 costing
    0.39 / 0.58 / 0.78 of a step)."""

    check: float = 1.55
    head: float = 8.0
    fill_a: float = 3.5
    fill_b: float = 0.08

    @classmethod
    def parse(cls, text: str) -> "ExitCost":
        """``CHECK,HEAD,FILL_A,FILL_B`` (layers); ValueError unless four non-negative numbers."""
        vals = [float(x) for x in text.split(",")]
        if len(vals) != 4 or min(vals) < 0:
            raise ValueError(text)
        return cls(*vals)


def replay(conf: dict, agree: dict, thresholds: dict[int, float], n_layers: int, final: int,
           cost: ExitCost) -> tuple[float, float, float]:
    """The engine's lossy policy on calibration positions: a token leaves at the first exit in
    ``thresholds`` (in layer order, ``final`` aside) whose confidence reaches its threshold;
    after the last layer a confident check (``final`` in ``thresholds``) skips the full head.
    ``conf[n]``/``agree[n]``: per position, the confidence at exit ``n`` and whether its token
    is the full model's.  Returns (mean cost in layers, share of tokens that left early or
    skipped the head with another token than the full model's, mean layers run)."""
    n_pos = len(next(iter(conf.values())))
    left = torch.zeros(n_pos, dtype=torch.bool)
    cost_ = torch.zeros(n_pos)
    wrong = torch.zeros(n_pos, dtype=torch.bool)
    depth = torch.full((n_pos,), float(n_layers))
    for n in sorted(k for k in thresholds if k != final):
        here = ~left
        cost_[here] += cost.check
        go = here & (conf[n] >= thresholds[n])
        cost_[go] += n + cost.fill_a + cost.fill_b * (n_layers - n)
        wrong |= go & ~agree[n]
        depth[go] = n
        left |= go
    rest = ~left
    cost_[rest] += n_layers + cost.head
    if final and final in thresholds:
        cost_[rest] += cost.check
        skip = rest & (conf[final] >= thresholds[final])
        cost_[skip] -= cost.head
        wrong |= skip & ~agree[final]
    return float(cost_.mean()), float(wrong.float().mean()), float(depth.mean())


def joint_thresholds(conf: dict, agree: dict, n_layers: int, final: int, bound: float, cost: ExitCost,
                     start: dict[int, float] | None = None, grid: int = 40, sweeps: int = 6) -> dict[int, float]:
    """Thresholds for all exits together: the cheapest policy (``replay``'s cost) whose tokens
    leave with another token than the full model's at most ``bound`` of the time, over all
    tokens.  Per-exit calibration bounds each exit's own exited tokens, so the cascade's total
    can exceed the bound (the shipped exits at 0.05: 8 %, bench/results/exit_cost_avx2.md) and
    it keeps every exit that takes ``min_rate``, checks that cost more than they save
    included.

    Each exit's threshold is one of ``grid`` values (the confidences at which 0.1 % .. 100 %
    of its tokens would leave, spaced geometrically) or none (the exit unchecked).  Coordinate
    descent (each exit in turn takes its best value, the others fixed) on cost + lambda x
    wrong for a range of lambdas, and from ``start`` restricted to each subset of its exits,
    gives candidate policies; the cheapest within the bound is refined by coordinate descent
    on cost under the bound.  Budgeted descent alone stalls: the first exit it opens spends
    the whole budget."""
    exits = sorted(conf)
    rates = torch.logspace(-3, 0, grid)
    cands = {n: sorted(set(torch.quantile(conf[n].float(), (1 - rates).clamp(0, 1)).tolist())) for n in exits}
    memo: dict = {}

    def run(thr: dict[int, float]) -> tuple[float, float]:
        key = tuple(sorted(thr.items()))
        if key not in memo:
            memo[key] = replay(conf, agree, thr, n_layers, final, cost)[:2]
        return memo[key]

    def descend(thr: dict[int, float], lam: float | None) -> dict[int, float]:
        def score(t):
            c, w = run(t)
            if lam is None:
                return c if w <= bound + 1e-12 else float("inf")
            return c + lam * w
        best = score(thr)
        for _ in range(sweeps):
            changed = False
            for n in exits:
                for c in [None] + cands[n]:
                    trial = {k: v for k, v in thr.items() if k != n} | ({} if c is None else {n: c})
                    sc = score(trial)
                    if sc < best - 1e-9:
                        best, thr, changed = sc, trial, True
            if not changed:
                break
        return thr

    found = [{}]
    for lam in torch.logspace(1, 4, 13).tolist():  # a wrong token "costs" 10 .. 10,000 layers
        found.append(descend({}, lam))
    for k in range(1, len(start or {}) + 1):
        for sub in itertools.combinations(sorted(start), k):
            found.append({n: start[n] for n in sub})
    feasible = [t for t in found if run(t)[1] <= bound + 1e-12]
    best = min(feasible, key=lambda t: run(t)[0])
    return descend(best, None)


@torch.no_grad()
def margins(model, exits: Exits, data: dict, measure: str, layers: list[int]) -> tuple[dict, dict]:
    """Per exit in ``layers`` (the last layer's check included): the ``measure`` confidence
    and whether the exit's token is the full model's, at each position of ``data``
    (``collect``'s states and top tokens), in chunks of 2,048 positions."""
    confs, agrees = {}, {}
    for n in layers:
        h = data["states"][n]
        before = data["states"].get(n - 1, h)  # only the cosine measure reads it (not after the last layer)
        conf, agree = [], []
        for hp, bp, tp in zip(h.split(2048), before.split(2048), data["top"].split(2048)):
            hp = hp.to(model.device, model.dtype)
            c, logits = exits.confidence(model, measure, n, hp, bp.to(hp))
            if logits is None:
                logits = exits.logits(model, n, hp, subset=True)
            agree.append(exits.tokens(logits.float(), subset=True).cpu() == tp)
            conf.append(c.float().cpu())
        confs[n], agrees[n] = torch.cat(conf), torch.cat(agree)
    return confs, agrees


@torch.no_grad()
def calibrate(lm, exits: Exits, data: dict, bounds: list[float], measures=MEASURES, min_rate: float = 0.0,
              policy: str = "each", cost: ExitCost = ExitCost()) -> dict:
    """Per measure, bound and exit: the lowest threshold whose exited tokens disagree
    with the full model at most ``bound`` of the time; the exit's agreement and the
    share of tokens that would exit.  Stored as ``thresholds["measure@bound"]``.  An exit
    that would take fewer than ``min_rate`` of the tokens gets no threshold: its check
    would cost more than it saves.  With ``exits.final`` set, the last layer gets a
    softmax threshold too: its subset-head margin decides when the full head is skipped.
    ``policy="joint"``: the stored thresholds are ``joint_thresholds`` instead (the bound on
    all tokens together, the exits worth their checks under ``cost``); the per-exit ones
    stay in the report, and ``report["joint"]`` has each bound's projected cost and share."""
    model = lm.model
    report: dict = {}
    exits.thresholds, exits.draft_thresholds = {}, {}
    n_layers = model.args.n_layers
    for measure in measures:
        if measure == "classifier" and not exits.trained:
            continue
        final = [exits.final] if exits.final and measure == "softmax" and len(exits.subset) else []
        confs, agrees = margins(model, exits, data, measure, exits.layers + final)
        for n in exits.layers + final:
            conf, agree = confs[n], agrees[n]
            order = conf.argsort(descending=True)
            wrong = (~agree[order]).float().cumsum(0)
            count = torch.arange(1, len(order) + 1).float()
            row = {"agree": round(float(agree.float().mean()), 4)}
            for bound in bounds:
                ok = (wrong / count <= bound) & (count >= 20)
                key = f"{measure}@{bound:g}"
                exits.thresholds.setdefault(key, {})
                if ok.any():
                    last = int(ok.nonzero().max())  # the most tokens within the bound
                    thr, rate = float(conf[order][last]), (last + 1) / len(order)
                else:
                    thr, rate = None, 0.0
                if thr is not None and rate >= min_rate:
                    exits.thresholds[key][n] = thr
                row[f"@{bound:g}"] = {"threshold": None if thr is None else round(thr, 5),
                                      "exit_rate": round(rate, 4), "used": n in exits.thresholds[key]}
            report[f"{measure}/{n}"] = row
        if policy == "joint":
            fin = final[0] if final else 0
            for bound in bounds:
                key = f"{measure}@{bound:g}"
                each = exits.thresholds.get(key, {})
                thr = joint_thresholds(confs, agrees, n_layers, fin, bound, cost, start=each)
                c, w, d = replay(confs, agrees, thr, n_layers, fin, cost)
                c0, w0, d0 = replay(confs, agrees, each, n_layers, fin, cost)
                exits.draft_thresholds[key] = each  # lossless mode gates drafts on an exit's own confidence
                exits.thresholds[key] = thr
                report.setdefault("joint", {})[key] = {
                    "thresholds": {str(n): round(v, 5) for n, v in sorted(thr.items())},
                    "cost": round(c, 3), "wrong": round(w, 4), "mean_layers": round(d, 2),
                    "projected_speedup": round((n_layers + cost.head) / c, 3),
                    "per_exit": {"exits": sorted(each), "cost": round(c0, 3), "wrong": round(w0, 4),
                                 "mean_layers": round(d0, 2),
                                 "projected_speedup": round((n_layers + cost.head) / c0, 3)}}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codecomplete.model.exit_train", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", default="16,20,24,27")
    ap.add_argument("--batches", type=int, default=120, help="training batches of 4 x 512 tokens")
    ap.add_argument("--val-batches", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--subset", type=int, default=4096, help="vocabulary subset size for cheap exit heads (0: none)")
    ap.add_argument("--bounds", default="0.02,0.05,0.1",
                    help="token disagreement bounds to calibrate for (engine setting early_exit.bound picks one)")
    ap.add_argument("--min-rate", type=float, default=0.03, help="exits taking fewer tokens get no threshold")
    ap.add_argument("--policy", choices=("each", "joint"), default="each",
                    help="thresholds per exit (each exit's own exited tokens within the bound), or jointly: the "
                         "cheapest thresholds under --cost whose tokens, all exits together, stay within the bound")
    ap.add_argument("--cost", default="1.55,8,3.5,0.08", metavar="CHECK,HEAD,FILL_A,FILL_B",
                    help="--policy joint's cost model in layers: a check, the full head, leaving early "
                         "(FILL_A + FILL_B x skipped layers); the defaults are the AVX2 EPYC's")
    ap.add_argument("--positions", choices=("all", "outputs"), default="all",
                    help="train the exits at every position of the samples, or only where the model's output is "
                         "predicted (FIM middles; calibration always uses those)")
    ap.add_argument("--untrained", action="store_true", help="no adapters or classifiers: calibrate the logit lens")
    ap.add_argument("--adapters", type=Path, metavar="RUN_DIR",
                    help="take the linear adapters trained by exit_stream in RUN_DIR (on the vocabulary subset of "
                         "--subset-from) instead of fitting them here; the classifiers and thresholds are fitted here")
    ap.add_argument("--adapter-kind", choices=ADAPTER_KINDS, default="linear",
                    help="with --adapters: which of the run's adapter kinds to serve "
                         "(mlp: more accurate, a costlier check)")
    ap.add_argument("--recalibrate", type=Path, metavar="EXITS_DIR",
                    help="only calibrate the exits in EXITS_DIR again (their adapters and classifiers kept), on this "
                         "--dtype: thresholds found on another dtype's states need not hold on the one served")
    ap.add_argument("--subset-from", type=Path, help="exits folder whose vocabulary subset to use "
                    "(default: the shipped exits' with --adapters, else the collected text's most frequent tokens)")
    ap.add_argument("--no-final", action="store_true",
                    help="no check after the last layer (a confident subset-head margin there skips the full head)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    try:
        args.cost = ExitCost.parse(args.cost)
    except ValueError:
        raise SystemExit("--cost takes four non-negative numbers: CHECK,HEAD,FILL_A,FILL_B") from None
    torch.manual_seed(args.seed)
    lm = load_model(args.model, device="cpu", dtype=args.dtype)
    if args.recalibrate:
        return recalibrate(lm, args, argv)
    layers = [int(x) for x in args.layers.split(",")]
    if any(not 0 < n < lm.model.args.n_layers for n in layers):
        raise SystemExit(f"--layers must lie in 1..{lm.model.args.n_layers - 1}")
    if args.adapters and args.untrained:
        raise SystemExit("--adapters and --untrained exclude each other (--untrained: no adapters at all)")
    trained = None
    if args.adapters:  # checked before the long collection
        from .exit_stream import load_adapters

        trained = load_adapters(args.adapters, args.adapter_kind)
        key = "weight" if args.adapter_kind == "linear" else "w1.weight"
        missing = [n for n in layers if f"exit_{n}.{key}" not in trained]
        if missing:
            raise SystemExit(f"{args.adapters} has no {args.adapter_kind} adapter at layer(s) {missing}")
    elif args.adapter_kind != "linear":
        raise SystemExit("--adapter-kind mlp needs --adapters (this command fits only linear adapters)")
    t0 = time.perf_counter()
    final = not args.no_final and args.subset > 0
    train = None if args.untrained else collect(lm, args.batches, layers, "train", args.seed,
                                                  every=args.positions == "all")
    val = collect(lm, args.val_batches, layers, "validation", args.seed + 1, final=final)
    counts = (train or val)["counts"]
    subset = counts.argsort(descending=True)[: args.subset].sort().values if args.subset else None
    if args.adapters or args.subset_from:
        from .exit_stream import SHIPPED_EXITS, read_subset

        subset = read_subset(args.subset_from or SHIPPED_EXITS)
    hidden = trained[f"exit_{layers[0]}.w1.weight"].shape[0] if args.adapter_kind == "mlp" else 0
    exits = Exits(lm.model.args.dim, layers, subset, adapter=args.adapter_kind, adapter_hidden=hidden)
    if trained is not None:
        from .exit_stream import saved_at

        for k, n in enumerate(exits.layers):
            try:
                exits.adapters[k].load_state_dict(saved_at(trained, n))
            except RuntimeError as exc:
                raise SystemExit(f"{args.adapters}: the {args.adapter_kind} adapter at layer {n} does not fit: {exc}")
    exits.final = lm.model.args.n_layers if final else 0
    report: dict = {"model": lm.name, "model_id": model_identity(lm.home),
                    "positions_train": 0 if train is None else len(train["top"]),
                    "positions_val": len(val["top"]), "subset": len(exits.subset),
                    "adapters_from": str(args.adapters) if args.adapters else None,
                    "subset_coverage_val": round(float(torch.isin(val["top"], exits.subset).float().mean()), 4)
                    if args.subset else 1.0}
    if train is not None:
        report.update(train_exits(lm, exits, train, args.epochs, lr=args.lr, seed=args.seed,
                                  fit_adapters=args.adapters is None))
        del train
    exits.to(dtype=lm.model.dtype).eval()
    bounds = [float(b) for b in args.bounds.split(",")]
    report["calibration"] = calibrate(lm, exits, val, bounds, min_rate=args.min_rate, policy=args.policy,
                                      cost=args.cost)
    report["joint"] = report["calibration"].pop("joint", None)
    report.update(bounds=bounds, min_rate=args.min_rate, policy=args.policy, cost=dataclasses.asdict(args.cost),
                  seconds=round(time.perf_counter() - t0, 1),
                  command="python -m codecomplete.model.exit_train " + " ".join(argv or sys.argv[1:]))
    exits.meta = report
    exits.save(args.out)
    print(json.dumps(report, indent=1))
    return 0


def recalibrate(lm, args, argv) -> int:
    """``--recalibrate``: the exits of a folder with new thresholds from this model and dtype."""
    from .early_exit import load_exits

    exits = load_exits(args.recalibrate, lm.model)
    t0 = time.perf_counter()
    val = collect(lm, args.val_batches, exits.layers, "validation", args.seed + 1, final=bool(exits.final))
    exits.to(dtype=lm.model.dtype).eval()
    bounds = [float(b) for b in args.bounds.split(",")]
    old = dict(exits.meta)
    report = {k: v for k, v in old.items() if k not in ("calibration", "bounds", "min_rate", "seconds", "command")}
    calibration = calibrate(lm, exits, val, bounds, min_rate=args.min_rate, policy=args.policy, cost=args.cost)
    report.update(positions_val=len(val["top"]), recalibrated_from=str(args.recalibrate),
                  trained_by=old.get("trained_by") or old.get("command"),
                  calibration=calibration, joint=calibration.pop("joint", None), bounds=bounds,
                  min_rate=args.min_rate, policy=args.policy, cost=dataclasses.asdict(args.cost),
                  dtype=str(lm.model.dtype).removeprefix("torch."),
                  seconds=round(time.perf_counter() - t0, 1),
                  command="python -m codecomplete.model.exit_train " + " ".join(argv or sys.argv[1:]))
    exits.meta = report
    exits.save(args.out)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
