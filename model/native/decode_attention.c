/* Attention of a few new tokens per sequence over many sequences' KV caches in one call
 * (CPU): decode steps (one token) and speculation's verification passes (a draft tree
 * under a mask).
 *
 * S new tokens per sequence: write their K and V into the sequence's cache, then attend
 * over the cache and the new tokens (causally, or as a boolean mask says).  The query heads that share a KV head
 * (grouped-query attention) are computed together, so each cached key and value row is
 * read once per layer, and a long cache is split into chunks ("split-K", as in flash
 * decoding) that the threads share, merged by their running max and sum.  Keys and values
 * are fp32 or bf16; arithmetic is fp32.
 *
 * Built by model/native.py with the system C compiler (-O3 -march=native -fopenmp) and
 * loaded with ctypes; the OpenMP runtime is the one PyTorch already loaded (same soname),
 * so both share one thread pool.  Without a compiler the model uses its PyTorch path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "common.h"

/* Rows [t0, t1) of a [T, E] fp32 or bf16 matrix as fp32: a pointer into it, or into `buf`
 * after converting. */
static inline const float *rows_f32(const void *base, int elsize, int E, int64_t t0, int64_t n, float *buf) {
    if (elsize == 4) return (const float *)base + t0 * E;
    const uint16_t *src = (const uint16_t *)base + t0 * E;
#pragma omp simd
    for (int64_t i = 0; i < n * E; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

/* Mask and softmax one query row's scores s[0, n) over cache positions [t0, t0 + n): row i
 * of the S new positions sees position t when mask[i * T + t] (mask: [S, T], T = len + S)
 * or, without a mask, when t <= len + i.  Leaves unnormalised probabilities in s (zeros
 * where hidden), their max in *m (-inf: nothing visible) and their sum in *l. */
static inline void mask_softmax(float *s, int64_t n, int64_t i, const uint8_t *mask, int64_t T, int64_t len,
                                int64_t t0, float *m, float *l) {
    if (mask) {
        const uint8_t *mi = mask + i * T + t0;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) s[t] = mi[t] ? s[t] : -INFINITY;
    } else {
        for (int64_t t = len + i + 1 - t0 > 0 ? len + i + 1 - t0 : 0; t < n; t++) s[t] = -INFINITY;
    }
    float mr = -INFINITY;
#pragma omp simd reduction(max : mr)
    for (int64_t t = 0; t < n; t++) mr = s[t] > mr ? s[t] : mr;
    float sum = 0.0f;
    if (mr == -INFINITY) {
        for (int64_t t = 0; t < n; t++) s[t] = 0.0f;
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) {
            float p = s[t] == -INFINITY ? 0.0f : exp_neg(s[t] - mr);
            s[t] = p;
            sum += p;
        }
    }
    *m = mr;
    *l = sum;
}

/* One work item: the R = G * S query rows that share one KV head (row r is query head
 * r / S at new position r % S), over cache positions [t0, t1) of it.  Position t is
 * visible to new position i when mask[i * T + t] (mask: [S, T], T = len + S) or, without
 * a mask, when t <= len + i (causal).  Writes the unnormalised output acc [R, E], the
 * max m [R] (-inf: nothing visible) and the sum l [R].  `scores` holds R * chunk floats,
 * `buf` chunk * E.  Instantiated for the common head sizes so the compiler unrolls the E
 * loops and keeps a query row in registers. */
#define ATTEND_CHUNK(NAME, EDIM)                                                                         \
    static void NAME(const float *q, const void *keys, const void *vals, int elsize, int R, int S,        \
                     int E_, int64_t len, const uint8_t *mask, int64_t t0, int64_t t1, float scale,        \
                     float *acc, float *m, float *l, float *scores, float *buf) {                          \
        const int E = EDIM > 0 ? EDIM : E_;                                                                \
        const int64_t n = t1 - t0, T = len + S;                                                            \
        const float *k = rows_f32(keys, elsize, E, t0, n, buf);                                            \
        for (int r = 0; r < R; r++) {                                                                      \
            const float *qr = q + (size_t)r * E;                                                           \
            float *s = scores + (size_t)r * n;                                                             \
            for (int64_t t = 0; t < n; t++) {                                                              \
                const float *kt = k + t * E;                                                               \
                float d = 0.0f;                                                                            \
                _Pragma("omp simd reduction(+ : d)") for (int e = 0; e < E; e++) d += qr[e] * kt[e];       \
                s[t] = d * scale;                                                                          \
            }                                                                                              \
            mask_softmax(s, n, r % S, mask, T, len, t0, m + r, l + r);                                    \
        }                                                                                                  \
        const float *v = rows_f32(vals, elsize, E, t0, n, buf);                                            \
        for (int r = 0; r < R; r++) {                                                                      \
            float a[EDIM > 0 ? EDIM : 1];                                                                  \
            float *ar = EDIM > 0 ? a : acc + (size_t)r * E;                                                \
            for (int e = 0; e < E; e++) ar[e] = 0.0f;                                                      \
            const float *pr = scores + (size_t)r * n;                                                      \
            if (m[r] != -INFINITY) {                                                                       \
                for (int64_t t = 0; t < n; t++) {                                                          \
                    const float p = pr[t], *vt = v + t * E;                                                \
                    for (int e = 0; e < E; e++) ar[e] += p * vt[e];                                        \
                }                                                                                          \
            }                                                                                              \
            if (EDIM > 0) memcpy(acc + (size_t)r * E, ar, sizeof(float) * E);                              \
        }                                                                                                  \
    }

ATTEND_CHUNK(attend_chunk_64, 64)
ATTEND_CHUNK(attend_chunk_128, 128)
ATTEND_CHUNK(attend_chunk_any, 0)

/* Scratch of one ATTEND_CHUNK_AVX512 call, in floats, after the scores: a block of 16 keys as fp32,
 * the block transposed in bf16 pairs and the query rows as bf16 pairs. */
#define KBLK_FLOATS(E) (16 * (E))
#define KT_FLOATS(E) (16 * (E))
#define QB_FLOATS(R, E) ((size_t)(R) * (E) / 2)

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 keys or values of row `idx` on as fp32 (bf16: a shift, in registers) */
static inline __m512 ld16(const void *base, int elsize, int64_t idx) {
    if (elsize == 4) return _mm512_loadu_ps((const float *)base + idx);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The sums of 16 vectors as one: element 4 * l + g of the result is the sum of a[4 * g + l]
 * (a transposition tree of 15 shuffles and adds instead of 16 separate horizontal sums,
 * which bounded the scalar-reduction loop at ~24 GB/s). */
static inline __m512 sum16(const __m512 *a) {
    __m512 t[8], u[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++)
        u[g] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * g], t[2 * g + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * g], t[2 * g + 1], 0xDD));
    __m512 v0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    __m512 v1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
    /* lane l of v0: [a0+a2, b0+b2, a1+a3, b1+b3] for a = u0, b = u1 (keys 4*0+l, 4*1+l), v1 likewise */
    return _mm512_add_ps(_mm512_shuffle_ps(v0, v1, 0x44), _mm512_shuffle_ps(v0, v1, 0xEE));
}

#ifdef __AVX512BF16__
/* 16 x 16 transpose of 32-bit elements: lane j of r[i] -> lane i of r[j] */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

/* 16 keys of E bf16 (rows of E/2 pairs, E a multiple of 32) transposed in pairs: kt [E/2][16] */
static inline void keys_in_pairs(const uint32_t *kb, int E, uint32_t *kt) {
    for (int c = 0; c < E / 2; c += 16) {
        __m512i r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(kb + (size_t)i * (E / 2) + c);
        transpose16(r);
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) _mm512_storeu_si512(kt + 16 * (c + j), r[j]);
    }
}

/* Scores of query rows r0 .. r0 + RB (bf16 pairs qb [R][E/2]) against KB blocks of 16 keys
 * transposed in pairs (kt [KB][E/2][16]: key j's dims 2p, 2p + 1 in lane j of row p): one
 * dpbf16 per pair of dims for 16 keys at once, no reduction; each broadcast query pair serves
 * KB blocks.  RB and KB are constants at each call site. */
static inline __attribute__((always_inline)) void scores_pairs(int RB, int KB, int E, const uint32_t *qb,
                                                               const uint32_t *kt, int r0, __m512 sc, float *scores,
                                                               int64_t n, int64_t t) {
    __m512 a[2][8];
#pragma GCC unroll 2
    for (int b = 0; b < 2; b++)
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) a[b][j] = _mm512_setzero_ps();
    for (int p = 0; p < E / 2; p++) {
        __m512bh kv[2];
#pragma GCC unroll 2
        for (int b = 0; b < 2; b++)
            if (b < KB) kv[b] = (__m512bh)_mm512_loadu_si512(kt + (size_t)b * 8 * E + 16 * p);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            if (j < RB) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qb[(size_t)(r0 + j) * (E / 2) + p]);
#pragma GCC unroll 2
                for (int b = 0; b < 2; b++)
                    if (b < KB) a[b][j] = _mm512_dpbf16_ps(a[b][j], kv[b], qv);
            }
    }
#pragma GCC unroll 2
    for (int b = 0; b < 2; b++)
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            if (j < RB && b < KB) _mm512_storeu_ps(scores + (size_t)(r0 + j) * n + t + 16 * b, _mm512_mul_ps(a[b][j], sc));
}

/* scores_pairs over every query row: blocks of eight, then the rest */
static inline __attribute__((always_inline)) void scores_rows(int KB, int R, int E, const uint32_t *qb,
                                                              const uint32_t *kt, __m512 sc, float *scores, int64_t n,
                                                              int64_t t) {
    int r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) scores_pairs(8, KB, E, qb, kt, r0, sc, scores, n, t);
    switch (R - r0) {
    case 7: scores_pairs(7, KB, E, qb, kt, r0, sc, scores, n, t); break;
    case 6: scores_pairs(6, KB, E, qb, kt, r0, sc, scores, n, t); break;
    case 5: scores_pairs(5, KB, E, qb, kt, r0, sc, scores, n, t); break;
    case 4: scores_pairs(4, KB, E, qb, kt, r0, sc, scores, n, t); break;
    case 3: scores_pairs(3, KB, E, qb, kt, r0, sc, scores, n, t); break;
    case 2: scores_pairs(2, KB, E, qb, kt, r0, sc, scores, n, t); break;
    case 1: scores_pairs(1, KB, E, qb, kt, r0, sc, scores, n, t); break;
    default: break;
    }
}
#endif

/* The values' part of a chunk for query rows r0 .. r0 + RB (RB a constant at each call site):
 * acc[r] = sum over the chunk's n positions of p[r, u] * v[u], each value row converted from
 * bf16 once for the RB rows. */
static inline __attribute__((always_inline)) void pv_rows(int RB, int NE, const void *vals, int elsize, int64_t t0,
                                                          int64_t n, const float *scores, int r0, float *acc) {
    const int E = 16 * NE;
    __m512 o[6][8];
#pragma GCC unroll 6
    for (int j = 0; j < 6; j++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (j < RB && c < NE) o[j][c] = _mm512_setzero_ps();
    for (int64_t u = 0; u < n; u++) {
        __m512 vv[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (c < NE) vv[c] = ld16(vals, elsize, (t0 + u) * E + 16 * c);
#pragma GCC unroll 6
        for (int j = 0; j < 6; j++)
            if (j < RB) {
                const __m512 p = _mm512_set1_ps(scores[(size_t)(r0 + j) * n + u]);
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    if (c < NE) o[j][c] = _mm512_fmadd_ps(p, vv[c], o[j][c]);
            }
    }
#pragma GCC unroll 6
    for (int j = 0; j < 6; j++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (j < RB && c < NE) _mm512_storeu_ps(acc + (size_t)(r0 + j) * E + 16 * c, o[j][c]);
}

#ifdef __AVX512BF16__
/* A chunk's values in pairs of positions: vp [(n + 1) / 2][NE][16] u32, lane d of vector c of
 * pair i = (v[2i][16c + d], v[2i + 1][16c + d]) as bf16 (an odd last position pairs with zero). */
static inline void values_in_pairs(const uint16_t *v, int64_t n, int NE, uint32_t *vp) {
    const int E = 16 * NE;
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t i = 0; i < (n + 1) / 2; i++)
        for (int c = 0; c < NE; c++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(v + 2 * i * E + 16 * c));
            const __m256i b = 2 * i + 1 < n ? _mm256_loadu_si256((const __m256i *)(v + (2 * i + 1) * E + 16 * c))
                                            : _mm256_setzero_si256();
            const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
            _mm512_storeu_si512(vp + (i * NE + c) * 16, _mm512_permutexvar_epi16(idx, z));
        }
}

/* A row's n probabilities (fp32) rounded to bf16 in place, so that u32 i holds the pair of
 * positions 2i, 2i + 1 (zero after an odd last one); rounding to nearest even, as PyTorch's
 * bf16 attention rounds its probabilities before the values' product. */
static inline void probs_in_pairs(float *s, int64_t n) {
    uint16_t *d = (uint16_t *)s;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) /* reads floats i .. i + 32, writes the bytes of floats i / 2 .. i / 2 + 16 */
        _mm512_storeu_si512(d + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + i + 16), _mm512_loadu_ps(s + i)));
    for (; i < n; i++) d[i] = f32_to_bf16(s[i]);
    if (n & 1) d[n] = 0;
}

/* The values' part of a chunk from the pairs above (vp), or made from the values v on the fly
 * (v not NULL: a single block of rows, where building vp would not pay), for query rows r0 ..
 * r0 + RB: one dpbf16 per pair of positions and 16 dims (RB a constant at each call site). */
static inline __attribute__((always_inline)) void pv_pairs(int RB, int NE, const uint32_t *vp, const uint16_t *v,
                                                           const float *scores, int64_t n, int r0, float *acc) {
    const int E = 16 * NE;
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 o[6][8];
#pragma GCC unroll 6
    for (int j = 0; j < 6; j++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (j < RB && c < NE) o[j][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < (n + 1) / 2; i++) {
        __m512bh vv[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (c < NE) {
                if (v) { /* one block of rows: the pairs in registers, as values_in_pairs makes them */
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(v + 2 * i * E + 16 * c));
                    const __m256i b = 2 * i + 1 < n ? _mm256_loadu_si256((const __m256i *)(v + (2 * i + 1) * E + 16 * c))
                                                    : _mm256_setzero_si256();
                    vv[c] = (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
                } else {
                    vv[c] = (__m512bh)_mm512_loadu_si512(vp + (i * NE + c) * 16);
                }
            }
#pragma GCC unroll 6
        for (int j = 0; j < 6; j++)
            if (j < RB) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(scores + (size_t)(r0 + j) * n))[i]);
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    if (c < NE) o[j][c] = _mm512_dpbf16_ps(o[j][c], vv[c], p);
            }
    }
#pragma GCC unroll 6
    for (int j = 0; j < 6; j++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (j < RB && c < NE) _mm512_storeu_ps(acc + (size_t)(r0 + j) * E + 16 * c, o[j][c]);
}
#endif

/* ATTEND_CHUNK for head sizes E = 16 * NE with AVX-512: scores for 16 keys at a time (each
 * key block is read once for all R query rows while it is in L1), keys and values converted
 * from bf16 in registers.  Over bf16 keys, when the queries are bf16 numbers (a bf16 model's
 * always are), the key block is transposed in pairs once (16 x 16 register transposes) and each
 * row's 16 scores are 32 dpbf16 (products exact in fp32, as before; only the order of the fp32
 * sums differs).  Measured over 1k keys, a layer: 1 new token 25 -> 21 us, 8 tokens 117 -> 68 us,
 * 16 tokens 187 -> 124 us.  bf16 values likewise: the probabilities are rounded to bf16 (as
 * PyTorch's bf16 attention rounds them before its values' product) and each pair of positions
 * is one dpbf16 per 16 dims (9 tokens over 1.9k keys 117 -> 106 us, 16 over 1k 111 -> 94 us).
 * Each query row is computed the same way whatever the other rows are.  Same contract as
 * ATTEND_CHUNK; `buf` holds the scratch above. */
#define ATTEND_CHUNK_AVX512(NAME, NE)                                                                    \
    static void NAME(const float *q, const void *keys, const void *vals, int elsize, int R, int S,        \
                     int E_, int64_t len, const uint8_t *mask, int64_t t0, int64_t t1, float scale,        \
                     float *acc, float *m, float *l, float *scores, float *buf) {                          \
        (void)E_;                                                                                          \
        const int E = 16 * NE;                                                                             \
        const int64_t n = t1 - t0, T = len + S;                                                            \
        const __m512 sc = _mm512_set1_ps(scale);                                                           \
        float *kblk = buf;                                                                                 \
        uint32_t *kt = (uint32_t *)(buf + KBLK_FLOATS(E)), *qb = kt + KT_FLOATS(E);                        \
        int64_t t = 0;                                                                                     \
        SCORES_PAIRS                                                                                       \
        for (; t + 16 <= n; t += 16) {                                                                     \
            const float *kb = (const float *)keys + (t0 + t) * E; /* the block's 16 keys in fp32 */        \
            if (elsize != 4) {                                                                             \
                for (int c = 0; c < E; c += 16) /* converted once, read R times from L1 */                 \
                    _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++)                                  \
                        _mm512_storeu_ps(kblk + i * E + c, ld16(keys, elsize, (t0 + t + i) * E + c));      \
                kb = kblk;                                                                                 \
            }                                                                                              \
            for (int r = 0; r < R; r++) {                                                                  \
                __m512 qv[NE], a[16];                                                                      \
                for (int c = 0; c < NE; c++) qv[c] = _mm512_loadu_ps(q + (size_t)r * E + 16 * c);          \
                _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) { /* unrolled: a[] in registers */  \
                    const float *kr = kb + (4 * (i & 3) + (i >> 2)) * E;                                   \
                    __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));                                  \
                    for (int c = 1; c < NE; c++) d = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), d); \
                    a[i] = d;                                                                              \
                }                                                                                          \
                _mm512_storeu_ps(scores + (size_t)r * n + t, _mm512_mul_ps(sum16(a), sc));                  \
            }                                                                                              \
        }                                                                                                  \
        for (; t < n; t++) {                                                                               \
            for (int r = 0; r < R; r++) {                                                                  \
                __m512 d = _mm512_setzero_ps();                                                            \
                for (int c = 0; c < NE; c++)                                                               \
                    d = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)r * E + 16 * c),                       \
                                        ld16(keys, elsize, (t0 + t) * E + 16 * c), d);                     \
                scores[(size_t)r * n + t] = _mm512_reduce_add_ps(d) * scale;                               \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < R; r++) mask_softmax(scores + (size_t)r * n, n, r % S, mask, T, len, t0, m + r, l + r); \
        /* values (rows with nothing visible have all-zero probabilities and get zeros) */         \
        PV_PAIRS                                                                                           \
        /* fp32 values: each row converted once for a block of query rows; converting the chunk   \
         * once into a buffer instead measured slower (the buffer is read back from L2) */         \
        if (NE <= 4) { /* six rows at a time: 24 accumulators */                                          \
            int r0 = 0;                                                                                    \
            for (; r0 + 6 <= R; r0 += 6) pv_rows(6, NE, vals, elsize, t0, n, scores, r0, acc);             \
            switch (R - r0) {                                                                              \
            case 5: pv_rows(5, NE, vals, elsize, t0, n, scores, r0, acc); break;                           \
            case 4: pv_rows(4, NE, vals, elsize, t0, n, scores, r0, acc); break;                           \
            case 3: pv_rows(3, NE, vals, elsize, t0, n, scores, r0, acc); break;                           \
            case 2: pv_rows(2, NE, vals, elsize, t0, n, scores, r0, acc); break;                           \
            case 1: pv_rows(1, NE, vals, elsize, t0, n, scores, r0, acc); break;                           \
            default: break;                                                                                \
            }                                                                                              \
        } else { /* two rows at a time: 2 * NE accumulators */                                            \
            int r0 = 0;                                                                                    \
            for (; r0 + 2 <= R; r0 += 2) pv_rows(2, NE, vals, elsize, t0, n, scores, r0, acc);             \
            if (r0 < R) pv_rows(1, NE, vals, elsize, t0, n, scores, r0, acc);                              \
        }                                                                                                  \
    }

/* Software prefetch for 32 bf16 positions of E dims starting at t: the keys two blocks ahead
 * (into L1) and the values of these positions (into L2, for the values' phase after the
 * softmax).  Without it a step's attention read its caches from memory at ~20 GB/s (the same
 * layer, cache-hot, took a third of the time): with it, and each thread's work items
 * contiguous (schedule static: a head's chunks follow each other in memory, so the prefetch
 * runs on into the thread's next item), 30 layers of one token over 2k bf16 positions took
 * 2.38 -> 1.45 ms, 5 tokens 3.61 -> 3.05 ms (interleaved A/B, ~0.4 ms of it Python). */
static inline void prefetch_kv(const void *keys, const void *vals, int64_t t, int E) {
    const char *k = (const char *)keys + (t + 64) * E * 2, *v = (const char *)vals + t * E * 2;
    for (int i = 0; i < 32 * E * 2; i += 64) {
        _mm_prefetch(k + i, _MM_HINT_T0);
        _mm_prefetch(v + i, _MM_HINT_T1);
    }
}

#ifdef __AVX512BF16__
/* the bf16-pair score path of ATTEND_CHUNK_AVX512: bf16 keys, every query
 * value a bf16 number (low 16 bits zero) */
#define SCORES_PAIRS                                                                                     \
    int pairs = elsize == 2;             \
    if (pairs) { /* every query value a bf16 number: the low halves of all R * E floats are zero */      \
        __m512i low = _mm512_setzero_si512();                                                            \
        for (size_t i = 0; i < (size_t)R * E; i += 16)                                                   \
            low = _mm512_or_si512(low, _mm512_loadu_si512(q + i));                                      \
        pairs = !_mm512_test_epi32_mask(low, _mm512_set1_epi32(0xffff));                                 \
    }                                                                                                    \
    if (pairs) {                                                                                         \
        for (int64_t i = 0; i < 64 * E * 2 && i < n * E * 2; i += 64) /* the first two blocks' keys */      \
            _mm_prefetch((const char *)keys + t0 * E * 2 + i, _MM_HINT_T0);                               \
        for (size_t i = 0; i < QB_FLOATS(R, E); i++) {                                                  \
            uint32_t lo, hi;                                                                             \
            memcpy(&lo, q + 2 * i, 4);                                                                   \
            memcpy(&hi, q + 2 * i + 1, 4);                                                               \
            qb[i] = (lo >> 16) | (hi & 0xffff0000u);                                                     \
        }                                                                                                \
        for (; t + 32 <= n; t += 32) { /* two blocks of 16 keys share each broadcast query pair */   \
            prefetch_kv(keys, vals, t0 + t, E);                                                      \
            keys_in_pairs((const uint32_t *)keys + (t0 + t) * (E / 2), E, kt);                       \
            keys_in_pairs((const uint32_t *)keys + (t0 + t + 16) * (E / 2), E, kt + 8 * E);          \
            scores_rows(2, R, E, qb, kt, sc, scores, n, t);                                          \
        }                                                                                            \
        for (; t + 16 <= n; t += 16) {                                                               \
            keys_in_pairs((const uint32_t *)keys + (t0 + t) * (E / 2), E, kt);                       \
            scores_rows(1, R, E, qb, kt, sc, scores, n, t);                                          \
        }                                                                                            \
    }
/* bf16 values: the chunk's values in pairs of positions (once, in L1) and the probabilities in
 * bf16 pairs, so that each pair of positions is one dpbf16 per 16 dims instead of two fp32 FMAs */
#define PV_PAIRS                                                                                         \
    if (elsize == 2) {                                                                                   \
        const uint16_t *v0 = (const uint16_t *)vals + t0 * E;                                            \
        for (int r = 0; r < R; r++) probs_in_pairs(scores + (size_t)r * n, n);                           \
        const int rb = E <= 64 ? 6 : 2; /* rows a block: 6 x 4 or 2 x 8 accumulators */                \
        uint32_t *vp = (uint32_t *)(qb + QB_FLOATS(R, E));                                               \
        if (R > rb) values_in_pairs(v0, n, E / 16, vp);                                                  \
        const uint16_t *direct = R > rb ? NULL : v0;                                                     \
        int r0 = 0;                                                                                      \
        for (; r0 + rb <= R; r0 += rb) {                                                                 \
            if (E <= 64) pv_pairs(6, E / 16, vp, direct, scores, n, r0, acc);                            \
            else pv_pairs(2, E / 16, vp, direct, scores, n, r0, acc);                                    \
        }                                                                                                \
        switch (R - r0) {                                                                                \
        case 5: pv_pairs(5, E / 16, vp, direct, scores, n, r0, acc); break;                              \
        case 4: pv_pairs(4, E / 16, vp, direct, scores, n, r0, acc); break;                              \
        case 3: pv_pairs(3, E / 16, vp, direct, scores, n, r0, acc); break;                              \
        case 2: pv_pairs(2, E / 16, vp, direct, scores, n, r0, acc); break;                              \
        case 1: pv_pairs(1, E / 16, vp, direct, scores, n, r0, acc); break;                              \
        default: break;                                                                                  \
        }                                                                                                \
    } else
#else
#define SCORES_PAIRS
#define PV_PAIRS
#endif

ATTEND_CHUNK_AVX512(attend_chunk_avx512_64, 4)
ATTEND_CHUNK_AVX512(attend_chunk_avx512_128, 8)
#endif

typedef void (*chunk_fn)(const float *, const void *, const void *, int, int, int, int, int64_t, const uint8_t *,
                         int64_t, int64_t, float, float *, float *, float *, float *, float *);

#include "attention.h"

static chunk_fn chunk_for(int E) {
#ifdef __AVX512F__
    return E == 64 ? attend_chunk_avx512_64 : E == 128 ? attend_chunk_avx512_128 : attend_chunk_any;
#else
    return E == 64 ? attend_chunk_64 : E == 128 ? attend_chunk_128 : attend_chunk_any;
#endif
}

/* Work items of a step: per sequence b, KV head and chunk of `chunk` cache positions; first[b]
 * is sequence b's first item (first: B + 1 entries).  Returns the number of items. */
int64_t attn_items(AttnStep *a, int64_t *first) {
    first[0] = 0;
    for (int b = 0; b < a->B; b++) {
        int64_t T = a->len[b] + a->S, nc = (T + a->chunk - 1) / a->chunk;
        first[b + 1] = first[b] + nc * a->K;
    }
    a->first = first;
    a->W = first[a->B];
    return a->W;
}

/* Scratch floats one thread needs for attn_team's items */
size_t attn_scratch(const AttnStep *a) {
    const size_t R = (size_t)a->G * a->S;
    return (R + a->E) * a->chunk + KBLK_FLOATS(a->E) + KT_FLOATS(a->E) + QB_FLOATS(R, a->E);
}

/* Every work item's partial output into acc/ms/ls (threads share the items), then, after a
 * barrier, the chunks of each query row merged by their max and sum into out [B, K*G, S, E]
 * fp32.  Called by every thread of a parallel region, each with its own scratch
 * (attn_scratch floats); the keys and values of the new tokens must be in the caches. */
void attn_team(const AttnStep *a, float *scratch, float *out) {
    const int R = a->G * a->S, E = a->E, K = a->K;
    const chunk_fn fn = chunk_for(E);
#pragma omp for schedule(static) /* contiguous items: a thread's chunks of a head follow each other in memory */
    for (int64_t w = 0; w < a->W; w++) {
        int b = 0;
        while (a->first[b + 1] <= w) b++;
        int64_t i = w - a->first[b], nc = (a->first[b + 1] - a->first[b]) / K;
        int h = (int)(i / nc);
        int64_t c = i % nc, T = a->len[b] + a->S, t0 = c * a->chunk, t1 = t0 + a->chunk < T ? t0 + a->chunk : T;
        size_t head = ((size_t)a->layer * K + h) * a->cap[b] * E * a->elsize;
        fn(a->q + ((size_t)b * K + h) * R * E, (const char *)a->kbase[b] + head, (const char *)a->vbase[b] + head,
           a->elsize, R, a->S, E, a->len[b], a->masks ? a->masks[b] : NULL, t0, t1, a->scale, a->acc + w * R * E,
           a->ms + w * R, a->ls + w * R, scratch, scratch + (size_t)R * a->chunk);
    }
#pragma omp for schedule(static)
    for (int64_t row = 0; row < (int64_t)a->B * K * R; row++) {
        const int r = (int)(row % R), h = (int)(row / R % K), b = (int)(row / R / K);
        int64_t nc = (a->first[b + 1] - a->first[b]) / K, w0 = a->first[b] + (int64_t)h * nc;
        float M = -INFINITY, L = 0.0f;
        for (int64_t c = 0; c < nc; c++) M = fmaxf(M, a->ms[(w0 + c) * R + r]);
        float *o = out + (size_t)row * E;
        for (int e = 0; e < E; e++) o[e] = 0.0f;
        if (M == -INFINITY) continue; /* nothing visible (an all-false mask row): zeros */
        for (int64_t c = 0; c < nc; c++) {
            float mc = a->ms[(w0 + c) * R + r];
            if (mc == -INFINITY) continue;
            float f = expf(mc - M);
            L += f * a->ls[(w0 + c) * R + r];
            const float *p = a->acc + ((w0 + c) * R + r) * E;
            for (int e = 0; e < E; e++) o[e] += f * p[e];
        }
        for (int e = 0; e < E; e++) o[e] /= L;
    }
}

/* B sequences, K KV heads, G query heads per KV head, head size E, S new tokens each, at
 * layer `layer`.
 *   q:      [B, K*G, S, E] fp32, the new tokens' queries (rotary applied)
 *   newk/v: [B, K, S, E] in the cache dtype (elsize bytes), the new tokens' keys and values
 *   kbase/vbase[b]: sequence b's caches [L, K, cap[b], E]; len[b] tokens are cached before
 *           the new ones, which are written at positions len[b] ..
 *   masks[b]: NULL (causal) or a boolean [S, len[b] + S], true = attend
 *   out:    [B, K*G, S, E] fp32
 * Returns 0, or -1 when scratch memory could not be had (nothing written to out). */
int decode_attention(int B, int K, int G, int E, int S, int layer, int elsize, const float *q, const void *newk,
                     const void *newv, void *const *kbase, void *const *vbase, const int64_t *cap,
                     const int64_t *len, const uint8_t *const *masks, float scale, int chunk, float *out) {
    AttnStep a = {B, K, G, E, S, layer, elsize, chunk, scale, q, kbase, vbase, cap, len, masks};
    int64_t *first = malloc(sizeof(int64_t) * (B + 1));
    if (!first) return -1;
    const int64_t W = attn_items(&a, first);
    const int R = G * S, threads = omp_get_max_threads();
    const size_t per = attn_scratch(&a);
    float *acc = malloc(sizeof(float) * ((size_t)W * R * (E + 2) + per * threads));
    if (!acc) {
        free(first);
        return -1;
    }
    a.acc = acc;
    a.ms = acc + W * R * E;
    a.ls = a.ms + W * R;
    float *scratch = a.ls + W * R;
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < K; h++) {
            size_t off = (((size_t)layer * K + h) * cap[b] + len[b]) * E * elsize;
            size_t src = ((size_t)b * K + h) * S * E * elsize;
            memcpy((char *)kbase[b] + off, (const char *)newk + src, (size_t)S * E * elsize);
            memcpy((char *)vbase[b] + off, (const char *)newv + src, (size_t)S * E * elsize);
        }
    }
#pragma omp parallel num_threads(threads)
    attn_team(&a, scratch + per * omp_get_thread_num(), out);
    free(acc);
    free(first);
    return 0;
}
