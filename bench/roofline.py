"""What a verification pass's linear layers could cost on this CPU: FMA peak, bandwidth, and the
linear kernel from memory with one and two threads (issue #8).

Speculation's speed-up is ``tokens per pass / (pass cost / step cost)``.  On a CPU without bf16
matrix units a one-row step streams the weights at the memory's rate while a pass of S rows does
S times the multiply-adds, so the pass's cost is set by how close the kernel comes to the cores'
FMA peak while the weights stream in.  This benchmark measures the three numbers that bound it,
outside PyTorch and Python (a C program built from model/native/linear.c with the native
library's flags):

1. **FMA peak** per core: 12 independent chains of 8-lane fused multiply-adds, one process per
   core, all running at once (the cores' clocks under load).
2. **The linear kernel from memory**: ``linear_team`` (the kernel the native library compiles
   to on this CPU) over enough copies of a matrix (random bf16 in its layout) that every call
   reads its weights from memory, S input rows, with one thread and with two; GMAC/s, the share
   of the measured peak (of as many cores as threads), and the weights' GB/s.
3. From those, the S-row call's cost against the one-row call's (both with every thread): what
   the linear layers of a pass cost in steps.
4. For comparison, the same kernel on one thread over a matrix that stays in its L2 (the
   tile's own rate, nothing streamed from memory).

Rounds interleave every cell (this machine's speed drifts within minutes); each cell is the
median of its rounds' best-of-reps.

    python bench/roofline.py [--rows 1,4,6,8] [--rounds 5] [--out bench/results/roofline_avx2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, write_results  # noqa: E402

from codecomplete.model import native  # noqa: E402

NATIVE = Path(native.__file__).resolve().parent
SHAPES = ((3072, 576), (576, 1536))  # SmolLM2-135M's gate+up and down projections (N, K)
HOT = ((256, 576), (256, 1536))  # slices of them that stay in one core's L2 (the kernel without the memory)

PROGRAM = r"""
#include "linear.c"
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define D(i) __m256 a##i = _mm256_set1_ps(i * 0.001f);
#define F(i) a##i = _mm256_fmadd_ps(a##i, b, c);
static double peak(void) {  /* GMAC/s of this thread: 12 chains of 8-lane FMAs */
    D(0) D(1) D(2) D(3) D(4) D(5) D(6) D(7) D(8) D(9) D(10) D(11)
    const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.0001f);
    const long n = 100000000;
    double t0 = now();
    for (long k = 0; k < n; k++) { F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) }
    double s = now() - t0;
    float r[8];
    __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    t = _mm256_add_ps(t, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    _mm256_storeu_ps(r, t);
    return n * 12.0 * 8 / s / 1e9 + 0.0 * r[0];
}
int main(int argc, char **argv) {
    if (argc == 2) { printf("%.3f\n", peak()); return 0; }
    const int N = atoi(argv[1]), K = atoi(argv[2]), M = atoi(argv[3]), T = atoi(argv[4]), copies = atoi(argv[5]),
              reps = atoi(argv[6]);
    /* room for either layout: panels [N/16][K][16] or groups [N/4][K/32][4][32] */
    const size_t a = (size_t)((N + 15) / 16) * 16 * K, b = (size_t)((N + 3) / 4) * 4 * ((K + 31) / 32) * 32;
    const size_t n = a > b ? a : b;
    uint16_t **w = malloc(sizeof(void *) * copies);
    unsigned s = 1;
    for (int c = 0; c < copies; c++) {
        w[c] = aligned_alloc(64, (n * 2 + 63) / 64 * 64);
        for (size_t i = 0; i < n; i++) w[c][i] = 0x3c00 + ((s = s * 1103515245u + 12345u) >> 24);
    }
    uint16_t *x = malloc((size_t)M * K * 2), *y = malloc((size_t)M * N * 2);
    for (size_t i = 0; i < (size_t)M * K; i++) x[i] = 0x3f00 + ((s = s * 1103515245u + 12345u) >> 25);
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        for (int c = 0; c < copies; c++) {
#pragma omp parallel num_threads(T)
            linear_team(M, N, K, x, w[c], NULL, y);
        }
        double t = (now() - t0) / copies;
        if (t < best) best = t;
    }
    printf("%.3f\n", best * 1e6);
    return 0;
}
"""


def build(tmp: Path) -> Path:
    src = tmp / "roofline.c"
    src.write_text(PROGRAM)
    exe = tmp / "roofline"
    flags = [f for f in native._FLAGS if f not in ("-fPIC", "-shared")]
    subprocess.run([os.environ.get("CC", "gcc"), *flags, f"-I{NATIVE}", str(src), "-o", str(exe), "-lm"], check=True,
                   cwd=NATIVE)
    return exe


def peak(exe: Path, procs: int) -> float:
    """Each of ``procs`` processes' GMAC/s, all running at once: their mean."""
    ps = [subprocess.Popen([str(exe), "peak"], stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    return statistics.mean(float(p.communicate()[0]) for p in ps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,6,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory-mb", type=int, default=160, help="weights per cell, well past the last-level cache")
    ap.add_argument("--out", default=str(RESULTS / "roofline_avx2"))
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    threads = (1, 2) if (os.cpu_count() or 1) >= 2 else (1,)
    cells: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for r in range(args.rounds):
            for t in threads:
                cells.setdefault(f"peak/{t}", []).append(peak(exe, t))
            for n, k in SHAPES:
                copies = max(2, args.memory_mb * 2**20 // (n * k * 2))
                for t in threads:
                    for m in rows:
                        out = subprocess.run([str(exe), str(n), str(k), str(m), str(t), str(copies), str(args.reps)],
                                             capture_output=True, text=True, check=True).stdout
                        cells.setdefault(f"linear/{n}x{k}/{m}/{t}", []).append(float(out))
            for n, k in HOT:
                for m in rows:
                    out = subprocess.run([str(exe), str(n), str(k), str(m), "1", "1", "2000"],
                                         capture_output=True, text=True, check=True).stdout
                    cells.setdefault(f"l2/{n}x{k}/{m}/1", []).append(float(out))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    med = {key: statistics.median(v) for key, v in cells.items()}
    pk = {t: med[f"peak/{t}"] for t in threads}
    lines = [header("The linear kernel against this CPU's FMA peak and memory"),
             f"FMA peak: {', '.join(f'{pk[t]:.1f} GMAC/s a core with {t} running' for t in threads)} (12 chains of "
             "8-lane FMAs, one process a core). Linear: `linear_team` of model/native/linear.c as the native library "
             f"builds it here (linear_bf16_path {native.linear_bf16_path()}), random bf16 weights, "
             f"{args.memory_mb} MB of copies a cell so every call reads its weights from memory; best of "
             f"{args.reps} passes over the copies, median of {args.rounds} interleaved rounds.", "",
             "| matrix (N x K) | rows | threads | us a call | GMAC/s | share of peak | weights GB/s | "
             "cost against 1 row (same threads) |",
             "|---|---|---|---|---|---|---|---|"]
    for n, k in SHAPES:
        for t in threads:
            one = med[f"linear/{n}x{k}/1/{t}"]
            for m in rows:
                us = med[f"linear/{n}x{k}/{m}/{t}"]
                gmac = m * n * k / us / 1e3
                lines.append(f"| {n} x {k} | {m} | {t} | {us:.1f} | {gmac:.1f} | {gmac / (pk[t] * t):.0%} | "
                             f"{n * k * 2 / us / 1e3:.1f} | {us / one:.2f}x |")
    lines += ["", "The kernel alone (one thread, the matrix in its L2; best of 2,000 calls, each with its parallel "
              "region and input conversion):", "",
              "| matrix (N x K) | rows | us a call | GMAC/s | share of one core's peak |", "|---|---|---|---|---|"]
    for n, k in HOT:
        for m in rows:
            us = med[f"l2/{n}x{k}/{m}/1"]
            gmac = m * n * k / us / 1e3
            lines.append(f"| {n} x {k} | {m} | {us:.2f} | {gmac:.1f} | {gmac / pk[1]:.0%} |")
    lines.append("")
    write_results(args.out, lines, {"cells": cells, "median": med})


if __name__ == "__main__":
    main()
