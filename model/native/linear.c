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
 *   multiple of 32 with zeros.
 *
 * On that layout one thread of this kernel streams ~29 GB/s and two ~57 GB/s (the same
 * kernel on the row-major layout: 11 and 23 GB/s).  A group of four weight rows is
 * multiplied with up to four input rows at a time in registers.  With AVX512-BF16 the dot
 * products are vdpbf16ps (bf16 pairs, fp32 accumulation); elsewhere a portable loop converts
 * bf16 to fp32 first.  The output is rounded to bf16 once, as oneDNN's bf16 linear does; the
 * two differ only in summation order.
 *
 * Built together with decode_attention.c (see model/native/__init__.py).
 */
#include "common.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

/* y[m, n0 + i] = s[i] + bias, for the rows of the group that exist (n0 + i < N) */
static inline void store4(const float *s, const uint16_t *bias, uint16_t *y, int N, int n0, int m) {
    for (int i = 0; i < 4 && n0 + i < N; i++) y[(size_t)m * N + n0 + i] = f32_to_bf16(s[i] + (bias ? bf16_to_f32(bias[n0 + i]) : 0.0f));
}

#ifdef __AVX512BF16__
/* the four sums of a0..a3, in s[0..3] */
static inline void reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float *s) {
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
    float all[16];
    _mm512_storeu_ps(all, t);
    s[0] = all[0], s[1] = all[4], s[2] = all[8], s[3] = all[12];
}

/* one group of four weight rows (packed, Kb blocks of 32) against input rows m0 .. m0+MR;
 * MR is a constant at each call site.  The sixteen accumulators are named variables, not an
 * array: GCC kept an array on the stack and spilled it every iteration (3x slower). */
#define DOT4(J)                                                                                                  \
    if (MR > J) {                                                                                                \
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(km, x + (size_t)(m0 + J) * K + k);                \
        a##J##0 = _mm512_dpbf16_ps(a##J##0, w0, xv);                                                            \
        a##J##1 = _mm512_dpbf16_ps(a##J##1, w1, xv);                                                            \
        a##J##2 = _mm512_dpbf16_ps(a##J##2, w2, xv);                                                            \
        a##J##3 = _mm512_dpbf16_ps(a##J##3, w3, xv);                                                            \
    }
#define STORE4(J)                                                                                                \
    if (MR > J) {                                                                                                \
        float s[4];                                                                                              \
        reduce4(a##J##0, a##J##1, a##J##2, a##J##3, s);                                                         \
        store4(s, bias, y, N, n0, m0 + J);                                                                       \
    }
static inline __attribute__((always_inline)) void group(int MR, int K, int Kb, const uint16_t *x, const uint16_t *w,
                                                        const uint16_t *bias, uint16_t *y, int N, int n0, int m0) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int kb = 0; kb < Kb; kb++) {
        const int k = kb * 32;
        const __mmask32 km = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        const uint16_t *wb = w + (size_t)kb * 128;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb), w1 = (__m512bh)_mm512_loadu_si512(wb + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wb + 64), w3 = (__m512bh)_mm512_loadu_si512(wb + 96);
        DOT4(0)
        DOT4(1)
        DOT4(2)
        DOT4(3)
    }
    STORE4(0)
    STORE4(1)
    STORE4(2)
    STORE4(3)
}

static void rows(int M, int N, int K, int Kb, const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int n0) {
    for (int m0 = 0; m0 < M; m0 += 4) {
        switch (M - m0 < 4 ? M - m0 : 4) {
        case 4: group(4, K, Kb, x, w, bias, y, N, n0, m0); break;
        case 3: group(3, K, Kb, x, w, bias, y, N, n0, m0); break;
        case 2: group(2, K, Kb, x, w, bias, y, N, n0, m0); break;
        default: group(1, K, Kb, x, w, bias, y, N, n0, m0); break;
        }
    }
}
#else
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
 * all bf16, x and y contiguous. */
void linear_bf16(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y) {
    const int Kb = (K + 31) / 32, groups = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int g = 0; g < groups; g++) rows(M, N, K, Kb, x, wp + (size_t)g * Kb * 128, bias, y, 4 * g);
}

/* 1 where the AVX512-BF16 path was compiled in */
int linear_bf16_native(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}
