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

/* ATTEND_CHUNK for head sizes E = 16 * NE with AVX-512: scores for 16 keys at a time (each
 * key block is read once for all R query rows while it is in L1), keys and values converted
 * from bf16 in registers.  Same contract as ATTEND_CHUNK. */
#define ATTEND_CHUNK_AVX512(NAME, NE)                                                                    \
    static void NAME(const float *q, const void *keys, const void *vals, int elsize, int R, int S,        \
                     int E_, int64_t len, const uint8_t *mask, int64_t t0, int64_t t1, float scale,        \
                     float *acc, float *m, float *l, float *scores, float *buf) {                          \
        (void)E_;                                                                                          \
        const int E = 16 * NE;                                                                             \
        const int64_t n = t1 - t0, T = len + S;                                                            \
        const __m512 sc = _mm512_set1_ps(scale);                                                           \
        int64_t t = 0;                                                                                     \
        for (; t + 16 <= n; t += 16) {                                                                     \
            const float *kb = (const float *)keys + (t0 + t) * E; /* the block's 16 keys in fp32 */        \
            if (elsize != 4) {                                                                             \
                for (int c = 0; c < E; c += 16) /* converted once, read R times from L1 */                 \
                    _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++)                                  \
                        _mm512_storeu_ps(buf + i * E + c, ld16(keys, elsize, (t0 + t + i) * E + c));       \
                kb = buf;                                                                                  \
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
        /* values: each row converted once for a block of RB query rows (rows with nothing visible \
         * have all-zero probabilities and get zeros) */                                               \
        enum { RB = NE <= 4 ? 4 : 2 };                                                                     \
        for (int r0 = 0; r0 < R; r0 += RB) {                                                               \
            const int rb = R - r0 < RB ? R - r0 : RB;                                                      \
            __m512 o[RB][NE];                                                                              \
            _Pragma("GCC unroll 8") for (int j = 0; j < RB; j++)                                           \
                _Pragma("GCC unroll 8") for (int c = 0; c < NE; c++) o[j][c] = _mm512_setzero_ps();        \
            for (int64_t u = 0; u < n; u++) {                                                              \
                __m512 vv[NE];                                                                             \
                _Pragma("GCC unroll 8") for (int c = 0; c < NE; c++)                                       \
                    vv[c] = ld16(vals, elsize, (t0 + u) * E + 16 * c);                                     \
                _Pragma("GCC unroll 8") for (int j = 0; j < RB; j++) {                                     \
                    if (j >= rb) break;                                                                    \
                    const __m512 p = _mm512_set1_ps(scores[(size_t)(r0 + j) * n + u]);                     \
                    _Pragma("GCC unroll 8") for (int c = 0; c < NE; c++) o[j][c] = _mm512_fmadd_ps(p, vv[c], o[j][c]); \
                }                                                                                          \
            }                                                                                              \
            for (int j = 0; j < rb; j++)                                                                   \
                for (int c = 0; c < NE; c++) _mm512_storeu_ps(acc + (size_t)(r0 + j) * E + 16 * c, o[j][c]); \
        }                                                                                                  \
    }

ATTEND_CHUNK_AVX512(attend_chunk_avx512_64, 4)
ATTEND_CHUNK_AVX512(attend_chunk_avx512_128, 8)
#endif

typedef void (*chunk_fn)(const float *, const void *, const void *, int, int, int, int, int64_t, const uint8_t *,
                         int64_t, int64_t, float, float *, float *, float *, float *, float *);

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
    const int R = G * S;
    int64_t *first = malloc(sizeof(int64_t) * (B + 1)); /* first work item of sequence b */
    if (!first) return -1;
    first[0] = 0;
    for (int b = 0; b < B; b++) {
        int64_t T = len[b] + S, nc = (T + chunk - 1) / chunk;
        first[b + 1] = first[b] + nc * K;
    }
    int64_t W = first[B];
    float *acc = malloc(sizeof(float) * W * R * (E + 2));
    if (!acc) {
        free(first);
        return -1;
    }
    float *ms = acc + W * R * E, *ls = ms + W * R;

    for (int b = 0; b < B; b++) {
        for (int h = 0; h < K; h++) {
            size_t off = (((size_t)layer * K + h) * cap[b] + len[b]) * E * elsize;
            size_t src = ((size_t)b * K + h) * S * E * elsize;
            memcpy((char *)kbase[b] + off, (const char *)newk + src, (size_t)S * E * elsize);
            memcpy((char *)vbase[b] + off, (const char *)newv + src, (size_t)S * E * elsize);
        }
    }

#ifdef __AVX512F__
    const chunk_fn fn = E == 64 ? attend_chunk_avx512_64 : E == 128 ? attend_chunk_avx512_128 : attend_chunk_any;
#else
    const chunk_fn fn = E == 64 ? attend_chunk_64 : E == 128 ? attend_chunk_128 : attend_chunk_any;
#endif
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * ((size_t)R + E) * chunk);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < W; w++) {
            if (!scores) continue;
            int b = 0;
            while (first[b + 1] <= w) b++;
            int64_t i = w - first[b], nc = (first[b + 1] - first[b]) / K;
            int h = (int)(i / nc);
            int64_t c = i % nc, T = len[b] + S, t0 = c * chunk, t1 = t0 + chunk < T ? t0 + chunk : T;
            size_t head = ((size_t)layer * K + h) * cap[b] * E * elsize;
            fn(q + ((size_t)b * K + h) * R * E, (const char *)kbase[b] + head, (const char *)vbase[b] + head, elsize, R,
               S, E, len[b], masks ? masks[b] : NULL, t0, t1, scale, acc + w * R * E, ms + w * R, ls + w * R, scores,
               scores + (size_t)R * chunk);
        }
        free(scores);
    }
    if (failed) {
        free(acc);
        free(first);
        return -1;
    }

    for (int b = 0; b < B; b++) {
        int64_t nc = (first[b + 1] - first[b]) / K;
        for (int h = 0; h < K; h++) {
            int64_t w0 = first[b] + (int64_t)h * nc;
            for (int r = 0; r < R; r++) {
                float M = -INFINITY, L = 0.0f;
                for (int64_t c = 0; c < nc; c++) M = fmaxf(M, ms[(w0 + c) * R + r]);
                float *o = out + (((size_t)b * K + h) * R + r) * E;
                for (int e = 0; e < E; e++) o[e] = 0.0f;
                if (M == -INFINITY) continue; /* nothing visible (an all-false mask row): zeros */
                for (int64_t c = 0; c < nc; c++) {
                    float mc = ms[(w0 + c) * R + r];
                    if (mc == -INFINITY) continue;
                    float f = expf(mc - M);
                    L += f * ls[(w0 + c) * R + r];
                    const float *a = acc + ((w0 + c) * R + r) * E;
                    for (int e = 0; e < E; e++) o[e] += f * a[e];
                }
                for (int e = 0; e < E; e++) o[e] /= L;
            }
        }
    }
    free(acc);
    free(first);
    return 0;
}
