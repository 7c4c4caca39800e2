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
    int Kp;                /* K padded to a multiple of 4 */
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
