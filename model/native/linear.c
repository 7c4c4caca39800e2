/* y = x W^T (+ bias) for a few rows x (decode steps, small verification passes) over bf16
 * weights: the product of a decode step, whose cost is reading the weights once.
 *
 * Measured on this project's 2-core CPU: oneDNN's prepacked bf16 kernel streamed a decode
 * step's weights at ~17 GB/s, and a plain row-major kernel at ~23 GB/s, while the machine
 * streams 34-56 GB/s; so a batch-1 step of SmolLM2-135M spent ~15 ms of its ~20 ms in the
 * linear layers.  Reading four rows at once from a row-major matrix makes four interleaved
 * streams 1-3 KB apart, which the hardware prefetchers follow poorly.  Here the weights are
 * repacked once (``pack_bf16`` in model/native/__init__.py) so that every read is sequential:
 *
 *   packed [N/4][K/32][4][32]: for each group of four rows, 32 columns of row 0, then of
 *   rows 1, 2, 3, then the next 32 columns.  N is padded to a multiple of 4 and K to a
 *   multiple of 32 with zeros.  (CPUs with AVX2 but not AVX512-BF16 have a layout and kernel
 *   of their own, further down: the panels, which an AVX512-BF16 build also runs where its
 *   vdpbf16ps is slow, see linear_choose.)
 *
 * On that layout one thread of this kernel streams ~29 GB/s and two ~57 GB/s (the same
 * kernel on the row-major layout: 11 and 23 GB/s).  A group of four weight rows is
 * multiplied with up to four input rows at a time in registers.  With AVX512-BF16 the dot
 * products are vdpbf16ps (bf16 pairs, fp32 accumulation); with AVX2 + FMA each 32-bit pair is
 * split into two fp32 vectors by a shift and a mask (on an AVX2-only AMD EPYC: one row over
 * SmolLM2-135M's weights 30.6 -> 18.1 ms, 16 rows 445 -> 58 ms; fp32 oneDNN 52 and 89 ms);
 * elsewhere a portable loop converts bf16 to fp32 first.  The output is rounded to bf16 once, as
 * oneDNN's bf16 linear does; the two differ only in summation order.
 *
 * The same kernel serves steps of many rows (speculation's verification, batched decoding):
 * six input rows at a time share each load of four weight vectors, so at 8-64 rows it is
 * bound by the dot products (~270 GMAC/s on two cores here, oneDNN 190-380 on the same shapes)
 * rather than by the weights' bytes.
 *
 * Built together with decode_attention.c (see model/native/__init__.py).
 */
#include "common.h"
#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Room for `need` floats in this thread's scratch (the fp32 copy of a call's input rows in the AVX2
 * kernels; NULL without the memory), kept between calls and freed when the thread exits (a pthread
 * key's destructor: a server's short-lived threads would otherwise leave up to 60 x K floats each
 * behind).  One buffer a thread: a kernel call takes it whole and gives it back when it returns. */
static __thread float *thread_x;
static __thread size_t thread_xcap;
static pthread_key_t thread_key;
static pthread_once_t thread_once = PTHREAD_ONCE_INIT;
static void thread_key_make(void) { pthread_key_create(&thread_key, free); }

static __attribute__((unused)) float *thread_floats(size_t need) {
    if (need > thread_xcap) {
        free(thread_x);
        thread_x = malloc(need * sizeof(float));
        thread_xcap = thread_x ? need : 0;
        pthread_once(&thread_once, thread_key_make);
        pthread_setspecific(thread_key, thread_x);
    }
    return thread_x;
}

/* y[m, n0 + i] = s[i] + bias, for the rows of the group that exist (n0 + i < N) */
static inline void store4(const float *s, const uint16_t *bias, uint16_t *y, int N, int n0, int m) {
    for (int i = 0; i < 4 && n0 + i < N; i++) y[(size_t)m * N + n0 + i] = f32_to_bf16(s[i] + (bias ? bf16_to_f32(bias[n0 + i]) : 0.0f));
}

#if defined(__AVX2__) && defined(__FMA__)
/* Shared by the AVX2 kernels (the bf16 panels and linear_q8's int8 panels). */

/* 8 fp32 sums (+ bias) rounded to bf16 as f32_to_bf16 rounds, stored at y[0 .. n) (n <= 8: the rest are padding) */
static inline void store8(__m256 s, const uint16_t *bias, uint16_t *y, int n) {
    if (n < 8) {
        float t[8];
        _mm256_storeu_ps(t, s);
        for (int i = 0; i < n; i++) y[i] = f32_to_bf16(t[i] + (bias ? bf16_to_f32(bias[i]) : 0.0f));
        return;
    }
    if (bias) s = _mm256_add_ps(s, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)bias)), 16)));
    const __m256i u = _mm256_castps_si256(s);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fc0), nan);
    _mm_storeu_si128((__m128i *)y, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* a tile's accumulators for input row R (four panels of two vectors: e rows 0-7, o rows 8-15), and
 the FMAs of row R's x[k] with a column's two weight vectors `we`, `wo` of panel Q */
#define PANEL_DECL(R) __m256 a##R##0e = z, a##R##0o = z, a##R##1e = z, a##R##1o = z, a##R##2e = z, a##R##2o = z, a##R##3e = z, a##R##3o = z;
#define PANEL_FMA(R, Q)                                                                                          \
    if (MR > R) {                                                                                                \
        const __m256 b = _mm256_broadcast_ss(xr + (size_t)R * K + k);                                              \
        a##R##Q##e = _mm256_fmadd_ps(we, b, a##R##Q##e);                                                         \
        a##R##Q##o = _mm256_fmadd_ps(wo, b, a##R##Q##o);                                                         \
    }
#endif

#ifdef __AVX512BF16__
/* the first half of reduce4's tree: 128-bit block i of the result holds lanes j = 0..3 of a_i
 * summed over its four blocks b as (b0 + b2) + (b1 + b3) */
static inline __m512 fold4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* the four sums of a0..a3 as lanes 0..3: fold4, then in each block (x0 + x2) + (x1 + x3) */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 t = fold4(a0, a1, a2, a3);
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}

/* y[m, n0 .. n0 + 4) = s + bias, rounded to bf16 as f32_to_bf16 rounds, in registers (a scalar loop here
 * cost as much as the dot products of a K = 576 matrix at six rows) */
static inline void store4v(__m128 s, const uint16_t *bias, uint16_t *y, int N, int n0, int m) {
    if (n0 + 4 > N) {
        float t[4];
        _mm_storeu_ps(t, s);
        store4(t, bias, y, N, n0, m);
        return;
    }
    if (bias) s = _mm_add_ps(s, _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(bias + n0))), 16)));
    const __m128i u = _mm_castps_si128(s);
    const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7fff), _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1))));
    r = _mm_blendv_epi8(_mm_srli_epi32(r, 16), _mm_set1_epi32(0x7fc0), nan);
    _mm_storel_epi64((__m128i *)(y + (size_t)m * N + n0), _mm_packus_epi32(r, r));
}

/* The sums of four input rows' accumulators against a group of four weight rows, y[m0 + r, n0 + i]
 * from a<r><i>, rounded and stored as reduce4 + store4v do for each row: the same additions in
 * the same order, so the same bits, with the last half of the tree, the bias and the rounding done
 * once for the 16 sums instead of once a row (the reductions were ~14 % of a 16-row product).
 * fold4 over weight row i's accumulators puts input row r's lanes in block r of t_i; the
 * unpacks then add lanes (0 + 2) and (1 + 3) of two t's at once, and the shuffles those two
 * sums, so that lane i of block r ends as reduce4's lane i of row r. */
static inline void store16(__m512 t0, __m512 t1, __m512 t2, __m512 t3, const uint16_t *bias, uint16_t *y, int N,
                           int n0, int m0) {
    const __m512 v01 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
    const __m512 v23 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t2), _mm512_castps_pd(t3))),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t2), _mm512_castps_pd(t3))));
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(v01, v23, 0x88), _mm512_shuffle_ps(v01, v23, 0xDD));
    if (n0 + 4 > N) { /* the last group, padded: only its rows that exist */
        float t[16];
        _mm512_storeu_ps(t, z);
        for (int r = 0; r < 4; r++) store4(t + 4 * r, bias, y, N, n0, m0 + r);
        return;
    }
    if (bias)
        z = _mm512_add_ps(z, _mm512_broadcast_f32x4(_mm_castsi128_ps(
                                 _mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(bias + n0))), 16))));
    /* rounded as store4v rounds (common.h), then row r's four bf16 in its 64 bits */
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rnd_bf16x16(z)), 16));
    const __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
    _mm_storel_epi64((__m128i *)(y + (size_t)m0 * N + n0), lo);
    _mm_storeh_pd((double *)(y + (size_t)(m0 + 1) * N + n0), _mm_castsi128_pd(lo));
    _mm_storel_epi64((__m128i *)(y + (size_t)(m0 + 2) * N + n0), hi);
    _mm_storeh_pd((double *)(y + (size_t)(m0 + 3) * N + n0), _mm_castsi128_pd(hi));
}

/* one group of four weight rows (packed, Kb blocks of 32) against input rows m0 .. m0+MR;
 * MR (1..6) is a constant at each call site.  The 24 accumulators are named variables, not
 * an array: GCC kept an array on the stack and spilled it every iteration (3x slower).  Six
 * input rows make 24 dot products per block of four weight vectors and six input loads, so
 * a step of many rows (a verification pass, a batch) is bound by the dot products, not by
 * the loads; the weights of the group stay in L1 for the next block of rows. */
#define DOT4(J)                                                                                                  \
    if (MR > J) {                                                                                                \
        const __m512bh xv = (__m512bh)(tail ? _mm512_maskz_loadu_epi16(km, x + (size_t)(m0 + J) * K + k)           \
                                            : _mm512_loadu_si512(x + (size_t)(m0 + J) * K + k));                  \
        a##J##0 = _mm512_dpbf16_ps(a##J##0, w0, xv);                                                            \
        a##J##1 = _mm512_dpbf16_ps(a##J##1, w1, xv);                                                            \
        a##J##2 = _mm512_dpbf16_ps(a##J##2, w2, xv);                                                            \
        a##J##3 = _mm512_dpbf16_ps(a##J##3, w3, xv);                                                            \
    }
#define STORE4(J)                                                                                                \
    if (MR > J) {                                                                                                \
        store4v(reduce4(a##J##0, a##J##1, a##J##2, a##J##3), bias, y, N, n0, m0 + J);                          \
    }
static inline __attribute__((always_inline)) void group(int MR, int K, int Kb, const uint16_t *x, const uint16_t *w,
                                                        const uint16_t *bias, uint16_t *y, int N, int n0, int m0,
                                                        const char *pf, int far) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    __m512 a40 = a00, a41 = a00, a42 = a00, a43 = a00, a50 = a00, a51 = a00, a52 = a00, a53 = a00;
    /* full blocks of 32 columns, then the last, partial one (K not a multiple of 32) under a mask */
#define BLOCK(TAIL)                                                                                              \
    {                                                                                                            \
        const int k = kb * 32, tail = TAIL;                                                                      \
        const __mmask32 km = TAIL ? (__mmask32)((1u << (K - k)) - 1u) : (__mmask32)0xffffffffu;                  \
        const uint16_t *wb = w + (size_t)kb * 128;                                                               \
        if (pf && far) {                                                                                         \
            _mm_prefetch(pf + kb * 256, _MM_HINT_T1), _mm_prefetch(pf + kb * 256 + 64, _MM_HINT_T1);             \
            _mm_prefetch(pf + kb * 256 + 128, _MM_HINT_T1), _mm_prefetch(pf + kb * 256 + 192, _MM_HINT_T1);      \
        } else if (pf) {                                                                                         \
            _mm_prefetch(pf + kb * 256, _MM_HINT_T0), _mm_prefetch(pf + kb * 256 + 64, _MM_HINT_T0);             \
            _mm_prefetch(pf + kb * 256 + 128, _MM_HINT_T0), _mm_prefetch(pf + kb * 256 + 192, _MM_HINT_T0);      \
        }                                                                                                        \
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb), w1 = (__m512bh)_mm512_loadu_si512(wb + 32);       \
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wb + 64), w3 = (__m512bh)_mm512_loadu_si512(wb + 96);   \
        DOT4(0) DOT4(1) DOT4(2) DOT4(3) DOT4(4) DOT4(5)                                                          \
    }
    const int full = K / 32;
    int kb = 0;
    for (; kb < full; kb++) BLOCK(0)
    if (kb < Kb) BLOCK(1)
#undef BLOCK
    if (MR >= 4) {
        store16(fold4(a00, a10, a20, a30), fold4(a01, a11, a21, a31), fold4(a02, a12, a22, a32),
                fold4(a03, a13, a23, a33), bias, y, N, n0, m0);
    } else {
        STORE4(0)
        STORE4(1)
        STORE4(2)
        STORE4(3)
    }
    STORE4(4)
    STORE4(5)
}

/* all M input rows against one group, in blocks of at most six rows of near-equal size
 * (8 rows: 4 + 4, not 6 + 2).  The first block also prefetches the next group's weights (into
 * L1): with several blocks the later ones compute from L1 and would otherwise leave the memory
 * idle (16 rows over all of SmolLM2-135M's weights, from memory: 17.8 -> 10.7 ms; oneDNN 12.4),
 * and with one block the hardware prefetchers alone kept ~0.8x of the machine's streaming rate
 * (one row over all weights, interleaved A/B: 7.5 -> 6.6 ms at ~39 GB/s, 6.2 -> 5.2 at ~53;
 * the next group, 4.6-12 KB ahead, beat 2 and 8 KB ahead, and L1 beat L2 and non-temporal;
 * prefetching the next matrix's first group before each barrier of decode_stack gained nothing).
 * From FAR_ROWS rows on, the first block prefetches FAR_GROUPS groups ahead into L2 instead: on
 * the AVX-512 EPYC (Zen 4, no AMX) the L1 prefetch of the next group left a pass's loads and dot
 * products almost serial (all of the default model's weights, old and new kernels interleaved,
 * bench/results/linear_avx512_prefetch.md: 6 rows 12.96 -> 7.51 ms, 8 rows 17.09 -> 10.60, 16 rows
 * 23.84 -> 15.34; 1-3 rows were as fast or faster with the L1 prefetch; 2-8 groups ahead measured
 * alike, 16 into L3 slower). */
#ifndef FAR_ROWS
#define FAR_ROWS 4
#endif
#ifndef FAR_GROUPS
#define FAR_GROUPS 3
#endif
static void rows(int M, int N, int K, int Kb, const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int n0) {
    const int blocks = (M + 5) / 6, far = M >= FAR_ROWS;
    for (int b = 0, m0 = 0; b < blocks; b++) {
        const int mr = (M - m0) / (blocks - b) + ((M - m0) % (blocks - b) ? 1 : 0);
        const char *pf = b == 0 ? (const char *)(w + (size_t)(far ? FAR_GROUPS : 1) * Kb * 128) : NULL;
        switch (mr) {
        case 6: group(6, K, Kb, x, w, bias, y, N, n0, m0, pf, far); break;
        case 5: group(5, K, Kb, x, w, bias, y, N, n0, m0, pf, far); break;
        case 4: group(4, K, Kb, x, w, bias, y, N, n0, m0, pf, far); break;
        case 3: group(3, K, Kb, x, w, bias, y, N, n0, m0, pf, far); break;
        case 2: group(2, K, Kb, x, w, bias, y, N, n0, m0, pf, far); break;
        default: group(1, K, Kb, x, w, bias, y, N, n0, m0, pf, far); break;
        }
        m0 += mr;
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA without AVX512-BF16 (most laptops and desktops, Skylake/Cascade Lake servers, AMD
 * before Zen 4): a layout and kernel of their own (pack_linear's `path` 1; 3 where the tiles are
 * AVX-512F's, below: with AVX-512F and no AVX512-BF16, or with AVX512-BF16 whose vdpbf16ps is
 * slow, linear_choose), in the form of a GEMM micro-kernel rather than dot products:
 *
 *   packed [N/16][K][8][2]: panels of 16 output rows; per column k, the 32-bit lane j holds
 *   W[16p + j][k] (low half) and W[16p + 8 + j][k] (high half).  N is padded to a multiple of
 *   16 with zeros; K is not padded.
 *
 * A shift (lanes' low halves) and a mask (high halves) make two fp32 vectors of eight output rows
 * each; every input row's x[k], converted to fp32 once per call, is broadcast and multiplied into
 * one accumulator per (input row, eight output rows).  Each output's sum is then one chain of
 * FMAs over k = 0 .. K-1, the same whatever the number of rows or the tile, so a row of a
 * verification pass has the bits of a one-token step.  Tiles: one input row against four panels
 * (8 accumulators: the FMA latency hidden), two rows against two, 3-6 rows against one panel
 * (6 rows: 12 accumulators, the two weight vectors and a broadcast in the 16 registers).
 *
 * Measured on an AVX2-only AMD EPYC (2 cores, ~17 GB/s streaming): the dot-product kernel this
 * replaced (4 weight rows x 2 input rows per step, two conversions per weight vector and per
 * input vector) reached ~24 GMAC/s a core on L2-resident matrices; this one ~34 (peak 44), and
 * over all of SmolLM2-135M's matrices from memory (alternating, medians): 1 row 15.2 -> 12.7 ms,
 * 4 rows 19.1 -> 15.5, 8 rows 27.5 -> 19.1, 16 rows 52.6 -> 30.2 (bench/results/linear_avx2.md). */
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>

/* MR input rows (m0 ..) against P panels (from w, `ps` elements apart), MR and P constants at each
 * call site; the accumulators are named variables (an array was kept on the stack).  Two columns a
 * loop turn: one 64-byte line of each panel, prefetched 1 KB ahead (512 and 2048 measured no
 * better on the EPYC). */
#define PANEL_COL(Q)                                                                                             \
    if (P > Q) {                                                                                                 \
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wk + (size_t)Q * ps));                            \
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                                          \
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));          \
        PANEL_FMA(0, Q) PANEL_FMA(1, Q) PANEL_FMA(2, Q) PANEL_FMA(3, Q) PANEL_FMA(4, Q) PANEL_FMA(5, Q)                \
    }
#define PANEL_STORE(R, Q)                                                                                        \
    if (MR > R && P > Q) {                                                                                       \
        const int n = N - n0 - 16 * Q;                                                                           \
        uint16_t *yr = y + (size_t)(m0 + R) * N + n0 + 16 * Q;                                                   \
        const uint16_t *bb = bias ? bias + n0 + 16 * Q : NULL;                                                   \
        store8(a##R##Q##e, bb, yr, n);                                                                           \
        if (n > 8) store8(a##R##Q##o, bb ? bb + 8 : NULL, yr + 8, n - 8);                                        \
    }
#define PANEL_STORES(R) PANEL_STORE(R, 0) PANEL_STORE(R, 1) PANEL_STORE(R, 2) PANEL_STORE(R, 3)
/* a tile's walk over the columns k (weights at w, panels `ps` apart, NP of them), COLS the work of
 * column k (its lines at wk): two columns a loop turn, each panel's line prefetched 1 KB ahead, or
 * with `pf` this block's share of the next panel, one line every `every` turns; then an odd last column */
#define PANEL_COLUMNS(COLS, NP)                                                                                  \
    int k = 0;                                                                                                   \
    for (int c = 0; k + 2 <= K; k += 2) {                                                                        \
        const uint16_t *wk = w + (size_t)k * 16;                                                                 \
        if (!pf)                                                                                                 \
            for (int q = 0; q < (NP); q++) _mm_prefetch((const char *)(wk + q * ps) + 1024, _MM_HINT_T0);        \
        else if (++c == every)                                                                                   \
            c = 0, _mm_prefetch(pf, _MM_HINT_T0), pf += 64;                                                      \
        COLS                                                                                                     \
        wk += 16, k++;                                                                                           \
        COLS                                                                                                     \
        k--;                                                                                                     \
    }                                                                                                            \
    if (k < K) {                                                                                                 \
        const uint16_t *wk = w + (size_t)k * 16;                                                                 \
        COLS                                                                                                     \
    }
static inline __attribute__((always_inline)) void panel_tile(int MR, int P, int K, const float *x, const uint16_t *w,
                                                              size_t ps, const uint16_t *bias, uint16_t *y, int N,
                                                              int n0, int m0, const char *pf, int every) {
    const __m256 z = _mm256_setzero_ps();
    PANEL_DECL(0) PANEL_DECL(1) PANEL_DECL(2) PANEL_DECL(3) PANEL_DECL(4) PANEL_DECL(5)
    const float *xr = x + (size_t)m0 * K;
    PANEL_COLUMNS(PANEL_COL(0) PANEL_COL(1) PANEL_COL(2) PANEL_COL(3), P)
    PANEL_STORES(0) PANEL_STORES(1) PANEL_STORES(2) PANEL_STORES(3) PANEL_STORES(4) PANEL_STORES(5)
}

/* each tile shape a function of its own: inlined together into one dispatcher, GCC allocated the
 * 6-row tile's registers worse (19 GMAC/s a core against 34 alone) */
#define PANEL_FN(A, B)                                                                                           \
    static __attribute__((noinline)) void panel_##A##x##B(int K, const float *x, const uint16_t *w, size_t ps,   \
                                                           const uint16_t *bias, uint16_t *y, int N, int n0,     \
                                                           int m0, const char *pf, int every) {                  \
        panel_tile(A, B, K, x, w, ps, bias, y, N, n0, m0, pf, every);                                            \
    }
PANEL_FN(1, 4) PANEL_FN(1, 3) PANEL_FN(1, 2) PANEL_FN(1, 1) PANEL_FN(2, 2) PANEL_FN(2, 1) PANEL_FN(3, 1)
PANEL_FN(4, 1) PANEL_FN(5, 1) PANEL_FN(6, 1)
#undef PANEL_FN

/* The same tiles on 512-bit vectors (AVX-512F), two panels at a time: a column's 256-bit lines of
 * panels 2Q and 2Q + 1 side by side in one vector (lanes 0-7 panel 2Q, 8-15 panel 2Q + 1), split by
 * the same shift and mask, each input row's x[k] broadcast over 16 lanes.  Every output is still
 * one chain of FMAs over k = 0 .. K-1, each FMA the one the 256-bit tile does (an FMA rounds once
 * whatever the vector width), so both tiles give the same bits: a panel run by either, a row by
 * any tile.  Where the dot products of vdpbf16ps are slow (linear_choose: 0.45 a cycle on the
 * AVX512-BF16 Xeon without AMX of 2026-12-02, the FMAs 1.8), these FMAs run the multi-row products
 * of a verification pass about twice as fast; one row is bound by the weights' bytes either way. */
#ifdef __AVX512F__
#define WIDE_DECL(R) __m512 b##R##0e = zz, b##R##0o = zz, b##R##1e = zz, b##R##1o = zz;
#define WIDE_FMA(R, Q)                                                                                           \
    if (MR > R) {                                                                                                \
        const __m512 b = _mm512_set1_ps(xr[(size_t)R * K + k]);                                                  \
        b##R##Q##e = _mm512_fmadd_ps(we, b, b##R##Q##e);                                                         \
        b##R##Q##o = _mm512_fmadd_ps(wo, b, b##R##Q##o);                                                         \
    }
#define WIDE_COL(Q)                                                                                              \
    if (PP > Q) {                                                                                                \
        const __m512i v = _mm512_inserti64x4(                                                                    \
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wk + (size_t)(2 * Q) * ps))),            \
            _mm256_loadu_si256((const __m256i *)(wk + (size_t)(2 * Q + 1) * ps)), 1);                            \
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                        \
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));        \
        WIDE_FMA(0, Q) WIDE_FMA(1, Q) WIDE_FMA(2, Q) WIDE_FMA(3, Q) WIDE_FMA(4, Q) WIDE_FMA(5, Q)                \
    }
static inline __m256 wide_half(__m512 v, int h) {
    return h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)) : _mm512_castps512_ps256(v);
}
#define WIDE_STORE(R, Q)                                                                                         \
    if (MR > R && PP > Q)                                                                                        \
        for (int h = 0; h < 2; h++) {                                                                            \
            const int n = N - n0 - 16 * (2 * Q + h);                                                             \
            if (n <= 0) break;                                                                                   \
            uint16_t *yr = y + (size_t)(m0 + R) * N + n0 + 16 * (2 * Q + h);                                     \
            const uint16_t *bb = bias ? bias + n0 + 16 * (2 * Q + h) : NULL;                                     \
            store8(wide_half(b##R##Q##e, h), bb, yr, n);                                                         \
            if (n > 8) store8(wide_half(b##R##Q##o, h), bb ? bb + 8 : NULL, yr + 8, n - 8);                      \
        }
#define WIDE_STORES(R) WIDE_STORE(R, 0) WIDE_STORE(R, 1)
static inline __attribute__((always_inline)) void wide_tile(int MR, int PP, int K, const float *x, const uint16_t *w,
                                                             size_t ps, const uint16_t *bias, uint16_t *y, int N,
                                                             int n0, int m0, const char *pf, int every) {
    const __m512 zz = _mm512_setzero_ps();
    WIDE_DECL(0) WIDE_DECL(1) WIDE_DECL(2) WIDE_DECL(3) WIDE_DECL(4) WIDE_DECL(5)
    const float *xr = x + (size_t)m0 * K;
    PANEL_COLUMNS(WIDE_COL(0) WIDE_COL(1), 2 * PP)
    WIDE_STORES(0) WIDE_STORES(1) WIDE_STORES(2) WIDE_STORES(3) WIDE_STORES(4) WIDE_STORES(5)
}
#define WIDE_FN(A, B)                                                                                            \
    static __attribute__((noinline)) void wide_##A##x##B(int K, const float *x, const uint16_t *w, size_t ps,    \
                                                          const uint16_t *bias, uint16_t *y, int N, int n0,      \
                                                          int m0, const char *pf, int every) {                   \
        wide_tile(A, B, K, x, w, ps, bias, y, N, n0, m0, pf, every);                                             \
    }
WIDE_FN(1, 2) WIDE_FN(1, 1) WIDE_FN(2, 2) WIDE_FN(2, 1) WIDE_FN(3, 1) WIDE_FN(4, 1) WIDE_FN(5, 1) WIDE_FN(6, 1)
#undef WIDE_FN
#undef WIDE_DECL
#undef WIDE_FMA
#undef WIDE_COL
#undef WIDE_STORE
#undef WIDE_STORES
static const int panel_wide = 1; /* the 512-bit tiles (above) where the build has them */
#else
static const int panel_wide = 0;
#endif

/* rows m0 .. m0 + mr against panels p .. p + np (np <= the tile's width for mr); with `pf`, the tile
 * prefetches one line of it every `every` loop turns instead of its own panels ahead */
static void panel_run(int mr, int np, int K, const float *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                      int N, int p, int m0, const char *pf, int every) {
    const size_t ps = (size_t)K * 16;
    const uint16_t *w = wp + (size_t)p * ps;
    const int n0 = 16 * p;
#ifdef __AVX512F__
    if (np >= 2) { /* the pairs of panels on 512-bit tiles, an odd last one on the 256-bit tile */
#define WIDE_CASE(A, B)                                                                                              if (mr == A && np / 2 == B) {                                                                                        wide_##A##x##B(K, x, w, ps, bias, y, N, n0, m0, pf, every);                                                      if (np % 2) panel_run(mr, 1, K, x, wp, bias, y, N, p + 2 * B, m0, NULL, 1);                                      return;                                                                                                      }
        WIDE_CASE(1, 2) WIDE_CASE(1, 1) WIDE_CASE(2, 2) WIDE_CASE(2, 1) WIDE_CASE(3, 1) WIDE_CASE(4, 1)
        WIDE_CASE(5, 1) WIDE_CASE(6, 1)
#undef WIDE_CASE
    }
#endif
#define PANEL_CASE(A, B)                                                                                         \
    if (mr == A && np == B) {                                                                                    \
        panel_##A##x##B(K, x, w, ps, bias, y, N, n0, m0, pf, every);                                             \
        return;                                                                                                  \
    }
    PANEL_CASE(1, 4) PANEL_CASE(1, 3) PANEL_CASE(1, 2) PANEL_CASE(1, 1) PANEL_CASE(2, 2) PANEL_CASE(2, 1)
    PANEL_CASE(3, 1) PANEL_CASE(4, 1) PANEL_CASE(5, 1) PANEL_CASE(6, 1)
#undef PANEL_CASE
}

/* the panels' width a tile of `mr` rows takes */
static inline int panel_width(int mr) { return panel_wide ? (mr <= 2 ? 4 : 2) : mr == 1 ? 4 : mr == 2 ? 2 : 1; }

/* outputs n0 .. n1 (those below N) of all M rows, one at a time, the same chains of FMAs as the
 * tiles (where there is no memory for the fp32 copy of the input rows) */
static void panel_scalar(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                         int n0, int n1) {
    for (int m = 0; m < M; m++)
        for (int n = n0; n < n1 && n < N; n++) {
            const uint16_t *w = wp + (size_t)(n / 16) * K * 16 + (n % 8) * 2 + (n % 16) / 8;
            float s = 0.0f;
            for (int k = 0; k < K; k++) s = fmaf(bf16_to_f32(w[(size_t)k * 16]), bf16_to_f32(x[(size_t)m * K + k]), s);
            y[(size_t)m * N + n] = f32_to_bf16(bias ? s + bf16_to_f32(bias[n]) : s);
        }
}

/* each thread's fp32 copy of the input rows: at most PANEL_XROWS at a time (thread_floats) */
enum { PANEL_XROWS = 60 };

/* linear_team on the panel layout: this thread's share of the panels (contiguous, equal counts),
 * input rows in chunks of up to PANEL_XROWS converted to fp32, then panels in runs that fit the L2
 * (each re-read from it by the chunk's blocks of <= 6 rows, near-equal: 8 rows = 4 + 4). */
static void panel_team(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y) {
    const int np = (N + 15) / 16, T = omp_get_num_threads(), t = omp_get_thread_num();
    const int p0 = (int)((long)np * t / T), p1 = (int)((long)np * (t + 1) / T);
    if (p0 >= p1 || M <= 0) return;
    float *const panel_x = thread_floats((size_t)(M < PANEL_XROWS ? M : PANEL_XROWS) * K);
    if (!panel_x) { /* no memory for the copy */
        panel_scalar(M, N, K, x, wp, bias, y, 16 * p0, 16 * p1);
        return;
    }
    const int run = (int)(262144 / ((size_t)K * 32)) > 1 ? (int)(262144 / ((size_t)K * 32)) : 1; /* panels per 256 KB */
    for (int r0 = 0; r0 < M; r0 += PANEL_XROWS) {
        const int mc = M - r0 < PANEL_XROWS ? M - r0 : PANEL_XROWS, blocks = (mc + 5) / 6;
        const uint16_t *xs = x + (size_t)r0 * K;
        for (size_t i = 0; i < (size_t)mc * K; i++) panel_x[i] = bf16_to_f32(xs[i]);
        uint16_t *yc = y + (size_t)r0 * N;
        if (blocks > 1 && blocks <= 4) {
            /* a panel at a time, its blocks spreading the prefetch of the next panel between them
             * (block b: its b-th share of the lines), so the memory streams while every block
             * computes (all weights from memory, 8 rows: 29.2 -> 24.6 ms); runs of panels with each
             * block's own prefetch left the memory idle while the blocks after the first computed
             * from the L2.  More blocks (prefill) are compute-bound, and runs did better there
             * (32 rows 80 against 90 ms, 256 rows 609 against 675). */
            const int step = panel_wide ? 2 : 1; /* panels a turn: a pair on the 512-bit tiles */
            const int lines = (K * 32 * step + 63) / 64, share = (lines + blocks - 1) / blocks;
            const int every = share * 2 < K ? K / (share * 2) : 1; /* turns (2 columns) per line of a share */
            for (int p = p0; p < p1; p += step) {
                const int np_ = p1 - p < step ? p1 - p : step;
                const char *next = p + np_ < p1 ? (const char *)(wp + (size_t)(p + np_) * K * 16) : NULL;
                for (int b = 0, m0 = 0; b < blocks; b++) {
                    const int mr = (mc - m0) / (blocks - b) + ((mc - m0) % (blocks - b) ? 1 : 0);
                    panel_run(mr, np_, K, panel_x, wp, bias, yc, N, p, m0, next ? next + (size_t)b * share * 64 : NULL,
                              every);
                    m0 += mr;
                }
            }
            continue;
        }
        for (int pc = p0; pc < p1; pc += run) {
            const int pe = pc + run < p1 ? pc + run : p1;
            for (int b = 0, m0 = 0; b < blocks; b++) {
                const int mr = (mc - m0) / (blocks - b) + ((mc - m0) % (blocks - b) ? 1 : 0), width = panel_width(mr);
                for (int p = pc; p < pe; p += width)
                    panel_run(mr, pe - p < width ? pe - p : width, K, panel_x, wp, bias, yc, N, p, m0, NULL, 1);
                m0 += mr;
            }
        }
    }
}

/* The logits of panel g (head rows 16g .. 16g + 16 in the panel layout, no bias) for all M input
 * rows, the bits panel_team gives them (the greedy heads' exact rows); xf: room for
 * min(M, PANEL_XROWS) x K floats, or NULL (then one output at a time, the same chains of FMAs). */
static void panel_exact(int M, int V, int K, const uint16_t *x, const uint16_t *wp, int g, uint16_t *y, float *xf) {
    if (xf) {
        for (int r0 = 0; r0 < M; r0 += PANEL_XROWS) { /* the fp32 copy of (at most PANEL_XROWS) input rows */
            const int mc = M - r0 < PANEL_XROWS ? M - r0 : PANEL_XROWS, blocks = (mc + 5) / 6;
            for (size_t i = 0; i < (size_t)mc * K; i++) xf[i] = bf16_to_f32(x[(size_t)r0 * K + i]);
            for (int b = 0, m0 = 0; b < blocks; b++) {
                const int mr = (mc - m0) / (blocks - b) + ((mc - m0) % (blocks - b) ? 1 : 0);
                panel_run(mr, 1, K, xf, wp, NULL, y + (size_t)r0 * V, V, g, m0, NULL, 1);
                m0 += mr;
            }
        }
        return;
    }
    panel_scalar(M, V, K, x, wp, NULL, y, 16 * g, 16 * g + 16);
}
#define LINEAR_PANELS 1
#endif

#ifdef __AVX512BF16__
/* Whether linear_team runs the panels (path 3) instead of vdpbf16ps's dot products (path 2): chosen
 * once per process, when the library loads, by timing both instructions on this CPU (about a
 * millisecond).  A dot-product instruction does 32 multiply-adds where an FMA does 16, and a
 * panel tile spends about 2.5 vector operations per 32 (two FMAs, its share of the shift, mask
 * and insert), so the panels win where FMAs issue more than 2.5 times as often as vdpbf16ps:
 * measured 4.0x on an AVX512-BF16 Xeon without AMX (1.3 G vdpbf16ps/s a core against 5.4 G FMAs),
 * while on the Zen 4 EPYC the dot kernel reached ~23 multiply-adds a cycle.  CODECOMPLETE_LINEAR=
 * panels or dot sets it (a comparison's switch: the two give different bits, so a model is packed
 * and generated with one). */
static int use_panels;

static double probe_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* instructions a second: n turns of twelve independent vdpbf16ps (dot) or FMAs */
__attribute__((noinline)) static double probe_rate(int dot, int n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512bh h = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    const double t0 = probe_now();
#define PROBE(OP)                                                                                                \
    for (int i = 0; i < n; i++) {                                                                                \
        a0 = OP(a0), a1 = OP(a1), a2 = OP(a2), a3 = OP(a3), a4 = OP(a4), a5 = OP(a5);                            \
        a6 = OP(a6), a7 = OP(a7), a8 = OP(a8), a9 = OP(a9), a10 = OP(a10), a11 = OP(a11);                        \
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),     \
                         "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));                                              \
    }
#define DOT_OP(a) _mm512_dpbf16_ps(a, h, h)
#define FMA_OP(a) _mm512_fmadd_ps(a, one, one)
    if (dot) {
        PROBE(DOT_OP)
    } else {
        PROBE(FMA_OP)
    }
#undef PROBE
#undef DOT_OP
#undef FMA_OP
    const double dt = probe_now() - t0;
    volatile float sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a11), _mm512_add_ps(a5, a7)));
    (void)sink, (void)a1, (void)a2, (void)a3, (void)a4, (void)a6, (void)a8, (void)a9, (void)a10;
    return dt > 0.0 ? 12.0 * n / dt : 0.0;
}

static double probe_dot_rate, probe_fma_rate;

__attribute__((constructor)) static void linear_choose(void) {
    for (int i = 0; i < 5; i++) { /* interleaved, the best of each: a busy core slows both alike */
        const double d = probe_rate(1, 20000), f = probe_rate(0, 20000);
        probe_dot_rate = d > probe_dot_rate ? d : probe_dot_rate;
        probe_fma_rate = f > probe_fma_rate ? f : probe_fma_rate;
    }
    const char *e = getenv("CODECOMPLETE_LINEAR");
    if (e && !strcmp(e, "panels")) use_panels = 1;
    else if (e && !strcmp(e, "dot")) use_panels = 0;
    else use_panels = probe_fma_rate > 2.5 * probe_dot_rate;
}

/* whether the bf16 products avoid vdpbf16ps here (linear_choose): decode_attention.c's pairs too */
int bf16_dot_slow(void) { return use_panels; }

/* what linear_choose measured: vdpbf16ps (0) or FMAs (1) a second on one core */
double linear_probe_rate(int which) { return which ? probe_fma_rate : probe_dot_rate; }
#else
double linear_probe_rate(int which) {
    (void)which;
    return 0.0;
}
int bf16_dot_slow(void) { return 0; }
#endif

#if !defined(__AVX512BF16__) && !defined(LINEAR_PANELS)
static void rows(int M, int N, int K, int Kb, const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int n0) {
    for (int m = 0; m < M; m++) {
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int kb = 0; kb < Kb; kb++) {
            const int k = kb * 32, n = K - k < 32 ? K - k : 32;
            const uint16_t *xr = x + (size_t)m * K + k;
            for (int i = 0; i < 4; i++) {
                const uint16_t *wr = w + (size_t)kb * 128 + i * 32;
                float d = 0.0f;
#pragma omp simd reduction(+ : d)
                for (int e = 0; e < n; e++) d += bf16_to_f32(wr[e]) * bf16_to_f32(xr[e]);
                s[i] += d;
            }
        }
        store4(s, bias, y, N, n0, m);
    }
}
#endif

/* x [M, K], packed weights of a [N, K] matrix (layout above), bias [N] or NULL, y [M, N];
 * all bf16, x and y contiguous.  Called inside a parallel region (decode_stack), the threads
 * share the groups of four weight rows (each a contiguous half of the matrix for two
 * threads) and do not wait for each other at the end: the caller places the barrier. */
void linear_team(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y) {
#if defined(__AVX512BF16__)
    if (use_panels) { /* the panel layout (linear_choose) */
        panel_team(M, N, K, x, wp, bias, y);
        return;
    }
#endif
#if defined(LINEAR_PANELS) && !defined(__AVX512BF16__)
    panel_team(M, N, K, x, wp, bias, y); /* the AVX2 layout (above) */
#else
    const int Kb = (K + 31) / 32, groups = (N + 3) / 4;
#pragma omp for schedule(static) nowait
    for (int g = 0; g < groups; g++) rows(M, N, K, Kb, x, wp + (size_t)g * Kb * 128, bias, y, 4 * g);
#endif
}

/* linear_team in a parallel region of its own */
void linear_bf16(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y) {
#pragma omp parallel
    linear_team(M, N, K, x, wp, bias, y);
}

/* ---- AMX: the same product on the tile unit (Sapphire Rapids and later) ----
 *
 * Measured on an AMX machine of this project (2 vCPUs, ~23 GB/s streaming): the kernel above
 * takes 11 ms for one row over SmolLM2-135M's 269 MB and 1.5x that for two rows (the AVX-512
 * dot products and reductions do not keep up with the loads there), oneDNN's prepacked bf16
 * kernel ~15.5 ms for 1-8 rows; TDPBF16PS on tiles streamed the same weights in ~9.5 ms for
 * any 1-16 rows.  So on such a machine every row count of the layer matrices runs here: a
 * verification pass of 16 rows costs the linear layers what a one-token step costs, and every
 * row of a pass gets the bits of a one-token step (each row's sums are its own, in the same
 * order whatever M is).
 *
 *   packed [N/16][K/32][16][16][2]: per group of 16 output rows and block of 32 columns, one
 *   1 KB tile in the unit's pair-interleaved ("VNNI") layout: tile row r holds columns 2r and
 *   2r + 1 of each of the 16 output rows.  N is padded to a multiple of 32 (two tiles share
 *   each load of the input), K must be a multiple of 32 (model/native/__init__.py packs this
 *   layout only then).
 *
 * Each thread configures its tiles at every call (16-row chunks and the remaining rows on tiles of
 * their own, so any M streams the weights once) and releases them at the end.  Linux grants the
 * tile state per process on request (amx_enable). */
#ifdef CODECOMPLETE_AMX
#include <sys/syscall.h>
#include <unistd.h>

/* tiles 0, 1: sums of 16-row chunks (or of all rows, M < 16), 2: their input, 3, 4: weights,
 * 5, 6, 7: the same as 0, 1, 2 for the last `rem` rows (0: unused) */
static void amx_config(int rows, int rem) {
    const uint8_t r = (uint8_t)rows, m = (uint8_t)rem, tiles[8] = {r, r, r, 16, 16, m, m, m};
    amx_tiles(tiles);
}

/* rows m0 .. m0 + mr of y, output rows n0 .. n0 + width (one or two tiles' sums, 16 or 32), each
 * sum times its output row's scale where sc0 is given (int8 weights: sc0 for the first 16 rows, sc1
 * for the next) (+ bias), rounded as f32_to_bf16 rounds */
static inline void amx_store_scaled(const float *c, int mr, int m0, int n0, int width, int N, const float *sc0,
                                    const float *sc1, const uint16_t *bias, uint16_t *y) {
    for (int i = 0; i < mr; i++) {
        for (int h = 0; h < width; h += 16) {
            const int n = n0 + h;
            if (n >= N) break;
            __m512 s = _mm512_loadu_ps(c + (size_t)(h / 16) * 256 + (size_t)i * 16);
            if (sc0) s = _mm512_mul_ps(s, _mm512_loadu_ps(h ? sc1 : sc0));
            const __mmask16 km = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1u);
            if (bias) s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                                               _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(km, bias + n)), 16)));
            const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(rnd_bf16x16(s)), 16); /* f32_to_bf16's bits */
            _mm256_mask_storeu_epi16(y + (size_t)(m0 + i) * N + n, km, _mm512_cvtepi32_epi16(r));
        }
    }
}

static inline void amx_store(const float *c, int mr, int m0, int n0, int width, int N, const uint16_t *bias, uint16_t *y) {
    amx_store_scaled(c, mr, m0, n0, width, N, NULL, NULL, bias, y);
}

/* every pair of groups against all M rows: 16-row chunks, then the remaining rows on their own
 * tiles, while the pair's weights are in cache (one pass over the weights for any M) */
#define AMX_CHUNK(C0, C1, A, XR)                                                                                 \
    {                                                                                                            \
        _tile_zero(C0);                                                                                          \
        _tile_zero(C1);                                                                                          \
        for (int kb = 0; kb < Kb; kb++) {                                                                        \
            if (first) { /* the pair's next weights, a few tiles ahead (past its end: the next pair's) */        \
                const char *p0 = (const char *)(w0 + (size_t)(kb + 4) * 512), *p1 = (const char *)(w1 + (size_t)(kb + 4) * 512); \
                for (int l = 0; l < 1024; l += 64) _mm_prefetch(p0 + l, _MM_HINT_T0), _mm_prefetch(p1 + l, _MM_HINT_T0); \
            }                                                                                                    \
            _tile_loadd(A, (XR) + kb * 32, K * 2);                                                               \
            _tile_loadd(3, w0 + (size_t)kb * 512, 64);                                                           \
            _tile_loadd(4, w1 + (size_t)kb * 512, 64);                                                           \
            _tile_dpbf16ps(C0, A, 3);                                                                            \
            _tile_dpbf16ps(C1, A, 4);                                                                            \
        }                                                                                                        \
        _tile_stored(C0, c, 64);                                                                                 \
        _tile_stored(C1, c + 256, 64);                                                                           \
        first = 0;                                                                                               \
    }

/* linear_team for weights packed in the AMX layout (K a multiple of 32) */
void linear_team_amx(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y) {
    const int Kb = K / 32, pairs = (N + 31) / 32, full = M / 16, rem = M % 16;
    float c[512];
    amx_config(full ? 16 : rem, full ? rem : 0);
#pragma omp for schedule(static) nowait
    for (int p = 0; p < pairs; p++) {
        const uint16_t *w0 = wp + (size_t)(2 * p) * Kb * 512, *w1 = w0 + (size_t)Kb * 512;
        int first = 1;
        for (int ch = 0; ch < full; ch++) {
            AMX_CHUNK(0, 1, 2, x + (size_t)ch * 16 * K)
            amx_store(c, 16, ch * 16, 32 * p, 32, N, bias, y);
        }
        if (rem && full) {
            AMX_CHUNK(5, 6, 7, x + (size_t)full * 16 * K)
            amx_store(c, rem, full * 16, 32 * p, 32, N, bias, y);
        } else if (rem) { /* M < 16: tiles 0, 1, 2 hold M rows */
            AMX_CHUNK(0, 1, 2, x)
            amx_store(c, rem, 0, 32 * p, 32, N, bias, y);
        }
    }
    _tile_release();
}
#undef AMX_CHUNK

/* output rows n0 .. n0 + 16 (one group, weights wg) for every input row, as linear_team_amx computes
 * them (the same tile sums in the same order: the same bits); y [M, N] */
static void amx_group(int M, int N, int K, const uint16_t *x, const uint16_t *wg, int n0, uint16_t *y) {
    float c[256];
    for (int m0 = 0; m0 < M; m0 += 16) {
        const int mr = M - m0 < 16 ? M - m0 : 16;
        amx_config(mr, 0);
        _tile_zero(0);
        for (int kb = 0; kb < K / 32; kb++) {
            _tile_loadd(2, x + (size_t)m0 * K + kb * 32, K * 2);
            _tile_loadd(3, wg + (size_t)kb * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
        }
        _tile_stored(0, c, 64);
        amx_store(c, mr, m0, n0, 16, N, NULL, y);
    }
    _tile_release();
}


/* asks Linux for the tile state (once per process); 1 when granted */
int amx_enable(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}
#else
void linear_team_amx(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y) {
    (void)M, (void)N, (void)K, (void)x, (void)wp, (void)bias, (void)y; /* never called: amx_enable() is 0 */
}

static void amx_group(int M, int N, int K, const uint16_t *x, const uint16_t *wg, int n0, uint16_t *y) {
    (void)M, (void)N, (void)K, (void)x, (void)wg, (void)n0, (void)y; /* never called: amx_enable() is 0 */
}

int amx_enable(void) { return 0; }
#endif

/* linear_team_amx in a parallel region of its own */
void linear_bf16_amx(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y) {
#pragma omp parallel
    linear_team_amx(M, N, K, x, wp, bias, y);
}

/* which path linear_team takes: 2 AVX512-BF16's dot products, 3 the panels on AVX-512F's FMAs
 * (where the build has AVX-512F but not AVX512-BF16, or has both and linear_choose says so),
 * 1 the panels on AVX2 + FMA, 0 the portable loop.  1 and 3 share the layout and the bits. */
int linear_bf16_path(void) {
#if defined(__AVX512BF16__)
    return use_panels ? 3 : 2;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__)
    return 3;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* ---- The greedy head: exact logits only where the greedy choice can be ----
 *
 * A decode step reads the head (V x D bf16; 57 MB of SmolLM2-135M's 269) for one thing: the
 * greedy token.  `head_greedy_team` reads an int8 copy instead (half the bytes), bounds every
 * row's error rigorously, and computes exact logits (the bf16 kernel above, the same bits as
 * linear_team) only for the groups of four rows that could hold the maximum; every other
 * logit is written as -inf.  The argmax, ties included, is the full head's:
 *
 *   w_j = s_j q_j + d_j (q_j int8, s_j = max|w_j| / 127, d_j the rounding), x = t (a + b/256) + e
 *   (a, b int8: a 16-bit fixed-point copy of the input row, t = max|x| / 127), so
 *   x.w_j - s_j t (a + b/256).q_j = x.d_j + s_j e.q_j, |.| <= |x| |d_j| + s_j |e| |q_j|
 *
 * (Cauchy-Schwarz; |d_j| and |q_j| are stored per row), plus 2^-7 of the magnitude for the
 * fp32 sums and the bf16 rounding of the exact logit.  With T = max_j (approx_j - err_j) <= the
 * largest exact logit, a row whose approx_j + err_j < T cannot be the maximum nor tie it.
 * On SmolLM2-135M's decode states a few (median 5, at most a few hundred) of 49152 rows stay.
 *
 * The int8 copy is stored as u8 (q + 128) packed [ceil(V/16)][K/4][16][4]: each 64-byte line
 * holds four columns of sixteen rows, so vpdpbusd (u8 x s8, four products per lane) with four of
 * the input's int8 broadcast (an embedded-broadcast operand) accumulates sixteen rows' sums per
 * instruction, with no horizontal reduction; the +128 comes off as 128 x the sum of a (or b).
 * Needs AVX512-VNNI and AVX512-BF16 (head_greedy_native()). */
#if (defined(__AVX512BF16__) && defined(__AVX512VNNI__)) || defined(LINEAR_PANELS)
/* input row x [K]'s 16-bit copy (K padded to Kp with zeros): int8 halves a and b ([Kp] each at r->a,
 * r->b), or with `wide` the int16 c = 256 a + b ([Kp] at r->a, 2 Kp bytes; the AVX2 bounds); and
 * 128 x the sums of a and b, t, |x|, |e|, whether it is finite */
static void quant_row(const uint16_t *x, int K, int Kp, QRow *r, int wide) {
    float mx = 0.0f;
    int ok = 1;
    for (int i = 0; i < K; i++) {
        float v = fabsf(bf16_to_f32(x[i]));
        if (!(v <= 3.0e38f)) ok = 0;
        mx = v > mx ? v : mx;
    }
    r->ok = ok;
    const float t = mx > 0.0f ? mx / 127.0f : 1.0f;
    double xs = 0.0, es = 0.0;
    int sa = 0, sb = 0;
    for (int i = 0; i < Kp; i++) {
        float v = i < K && ok ? bf16_to_f32(x[i]) : 0.0f;
        float u = v / t, a = nearbyintf(u), b = nearbyintf((u - a) * 256.0f);
        if (a > 127.0f) a = 127.0f;
        if (a < -127.0f) a = -127.0f;
        if (b > 127.0f) b = 127.0f;
        if (b < -127.0f) b = -127.0f;
        double e = (double)v - (double)t * ((double)a + (double)b / 256.0);
        xs += (double)v * v;
        es += e * e;
        if (wide) {
            ((int16_t *)r->a)[i] = (int16_t)(256 * (int)a + (int)b);
        } else {
            r->a[i] = (int8_t)a;
            r->b[i] = (int8_t)b;
        }
        sa += (int)a;
        sb += (int)b;
    }
    r->sa = sa * 128;
    r->sb = sb * 128;
    r->t = t;
    r->xn = (float)(sqrt(xs) * (1.0 + 1e-6));
    r->en = (float)(sqrt(es) * (1.0 + 1e-3) + 1e-30);
}


/* Inside a parallel region: every input row's copy (quant_row; `wide`: the AVX2 form), each in 2 Kp
 * bytes of `bytes`; ends with the loop's barrier */
static void quant_rows(int M, int K, int Kp, const uint16_t *x, QRow *qr, int8_t *bytes, int wide) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        qr[m].a = bytes + (size_t)m * 2 * Kp;
        qr[m].b = wide ? NULL : qr[m].a + Kp;
        quant_row(x + (size_t)m * K, K, Kp, qr + m, wide);
    }
}

/* Inside a parallel region: each row's threshold T[m], the largest lower bound over the nt threads'
 * maxima thr [nt, M], or -inf (every logit computed) for a row that is not finite; ends with a barrier */
static void thresholds(int M, int nt, const float *thr, const QRow *qr, float *T) {
#pragma omp barrier
#pragma omp single
    for (int m = 0; m < M; m++) {
        float t = -INFINITY;
        for (int i = 0; i < nt; i++) t = thr[(size_t)i * M + m] > t ? thr[(size_t)i * M + m] : t;
        T[m] = qr[m].ok && t == t ? t : -INFINITY;
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <omp.h>

/* what the bounds of head rows j0 .. j0 + 16 need of them: scales, the two norms, which are rows */
typedef struct {
    __m512 s, dn, qn;
    __mmask16 live;
    int j0;
} QCols;

static inline __attribute__((always_inline)) QCols qcols(const QHead *qh, int j0, int V) {
    QCols c = {_mm512_loadu_ps(qh->scale + j0), _mm512_loadu_ps(qh->dnorm + j0), _mm512_loadu_ps(qh->qnorm + j0),
               j0 + 16 <= V ? (__mmask16)0xffff : (__mmask16)((1u << (V - j0)) - 1u), j0};
    return c;
}

/* input row r's bound of the head rows in `c` from its int8 sums sa_ (of a) and sb_ (of b) against
 * them: hi[j] = approx + err, and the running max of approx - err over the live rows */
static inline __attribute__((always_inline)) void qout(__m512i sa_, __m512i sb_, const QRow *r, const QCols *c,
                                                       float *hi, __m512 *lomax) {
    const __m512 slack = _mm512_set1_ps(1.0f / 128.0f), tiny = _mm512_set1_ps(1e-6f);
    __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sb_, _mm512_set1_epi32(r->sb))),
                                 _mm512_set1_ps(1.0f / 256.0f), _mm512_cvtepi32_ps(_mm512_sub_epi32(sa_, _mm512_set1_epi32(r->sa))));
    __m512 approx = _mm512_mul_ps(dot, _mm512_mul_ps(c->s, _mm512_set1_ps(r->t)));
    __m512 err = _mm512_fmadd_ps(c->dn, _mm512_set1_ps(r->xn), _mm512_mul_ps(_mm512_mul_ps(c->s, c->qn), _mm512_set1_ps(r->en)));
    err = _mm512_add_ps(err, _mm512_fmadd_ps(slack, _mm512_add_ps(_mm512_abs_ps(approx), err), tiny));
    _mm512_storeu_ps(hi + c->j0, _mm512_add_ps(approx, err));
    *lomax = _mm512_mask_max_ps(*lomax, c->live, *lomax, _mm512_sub_ps(approx, err));
}

/* hi[m][j] = approx + err and the running max of approx - err of rows j0 .. j0 + 16 for input
 * rows m0 .. m0 + MR (MR <= 4, a constant at each call site) */
static inline __attribute__((always_inline)) void qgroup(int MR, const QHead *qh, const QRow *qr, int m0, int g,
                                                         int V, float *hi, int Vp, __m512 *lomax) {
    const int Kq = qh->Kp / 4;
    const uint8_t *wg = qh->q + (size_t)g * Kq * 64;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const int32_t *pa0 = (const int32_t *)qr[m0].a, *pb0 = (const int32_t *)qr[m0].b;
    const int32_t *pa1 = MR > 1 ? (const int32_t *)qr[m0 + 1].a : pa0, *pb1 = MR > 1 ? (const int32_t *)qr[m0 + 1].b : pb0;
    const int32_t *pa2 = MR > 2 ? (const int32_t *)qr[m0 + 2].a : pa0, *pb2 = MR > 2 ? (const int32_t *)qr[m0 + 2].b : pb0;
    const int32_t *pa3 = MR > 3 ? (const int32_t *)qr[m0 + 3].a : pa0, *pb3 = MR > 3 ? (const int32_t *)qr[m0 + 3].b : pb0;
    for (int kq = 0; kq < Kq; kq++) {
        const __m512i w = _mm512_loadu_si512(wg + (size_t)kq * 64);
        a0 = _mm512_dpbusd_epi32(a0, w, _mm512_set1_epi32(pa0[kq]));
        b0 = _mm512_dpbusd_epi32(b0, w, _mm512_set1_epi32(pb0[kq]));
        if (MR > 1) {
            a1 = _mm512_dpbusd_epi32(a1, w, _mm512_set1_epi32(pa1[kq]));
            b1 = _mm512_dpbusd_epi32(b1, w, _mm512_set1_epi32(pb1[kq]));
        }
        if (MR > 2) {
            a2 = _mm512_dpbusd_epi32(a2, w, _mm512_set1_epi32(pa2[kq]));
            b2 = _mm512_dpbusd_epi32(b2, w, _mm512_set1_epi32(pb2[kq]));
        }
        if (MR > 3) {
            a3 = _mm512_dpbusd_epi32(a3, w, _mm512_set1_epi32(pa3[kq]));
            b3 = _mm512_dpbusd_epi32(b3, w, _mm512_set1_epi32(pb3[kq]));
        }
    }
    const QCols c = qcols(qh, g * 16, V);
    qout(a0, b0, qr + m0, &c, hi + (size_t)m0 * Vp, lomax + m0);
    if (MR > 1) qout(a1, b1, qr + m0 + 1, &c, hi + (size_t)(m0 + 1) * Vp, lomax + m0 + 1);
    if (MR > 2) qout(a2, b2, qr + m0 + 2, &c, hi + (size_t)(m0 + 2) * Vp, lomax + m0 + 2);
    if (MR > 3) qout(a3, b3, qr + m0 + 3, &c, hi + (size_t)(m0 + 3) * Vp, lomax + m0 + 3);
}

#if defined(CODECOMPLETE_AMX) && defined(__AMX_INT8__)
#define QHEAD_AMX 1
static int qhead_amx = 1; /* head_greedy_amx_set */
/* rows from which the tiles bound faster than vpdpbusd (measured on SmolLM2-135M's head, a whole
 * native step: the same at 1-3 rows, faster from 4; bench/results/greedy_head_amx.md) */
#define QHEAD_TILE_MIN 4

/* qgroup for groups g and g + 1 (where `two`) and all M <= 16 input rows on int8 tiles: TDPBSUD
 * multiplies the rows' s8 halves by the u8 weights, whose packing [Kp/4][16][4] per group is
 * already the right factor's tile layout (sixteen four-column lines per 64 columns).  Tiles 0, 1:
 * the rows' a and b (M rows of 64 bytes; qr's copies lie 2 Kp bytes apart); 2, 3: the two groups'
 * weights; 4, 5: group g's sums of a and b; 6, 7: group g + 1's.  Prefetches the next pair. */
static void qpair_amx(const QHead *qh, const QRow *qr, int M, int g, int two, int V, float *hi, int Vp,
                      __m512 *lomax) {
    const size_t gb = (size_t)qh->Kp * 16; /* one group's bytes */
    const uint8_t *w0 = qh->q + (size_t)g * gb, *w1 = w0 + gb;
    const int stride = 2 * qh->Kp;
    int32_t c[4][256];
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int kc = 0; kc < qh->Kp / 64; kc++) {
        const char *p = (const char *)(w0 + 2 * gb + (size_t)kc * 1024);
        for (int l = 0; l < 1024; l += 64) _mm_prefetch(p + l, _MM_HINT_T0), _mm_prefetch(p + gb + l, _MM_HINT_T0);
        _tile_loadd(0, qr[0].a + kc * 64, stride);
        _tile_loadd(1, qr[0].b + kc * 64, stride);
        _tile_loadd(2, w0 + (size_t)kc * 1024, 64);
        _tile_dpbsud(4, 0, 2);
        _tile_dpbsud(5, 1, 2);
        if (two) {
            _tile_loadd(3, w1 + (size_t)kc * 1024, 64);
            _tile_dpbsud(6, 0, 3);
            _tile_dpbsud(7, 1, 3);
        }
    }
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    if (two) {
        _tile_stored(6, c[2], 64);
        _tile_stored(7, c[3], 64);
    }
    for (int h = 0; h <= two; h++) {
        const QCols cols = qcols(qh, (g + h) * 16, V);
        for (int m = 0; m < M; m++)
            qout(_mm512_loadu_si512(c[2 * h] + m * 16), _mm512_loadu_si512(c[2 * h + 1] + m * 16), qr + m, &cols,
                 hi + (size_t)m * Vp, lomax + m);
    }
}
#endif

/* whether the greedy head's bounds run on int8 tiles for QHEAD_TILE_MIN .. 16 rows where they can
 * (Kp a multiple of 64, the AMX layout): `on` 0 / 1 sets it (a comparison's switch), -1 asks */
int head_greedy_amx_set(int on) {
#ifdef QHEAD_AMX
    if (on >= 0) qhead_amx = on && amx_enable();
    return qhead_amx && amx_enable();
#else
    (void)on;
    return 0;
#endif
}

/* Inside a parallel region: logits y [M, V] of x [M, K] (bf16) as described above; wp the bf16
 * head packed for linear_team, qh its int8 copy; scratch: rows (M QRow with 2 * Kp bytes each
 * at `bytes`), hi [M, Vp] floats, thr [threads, M] floats, T [M].  Ends with a barrier. */
void head_greedy_team(int M, int V, int K, const uint16_t *x, const uint16_t *wp, const QHead *qh, QRow *qr,
                      int8_t *bytes, float *hi, float *thr, float *T, uint16_t *y, int amx) {
    const int Kp = qh->Kp, Vp = (V + 15) / 16 * 16, groups = Vp / 16, Kb = (K + 31) / 32;
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    quant_rows(M, K, Kp, x, qr, bytes, 0); /* every row quantised */
#ifdef QHEAD_AMX
    if (amx && qhead_amx && M >= QHEAD_TILE_MIN && M <= 16 && Kp % 64 == 0) {
        const uint8_t tiles[8] = {(uint8_t)M, (uint8_t)M, 16, 16, (uint8_t)M, (uint8_t)M, (uint8_t)M, (uint8_t)M};
        __m512 lomax[16];
        for (int m = 0; m < M; m++) lomax[m] = _mm512_set1_ps(-INFINITY);
        amx_tiles(tiles);
#pragma omp for schedule(static) nowait
        for (int g = 0; g < groups; g += 2) qpair_amx(qh, qr, M, g, g + 1 < groups, V, hi, Vp, lomax);
        _tile_release();
        for (int m = 0; m < M; m++) thr[(size_t)tid * M + m] = _mm512_reduce_max_ps(lomax[m]);
    } else
#endif
    for (int m0 = 0; m0 < M; m0 += 64) { /* lomax lives in registers/stack: 64 rows at a time */
        const int mc = M - m0 < 64 ? M - m0 : 64;
        __m512 lomax[64];
        for (int m = 0; m < mc; m++) lomax[m] = _mm512_set1_ps(-INFINITY);
#pragma omp for schedule(static) nowait
        for (int g = 0; g < groups; g++) {
            int m = 0;
            for (; m + 4 <= mc; m += 4) qgroup(4, qh, qr + m0, m, g, V, hi + (size_t)m0 * Vp, Vp, lomax);
            switch (mc - m) {
            case 3: qgroup(3, qh, qr + m0, m, g, V, hi + (size_t)m0 * Vp, Vp, lomax); break;
            case 2: qgroup(2, qh, qr + m0, m, g, V, hi + (size_t)m0 * Vp, Vp, lomax); break;
            case 1: qgroup(1, qh, qr + m0, m, g, V, hi + (size_t)m0 * Vp, Vp, lomax); break;
            default: break;
            }
        }
        for (int m = 0; m < mc; m++) thr[(size_t)tid * M + m0 + m] = _mm512_reduce_max_ps(lomax[m]);
    }
    thresholds(M, nt, thr, qr, T); /* a non-finite row: every logit computed */
    float *xf = use_panels && !amx ? thread_floats((size_t)(M < PANEL_XROWS ? M : PANEL_XROWS) * K) : NULL;
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) { /* sixteen rows: four groups of the bf16 kernel */
        __mmask16 need = 0;
        for (int m = 0; m < M; m++)
            need |= _mm512_cmp_ps_mask(_mm512_loadu_ps(hi + (size_t)m * Vp + g * 16), _mm512_set1_ps(T[m]), _CMP_GE_OQ)
                    | (T[m] == -INFINITY ? (__mmask16)0xffff : (__mmask16)0);
        if (!need && g * 16 + 16 <= V) { /* the common case: sixteen -inf per row in one store */
            for (int m = 0; m < M; m++) _mm256_storeu_si256((__m256i *)(y + (size_t)m * V + g * 16), _mm256_set1_epi16((short)0xff80));
            continue;
        }
        if (amx) { /* the head in the AMX layout: the group's sixteen rows on the tiles, as linear_team_amx */
            amx_group(M, V, K, x, wp + (size_t)g * (K / 32) * 512, g * 16, y);
            continue;
        }
        if (use_panels) { /* the head in the panel layout (linear_team on panels): the panel's sixteen rows */
            panel_exact(M, V, K, x, wp, g, y, xf);
            continue;
        }
        for (int q4 = 0; q4 < 4; q4++) {
            const int n0 = g * 16 + q4 * 4;
            if (n0 >= V) break;
            if ((need >> (q4 * 4)) & 0xf) {
                rows(M, V, K, Kb, x, wp + (size_t)(n0 / 4) * Kb * 128, NULL, y, n0);
            } else {
                for (int m = 0; m < M; m++)
                    for (int i = 0; i < 4 && n0 + i < V; i++) y[(size_t)m * V + n0 + i] = 0xff80; /* -inf */
            }
        }
    }
}

int head_greedy_native(void) { return 1; }
int head_greedy_vnni(void) { return 1; } /* the bounds on vpdpbusd: up to GREEDY_HEAD_ROWS rows (__init__.py) */
#elif defined(LINEAR_PANELS)
/* The greedy head on AVX2 + FMA (no VNNI): the same int8 copy, bound and exact rows as above, with
 * the products on vpmaddwd.  Each input row is one int16 c = 256 a + b a column (quant_row's wide
 * form: the same 16-bit copy, so the same bound); each 16 bytes of a 64-byte line (four head rows,
 * four columns, u8 q + 128) are widened to int16 and multiplied by the row's four c broadcast, so
 * a lane sums two columns of one head row, and the two lanes of a row are added at the end.
 * vpmaddwd does sixteen multiply-adds where an FMA of the bf16 kernel does eight, on half the
 * bytes.  A lane's sums stay exact in int32 for 32 lines (2 x 32 x 255 x 32639 < 2^29; a row's two
 * lanes < 2^30), then move to float64 (exact: integers below 2^53); the rest is the AVX-512 qout in 8 lanes.
 * Exact logits: the panels (16 head rows) where any input row needs one, by panel_run, the bits
 * linear_team gives (each output one chain of FMAs whatever the tile). */
enum { QCHUNK = 32 };
#ifndef QHEAD_PF
#define QHEAD_PF 1024 /* bytes ahead */
#endif

#define QACC_DECL(R) __m256i c##R##0 = z, c##R##1 = z, c##R##2 = z, c##R##3 = z;
#define QACC_MADD(R, I)                                                                                          \
    if (MR > R) c##R##I = _mm256_add_epi32(c##R##I, _mm256_madd_epi16(w, _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(x##R + 4 * kq)))));
#define QACC_LINE(I)                                                                                             \
    {                                                                                                            \
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wl + 16 * (I))));              \
        QACC_MADD(0, I) QACC_MADD(1, I) QACC_MADD(2, I)                                                           \
    }
/* row R's 16 sums (head rows j0 .. j0 + 16 in order: hadd gives 0 1 4 5 2 3 6 7) added to d[R] */
#define QACC_FLUSH(R)                                                                                            \
    if (MR > R) {                                                                                                \
        const __m256i o = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);                                              \
        const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(c##R##0, c##R##1), o);                    \
        const __m256i hi_ = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(c##R##2, c##R##3), o);                   \
        double *dr = d[R];                                                                                       \
        _mm256_storeu_pd(dr, _mm256_add_pd(_mm256_loadu_pd(dr), _mm256_cvtepi32_pd(_mm256_castsi256_si128(lo))));  \
        _mm256_storeu_pd(dr + 4, _mm256_add_pd(_mm256_loadu_pd(dr + 4), _mm256_cvtepi32_pd(_mm256_extracti128_si256(lo, 1)))); \
        _mm256_storeu_pd(dr + 8, _mm256_add_pd(_mm256_loadu_pd(dr + 8), _mm256_cvtepi32_pd(_mm256_castsi256_si128(hi_)))); \
        _mm256_storeu_pd(dr + 12, _mm256_add_pd(_mm256_loadu_pd(dr + 12), _mm256_cvtepi32_pd(_mm256_extracti128_si256(hi_, 1)))); \
        c##R##0 = c##R##1 = c##R##2 = c##R##3 = z;                                                               \
    }

/* input row r's bounds of head rows j0 .. j0 + 16 from its exact sums d (of c (q + 128)):
 * hi[j] = approx + err, and the running max of approx - err over the rows that exist */
static inline void qout2(const double *d, const QRow *r, const QHead *qh, int j0, int V, float *hi, __m256 *lomax) {
    const __m256 slack = _mm256_set1_ps(1.0f / 128.0f), tiny = _mm256_set1_ps(1e-6f), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const double off = 256.0 * (double)r->sa + (double)r->sb; /* 128 x the sum of c */
    for (int h = 0; h < 16; h += 8) {
        const __m256d lo = _mm256_mul_pd(_mm256_sub_pd(_mm256_loadu_pd(d + h), _mm256_set1_pd(off)), _mm256_set1_pd(1.0 / 256.0));
        const __m256d up = _mm256_mul_pd(_mm256_sub_pd(_mm256_loadu_pd(d + h + 4), _mm256_set1_pd(off)), _mm256_set1_pd(1.0 / 256.0));
        const __m256 dot = _mm256_set_m128(_mm256_cvtpd_ps(up), _mm256_cvtpd_ps(lo));
        const __m256 s = _mm256_loadu_ps(qh->scale + j0 + h);
        const __m256 approx = _mm256_mul_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(r->t)));
        __m256 err = _mm256_fmadd_ps(_mm256_loadu_ps(qh->dnorm + j0 + h), _mm256_set1_ps(r->xn),
                                     _mm256_mul_ps(_mm256_mul_ps(s, _mm256_loadu_ps(qh->qnorm + j0 + h)), _mm256_set1_ps(r->en)));
        err = _mm256_add_ps(err, _mm256_fmadd_ps(slack, _mm256_add_ps(_mm256_andnot_ps(sign, approx), err), tiny));
        _mm256_storeu_ps(hi + j0 + h, _mm256_add_ps(approx, err));
        const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(j0 + h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(V), lane));
        *lomax = _mm256_max_ps(*lomax, _mm256_blendv_ps(ninf, _mm256_sub_ps(approx, err), live));
    }
}

/* hi[m][j] and the running max of approx - err of head rows g * 16 .. + 16 for input rows m0 .. m0 + MR
 * (MR <= 3, a constant at each call site: 12 accumulators, a widened line and a broadcast) */
static inline __attribute__((always_inline)) void qgroup2(int MR, const QHead *qh, const QRow *qr, int m0, int g,
                                                          int V, float *hi, int Vp, __m256 *lomax) {
    const int Kq = qh->Kp / 4;
    const uint8_t *wg = qh->q + (size_t)g * Kq * 64;
    const __m256i z = _mm256_setzero_si256();
    QACC_DECL(0) QACC_DECL(1) QACC_DECL(2)
    const int16_t *x0 = (const int16_t *)qr[m0].a;
    const int16_t *x1 = MR > 1 ? (const int16_t *)qr[m0 + 1].a : x0, *x2 = MR > 2 ? (const int16_t *)qr[m0 + 2].a : x0;
    double d[3][16] = {{0.0}};
    for (int k0 = 0; k0 < Kq; k0 += QCHUNK) {
        const int ke = k0 + QCHUNK < Kq ? k0 + QCHUNK : Kq;
        for (int kq = k0; kq < ke; kq++) {
            const uint8_t *wl = wg + (size_t)kq * 64;
            if (QHEAD_PF) _mm_prefetch((const char *)wl + QHEAD_PF, _MM_HINT_T0);
            QACC_LINE(0) QACC_LINE(1) QACC_LINE(2) QACC_LINE(3)
        }
        QACC_FLUSH(0) QACC_FLUSH(1) QACC_FLUSH(2)
    }
    for (int r = 0; r < MR; r++) qout2(d[r], qr + m0 + r, qh, g * 16, V, hi + (size_t)(m0 + r) * Vp, lomax + m0 + r);
}
#undef QACC_DECL
#undef QACC_MADD
#undef QACC_LINE
#undef QACC_FLUSH

int head_greedy_amx_set(int on) {
    (void)on;
    return 0;
}

/* head_greedy_team (above) on AVX2: wp the head in the panel layout; `amx` is never set here */
void head_greedy_team(int M, int V, int K, const uint16_t *x, const uint16_t *wp, const QHead *qh, QRow *qr,
                      int8_t *bytes, float *hi, float *thr, float *T, uint16_t *y, int amx) {
    (void)amx;
    const int Kp = qh->Kp, Vp = (V + 15) / 16 * 16, groups = Vp / 16;
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    quant_rows(M, K, Kp, x, qr, bytes, 1); /* every row quantised */
    for (int m0 = 0; m0 < M; m0 += 64) {
        const int mc = M - m0 < 64 ? M - m0 : 64;
        __m256 lomax[64];
        for (int m = 0; m < mc; m++) lomax[m] = _mm256_set1_ps(-INFINITY);
#pragma omp for schedule(static) nowait
        for (int g = 0; g < groups; g++) {
            int m = 0;
            for (; m + 3 <= mc; m += 3) qgroup2(3, qh, qr + m0, m, g, V, hi + (size_t)m0 * Vp, Vp, lomax);
            if (mc - m == 2) qgroup2(2, qh, qr + m0, m, g, V, hi + (size_t)m0 * Vp, Vp, lomax);
            else if (mc - m == 1) qgroup2(1, qh, qr + m0, m, g, V, hi + (size_t)m0 * Vp, Vp, lomax);
        }
        for (int m = 0; m < mc; m++) {
            float t[8], mx = -INFINITY;
            _mm256_storeu_ps(t, lomax[m]);
            for (int i = 0; i < 8; i++) mx = t[i] > mx ? t[i] : mx;
            thr[(size_t)tid * M + m0 + m] = mx;
        }
    }
    thresholds(M, nt, thr, qr, T); /* a non-finite row: every logit computed */
    const int xr = M < PANEL_XROWS ? M : PANEL_XROWS;
    float *xf = thread_floats((size_t)xr * K);
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
        int need = 0;
        for (int m = 0; m < M && !need; m++) {
            if (T[m] == -INFINITY) need = 1;
            for (int j = 0; j < 16 && !need; j++) need = hi[(size_t)m * Vp + g * 16 + j] >= T[m];
        }
        if (need) {
            panel_exact(M, V, K, x, wp, g, y, xf);
            continue;
        }
        for (int m = 0; m < M; m++)
            for (int n = 16 * g; n < 16 * g + 16 && n < V; n++) y[(size_t)m * V + n] = 0xff80; /* -inf */
    }
}

int head_greedy_native(void) { return 1; }
int head_greedy_vnni(void) { return 0; }
#else
int head_greedy_native(void) { return 0; }
int head_greedy_vnni(void) { return 0; }
int head_greedy_amx_set(int on) {
    (void)on;
    return 0;
}
/* never called without the instructions (decode_stack asks head_greedy_native first); defined so
 * that the library links and loads on every CPU */
void head_greedy_team(int M, int V, int K, const uint16_t *x, const uint16_t *wp, const QHead *qh, QRow *qr,
                      int8_t *bytes, float *hi, float *thr, float *T, uint16_t *y, int amx) {
    (void)M, (void)V, (void)K, (void)x, (void)wp, (void)qh, (void)qr, (void)bytes, (void)hi, (void)thr, (void)T,
        (void)y, (void)amx;
}
#endif

/* ---- int8 weights (model.weights = "int8"): a decode step streams half the bytes ----
 *
 * A one-row step on two AVX2 cores is bound by the weights' stream (~19 GB/s,
 * bench/results/roofline_avx2.md): SmolLM2-135M's layer matrices are 212 MB of bf16 a step.
 * Weight-only int8 with one scale per output row, w[n][k] ~ s[n] q[n][k] (q = round(w / s) in
 * [-127, 127], s = max_k |w[n][k]| / 127, model/native/__init__.py's pack_linear_q8), halves them.
 * The input keeps its bf16 values (converted to fp32 once a call, as the panel kernel does); each
 * output's sum is one chain of FMAs over k = 0 .. K-1 of q (exact in fp32) times x, multiplied by
 * s[n] once at the end: so, as in the bf16 kernels, a row's bits do not depend on how many rows the
 * call has or which tile ran it (a verification pass's rows have a one-token step's bits).
 *
 *   packed [N/16][K * 16 + 64] bytes: per panel of sixteen output rows, column k's sixteen int8
 *   at 16 k (row 16p + j at byte j), then the panel's sixteen fp32 scales.  N is padded to a
 *   multiple of 16 with zero rows (scale 1); K is not padded.
 *
 * Tiles as the panel kernel's: one input row against four panels (8 accumulators), two against
 * two, 3-6 rows against one; each column's sixteen bytes sign-extended and converted to two fp32
 * vectors (vpmovsxbd + vcvtdq2ps), shared by the tile's rows.  Elsewhere a portable loop. */
#include <omp.h>

enum { Q8_XROWS = 60 }; /* input rows converted to fp32 at a time */

static inline size_t q8_panel_bytes(int K) { return (size_t)K * 16 + 64; }

#if defined(__AVX2__) && defined(__FMA__)
#define Q8_COL(Q)                                                                                                \
    if (P > Q) {                                                                                                 \
        const int8_t *wq = w + (size_t)Q * ps + (size_t)k * 16;                                                  \
        const __m256 we = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)wq)));        \
        const __m256 wo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wq + 8))));  \
        PANEL_FMA(0, Q) PANEL_FMA(1, Q) PANEL_FMA(2, Q) PANEL_FMA(3, Q) PANEL_FMA(4, Q) PANEL_FMA(5, Q)          \
    }
#define Q8_STORE(R, Q)                                                                                           \
    if (MR > R && P > Q) {                                                                                       \
        const int n = N - n0 - 16 * Q;                                                                           \
        uint16_t *yr = y + (size_t)(m0 + R) * N + n0 + 16 * Q;                                                   \
        const uint16_t *bb = bias ? bias + n0 + 16 * Q : NULL;                                                   \
        const float *sc = (const float *)(w + (size_t)Q * ps + (size_t)K * 16);                                  \
        store8(_mm256_mul_ps(a##R##Q##e, _mm256_loadu_ps(sc)), bb, yr, n);                                       \
        if (n > 8) store8(_mm256_mul_ps(a##R##Q##o, _mm256_loadu_ps(sc + 8)), bb ? bb + 8 : NULL, yr + 8, n - 8); \
    }
#define Q8_STORES(R) Q8_STORE(R, 0) Q8_STORE(R, 1) Q8_STORE(R, 2) Q8_STORE(R, 3)
static inline __attribute__((always_inline)) void q8_tile(int MR, int P, int K, const float *x, const int8_t *w,
                                                           size_t ps, const uint16_t *bias, uint16_t *y, int N, int n0,
                                                           int m0) {
    const __m256 z = _mm256_setzero_ps();
    PANEL_DECL(0) PANEL_DECL(1) PANEL_DECL(2) PANEL_DECL(3) PANEL_DECL(4) PANEL_DECL(5)
    const float *xr = x + (size_t)m0 * K;
    int k = 0;
    for (; k + 4 <= K; k += 4) { /* four columns a turn: one 64-byte line of each panel, prefetched 1 KB ahead */
        for (int q = 0; q < P; q++) _mm_prefetch((const char *)(w + q * ps + (size_t)k * 16) + 1024, _MM_HINT_T0);
        Q8_COL(0) Q8_COL(1) Q8_COL(2) Q8_COL(3)
        k++;
        Q8_COL(0) Q8_COL(1) Q8_COL(2) Q8_COL(3)
        k++;
        Q8_COL(0) Q8_COL(1) Q8_COL(2) Q8_COL(3)
        k++;
        Q8_COL(0) Q8_COL(1) Q8_COL(2) Q8_COL(3)
        k -= 3;
    }
    for (; k < K; k++) {
        Q8_COL(0) Q8_COL(1) Q8_COL(2) Q8_COL(3)
    }
    Q8_STORES(0) Q8_STORES(1) Q8_STORES(2) Q8_STORES(3) Q8_STORES(4) Q8_STORES(5)
}

#define Q8_FN(A, B)                                                                                              \
    static __attribute__((noinline)) void q8_##A##x##B(int K, const float *x, const int8_t *w, size_t ps,        \
                                                        const uint16_t *bias, uint16_t *y, int N, int n0, int m0) { \
        q8_tile(A, B, K, x, w, ps, bias, y, N, n0, m0);                                                          \
    }
Q8_FN(1, 4) Q8_FN(1, 3) Q8_FN(1, 2) Q8_FN(1, 1) Q8_FN(2, 2) Q8_FN(2, 1) Q8_FN(3, 1) Q8_FN(4, 1) Q8_FN(5, 1)
Q8_FN(6, 1)
#undef Q8_FN

/* rows m0 .. m0 + mr against panels p .. p + np (np <= the tile's width for mr) */
static void q8_run(int mr, int np, int K, const float *x, const int8_t *wp, const uint16_t *bias, uint16_t *y, int N,
                   int p, int m0) {
    const size_t ps = q8_panel_bytes(K);
    const int8_t *w = wp + (size_t)p * ps;
    const int n0 = 16 * p;
#define Q8_CASE(A, B)                                                                                            \
    if (mr == A && np == B) {                                                                                    \
        q8_##A##x##B(K, x, w, ps, bias, y, N, n0, m0);                                                           \
        return;                                                                                                  \
    }
    Q8_CASE(1, 4) Q8_CASE(1, 3) Q8_CASE(1, 2) Q8_CASE(1, 1) Q8_CASE(2, 2) Q8_CASE(2, 1) Q8_CASE(3, 1) Q8_CASE(4, 1)
    Q8_CASE(5, 1) Q8_CASE(6, 1)
#undef Q8_CASE
}
#define Q8_SIMD 1
#endif

/* ---- int8 weights on AMX tiles ----
 *
 * On a CPU with AMX the panel tiles above leave the tile unit idle: measured on this project's AMX
 * Xeon (2 cores), int8 steps were 1.36-1.44x faster than bf16 ones but a pass of 8 rows 0.79x, of 16
 * rows 0.59x and a prefill 0.24x (bench/results/int8_weights_amx_panels.md).  Here each block of 32 columns
 * of a panel is widened to a bf16 tile in the unit's pair layout (every int8 value is a bf16 number:
 * its fp32 conversion has zero low halves), and TDPBF16PS multiplies it with the input rows as
 * linear_team_amx does: each output row's sums in the tile's order, whatever M is (a pass's rows keep
 * a one-token step's bits), times its scale at the store.  Calls of up to 16 rows (steps, passes)
 * widen each block just ahead of its products (q8_small_amx); longer ones (prefill) widen two panels
 * whole into this thread's scratch, read by every 16-row chunk.  K must be a multiple of 32; other
 * matrices keep the panel kernel (per matrix: every M alike).  Measured on the AMX Xeon against the
 * panel kernel (bench/results/int8_weights_amx.md): a step ~10 % slower (the widening), passes of 8-16
 * rows 1.5-2x faster, a prefill 4x faster. */
#ifdef CODECOMPLETE_AMX
static int q8_amx; /* q8_amx_set */
#ifndef Q8_AHEAD
#define Q8_AHEAD 2 /* blocks widened ahead of the products that read them */
#endif
#define Q8_RING (Q8_AHEAD + 2) /* blocks of the ring a one-chunk call widens into */
#ifndef Q8_PF
#define Q8_PF 2048 /* bytes of a panel prefetched ahead of its widening */
#endif

/* the bf16 bytes of 0 .. 127 (low, high), q8_widen's tables: written by q8_amx_set, before any call */
static uint8_t lo_tab[128] __attribute__((aligned(64))), hi_tab[128] __attribute__((aligned(64)));

/* on: 1 or 0 sets it (1 only where Linux grants the tiles), -1 leaves it; returns the setting */
int q8_amx_set(int on) {
    if (on < 0) return q8_amx;
    for (int i = 0; i < 128; i++) {
        const float f = (float)i;
        uint32_t u;
        memcpy(&u, &f, 4);
        lo_tab[i] = (uint8_t)(u >> 16);
        hi_tab[i] = (uint8_t)(u >> 24);
    }
    q8_amx = on && amx_enable();
    return q8_amx;
}

/* block kb (columns 32 kb .. 32 kb + 32) of panel w as a bf16 tile t [16][16 pairs]: tile row r holds
 * columns 32 kb + 2r and 32 kb + 2r + 1 of the panel's sixteen output rows (bytes 16 c .. 16 c + 16 of
 * the panel for column c) */
static inline void q8_widen(const int8_t *w, int kb, uint32_t *t) {
    const int8_t *c = w + (size_t)kb * 512;
#ifdef __AVX512VBMI__
    /* bytes as table lookups: a bf16 of -v is v's with the sign bit, so each |v| (0 .. 127) indexes
     * its bf16's low byte (lo) and high byte (hi), two 128-entry tables in pairs of registers; then
     * one two-source byte permute per tile row puts (lo, hi) of column 2r and of 2r + 1 side by side
     * for each output row.  6 operations per 64 weights, where the conversions below take 12. */
    static const uint8_t idx_bytes[64] = {
        0,  64, 16, 80, 1,  65, 17, 81, 2,  66, 18, 82, 3,  67, 19, 83, 4,  68, 20, 84, 5,  69,
        21, 85, 6,  70, 22, 86, 7,  71, 23, 87, 8,  72, 24, 88, 9,  73, 25, 89, 10, 74, 26, 90,
        11, 75, 27, 91, 12, 76, 28, 92, 13, 77, 29, 93, 14, 78, 30, 94, 15, 79, 31, 95};
    const __m512i l0 = _mm512_load_si512(lo_tab), l1 = _mm512_load_si512(lo_tab + 64);
    const __m512i h0 = _mm512_load_si512(hi_tab), h1 = _mm512_load_si512(hi_tab + 64);
    const __m512i i0 = _mm512_loadu_si512(idx_bytes), i1 = _mm512_add_epi8(i0, _mm512_set1_epi8(32));
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    for (int r = 0; r < 16; r += 2) {
        _mm_prefetch((const char *)c + Q8_PF + 32 * r, _MM_HINT_T0); /* every line, Q8_PF bytes ahead */
        const __m512i v = _mm512_loadu_si512(c + 32 * r); /* tile rows r and r + 1: columns 2r .. 2r + 3 */
        const __m512i a = _mm512_abs_epi8(v);
        const __m512i lo = _mm512_permutex2var_epi8(l0, a, l1);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(h0, a, h1), v, sign, 0xf8);
        _mm512_storeu_si512(t + 16 * r, _mm512_permutex2var_epi8(lo, i0, hi));
        _mm512_storeu_si512(t + 16 * (r + 1), _mm512_permutex2var_epi8(lo, i1, hi));
    }
#else
    for (int r = 0; r < 16; r++) {
        if ((r & 1) == 0) _mm_prefetch((const char *)c + Q8_PF + 32 * r, _MM_HINT_T0);
        const __m512i a = _mm512_castps_si512(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 32 * r)))));
        const __m512i b = _mm512_castps_si512(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 32 * r + 16)))));
        /* low half: column 2r's bf16 (a's high half), high half: column 2r + 1's */
        _mm512_storeu_si512(t + 16 * r, _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(a, 16), b));
    }
#endif
}

#define Q8_AMX_CHUNK(C0, C1, A, XR)                                                                              \
    {                                                                                                            \
        _tile_zero(C0);                                                                                          \
        _tile_zero(C1);                                                                                          \
        for (int kb = 0; kb < Kb; kb++) {                                                                        \
            _tile_loadd(A, (XR) + kb * 32, K * 2);                                                               \
            _tile_loadd(3, t0 + (size_t)kb * 256, 64);                                                           \
            _tile_loadd(4, t1 + (size_t)kb * 256, 64);                                                           \
            _tile_dpbf16ps(C0, A, 3);                                                                            \
            _tile_dpbf16ps(C1, A, 4);                                                                            \
        }                                                                                                        \
        _tile_stored(C0, c, 64);                                                                                 \
        _tile_stored(C1, c + 256, 64);                                                                           \
    }

/* q8_team_amx for M <= 16 rows (one chunk: decode steps, verification passes): four panels at a time,
 * four chains of sums at once (a profile of two chains showed the call's end waiting on them; four
 * measured about the same as two, within this machine's drift), each panel's sums in the order the
 * chunked path adds them (the same bits).  Each block is widened Q8_AHEAD blocks before its products
 * read it (a tile load waits for the stores it reads) into a ring of Q8_RING blocks a panel, in L1. */
static void q8_small_amx(int M, int N, int K, const uint16_t *x, const int8_t *wp, const uint16_t *bias,
                         uint16_t *y, int p0, int p1, uint32_t *ring) {
    const int Kb = K / 32;
    const size_t ps = q8_panel_bytes(K);
    const uint8_t m = (uint8_t)M, tiles[8] = {m, m, m, m, m, 16, 16, 0}; /* 0-3 sums, 4 input, 5, 6 weights */
    float c[1024];
    amx_tiles(tiles);
    for (int p = p0; p < p1; p += 4) {
        const int np = p1 - p < 4 ? p1 - p : 4;
        const int8_t *w[4];
        uint32_t *r[4];
        for (int i = 0; i < 4; i++) { /* past np: the last panel again, its sums not stored */
            w[i] = wp + (size_t)(p + (i < np ? i : np - 1)) * ps;
            r[i] = ring + (size_t)(i < np ? i : np - 1) * Q8_RING * 256;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kb = 0; kb < Q8_AHEAD && kb < Kb; kb++)
            for (int i = 0; i < np; i++) q8_widen(w[i], kb, r[i] + (kb % Q8_RING) * 256);
        for (int kb = 0; kb < Kb; kb++) {
            const int ahead = kb + Q8_AHEAD, slot = (kb % Q8_RING) * 256;
            if (ahead < Kb)
                for (int i = 0; i < np; i++) q8_widen(w[i], ahead, r[i] + (ahead % Q8_RING) * 256);
            _tile_loadd(4, x + kb * 32, K * 2);
            _tile_loadd(5, r[0] + slot, 64);
            _tile_loadd(6, r[1] + slot, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, r[2] + slot, 64);
            _tile_loadd(6, r[3] + slot, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
        for (int i = 0; i < np; i += 2) {
            const float *sa = (const float *)(w[i] + (size_t)K * 16), *sb = (const float *)(w[i + 1] + (size_t)K * 16);
            amx_store_scaled(c + 256 * i, M, 0, 16 * (p + i), np - i > 1 ? 32 : 16, N, sa, sb, bias, y);
        }
    }
    _tile_release();
}

/* linear_q8_team's panels p0 .. p1 on the tiles (K a multiple of 32); 0, or -1 without scratch */
static int q8_team_amx(int M, int N, int K, const uint16_t *x, const int8_t *wp, const uint16_t *bias, uint16_t *y,
                       int p0, int p1) {
    const int Kb = K / 32, full = M / 16, rem = M % 16;
    const size_t ps = q8_panel_bytes(K);
    float *const scratch = thread_floats((size_t)(2 * Kb > 4 * Q8_RING ? 2 * Kb : 4 * Q8_RING) * 256 + 16);
    if (!scratch) return -1;
    uint32_t *const buf = (uint32_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63); /* whole cache lines a tile row */
    if (M <= 16) {
        q8_small_amx(M, N, K, x, wp, bias, y, p0, p1, buf);
        return 0;
    }
    float c[512];
    amx_config(16, rem); /* M > 16: full >= 1 */
    for (int p = p0; p < p1; p += 2) { /* two panels share each load of the input's tile */
        const int two = p + 1 < p1; /* an odd last panel: its tile twice, the second sums not stored */
        const int8_t *w0 = wp + (size_t)p * ps, *w1 = two ? w0 + ps : w0;
        uint32_t *const t0 = buf, *const t1 = two ? buf + (size_t)Kb * 256 : buf;
        const float *sc0 = (const float *)(w0 + (size_t)K * 16), *sc1 = (const float *)(w1 + (size_t)K * 16);
        const int width = two ? 32 : 16;
        for (int kb = 0; kb < Kb; kb++) {
            q8_widen(w0, kb, t0 + (size_t)kb * 256);
            if (two) q8_widen(w1, kb, t1 + (size_t)kb * 256);
        }
        for (int ch = 0; ch < full; ch++) {
            Q8_AMX_CHUNK(0, 1, 2, x + (size_t)ch * 16 * K)
            amx_store_scaled(c, 16, ch * 16, 16 * p, width, N, sc0, sc1, bias, y);
        }
        if (rem) { /* the rows past the last 16-row chunk, on tiles of their own */
            Q8_AMX_CHUNK(5, 6, 7, x + (size_t)full * 16 * K)
            amx_store_scaled(c, rem, full * 16, 16 * p, width, N, sc0, sc1, bias, y);
        }
    }
    _tile_release();
    return 0;
}
#undef Q8_AMX_CHUNK
#define Q8_AMX 1
#else
int q8_amx_set(int on) {
    (void)on;
    return 0;
}
#endif

/* x [M, K] bf16 times int8 weights packed as above (+ bias [N] bf16 or NULL): y [M, N] bf16.
 * Called inside a parallel region (decode_stack): each thread takes a contiguous share of the
 * panels and does not wait at the end (the caller places the barrier). */
void linear_q8_team(int M, int N, int K, const uint16_t *x, const int8_t *wp, const uint16_t *bias, uint16_t *y) {
    const int np = (N + 15) / 16, T = omp_get_num_threads(), t = omp_get_thread_num();
    const int p0 = (int)((long)np * t / T), p1 = (int)((long)np * (t + 1) / T);
    const size_t ps = q8_panel_bytes(K);
    if (p0 >= p1 || M <= 0) return;
#ifdef Q8_AMX
    if (q8_amx && K % 32 == 0 && q8_team_amx(M, N, K, x, wp, bias, y, p0, p1) == 0) return;
#endif
#ifdef Q8_SIMD
    float *const q8_x = thread_floats((size_t)(M < Q8_XROWS ? M : Q8_XROWS) * K);
    if (q8_x) {
        const int run = (int)(262144 / ps) > 1 ? (int)(262144 / ps) : 1; /* panels per 256 KB: re-read from the L2 */
        for (int r0 = 0; r0 < M; r0 += Q8_XROWS) {
            const int mc = M - r0 < Q8_XROWS ? M - r0 : Q8_XROWS, blocks = (mc + 5) / 6;
            const uint16_t *xs = x + (size_t)r0 * K;
            for (size_t i = 0; i < (size_t)mc * K; i++) q8_x[i] = bf16_to_f32(xs[i]);
            uint16_t *yc = y + (size_t)r0 * N;
            for (int pc = p0; pc < p1; pc += run) {
                const int pe = pc + run < p1 ? pc + run : p1;
                for (int b = 0, m0 = 0; b < blocks; b++) {
                    const int mr = (mc - m0) / (blocks - b) + ((mc - m0) % (blocks - b) ? 1 : 0);
                    const int width = mr == 1 ? 4 : mr == 2 ? 2 : 1;
                    for (int p = pc; p < pe; p += width)
                        q8_run(mr, pe - p < width ? pe - p : width, K, q8_x, wp, bias, yc, N, p, m0);
                    m0 += mr;
                }
            }
        }
        return;
    }
#endif
    /* the portable loop (or no memory for the fp32 copy): the same chain of FMAs for each output */
    for (int m = 0; m < M; m++)
        for (int n = 16 * p0; n < 16 * p1 && n < N; n++) {
            const int8_t *w = wp + (size_t)(n / 16) * ps + n % 16;
            const float *sc = (const float *)(wp + (size_t)(n / 16) * ps + (size_t)K * 16);
            float s = 0.0f;
            for (int k = 0; k < K; k++) s = fmaf((float)w[(size_t)k * 16], bf16_to_f32(x[(size_t)m * K + k]), s);
            y[(size_t)m * N + n] = f32_to_bf16(s * sc[n % 16] + (bias ? bf16_to_f32(bias[n]) : 0.0f));
        }
}

/* linear_q8_team in a parallel region of its own */
void linear_q8(int M, int N, int K, const uint16_t *x, const int8_t *wp, const uint16_t *bias, uint16_t *y) {
#pragma omp parallel
    linear_q8_team(M, N, K, x, wp, bias, y);
}
