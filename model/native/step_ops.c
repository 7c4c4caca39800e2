/* The small element-wise parts of a few-token step (decode, verification) fused into one
 * call each, so that a layer of a decode step is four linear layers and four native calls
 * instead of ~40 PyTorch ops (each costs ~5-10 us of dispatch on this CPU, about as much as
 * the linear layers' weight reads at batch 1).
 *
 * Activations are bf16 (el = 2) or fp32 (el = 4).  Where the PyTorch path rounds to bf16
 * between ops (HF Llama's order), these round at the same places, so the two paths agree to
 * the last bit in most elements and within one bf16 rounding elsewhere.
 *
 * Built together with decode_attention.c (see model/native/__init__.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int decode_attention(int B, int K, int G, int E, int S, int layer, int elsize, const float *q, const void *newk,
                     const void *newv, void *const *kbase, void *const *vbase, const int64_t *cap,
                     const int64_t *len, const uint8_t *const *masks, float scale, int chunk, float *out);

#include "common.h"

static inline float ld(const void *p, size_t i, int el) {
    return el == 4 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* f rounded to the activation dtype (bf16: to its nearest bf16, as a float) */
static inline float rnd(float f, int el) {
    if (el == 4) return f;
    return bf16_to_f32(f32_to_bf16(f));
}

static inline void st(void *p, size_t i, float f, int el) {
    if (el == 4)
        ((float *)p)[i] = f;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(f);
}

/* RMSNorm of `rows` rows of width D, HF Llama's order: normalise in fp32, round to the
 * activation dtype, then scale by the weight w (activation dtype) and round again.  With
 * `h` (not NULL) the residual comes first: x = x + h (rounded) is written to `xsum`, and
 * that sum is what gets normalised.  out may not alias x; xsum may. */
void rms_norm(int rows, int D, int el, const void *x, const void *h, void *xsum, const void *w, float eps,
              void *out) {
    const void *src = h ? xsum : x; /* what gets normalised, read again in the second pass */
    for (int r = 0; r < rows; r++) {
        size_t o = (size_t)r * D;
        float ss = 0.0f;
        for (int d = 0; d < D; d++) {
            float v = ld(x, o + d, el);
            if (h) {
                v = rnd(v + ld(h, o + d, el), el);
                st(xsum, o + d, v, el);
            }
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int d = 0; d < D; d++) st(out, o + d, ld(w, d, el) * rnd(ld(src, o + d, el) * inv, el), el);
    }
}

/* The MLP's gate: gu [rows, 2F] holds gate | up; out [rows, F] = silu(gate) * up, each
 * rounded to the activation dtype as PyTorch's bf16 ops do. */
void silu_mul(int rows, int F, int el, const void *gu, void *out) {
    for (int r = 0; r < rows; r++) {
        const size_t gi = (size_t)r * 2 * F, oi = (size_t)r * F;
        for (int j = 0; j < F; j++) {
            float g = ld(gu, gi + j, el), u = ld(gu, gi + F + j, el);
            float e = exp_neg(-fabsf(g)); /* sigmoid without overflow */
            float sig = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            st(out, oi + j, rnd(rnd(g * sig, el) * u, el), el);
        }
    }
}

/* Rotary embedding of one head's E values x (activation dtype) at one position: HF Llama's
 * x * cos + rotate_half(x) * sin, with sin's first half negated in the table (see
 * Transformer.rope), rounded after each op as in PyTorch. */
static inline float rope_at(const void *x, size_t xo, const void *cs, const void *sn, size_t co, int e, int E, int el) {
    int half = E / 2, j = e < half ? e + half : e - half;
    float a = rnd(ld(x, xo + e, el) * ld(cs, co + e, el), el);
    float b = rnd(ld(x, xo + j, el) * ld(sn, co + e, el), el);
    return rnd(a + b, el);
}

/* A few-token step's attention straight from the fused qkv projection:
 *   qkv [B, S, (K*G + 2K) * E] in the activation dtype (queries, then keys, then values)
 *   cos, sin [B, S, E] in the activation dtype (Transformer.rope)
 * applies the rotary embedding to queries and keys, writes keys and values into the caches
 * (dtype el_kv) and attends as decode_attention does (causal, or masks[b]); writes
 * out [B, S, K*G*E] in the activation dtype, ready for the output projection.
 * Returns 0, or -1 when scratch memory could not be had. */
int qkv_attention(int B, int K, int G, int E, int S, int layer, int el_kv, int el, const void *qkv, const void *cs,
                  const void *sn, void *const *kbase, void *const *vbase, const int64_t *cap, const int64_t *len,
                  const uint8_t *const *masks, float scale, int chunk, void *out) {
    const int H = K * G, R = G * S, W = (H + 2 * K) * E;
    const size_t nq = (size_t)B * H * S * E, nk = (size_t)B * K * S * E;
    float *q = malloc(sizeof(float) * nq * 2);
    char *kv = malloc((size_t)el_kv * nk * 2);
    if (!q || !kv) {
        free(q);
        free(kv);
        return -1;
    }
    float *o = q + nq;
    char *nkey = kv, *nval = kv + (size_t)el_kv * nk;
    for (int b = 0; b < B; b++) {
        for (int i = 0; i < S; i++) {
            const size_t xo = ((size_t)b * S + i) * W, co = ((size_t)b * S + i) * E;
            for (int h = 0; h < H; h++) { /* q[b, h / G, (h % G) * S + i, :] */
                float *dst = q + (((size_t)b * K + h / G) * R + (size_t)(h % G) * S + i) * E;
                for (int e = 0; e < E; e++) dst[e] = rope_at(qkv, xo + (size_t)h * E, cs, sn, co, e, E, el);
            }
            for (int h = 0; h < K; h++) { /* new keys and values [b, h, i, :] in the cache dtype */
                const size_t d = (((size_t)b * K + h) * S + i) * E;
                const size_t ko = xo + (size_t)(H + h) * E, vo = xo + (size_t)(H + K + h) * E;
                for (int e = 0; e < E; e++) {
                    st(nkey, d + e, rope_at(qkv, ko, cs, sn, co, e, E, el), el_kv);
                    st(nval, d + e, ld(qkv, vo + e, el), el_kv);
                }
            }
        }
    }
    int rc = decode_attention(B, K, G, E, S, layer, el_kv, q, nkey, nval, kbase, vbase, cap, len, masks, scale, chunk,
                              o);
    if (rc == 0) {
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < S; i++) {
                    const float *src = o + (((size_t)b * K + h / G) * R + (size_t)(h % G) * S + i) * E;
                    const size_t d = (((size_t)b * S + i) * H + h) * E;
                    for (int e = 0; e < E; e++) st(out, d + e, src[e], el);
                }
    }
    free(q);
    free(kv);
    return rc;
}

void linear_bf16(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y);

/* A whole transformer layer of a few-token step of a bf16 model in one call (what
 * Block.forward does, without ~15 Python-level calls a layer):
 *   h = norm1(x); qkv = h Wqkv^T (+ b); att = attention(rope(qkv)) (caches written);
 *   x1 = x + att Wo^T; h = norm2(x1); out = x1 + (silu(gate) * up) W2^T, [gate|up] = h W13^T
 * x, out [M, D] with M = B * S rows; weights packed for linear_bf16 (bqkv: [(H + 2K) E] or
 * NULL); norm weights [D]; cos, sin [B, S, E]; caches and masks as in qkv_attention; all
 * activations bf16, rounded where the PyTorch path rounds.  Returns 0, or -1 when scratch
 * memory could not be had (the caches may then hold this step's keys for some layers; the
 * caller fails the step). */
int decode_layer(int B, int S, int D, int H, int K, int E, int F, int layer, int el_kv, const uint16_t *x,
                 const uint16_t *norm1, const uint16_t *norm2, float eps, const uint16_t *wqkv, const uint16_t *bqkv,
                 const uint16_t *wo, const uint16_t *w13, const uint16_t *w2, const uint16_t *cs, const uint16_t *sn,
                 void *const *kbase, void *const *vbase, const int64_t *cap, const int64_t *len,
                 const uint8_t *const *masks, float scale, int chunk, uint16_t *out) {
    const int M = B * S, W = (H + 2 * K) * E;
    const size_t n = (size_t)M * ((size_t)D + W + (size_t)H * E + D + 2 * (size_t)F + F + D);
    uint16_t *h = malloc(sizeof(uint16_t) * n);
    if (!h) return -1;
    uint16_t *qkv = h + (size_t)M * D, *att = qkv + (size_t)M * W, *a = att + (size_t)M * H * E;
    uint16_t *gu = a + (size_t)M * D, *g = gu + (size_t)M * 2 * F, *m = g + (size_t)M * F;
    rms_norm(M, D, 2, x, NULL, NULL, norm1, eps, h);
    linear_bf16(M, W, D, h, wqkv, bqkv, qkv);
    int rc = qkv_attention(B, K, H / K, E, S, layer, el_kv, 2, qkv, cs, sn, kbase, vbase, cap, len, masks, scale,
                           chunk, att);
    if (rc == 0) {
        linear_bf16(M, D, H * E, att, wo, NULL, a);
        rms_norm(M, D, 2, x, a, out, norm2, eps, h); /* out = x + a, h = norm2(out) */
        linear_bf16(M, 2 * F, D, h, w13, NULL, gu);
        silu_mul(M, F, 2, gu, g);
        linear_bf16(M, D, F, g, w2, NULL, m);
        for (size_t i = 0; i < (size_t)M * D; i++) out[i] = f32_to_bf16(ld(out, i, 2) + ld(m, i, 2));
    }
    free(h);
    return rc;
}
