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
 * after converting.  `pf` (or NULL): another bf16 matrix of the same shape whose same rows the
 * caller reads next (a chunk's values after its keys), prefetched into L2 while converting, so
 * their stream starts while the keys' products run instead of after them. */
static inline const float *rows_f32(const void *base, int elsize, int E, int64_t t0, int64_t n, float *buf,
                                    const void *pf) {
    if (elsize == 4) return (const float *)base + t0 * E;
    const uint16_t *src = (const uint16_t *)base + t0 * E;
    const char *next = pf ? (const char *)((const uint16_t *)pf + t0 * E) : NULL;
    const size_t row = (size_t)E * 2;
    for (int64_t t = 0; t < n; t++) {
        if (next)
            for (size_t b = 0; b < row; b += 64) __builtin_prefetch(next + t * row + b, 0, 2);
#pragma omp simd
        for (int e = 0; e < E; e++) buf[t * E + e] = bf16_to_f32(src[t * E + e]);
    }
    return buf;
}

/* One query row's scores s[0, n) over cache positions [t0, t0 + n) with the hidden ones set to
 * -inf: row i of the S new positions sees position t when mask[i * T + t] (mask: [S, T],
 * T = len + S) or, without a mask, when t <= len + i. */
static inline void hide(float *s, int64_t n, int64_t i, const uint8_t *mask, int64_t T, int64_t len, int64_t t0) {
    if (mask) {
        const uint8_t *mi = mask + i * T + t0;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) s[t] = mi[t] ? s[t] : -INFINITY;
    } else {
        for (int64_t t = len + i + 1 - t0 > 0 ? len + i + 1 - t0 : 0; t < n; t++) s[t] = -INFINITY;
    }
}

/* s[0, n) summed as position t adding to lane t % 16, the lanes then in a fixed tree: the same
 * bits for any n whose extra positions hold zeros.  Without reassociation, or GCC may split the
 * lanes' sums into several accumulators by the block count's parity (it did for some n). */
__attribute__((optimize("no-associative-math"))) static float lane_sum(const float *s, int64_t n) {
    float part[16] = {0.0f};
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)
        for (int j = 0; j < 16; j++) part[j] += s[t + j];
    for (int j = 0; t + j < n; j++) part[j] += s[t + j];
    for (int w = 8; w; w >>= 1)
        for (int j = 0; j < w; j++) part[j] += part[j + w];
    return part[0];
}

/* s[j] = exp(s[j] - mr) for 16 scores, 0 where hidden (-inf): one vector code path for every block.
 * Not inlined: inlined, the full blocks' copy and the padded last block's copy were compiled apart and
 * could round an exp otherwise (with -ffp-contract=fast each copy fuses its own multiply-adds), so a
 * row whose chunk was full in a pass and ended in a partial block in its step lost a last bit (a few
 * rows in a thousand, fp32 and bf16 caches alike). */
__attribute__((noinline)) static void exp_block16(float *s, float mr) {
#pragma omp simd
    for (int j = 0; j < 16; j++) s[j] = s[j] == -INFINITY ? 0.0f : exp_neg(s[j] - mr);
}

/* Mask (hide) and softmax one query row's scores s[0, n).  Leaves unnormalised probabilities
 * in s (zeros where hidden), their max in *m (-inf: nothing visible) and their sum in *l. */
static inline void mask_softmax(float *s, int64_t n, int64_t i, const uint8_t *mask, int64_t T, int64_t len,
                                int64_t t0, float *m, float *l) {
    hide(s, n, i, mask, T, len, t0);
    float mr = -INFINITY;
#pragma omp simd reduction(max : mr)
    for (int64_t t = 0; t < n; t++) mr = s[t] > mr ? s[t] : mr;
    float sum = 0.0f;
    if (mr == -INFINITY) {
        for (int64_t t = 0; t < n; t++) s[t] = 0.0f;
    } else {
        /* position t adds to lane t % 16, and the lanes are summed in a fixed tree: a row's sum
         * then has the same bits whether the chunk ends at the row's own position (a one-token
         * step) or further on, at hidden positions that add zeros (a verification pass).  A plain
         * SIMD reduction sends the last n % 8 positions through a scalar tail instead, so the two
         * rounded differently (measured: speculation in bf16 on an AVX2 CPU left greedy output).
         * The exp goes over whole blocks of 16 too (the last one through a padded copy): the
         * compiler's vector body and its scalar tail may round an exp differently. */
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) exp_block16(s + t, mr);
        if (t < n) {
            float pad[16];
            for (int j = 0; j < 16; j++) pad[j] = t + j < n ? s[t + j] : -INFINITY;
            exp_block16(pad, mr);
            memcpy(s + t, pad, sizeof(float) * (size_t)(n - t));
        }
        sum = lane_sum(s, n);
    }
    *m = mr;
    *l = sum;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* exp(x) for x <= 0 on 16 lanes: x = n ln2 + r, |r| <= ln2 / 2 (exp_neg's range reduction), exp(r)
 * by a degree-6 polynomial (exp_neg's coefficients less its r^7 term: relative error 2.4e-7
 * measured over [-87, 0], exp(0) = 1 exactly), 2^n by scalef.  Compiled as the softmaxes are, so
 * that it is inlined there (a call per 16 lanes cost a third of a wide pass's softmax). */
__attribute__((optimize("no-associative-math"), always_inline)) static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = exp_reduce16(x, n);
    __m512 p = exp_mid16(_mm512_set1_ps(1.3981999507e-3f), r);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* mask_softmax in blocks of 16 lanes, the last one masked: position t's probability is computed
 * the same way wherever it falls, and the sum adds lane t % 16's values in order, then the 16
 * lanes.  So a row's max, probabilities and sum are the same bits whatever hidden positions
 * follow its visible ones in the chunk (a one-token step against a multi-token pass over the
 * same visible keys; a hidden position adds an exact zero). */
/* hide (as mask_softmax) the hidden of a row's n scores, and return the largest visible one
 * (-inf: none) */
__attribute__((optimize("no-associative-math"), always_inline)) static inline float
visible_max16(float *s, int64_t n, int64_t i, const uint8_t *mask, int64_t T, int64_t len, int64_t t0) {
    hide(s, n, i, mask, T, len, t0);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
        mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, s + t));
    }
    return _mm512_reduce_max_ps(mx);
}

__attribute__((optimize("no-associative-math"))) /* the sums in this order, whatever the build's flags */
static inline void mask_softmax16(float *s, int64_t n, int64_t i, const uint8_t *mask, int64_t T, int64_t len,
                                  int64_t t0, float *m, float *l) {
    const float mr = visible_max16(s, n, i, mask, T, len, t0);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(mr);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(k, s + t);
        const __mmask16 seen = _mm512_mask_cmp_ps_mask(k, v, ninf, _CMP_NEQ_OQ);
        const __m512 p = mr == -INFINITY ? _mm512_setzero_ps() : _mm512_maskz_mov_ps(seen, exp_neg16(_mm512_sub_ps(v, mv)));
        _mm512_mask_storeu_ps(s + t, k, p);
        acc = _mm512_add_ps(acc, p);
    }
    *m = mr;
    *l = _mm512_reduce_add_ps(acc);
}

#define MASK_SOFTMAX mask_softmax16
#else
#define MASK_SOFTMAX mask_softmax
#endif

/* s[j] = scale * (q . k_j) for 16 keys k [16, E]: not inlined, so that every block of every chunk,
 * the padded last one too, runs the same instructions (a loop over positions ending at n let the
 * compiler round its last n % 8 dot products otherwise than the rest) */
__attribute__((noinline)) static void scores16(const float *q, const float *k, int E, float scale, float *s) {
    for (int j = 0; j < 16; j++) {
        const float *kt = k + (size_t)j * E;
        float d = 0.0f;
#pragma omp simd reduction(+ : d)
        for (int e = 0; e < E; e++) d += q[e] * kt[e];
        s[j] = d * scale;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ROWS_AVX2 1
/* x stays in a register: GCC otherwise folds the load into each of the J products that use it,
 * loading it J times (15 loads for 12 products, the loop bound by the loads) */
#define IN_REGISTER(x) __asm__("" : "+x"(x))
/* F(J, ...) with J = 3, 2 or 1 a constant, so that each row count gets its own unrolled copy */
#define BY_ROWS(F, J, ...)              \
    do {                                \
        if ((J) == 3)                   \
            F(3, __VA_ARGS__);          \
        else if ((J) == 2)              \
            F(2, __VA_ARGS__);          \
        else                            \
            F(1, __VA_ARGS__);          \
    } while (0)
/* The four sums of x[0..3]'s lanes: lane i of x[c] summed as ((0+1)+(2+3)) + ((4+5)+(6+7)), the
 * same tree for every x whatever sits beside it. */
static inline __m128 lanes_sum4(const __m256 x[4]) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* s[j][c] = scale * (q[j] . k[c]) for J (1-3) query rows q (E apart) and 16 keys k [16, E], E a
 * multiple of 8 (s: rows ns apart): tiles of J rows by 4 keys, so each load of a key vector serves
 * J rows and each load of a query vector 4 keys (one row at a time, scores16 loaded both for every
 * product and ended each key in a reduction of its own).  Each (row, key) is one chain of fused
 * multiply-adds over the E / 8 vectors, then lanes_sum4's fixed tree, whatever J is; where the
 * kernel takes this path every row takes it, so a row's bits do not depend on the rows beside it. */
__attribute__((optimize("no-associative-math"), always_inline)) static inline void scores_rows_j(
    int J, int E, const float *q, const float *k, float scale, float *s, int64_t ns) {
    const __m128 sc = _mm_set1_ps(scale);
    for (int c0 = 0; c0 < 16; c0 += 4) {
        __m256 a[3][4];
        for (int j = 0; j < J; j++)
            for (int c = 0; c < 4; c++) a[j][c] = _mm256_setzero_ps();
        const float *kc = k + (size_t)c0 * E;
        for (int e = 0; e < E; e += 8) {
            /* the J query vectors in registers, then one key vector at a time: 12 accumulators, 3
             * queries and a key fill the 16 registers */
            __m256 qv[3];
            for (int j = 0; j < J; j++) {
                qv[j] = _mm256_loadu_ps(q + (size_t)j * E + e);
                IN_REGISTER(qv[j]);
            }
            for (int c = 0; c < 4; c++) {
                __m256 kv = _mm256_loadu_ps(kc + (size_t)c * E + e);
                IN_REGISTER(kv);
                for (int j = 0; j < J; j++) a[j][c] = _mm256_fmadd_ps(qv[j], kv, a[j][c]);
            }
        }
        for (int j = 0; j < J; j++) _mm_storeu_ps(s + (size_t)j * ns + c0, _mm_mul_ps(lanes_sum4(a[j]), sc));
    }
}
__attribute__((noinline)) static void scores_rows_avx2(int J, int E, const float *q, const float *k, float scale,
                                                       float *s, int64_t ns) {
    BY_ROWS(scores_rows_j, J, E, q, k, scale, s, ns);
}
/* acc[j][e] = sum over t of p[j][t] v[t][e] for J (1-3) rows j (p: rows n apart, acc: rows E apart; a
 * row whose max m[j] is -inf sees nothing: zeros), E a multiple of 32: 32 columns of the J rows in
 * registers, so each value vector is loaded once for J rows.  Each (row, column) is one chain of
 * fused multiply-adds in t order whatever J is, and where the kernel takes this path (AVX2, E a
 * multiple of 32) every row takes it, so a row's bits do not depend on the rows beside it.  One row
 * at a time, the value products were bound by the loads from the chunk's fp32 copy
 * (pass_cost_avx2.md). */
__attribute__((optimize("no-associative-math"), always_inline)) static inline void pv_rows_j(
    int J, int E, int64_t n, const float *v, const float *p, const float *m, float *acc) {
    for (int e0 = 0; e0 < E; e0 += 32) {
        __m256 a[3][4];
        for (int j = 0; j < J; j++)
            for (int i = 0; i < 4; i++) a[j][i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            /* the J probabilities in registers, then one value vector at a time (as scores_rows_j) */
            const float *vt = v + t * E + e0;
            __m256 pj[3];
            for (int j = 0; j < J; j++) {
                pj[j] = _mm256_broadcast_ss(p + (size_t)j * n + t);
                IN_REGISTER(pj[j]);
            }
            for (int i = 0; i < 4; i++) {
                __m256 vv = _mm256_loadu_ps(vt + 8 * i);
                IN_REGISTER(vv);
                for (int j = 0; j < J; j++) a[j][i] = _mm256_fmadd_ps(pj[j], vv, a[j][i]);
            }
        }
        for (int j = 0; j < J; j++) {
            uint32_t mb; /* m[j] == -inf as an integer test: a float test kept -inf in a vector register */
            memcpy(&mb, m + j, sizeof mb);
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(acc + (size_t)j * E + e0 + 8 * i, mb == 0xff800000u ? _mm256_setzero_ps() : a[j][i]);
        }
    }
}
__attribute__((noinline)) static void pv_rows_avx2(int J, int E, int64_t n, const float *v, const float *p,
                                                   const float *m, float *acc) {
    BY_ROWS(pv_rows_j, J, E, n, v, p, m, acc);
}
#else
#define ROWS_AVX2 0
#define pv_rows_avx2(J, E, n, v, p, m, acc) ((void)0)
#define scores_rows_avx2(J, E, q, k, scale, s, ns) ((void)0)
#endif

/* One work item: the R = G * S query rows that share one KV head (row r is query head
 * r / S at new position r % S), over cache positions [t0, t1) of it.  Position t is
 * visible to new position i when mask[i * T + t] (mask: [S, T], T = len + S) or, without
 * a mask, when t <= len + i (causal).  Writes the unnormalised output acc [R, E], the
 * max m [R] (-inf: nothing visible) and the sum l [R].  `scores` holds R * chunk floats,
 * `buf` chunk * E.  Instantiated for the common head sizes so the compiler unrolls the E
 * loops and keeps a query row in registers.  Without reassociation: with it GCC split the E = 64
 * instance's sum over positions into several accumulators, so a row's output depended on how
 * many positions the chunk held (a step's and a pass's rows differed in the last bit). */
#define ATTEND_CHUNK(NAME, EDIM)                                                                         \
    __attribute__((optimize("no-associative-math"))) static void NAME(                                  \
        const float *q, const void *keys, const void *vals, int elsize, int R, int S,                      \
                     int E_, int64_t len, const uint8_t *mask, int64_t t0, int64_t t1, float scale,        \
                     float *acc, float *m, float *l, float *scores, float *buf, int64_t split,             \
                     const void *kalt, const void *valt) {                                                 \
        (void)split, (void)kalt, (void)valt; /* rows all at keys/vals (attn_gathered gathers a whole chunk) */ \
        const int E = EDIM > 0 ? EDIM : E_;                                                                \
        const int64_t n = t1 - t0, T = len + S;                                                            \
        const float *k = rows_f32(keys, elsize, E, t0, n, buf, vals);                                      \
        const int64_t nb = n / 16 * 16;                                                                    \
        float kpad[16 * (EDIM > 0 ? EDIM : E_)];                                                           \
        if (nb < n) { /* the last, partial block of 16 keys, zero-padded */                                \
            memset(kpad, 0, sizeof kpad);                                                                  \
            memcpy(kpad, k + nb * E, sizeof(float) * (size_t)(n - nb) * E);                                \
        }                                                                                                  \
        if (ROWS_AVX2 && EDIM > 0 && EDIM % 8 == 0) { /* up to three rows share each load of the keys */   \
            for (int64_t t = 0; t < nb; t += 16) /* a block of keys in L1 for every group of rows */      \
                for (int r = 0; r < R; r += 3)                                                             \
                    scores_rows_avx2(R - r < 3 ? R - r : 3, E, q + (size_t)r * E, k + t * E, scale,        \
                                     scores + (size_t)r * n + t, n);                                       \
            for (int r = 0; nb < n && r < R; r += 3) {                                                     \
                const int J = R - r < 3 ? R - r : 3;                                                       \
                float tail[3][16];                                                                         \
                scores_rows_avx2(J, E, q + (size_t)r * E, kpad, scale, tail[0], 16);                       \
                for (int j = 0; j < J; j++)                                                                \
                    memcpy(scores + (size_t)(r + j) * n + nb, tail[j], sizeof(float) * (size_t)(n - nb));  \
            }                                                                                              \
            for (int r = 0; r < R; r++) MASK_SOFTMAX(scores + (size_t)r * n, n, r % S, mask, T, len, t0, m + r, l + r);\
        } else {                                                                                           \
            for (int r = 0; r < R; r++) {                                                                  \
                const float *qr = q + (size_t)r * E;                                                       \
                float *s = scores + (size_t)r * n, tail[16];                                               \
                for (int64_t t = 0; t < nb; t += 16) scores16(qr, k + t * E, E, scale, s + t);            \
                if (nb < n) {                                                                              \
                    scores16(qr, kpad, E, scale, tail);                                                    \
                    memcpy(s + nb, tail, sizeof(float) * (size_t)(n - nb));                                \
                }                                                                                          \
                MASK_SOFTMAX(s, n, r % S, mask, T, len, t0, m + r, l + r);                                \
            }                                                                                              \
        }                                                                                                  \
        const float *v = rows_f32(vals, elsize, E, t0, n, buf, NULL);                                      \
        int r = 0;                                                                                         \
        if (ROWS_AVX2 && EDIM > 0 && EDIM % 32 == 0) { /* up to three rows share each load of the values */  \
            for (; r < R; r += 3) pv_rows_avx2(R - r < 3 ? R - r : 3, E, n, v, scores + (size_t)r * n, m + r,\
                                          acc + (size_t)r * E);                                            \
        }                                                                                                  \
        for (; r < R; r++) {                                                                               \
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
#define RPAD(R) (((R) + 15) / 16 * 16) /* query rows as the AMX tiles take them (score rows, qb) */

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 keys or values of row `idx` on as fp32 (bf16: a shift, in registers) */
static inline __m512 ld16(const void *base, int elsize, int64_t idx) {
    if (elsize == 4) return _mm512_loadu_ps((const float *)base + idx);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Where a chunk's key or value rows lie: row u at base + u * stride for u < split, else at
 * alt + (u - split) * stride (a verification row's chunk: the cache up to a block boundary, then
 * rows gathered for it; see attn_gathered).  split is a multiple of 16, so a block of 16 rows or a
 * pair of rows never straddles it. */
typedef struct {
    const char *base, *alt;
    int64_t split;
    size_t stride;
} Seg;

static inline const void *seg_row(const Seg *s, int64_t u) {
    return u < s->split ? s->base + (size_t)u * s->stride : s->alt + (size_t)(u - s->split) * s->stride;
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
 * KB blocks, into scores[r * ns + t ..].  RB and KB are constants at each call site.  With FMA
 * (a constant too; where vdpbf16ps is slow, linear.c's bf16_dot_slow): each pair of key vectors
 * split into two fp32 vectors by a shift and a mask, as the linear panels split theirs, and two
 * FMAs with the query's fp32 dims qf [R][E] (bf16 numbers: the pair path's condition), so each
 * score is one chain of FMAs over the dims in order, whatever the rows. */
static inline __attribute__((always_inline)) void scores_pairs(int RB, int KB, int E, const uint32_t *qb,
                                                               const float *qf, const uint32_t *kt, int r0, __m512 sc,
                                                               float *scores, int64_t ns, int64_t t, int FMA) {
    __m512 a[2][8];
#pragma GCC unroll 2
    for (int b = 0; b < 2; b++)
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) a[b][j] = _mm512_setzero_ps();
    for (int p = 0; p < E / 2; p++) {
        __m512bh kv[2];
        __m512 ke[2], ko[2];
#pragma GCC unroll 2
        for (int b = 0; b < 2; b++)
            if (b < KB) {
                kv[b] = (__m512bh)_mm512_loadu_si512(kt + (size_t)b * 8 * E + 16 * p);
                if (FMA) {
                    ke[b] = _mm512_castsi512_ps(_mm512_slli_epi32((__m512i)kv[b], 16));
                    ko[b] = _mm512_castsi512_ps(_mm512_and_si512((__m512i)kv[b], _mm512_set1_epi32((int)0xffff0000u)));
                }
            }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            if (j < RB) {
                if (FMA) {
                    const __m512 qe = _mm512_set1_ps(qf[(size_t)(r0 + j) * E + 2 * p]);
                    const __m512 qo = _mm512_set1_ps(qf[(size_t)(r0 + j) * E + 2 * p + 1]);
#pragma GCC unroll 2
                    for (int b = 0; b < 2; b++)
                        if (b < KB) a[b][j] = _mm512_fmadd_ps(ko[b], qo, _mm512_fmadd_ps(ke[b], qe, a[b][j]));
                } else {
                    const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qb[(size_t)(r0 + j) * (E / 2) + p]);
#pragma GCC unroll 2
                    for (int b = 0; b < 2; b++)
                        if (b < KB) a[b][j] = _mm512_dpbf16_ps(a[b][j], kv[b], qv);
                }
            }
    }
#pragma GCC unroll 2
    for (int b = 0; b < 2; b++)
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            if (j < RB && b < KB) _mm512_storeu_ps(scores + (size_t)(r0 + j) * ns + t + 16 * b, _mm512_mul_ps(a[b][j], sc));
}

/* scores_pairs over every query row: blocks of eight, then the rest */
static inline __attribute__((always_inline)) void scores_rows(int KB, int R, int E, const uint32_t *qb,
                                                              const float *qf, const uint32_t *kt, __m512 sc,
                                                              float *scores, int64_t ns, int64_t t, int FMA) {
    int r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) scores_pairs(8, KB, E, qb, qf, kt, r0, sc, scores, ns, t, FMA);
    switch (R - r0) {
    case 7: scores_pairs(7, KB, E, qb, qf, kt, r0, sc, scores, ns, t, FMA); break;
    case 6: scores_pairs(6, KB, E, qb, qf, kt, r0, sc, scores, ns, t, FMA); break;
    case 5: scores_pairs(5, KB, E, qb, qf, kt, r0, sc, scores, ns, t, FMA); break;
    case 4: scores_pairs(4, KB, E, qb, qf, kt, r0, sc, scores, ns, t, FMA); break;
    case 3: scores_pairs(3, KB, E, qb, qf, kt, r0, sc, scores, ns, t, FMA); break;
    case 2: scores_pairs(2, KB, E, qb, qf, kt, r0, sc, scores, ns, t, FMA); break;
    case 1: scores_pairs(1, KB, E, qb, qf, kt, r0, sc, scores, ns, t, FMA); break;
    default: break;
    }
}
#endif

/* The values' part of a chunk for query rows r0 .. r0 + RB (RB a constant at each call site):
 * acc[r] = sum over the chunk's n positions of p[r, u] * v[u] (row r of the scores at r * ns),
 * each value row converted from bf16 once for the RB rows. */
static inline __attribute__((always_inline)) void pv_rows(int RB, int NE, const Seg *vs, int elsize, int64_t n,
                                                          int64_t ns, const float *scores, int r0, float *acc) {
    const int E = 16 * NE;
    __m512 o[6][8];
#pragma GCC unroll 6
    for (int j = 0; j < 6; j++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (j < RB && c < NE) o[j][c] = _mm512_setzero_ps();
    const char *vr = vs->base;
    for (int64_t u = 0; u < n; u++, vr += vs->stride) {
        __m512 vv[8];
        if (u == vs->split) vr = vs->alt;
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (c < NE) vv[c] = ld16(vr, elsize, 16 * c);
#pragma GCC unroll 6
        for (int j = 0; j < 6; j++)
            if (j < RB) {
                const __m512 p = _mm512_set1_ps(scores[(size_t)(r0 + j) * ns + u]);
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
static inline void values_in_pairs(const Seg *vs, int64_t n, int NE, uint32_t *vp) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const uint16_t *va = (const uint16_t *)vs->base; /* rows 2i, 2i + 1: a pair never straddles the split */
    for (int64_t i = 0; i < (n + 1) / 2; i++, va += 32 * NE) {
        if (2 * i == vs->split) va = (const uint16_t *)vs->alt;
        const uint16_t *vb = va + 16 * NE;
        for (int c = 0; c < NE; c++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(va + 16 * c));
            const __m256i b = 2 * i + 1 < n ? _mm256_loadu_si256((const __m256i *)(vb + 16 * c)) : _mm256_setzero_si256();
            const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
            _mm512_storeu_si512(vp + (i * NE + c) * 16, _mm512_permutexvar_epi16(idx, z));
        }
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

/* probs_in_pairs's rounding for the FMA path: a row's n probabilities rounded to bf16 numbers
 * in place, kept as floats, and a zero after an odd last one (its pair's second value is zero) */
static inline void probs_rounded(float *s, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i));
        _mm512_storeu_ps(s + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    for (; i < n; i++) s[i] = bf16_to_f32(f32_to_bf16(s[i]));
    if (n & 1) s[n] = 0.0f;
}

/* The values' part of a chunk from the pairs above (vp), or made from the values v on the fly
 * (v not NULL: a single block of rows, where building vp would not pay), for query rows r0 ..
 * r0 + RB: one dpbf16 per pair of positions and 16 dims (RB a constant at each call site).  With
 * FMA (scores_pairs's switch; the probabilities then as probs_rounded leaves them): each pair of
 * value vectors split by a shift and a mask, two FMAs with the two positions' probabilities. */
static inline __attribute__((always_inline)) void pv_pairs(int RB, int NE, const uint32_t *vp, const Seg *v,
                                                           const float *scores, int64_t n, int64_t ns, int r0,
                                                           float *acc, int FMA) {
    const int E = 16 * NE;
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 o[6][8];
#pragma GCC unroll 6
    for (int j = 0; j < 6; j++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (j < RB && c < NE) o[j][c] = _mm512_setzero_ps();
    const uint16_t *va = v ? (const uint16_t *)v->base : NULL; /* rows 2i, 2i + 1: a pair never straddles the split */
    for (int64_t i = 0; i < (n + 1) / 2; i++, va += v ? 2 * E : 0) {
        __m512bh vv[8];
        if (v && 2 * i == v->split) va = (const uint16_t *)v->alt;
        const uint16_t *vb = va + E;
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (c < NE) {
                if (v) { /* one block of rows: the pairs in registers, as values_in_pairs makes them */
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(va + 16 * c));
                    const __m256i b = 2 * i + 1 < n ? _mm256_loadu_si256((const __m256i *)(vb + 16 * c))
                                                    : _mm256_setzero_si256();
                    vv[c] = (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
                } else {
                    vv[c] = (__m512bh)_mm512_loadu_si512(vp + (i * NE + c) * 16);
                }
            }
        if (FMA) {
            __m512 ve[8], vo[8];
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                if (c < NE) {
                    ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32((__m512i)vv[c], 16));
                    vo[c] = _mm512_castsi512_ps(_mm512_and_si512((__m512i)vv[c], _mm512_set1_epi32((int)0xffff0000u)));
                }
#pragma GCC unroll 6
            for (int j = 0; j < 6; j++)
                if (j < RB) {
                    const float *sp = scores + (size_t)(r0 + j) * ns + 2 * i;
                    const __m512 pe = _mm512_set1_ps(sp[0]), po = _mm512_set1_ps(sp[1]);
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++)
                        if (c < NE) o[j][c] = _mm512_fmadd_ps(vo[c], po, _mm512_fmadd_ps(ve[c], pe, o[j][c]));
                }
            continue;
        }
#pragma GCC unroll 6
        for (int j = 0; j < 6; j++)
            if (j < RB) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(scores + (size_t)(r0 + j) * ns))[i]);
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

#ifdef CODECOMPLETE_AMX
/* Attention's two products on AMX tiles (attn_amx_set turns them on; off by default).  Each row of
 * a tile product is its own sums in a fixed order, whatever the other rows hold, so a row's bits
 * do not depend on how many rows a pass has, as with the AVX-512 dot products they replace; only
 * the order of each row's fp32 sums differs from those.  Tiles 0-3: sums (16 rows of 16 floats),
 * 4-7: the factors (keys and queries for the scores, probabilities and values after). */
static int attn_amx;

/* on: 1 or 0 sets it (1 only where Linux grants the tiles), -1 leaves it; returns the setting */
int attn_amx_set(int on) {
    if (on >= 0) attn_amx = on && amx_enable();
    return attn_amx;
}

static void attn_tiles(void) {
    static const uint8_t all16[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_tiles(all16);
}

/* mask_softmax16 for the tiles: the same max, probabilities and sum, the probabilities written
 * straight as bf16 at the start of the row (as probs_in_pairs lays them out), zeros up to a
 * multiple of 32 positions */
__attribute__((optimize("no-associative-math"))) static void amx_softmax(float *s, int64_t n, int64_t i,
                                                                         const uint8_t *mask, int64_t T, int64_t len,
                                                                         int64_t t0, float *m, float *l) {
    const float mr = visible_max16(s, n, i, mask, T, len, t0);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(mr);
    uint16_t *d = (uint16_t *)s; /* reads floats t .. t + 32, then writes the bytes of floats t / 2 .. t / 2 + 16 */
    for (int64_t t = 0; t < n; t += 32) {
        __m512 p[2];
        for (int h = 0; h < 2; h++) {
            const int64_t u = t + 16 * h, left = n - u;
            const __mmask16 k = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
            const __m512 v = _mm512_maskz_loadu_ps(k, s + u);
            const __mmask16 seen = _mm512_mask_cmp_ps_mask(k, v, ninf, _CMP_NEQ_OQ);
            p[h] = mr == -INFINITY ? _mm512_setzero_ps() : _mm512_maskz_mov_ps(seen, exp_neg16(_mm512_sub_ps(v, mv)));
            if (k) acc = _mm512_add_ps(acc, p[h]);
        }
        _mm512_storeu_si512(d + t, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    }
    *m = mr;
    *l = _mm512_reduce_add_ps(acc);
}

/* qb's rows (RPAD(R) of E/2 bf16 pairs) transposed in blocks of 16 rows: qt [RPAD(R) / 16][E/2][16],
 * the tiles' right-hand factor for amx_scores_kq */
static inline void queries_in_columns(int R, int E, const uint32_t *qb, uint32_t *qt) {
    for (int r0 = 0; r0 < R; r0 += 16)
        for (int c = 0; c < E / 2; c += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(qb + (size_t)(r0 + i) * (E / 2) + c);
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(qt + ((size_t)r0 * (E / 2) + (size_t)(c + j) * 16), r[j]);
        }
}

/* the scores of query rows 0 .. R against nb (1-4) blocks of 16 keys into scores[r * ns + t ..],
 * scaled: the keys as the tiles' left factor, read in place (block b's 16 rows of E bf16 at kb[b],
 * `stride` bytes apart), the queries as the right (qt, queries_in_columns), and each block's
 * 16 x 16 sums transposed into score rows.  (Measured against the queries on the left and the keys
 * transposed in pairs on the right: the same bits, 10-15 % slower.)  Four blocks at a time keep
 * four independent sums on the tiles. */
static inline void amx_scores_kq(int R, int E, const uint32_t *qt, const uint16_t *const kb[4], int nb,
                                 size_t stride, float scale, float *scores, int64_t ns, int64_t t) {
    const __m512 sc = _mm512_set1_ps(scale);
    float tmp[4][256];
    for (int r0 = 0; r0 < R; r0 += 16) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int j = 0; j < E / 32; j++) {
            _tile_loadd(6, qt + (size_t)r0 * (E / 2) + (size_t)j * 256, 64);
            _tile_loadd(4, kb[0] + 32 * j, stride);
            if (nb > 1) _tile_loadd(5, kb[1] + 32 * j, stride);
            _tile_dpbf16ps(0, 4, 6);
            if (nb > 1) _tile_dpbf16ps(1, 5, 6);
            if (nb > 2) {
                _tile_loadd(4, kb[2] + 32 * j, stride);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (nb > 3) {
                _tile_loadd(5, kb[3] + 32 * j, stride);
                _tile_dpbf16ps(3, 5, 6);
            }
        }
        _tile_stored(0, tmp[0], 64);
        if (nb > 1) _tile_stored(1, tmp[1], 64);
        if (nb > 2) _tile_stored(2, tmp[2], 64);
        if (nb > 3) _tile_stored(3, tmp[3], 64);
        for (int b = 0; b < nb; b++) {
            __m512i c[16];
            for (int i = 0; i < 16; i++) c[i] = _mm512_loadu_si512(tmp[b] + 16 * i);
            transpose16(c);
            for (int r = 0; r < 16 && r0 + r < R; r++)
                _mm512_storeu_ps(scores + (size_t)(r0 + r) * ns + t + 16 * b, _mm512_mul_ps(_mm512_castsi512_ps(c[r]), sc));
        }
    }
}

/* acc[r] (r < R, E floats each) = the sum over n32 positions (a multiple of 32) of p[r, u] v[u]:
 * the probabilities as bf16 pairs at the start of each score row (amx_softmax, zeros up to
 * n32), the values in pairs of positions (values_in_pairs, zero pairs up to n32 / 2); E a
 * multiple of 64 (four tiles of 16 dims a pass over the positions) */
static inline void amx_pv(int R, int E, const float *scores, int64_t ns, const uint32_t *vp, int64_t n32, float *acc) {
    const int NE = E / 16;
    float tmp[4][256];
    for (int r0 = 0; r0 < R; r0 += 16) {
        const int rows = R - r0 < 16 ? R - r0 : 16;
        const uint16_t *pr = (const uint16_t *)(scores + (size_t)r0 * ns);
        for (int c0 = 0; c0 < NE; c0 += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t u = 0; u < n32; u += 32) {
                const uint32_t *vb = vp + ((size_t)(u / 2) * NE + c0) * 16;
                _tile_loadd(4, pr + u, ns * 4);
                _tile_loadd(5, vb, NE * 64);
                _tile_loadd(6, vb + 16, NE * 64);
                _tile_loadd(7, vb + 32, NE * 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, vb + 48, NE * 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 4, 5);
            }
            float *out = acc + (size_t)r0 * E + 16 * c0;
            if (rows == 16) {
                _tile_stored(0, out, E * 4);
                _tile_stored(1, out + 16, E * 4);
                _tile_stored(2, out + 32, E * 4);
                _tile_stored(3, out + 48, E * 4);
            } else {
                _tile_stored(0, tmp[0], 64);
                _tile_stored(1, tmp[1], 64);
                _tile_stored(2, tmp[2], 64);
                _tile_stored(3, tmp[3], 64);
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < 4; c++) memcpy(out + (size_t)r * E + 16 * c, tmp[c] + 16 * r, 64);
            }
        }
    }
}
#define AMX_ON attn_amx
#define ATTN_TILES() attn_tiles()
#define ATTN_RELEASE() _tile_release()
#define AMX_SCORES_KQ amx_scores_kq
#define AMX_SOFTMAX amx_softmax
#define QUERIES_IN_COLUMNS queries_in_columns
#define AMX_PV amx_pv
#else
#define AMX_ON 0
#define ATTN_TILES() ((void)0)
#define ATTN_RELEASE() ((void)0)
#define AMX_SCORES_KQ(...) ((void)0)
#define AMX_SOFTMAX(...) ((void)0)
#define QUERIES_IN_COLUMNS(...) ((void)0)
#define AMX_PV(...) ((void)0)
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
                     float *acc, float *m, float *l, float *scores, float *buf, int64_t split,             \
                     const void *kalt, const void *valt) {                                                 \
        (void)E_;                                                                                          \
        const int E = 16 * NE;                                                                             \
        const int64_t n = t1 - t0, T = len + S, ns = (n + 15) / 16 * 16; /* ns: a score row's stride */ \
        const Seg ks = {(const char *)keys + (size_t)t0 * E * elsize, (const char *)kalt, split,           \
                        (size_t)E * elsize};                                                               \
        const Seg vs = {(const char *)vals + (size_t)t0 * E * elsize, (const char *)valt, split,           \
                        (size_t)E * elsize};                                                               \
        const __m512 sc = _mm512_set1_ps(scale);                                                           \
        float *kblk = buf;                                                                                 \
        uint32_t *kt = (uint32_t *)(buf + KBLK_FLOATS(E)), *qb = kt + KT_FLOATS(E);                        \
        int64_t t = 0;                                                                                     \
        const int amx = AMX_ON && elsize == 2; /* bf16 caches: both products on tiles */                   \
        int tiles = 0;                                                                                     \
        (void)amx, (void)tiles;                                                                            \
        SCORES_PAIRS                                                                                       \
        for (; t < n; t += 16) { /* the last block padded with zero keys (their scores are dropped) */    \
            const float *kb = (const float *)seg_row(&ks, t); /* the block's 16 keys in fp32 */           \
            if (elsize != 4 || t + 16 > n) {                                                               \
                for (int c = 0; c < E; c += 16) /* converted once, read R times from L1 */                 \
                    _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++)                                  \
                        _mm512_storeu_ps(kblk + i * E + c, t + i < n ? ld16(seg_row(&ks, t + i), elsize, c) \
                                                                     : _mm512_setzero_ps());               \
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
                _mm512_storeu_ps(scores + (size_t)r * ns + t, _mm512_mul_ps(sum16(a), sc));                 \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < R; r++) { /* on tiles: the probabilities as bf16 pairs, ready for them */             \
            if (amx) AMX_SOFTMAX(scores + (size_t)r * ns, n, r % S, mask, T, len, t0, m + r, l + r);           \
            else mask_softmax16(scores + (size_t)r * ns, n, r % S, mask, T, len, t0, m + r, l + r);             \
        }                                                                                                  \
        /* values (rows with nothing visible have all-zero probabilities and get zeros) */         \
        PV_PAIRS                                                                                           \
        /* fp32 values: each row converted once for a block of query rows; converting the chunk   \
         * once into a buffer instead measured slower (the buffer is read back from L2) */         \
        if (NE <= 4) { /* six rows at a time: 24 accumulators */                                          \
            int r0 = 0;                                                                                    \
            for (; r0 + 6 <= R; r0 += 6) pv_rows(6, NE, &vs, elsize, n, ns, scores, r0, acc);             \
            switch (R - r0) {                                                                              \
            case 5: pv_rows(5, NE, &vs, elsize, n, ns, scores, r0, acc); break;                           \
            case 4: pv_rows(4, NE, &vs, elsize, n, ns, scores, r0, acc); break;                           \
            case 3: pv_rows(3, NE, &vs, elsize, n, ns, scores, r0, acc); break;                           \
            case 2: pv_rows(2, NE, &vs, elsize, n, ns, scores, r0, acc); break;                           \
            case 1: pv_rows(1, NE, &vs, elsize, n, ns, scores, r0, acc); break;                           \
            default: break;                                                                                \
            }                                                                                              \
        } else { /* two rows at a time: 2 * NE accumulators */                                            \
            int r0 = 0;                                                                                    \
            for (; r0 + 2 <= R; r0 += 2) pv_rows(2, NE, &vs, elsize, n, ns, scores, r0, acc);             \
            if (r0 < R) pv_rows(1, NE, &vs, elsize, n, ns, scores, r0, acc);                              \
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
int bf16_dot_slow(void); /* linear.c: vdpbf16ps slow on this CPU (linear_choose) */
/* scores_rows with its FMA switch as a constant at each call site */
#define SCORES_ROWS(KB)                                                                                  \
    do {                                                                                                 \
        if (fma_pairs) scores_rows(KB, R, E, qb, q, kt, sc, scores, ns, t, 1);                           \
        else scores_rows(KB, R, E, qb, q, kt, sc, scores, ns, t, 0);                                     \
    } while (0)
#define PV_PAIRS_ROWS(RB)                                                                                \
    do {                                                                                                 \
        if (fma_pairs) pv_pairs(RB, E / 16, vp, direct, scores, n, ns, r0, acc, 1);                      \
        else pv_pairs(RB, E / 16, vp, direct, scores, n, ns, r0, acc, 0);                                \
    } while (0)
/* the bf16-pair score path of ATTEND_CHUNK_AVX512: bf16 keys, every query
 * value a bf16 number (low 16 bits zero); where vdpbf16ps is slow (fma_pairs), the same pairs
 * through FMAs (scores_pairs, pv_pairs: measured on an AVX512-BF16 Xeon without AMX, where the
 * fp32 path below was slower still) */
#define SCORES_PAIRS                                                                                     \
    int pairs = elsize == 2;             \
    const int fma_pairs = !amx && bf16_dot_slow();                                                      \
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
        uint32_t *qt = qb + QB_FLOATS(RPAD(R), E); /* the queries transposed for the tiles */         \
        (void)qt;                                                                                        \
        if (amx) { /* the tiles take 16 query rows: the rows past R zero */                             \
            memset(qb + QB_FLOATS(R, E), 0, sizeof(uint32_t) * (QB_FLOATS(RPAD(R), E) - QB_FLOATS(R, E))); \
            ATTN_TILES();                                                                                \
            tiles = 1;                                                                                   \
            QUERIES_IN_COLUMNS(R, E, qb, qt);                                                            \
            for (; t + 16 <= n; t += 64) {                                                               \
                const uint16_t *kb4[4];                                                                  \
                int nb = 0;                                                                              \
                for (; nb < 4 && t + 16 * nb + 16 <= n; nb++) kb4[nb] = seg_row(&ks, t + 16 * nb);       \
                prefetch_kv(keys, vals, t0 + t, E);                                                      \
                prefetch_kv(keys, vals, t0 + t + 32, E);                                                 \
                AMX_SCORES_KQ(R, E, qt, kb4, nb, ks.stride, scale, scores, ns, t);                       \
                if (nb < 4) t -= 16 * (4 - nb);                                                          \
            }                                                                                            \
        }                                                                                                \
        for (; t + 32 <= n; t += 32) { /* two blocks of 16 keys share each broadcast query pair */   \
            prefetch_kv(keys, vals, t0 + t, E);                                                      \
            keys_in_pairs((const uint32_t *)seg_row(&ks, t), E, kt);                                 \
            keys_in_pairs((const uint32_t *)seg_row(&ks, t + 16), E, kt + 8 * E);                    \
            SCORES_ROWS(2);                                          \
        }                                                                                            \
        for (; t + 16 <= n; t += 16) {                                                               \
            keys_in_pairs((const uint32_t *)seg_row(&ks, t), E, kt);                                 \
            SCORES_ROWS(1);                                          \
        }                                                                                            \
        if (t < n) { /* the last keys padded with zero keys to a block (their scores are dropped) */ \
            uint16_t *pad = (uint16_t *)kblk;                                                        \
            memcpy(pad, seg_row(&ks, t), sizeof(uint16_t) * (size_t)(n - t) * E);                   \
            memset(pad + (n - t) * E, 0, sizeof(uint16_t) * (size_t)(16 - (n - t)) * E);             \
            if (amx) {                                                                               \
                const uint16_t *kb1[4] = {pad, pad, pad, pad};                                       \
                AMX_SCORES_KQ(R, E, qt, kb1, 1, E * 2, scale, scores, ns, t);                        \
            } else {                                                                                 \
                keys_in_pairs((const uint32_t *)pad, E, kt);                                         \
                SCORES_ROWS(1);                                      \
            }                                                                                        \
            t = n;                                                                                   \
        }                                                                                            \
    }
/* bf16 values: the chunk's values in pairs of positions (once, in L1) and the probabilities in
 * bf16 pairs, so that each pair of positions is one dpbf16 per 16 dims instead of two fp32 FMAs */
#define PV_PAIRS                                                                                         \
    if (elsize == 2) {                                                                                   \
        const Seg *v0 = &vs;                                                                             \
        if (amx) { /* the probabilities are bf16 pairs up to a multiple of 32 positions; the values too */ \
            const int64_t n32 = (n + 31) / 32 * 32, p0 = (n + 1) / 2;                                     \
            uint32_t *vp = (uint32_t *)(qb + 2 * QB_FLOATS(RPAD(R), E));                                 \
            values_in_pairs(v0, n, E / 16, vp);                                                          \
            memset(vp + p0 * E, 0, sizeof(uint32_t) * (size_t)(n32 / 2 - p0) * E);                      \
            if (!tiles) ATTN_TILES();                                                                    \
            AMX_PV(R, E, scores, ns, vp, n32, acc);                                                      \
            ATTN_RELEASE();                                                                              \
            return;                                                                                      \
        }                                                                                                \
        for (int r = 0; r < R; r++)                                                                      \
            if (fma_pairs) probs_rounded(scores + (size_t)r * ns, n);                                    \
            else probs_in_pairs(scores + (size_t)r * ns, n);                                             \
        /* rows a block: 6 x 4 or 2 x 8 accumulators; with FMAs 4 x 4 or 1 x 8 (the split values too) */ \
        const int rb = fma_pairs ? (E <= 64 ? 4 : 1) : E <= 64 ? 6 : 2;                                  \
        uint32_t *vp = (uint32_t *)(qb + 2 * QB_FLOATS(RPAD(R), E));                                     \
        if (R > rb) values_in_pairs(v0, n, E / 16, vp);                                                  \
        const Seg *direct = R > rb ? NULL : v0;                                                          \
        int r0 = 0;                                                                                      \
        for (; r0 + rb <= R; r0 += rb) {                                                                 \
            if (fma_pairs && E <= 64) PV_PAIRS_ROWS(4);                                                  \
            else if (fma_pairs) PV_PAIRS_ROWS(1);                                                        \
            else if (E <= 64) PV_PAIRS_ROWS(6);                                                          \
            else PV_PAIRS_ROWS(2);                                                                       \
        }                                                                                                \
        switch (R - r0) {                                                                                \
        case 5: PV_PAIRS_ROWS(5); break;                                                            \
        case 4: PV_PAIRS_ROWS(4); break;                                                            \
        case 3: PV_PAIRS_ROWS(3); break;                                                            \
        case 2: PV_PAIRS_ROWS(2); break;                                                            \
        case 1: PV_PAIRS_ROWS(1); break;                                                            \
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
                         int64_t, int64_t, float, float *, float *, float *, float *, float *, int64_t, const void *,
                         const void *);

#include "attention.h"

static chunk_fn chunk_for(int E) {
#ifdef __AVX512F__
    return E == 64 ? attend_chunk_avx512_64 : E == 128 ? attend_chunk_avx512_128 : attend_chunk_any;
#else
    return E == 64 ? attend_chunk_64 : E == 128 ? attend_chunk_128 : attend_chunk_any;
#endif
}

/* whether a chunk function reads its rows from two segments (split, kalt, valt) */
static int chunk_splits(chunk_fn fn) {
#ifdef __AVX512F__
    return fn == attend_chunk_avx512_64 || fn == attend_chunk_avx512_128;
#else
    (void)fn;
    return 0;
#endif
}

/* Work items of a step: per sequence b, KV head and chunk of `chunk` cache positions; first[b]
 * is sequence b's first item (first: B + 1 entries).  Also finds the masked rows whose visible
 * positions are not a prefix of the cache and new tokens (a draft tree's rows below a sibling):
 * a->vinfo[b * S + i] is -1, or the offset in vinfo of (f, visible count, the visible positions
 * from f on), f the row's first hidden position (see attn_gathered).  Returns the number of
 * items, or -1 when memory could not be had (release with attn_release). */
int64_t attn_items(AttnStep *a, int64_t *first) {
    first[0] = 0;
    size_t need = 0;
    for (int b = 0; b < a->B; b++) {
        int64_t T = a->len[b] + a->S, nc = (T + a->chunk - 1) / a->chunk;
        first[b + 1] = first[b] + nc * a->K;
        if (a->masks && a->masks[b]) need += (size_t)a->S * (T + 2);
    }
    a->first = first;
    a->W = first[a->B];
    a->vinfo = NULL;
    if (!need) return a->W;
    int32_t *v = malloc(sizeof(int32_t) * ((size_t)a->B * a->S + need));
    if (!v) return -1;
    int32_t used = a->B * a->S, any = 0;
    for (int b = 0; b < a->B; b++) {
        const int64_t T = a->len[b] + a->S;
        for (int i = 0; i < a->S; i++) {
            v[b * a->S + i] = -1;
            if (!a->masks || !a->masks[b]) continue;
            const uint8_t *row = a->masks[b] + (size_t)i * T;
            int64_t f = 0, seen = 0;
            while (f < T && row[f]) f++;
            for (int64_t t = f; t < T; t++) seen += row[t] != 0;
            if (!seen) continue; /* a prefix (or nothing): the shared pass computes it as a step would */
            v[b * a->S + i] = used;
            v[used] = (int32_t)f;
            v[used + 1] = (int32_t)(f + seen);
            used += 2;
            for (int64_t t = f; t < T; t++)
                if (row[t]) v[used++] = (int32_t)t;
            any = 1;
        }
    }
    if (!any) {
        free(v);
        return a->W;
    }
    a->vinfo = v;
    return a->W;
}

void attn_release(AttnStep *a) {
    free(a->vinfo);
    a->vinfo = NULL;
}

/* attn_gathered's floats at the end of a thread's scratch: a chunk's keys and values, the G
 * query rows, their outputs, maxima and sums */
static size_t gathered_floats(const AttnStep *a) {
    return a->vinfo ? 2 * (size_t)a->chunk * a->E + 2 * (size_t)a->G * (a->E + 1) : 0;
}

/* Scratch floats one thread needs for attn_team's items (and attn_gathered's rows) */
size_t attn_scratch(const AttnStep *a) {
    const size_t R = (size_t)a->G * a->S;
    return (RPAD(R) + a->E) * a->chunk + KBLK_FLOATS(a->E) + KT_FLOATS(a->E) + 2 * QB_FLOATS(RPAD(R), a->E) +
           gathered_floats(a);
}

/* The rows attn_items marked, recomputed over their visible positions as if those were
 * contiguous: the chunks of the row's j-th visible position j / chunk, each computed by the
 * chunk function as a one-token step over the same keys computes it (a draft tree's row sees
 * the cache, the root and its ancestors; greedy decoding sees them as the cache).  So a
 * verification pass gives every row the bits a step gives it, whatever its siblings.  With
 * AVX-512 the cache's rows before the row's first hidden position are read in place (up to
 * a block of 16) and only the rest is gathered; otherwise the whole chunk is gathered. */
static void attn_gathered(const AttnStep *a, chunk_fn fn, float *scratch) {
    const int S = a->S, K = a->K, G = a->G, E = a->E, R = G * S, el = a->elsize;
    const size_t row = (size_t)E * el;
    float *base = scratch + attn_scratch(a) - gathered_floats(a);
    char *gk = (char *)base, *gv = gk + (size_t)a->chunk * E * sizeof(float);
    float *qv = base + 2 * (size_t)a->chunk * E, *tacc = qv + (size_t)G * E, *tm = tacc + (size_t)G * E, *tl = tm + G;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < (int64_t)a->B * K * S; task++) {
        const int i = (int)(task % S), h = (int)(task / S % K), b = (int)(task / S / K);
        const int32_t o = a->vinfo[b * S + i];
        if (o < 0) continue;
        const int64_t f = a->vinfo[o], nvis = a->vinfo[o + 1];
        const int32_t *tail = a->vinfo + o + 2;
        const int64_t nc = (a->first[b + 1] - a->first[b]) / K, w0 = a->first[b] + (int64_t)h * nc;
        const size_t head = ((size_t)a->layer * K + h) * a->cap[b] * E * el;
        const char *kb = (const char *)a->kbase[b] + head, *vb = (const char *)a->vbase[b] + head;
        for (int g = 0; g < G; g++) memcpy(qv + (size_t)g * E, a->q + (((size_t)b * K + h) * R + (size_t)g * S + i) * E,
                                           sizeof(float) * E);
        for (int64_t c = f / a->chunk; c < nc; c++) {
            const int64_t w = w0 + c, r0 = c * a->chunk, r1 = r0 + a->chunk < nvis ? r0 + a->chunk : nvis;
            if (r0 >= nvis) { /* past the row's visible positions: nothing here */
                for (int g = 0; g < G; g++) a->ms[w * R + (size_t)g * S + i] = -INFINITY;
                continue;
            }
            /* rows [r0, r0 + split) in place (the AVX-512 chunk functions read a second segment) */
            const int64_t split = f > r0 && chunk_splits(fn) ? (f - r0) / 16 * 16 : 0;
            for (int64_t j = r0 + split; j < r1; j++) {
                const int64_t slot = j < f ? j : tail[j - f];
                memcpy(gk + (size_t)(j - r0 - split) * row, kb + (size_t)slot * row, row);
                memcpy(gv + (size_t)(j - r0 - split) * row, vb + (size_t)slot * row, row);
            }
            if (split)
                fn(qv, kb, vb, el, G, 1, E, nvis - 1, NULL, r0, r1, a->scale, tacc, tm, tl, scratch,
                   scratch + (size_t)RPAD(G) * a->chunk, split, gk, gv);
            else
                fn(qv, gk, gv, el, G, 1, E, r1 - r0 - 1, NULL, 0, r1 - r0, a->scale, tacc, tm, tl, scratch,
                   scratch + (size_t)RPAD(G) * a->chunk, r1 - r0, NULL, NULL);
            for (int g = 0; g < G; g++) {
                const size_t at = w * R + (size_t)g * S + i;
                memcpy(a->acc + at * E, tacc + (size_t)g * E, sizeof(float) * E);
                a->ms[at] = tm[g];
                a->ls[at] = tl[g];
            }
        }
    }
}

/* Every work item's partial output into acc/ms/ls (threads share the items), then, after a
 * barrier, the chunks of each query row merged by their max and sum into out [B, K*G, S, E]
 * fp32.  Called by every thread of a parallel region, each with its own scratch
 * (attn_scratch floats); the keys and values of the new tokens must be in the caches. */
void attn_team(const AttnStep *a, float *scratch, float *out) {
    const int R = a->G * a->S, E = a->E, K = a->K;
    const chunk_fn fn = chunk_for(E);
    /* Each thread takes a contiguous run of items (a thread's chunks of a head follow each other in
     * memory, so the prefetch runs on into its next item) holding its share of the positions: item w
     * goes to the thread whose share holds the item's middle position.  (Equal counts of items left
     * a thread idle for a chunk in seven: 1k positions make four full chunks and a short one a head.) */
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t total = 0;
    for (int b = 0; b < a->B; b++) total += (int64_t)K * (a->len[b] + a->S);
    int64_t before = 0;
    for (int64_t w = 0; w < a->W; w++) {
        int b = 0;
        while (a->first[b + 1] <= w) b++;
        int64_t i = w - a->first[b], nc = (a->first[b + 1] - a->first[b]) / K;
        int h = (int)(i / nc);
        int64_t c = i % nc, T = a->len[b] + a->S, t0 = c * a->chunk, t1 = t0 + a->chunk < T ? t0 + a->chunk : T;
        const int64_t mid = before + (t1 - t0) / 2;
        before += t1 - t0;
        if ((int)(mid * nt / total) != me) continue;
        size_t head = ((size_t)a->layer * K + h) * a->cap[b] * E * a->elsize;
        fn(a->q + ((size_t)b * K + h) * R * E, (const char *)a->kbase[b] + head, (const char *)a->vbase[b] + head,
           a->elsize, R, a->S, E, a->len[b], a->masks ? a->masks[b] : NULL, t0, t1, a->scale, a->acc + w * R * E,
           a->ms + w * R, a->ls + w * R, scratch, scratch + (size_t)RPAD(R) * a->chunk, T, NULL, NULL);
    }
#pragma omp barrier
    if (a->vinfo) attn_gathered(a, fn, scratch);
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
    if (W < 0) {
        free(first);
        return -1;
    }
    const int R = G * S, threads = omp_get_max_threads();
    const size_t per = attn_scratch(&a);
    float *acc = malloc(sizeof(float) * ((size_t)W * R * (E + 2) + per * threads));
    if (!acc) {
        attn_release(&a);
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
    attn_release(&a);
    free(acc);
    free(first);
    return 0;
}

#ifndef CODECOMPLETE_AMX
int attn_amx_set(int on) {
    (void)on;
    return 0; /* no tiles in this build */
}
#endif
