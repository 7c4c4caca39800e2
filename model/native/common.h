/* Helpers shared by the native kernels (the .c files beside this one): bf16 <-> fp32 and a vectorisable
 * exp for non-positive arguments. */
#ifndef CODECOMPLETE_NATIVE_COMMON_H
#define CODECOMPLETE_NATIVE_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as PyTorch does; NaN stays NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bf16 as fp32 */
static inline __m512 ld_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f32_to_bf16 of 16 floats at once, kept as floats: to the nearest bf16 (even on ties), NaN to its quiet NaN */
static inline __m512 rnd_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)));
}

/* Cephes expf on 16 lanes, the parts its variants share (exp_neg16 in decode_attention.c, silu_bf16
 * in step_ops.c): the reduced argument r = x - n ln2 (ln2 in two parts) and the polynomial's middle
 * terms, p -> (((p r + c3) r + c4) r + c5) r + c6.  Always inlined: the softmaxes are compiled with
 * their own optimize attribute, and GCC did not inline a plain inline function into those (amx_softmax
 * called both per 16 lanes).  Inlined, the same bits; attention alone 1-11 % faster over 1-16 rows at
 * 1k-2k positions on the AMX Xeon, whole forwards within this machine's noise (interleaved A/B) */
static inline __attribute__((always_inline)) __m512 exp_reduce16(__m512 x, __m512 n) {
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    return _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
}

static inline __attribute__((always_inline)) __m512 exp_mid16(__m512 p, __m512 r) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    return _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define CODECOMPLETE_AMX 1
/* LDTILECFG's operand (palette 1): bytes per row and rows of each of the 8 tiles */
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileCfg;

int amx_enable(void); /* linear.c: asks Linux for the tile state; 1 when granted */

/* configures this thread's 8 tiles: tile t has rows[t] rows of 64 bytes (0: unused) */
static inline void amx_tiles(const uint8_t rows[8]) {
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = rows[t] ? 64 : 0, c.rows[t] = rows[t];
    _tile_loadconfig(&c);
}
#endif
#endif

/* exp(x) for x <= 0 (softmax after subtracting the max, a sigmoid's tail): Cephes-style
 * range reduction and a degree-6 polynomial, written so the compiler vectorises it;
 * relative error ~1e-7. */
static inline float exp_neg(float x) {
    if (x < -87.0f) x = -87.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* The int8 copy of a head for the greedy head (linear.c, head_greedy_team) */
typedef struct {
    const uint8_t *q;      /* q + 128, [ceil(V/16)][Kp/4][16][4] */
    const float *scale;    /* [Vp] s_j (0 on padding rows) */
    const float *dnorm;    /* [Vp] |w_j - s_j q_j| */
    const float *qnorm;    /* [Vp] |q_j| */
    int Kp;                /* K padded to a multiple of 64 (of 4 is enough without the tiles) */
} QHead;

/* per input row: its int8 copies a and b ([Kp] each), 128 x their sums, t, |x|, |e|, and whether
 * it is finite */
typedef struct {
    int8_t *a, *b;
    int32_t sa, sb;
    float t, xn, en;
    int ok;
} QRow;
#endif
