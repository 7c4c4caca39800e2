/* A few-token step (decode, verification) of a bf16 model in one call: ``decode_stack`` runs
 * every layer, the final norm and the head in one parallel region (the threads meet at barriers,
 * no fork and join per op), instead of ~40 PyTorch ops a layer (each ~5-10 us of dispatch on
 * this CPU, about as much as the linear layers' weight reads at batch 1).  The element-wise
 * parts (RMSNorm with the residual, the SiLU gate, rotary + cache writes + attention) are also
 * callable one by one, for fp32 models and the PyTorch-linear path.
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

#include <omp.h>

#include "attention.h"
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

/* sigmoid(g) without overflow, from exp_neg */
static inline float sigmoid(float g) {
    const float e = exp_neg(-fabsf(g));
    return g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

/* silu(g) * u of n bf16 pairs, rounded as PyTorch's bf16 ops round: exp_neg's sigmoid, 16 lanes at a
 * time where AVX-512 is compiled in.  The lanes repeat the scalar loop's operations, one division for
 * both signs' numerators; checked against it for every bf16 gate (the up factor comes after the
 * roundings that depend on the gate alone): identical bits.  ~1.6x faster than the scalar loop. */
static void silu_bf16(int n, const uint16_t *g, const uint16_t *u, uint16_t *out) {
    int j = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m512 gv = ld_bf16x16(g + j), uv = ld_bf16x16(u + j);
        const __m512 x = _mm512_max_ps(_mm512_sub_ps(zero, _mm512_abs_ps(gv)), _mm512_set1_ps(-87.0f)); /* exp_neg(-|g|) */
        const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                              _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __m512 r = exp_reduce16(x, k);
        __m512 p = exp_mid16(_mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f)), r);
        p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), one);
        const __m512i e2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
        const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(e2));
        const __mmask16 pos = _mm512_cmp_ps_mask(gv, zero, _CMP_GE_OQ);
        const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(pos, e, one), _mm512_add_ps(one, e));
        const __m512 y = rnd_bf16x16(_mm512_mul_ps(rnd_bf16x16(_mm512_mul_ps(gv, sig)), uv));
        _mm256_storeu_si256((__m256i *)(out + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(y), 16)));
    }
#endif
    for (; j < n; j++) {
        const float gj = bf16_to_f32(g[j]);
        out[j] = f32_to_bf16(rnd(rnd(gj * sigmoid(gj), 2) * bf16_to_f32(u[j]), 2));
    }
}

/* The MLP's gate: gu [rows, 2F] holds gate | up; out [rows, F] = silu(gate) * up, each
 * rounded to the activation dtype as PyTorch's bf16 ops do. */
void silu_mul(int rows, int F, int el, const void *gu, void *out) {
    for (int r = 0; r < rows; r++) {
        const size_t gi = (size_t)r * 2 * F, oi = (size_t)r * F;
        if (el == 2) {
            silu_bf16(F, (const uint16_t *)gu + gi, (const uint16_t *)gu + gi + F, (uint16_t *)out + oi);
            continue;
        }
        for (int j = 0; j < F; j++) {
            const float g = ld(gu, gi + j, el);
            st(out, oi + j, rnd(rnd(g * sigmoid(g), el) * ld(gu, gi + F + j, el), el), el);
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

#ifdef __AVX512F__
/* 16 floats that are bf16 numbers (rnd_bf16x16's output) stored as bf16 */
static inline void st_bf16x16(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16)));
}

/* rope_at for a whole bf16 head (E a multiple of 32) into out[0, E) as floats (bf16 numbers) */
static inline void rope_head_bf16(const uint16_t *x, const uint16_t *cs, const uint16_t *sn, int E, float *out) {
    const int half = E / 2;
    for (int c = 0; c < half; c += 16) {
        const __m512 x1 = ld_bf16x16(x + c), x2 = ld_bf16x16(x + half + c);
        const __m512 a1 = rnd_bf16x16(_mm512_mul_ps(x1, ld_bf16x16(cs + c)));
        const __m512 b1 = rnd_bf16x16(_mm512_mul_ps(x2, ld_bf16x16(sn + c)));
        const __m512 a2 = rnd_bf16x16(_mm512_mul_ps(x2, ld_bf16x16(cs + half + c)));
        const __m512 b2 = rnd_bf16x16(_mm512_mul_ps(x1, ld_bf16x16(sn + half + c)));
        _mm512_storeu_ps(out + c, rnd_bf16x16(_mm512_add_ps(a1, b1)));
        _mm512_storeu_ps(out + half + c, rnd_bf16x16(_mm512_add_ps(a2, b2)));
    }
}
#endif

/* Queries, keys and values of rows [r0, r1) of a step from the fused qkv projection:
 *   qkv [B, S, (K*G + 2K) * E] in the activation dtype (queries, then keys, then values)
 *   cos, sin [B, S, E] in the activation dtype (Transformer.rope)
 * Rotary embedding on queries and keys (rounded as PyTorch rounds); the queries go to
 * q [B, K, G*S, E] fp32 (attention's layout: row (h % G) * S + i of KV head h / G), the keys
 * and values straight into the caches (dtype el_kv) at positions len[b] + i. */
static void rope_rows(int r0, int r1, int S, int K, int G, int E, int layer, int el_kv, int el, const void *qkv,
                      const void *cs, const void *sn, void *const *kbase, void *const *vbase, const int64_t *cap,
                      const int64_t *len, float *q) {
    const int H = K * G, R = G * S, W = (H + 2 * K) * E;
    for (int row = r0; row < r1; row++) {
        const int b = row / S, i = row % S;
        const size_t xo = (size_t)row * W, co = (size_t)row * E;
#ifdef __AVX512F__
        if (el == 2 && E % 32 == 0 && E <= 256) { /* bf16 activations: 16 lanes at a time, the same roundings */
            const uint16_t *x = (const uint16_t *)qkv + xo, *c = (const uint16_t *)cs + co, *sv = (const uint16_t *)sn + co;
            float kr[256];
            for (int h = 0; h < H; h++)
                rope_head_bf16(x + (size_t)h * E, c, sv, E, q + (((size_t)b * K + h / G) * R + (size_t)(h % G) * S + i) * E);
            for (int h = 0; h < K; h++) {
                const size_t d = (((size_t)layer * K + h) * cap[b] + len[b] + i) * E;
                const uint16_t *v = x + (size_t)(H + K + h) * E;
                rope_head_bf16(x + (size_t)(H + h) * E, c, sv, E, kr);
                if (el_kv == 2) {
                    for (int e = 0; e < E; e += 16) st_bf16x16((uint16_t *)kbase[b] + d + e, _mm512_loadu_ps(kr + e));
                    memcpy((uint16_t *)vbase[b] + d, v, sizeof(uint16_t) * E);
                } else {
                    memcpy((float *)kbase[b] + d, kr, sizeof(float) * E);
                    for (int e = 0; e < E; e += 16) _mm512_storeu_ps((float *)vbase[b] + d + e, ld_bf16x16(v + e));
                }
            }
            continue;
        }
#endif
        for (int h = 0; h < H; h++) {
            float *dst = q + (((size_t)b * K + h / G) * R + (size_t)(h % G) * S + i) * E;
            for (int e = 0; e < E; e++) dst[e] = rope_at(qkv, xo + (size_t)h * E, cs, sn, co, e, E, el);
        }
        for (int h = 0; h < K; h++) {
            const size_t d = (((size_t)layer * K + h) * cap[b] + len[b] + i) * E;
            const size_t ko = xo + (size_t)(H + h) * E, vo = xo + (size_t)(H + K + h) * E;
            for (int e = 0; e < E; e++) {
                st(kbase[b], d + e, rope_at(qkv, ko, cs, sn, co, e, E, el), el_kv);
                st(vbase[b], d + e, ld(qkv, vo + e, el), el_kv);
            }
        }
    }
}

/* attention's output o [B, K, G*S, E] fp32 as out [B, S, K*G*E] in the activation dtype, rows [r0, r1) */
static void heads_out(int r0, int r1, int S, int K, int G, int E, int el, const float *o, void *out) {
    const int H = K * G, R = G * S;
    for (int row = r0; row < r1; row++) {
        const int b = row / S, i = row % S;
        for (int h = 0; h < H; h++) {
            const float *src = o + (((size_t)b * K + h / G) * R + (size_t)(h % G) * S + i) * E;
            const size_t d = ((size_t)row * H + h) * E;
#ifdef __AVX512F__
            if (el == 2 && E % 16 == 0) {
                for (int e = 0; e < E; e += 16) st_bf16x16((uint16_t *)out + d + e, rnd_bf16x16(_mm512_loadu_ps(src + e)));
                continue;
            }
#endif
            for (int e = 0; e < E; e++) st(out, d + e, src[e], el);
        }
    }
}

/* Scratch of one step's attention: the queries and outputs (fp32), the work items' partial
 * results and each thread's scores; one malloc, freed by the caller. */
typedef struct {
    AttnStep a;
    float *q, *o, *scratch;
    size_t per;
    int threads;
    void *mem;
} AttnScratch;

static int attn_alloc(AttnScratch *s, int B, int K, int G, int E, int S, int el_kv, int chunk, float scale,
                      void *const *kbase, void *const *vbase, const int64_t *cap, const int64_t *len,
                      const uint8_t *const *masks) {
    AttnStep a = {B, K, G, E, S, 0, el_kv, chunk, scale, NULL, kbase, vbase, cap, len, masks};
    int64_t *first = malloc(sizeof(int64_t) * (B + 1));
    if (!first) return -1;
    const int64_t W = attn_items(&a, first); /* items depend on the lengths only: the same for every layer */
    if (W < 0) {
        free(first);
        return -1;
    }
    const size_t R = (size_t)G * S, nq = (size_t)B * K * R * E;
    s->threads = omp_get_max_threads();
    s->per = attn_scratch(&a);
    float *f = malloc(sizeof(float) * (2 * nq + (size_t)W * R * (E + 2) + s->per * s->threads));
    if (!f) {
        attn_release(&a);
        free(first);
        return -1;
    }
    s->q = f;
    s->o = f + nq;
    a.acc = s->o + nq;
    a.ms = a.acc + W * R * E;
    a.ls = a.ms + W * R;
    s->scratch = a.ls + W * R;
    a.q = s->q;
    s->a = a;
    s->mem = f;
    return 0;
}

static void attn_free(AttnScratch *s) {
    attn_release(&s->a);
    free(s->a.first);
    free(s->mem);
}

/* One layer's attention inside a parallel region: rotary and cache writes for the step's M
 * rows, attention, and its output in the activation dtype (out [M, H*E]). */
static void attention_team(AttnScratch *s, int layer, int el, const void *qkv, const void *cs, const void *sn,
                           void *out) {
    AttnStep *a = &s->a;
    const int M = a->B * a->S;
#pragma omp single
    a->layer = layer; /* the implied barrier publishes it */
#pragma omp for schedule(static)
    for (int row = 0; row < M; row++)
        rope_rows(row, row + 1, a->S, a->K, a->G, a->E, layer, a->elsize, el, qkv, cs, sn, a->kbase, a->vbase, a->cap,
                  a->len, s->q);
    attn_team(a, s->scratch + s->per * omp_get_thread_num(), s->o);
#pragma omp for schedule(static)
    for (int row = 0; row < M; row++) heads_out(row, row + 1, a->S, a->K, a->G, a->E, el, s->o, out);
}

/* A few-token step's attention straight from the fused qkv projection (qkv, cos, sin as for
 * rope_rows): rotary embedding, keys and values written into the caches (dtype el_kv),
 * attention as decode_attention computes it (causal, or masks[b]); writes out
 * [B, S, K*G*E] in the activation dtype, ready for the output projection.
 * Returns 0, or -1 when scratch memory could not be had. */
int qkv_attention(int B, int K, int G, int E, int S, int layer, int el_kv, int el, const void *qkv, const void *cs,
                  const void *sn, void *const *kbase, void *const *vbase, const int64_t *cap, const int64_t *len,
                  const uint8_t *const *masks, float scale, int chunk, void *out) {
    AttnScratch s;
    if (attn_alloc(&s, B, K, G, E, S, el_kv, chunk, scale, kbase, vbase, cap, len, masks) != 0) return -1;
#pragma omp parallel num_threads(s.threads)
    attention_team(&s, layer, el, qkv, cs, sn, out);
    attn_free(&s);
    return 0;
}

void linear_team(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y);
void linear_team_amx(int M, int N, int K, const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y);
void linear_q8_team(int M, int N, int K, const uint16_t *x, const int8_t *wp, const uint16_t *bias, uint16_t *y);
void head_greedy_team(int M, int V, int K, const uint16_t *x, const uint16_t *wp, const QHead *qh, QRow *qr,
                      int8_t *bytes, float *hi, float *thr, float *T, uint16_t *y, int amx);
int head_greedy_native(void);

/* silu(gate) * up of rows [0, M) inside a parallel region, split in pieces of 256 columns */
static void silu_team(int M, int F, const uint16_t *gu, uint16_t *out) {
    const int pieces = (F + 255) / 256;
#pragma omp for schedule(static)
    for (int p = 0; p < M * pieces; p++) {
        const int r = p / pieces, j0 = p % pieces * 256, n = F - j0 < 256 ? F - j0 : 256;
        const uint16_t *g = gu + (size_t)r * 2 * F + j0;
        silu_bf16(n, g, g + F, out + (size_t)r * F + j0);
    }
}

/* What decode_stack reads of one layer: norm weights [D], linear weights packed for linear_bf16,
 * the qkv bias [(H + 2K) E] or NULL; all bf16. */
enum { W_NORM1, W_NORM2, W_QKV, W_BQKV, W_O, W_13, W_2, W_PER_LAYER };

/* Layers layer0 .. layer0 + L of a few-token step of a bf16 model in one call and one parallel
 * region (what Block.forward does per layer, without ~15 Python-level calls and five thread
 * fork/joins a layer): per layer
 *   h = norm1(x); qkv = h Wqkv^T (+ b); att = attention(rope(qkv)) (caches written);
 *   x1 = x + att Wo^T; h = norm2(x1); x = x1 + (silu(gate) * up) W2^T, [gate|up] = h W13^T
 * x [M, D] with M = B * S rows, updated in place; w: L * W_PER_LAYER pointers; cos, sin
 * [B, S, E]; caches and masks as in qkv_attention; activations bf16, rounded where the PyTorch
 * path rounds.  With `head` (not NULL): logits [B or M, V] = head(norm(x)) (normf [D], head packed
 * for linear_bf16) of each sequence's last row (`last_only`) or of every row; with `qhead` too (its
 * int8 copy, head_greedy_native()), exact logits only where the greedy choice can be and -inf
 * elsewhere (head_greedy_team in linear.c).  `amx`: every matrix (the head's too) is packed for and runs on
 * AMX tiles (linear_team_amx).  `q8`: the layers' four matrices are int8 with a scale per output row,
 * packed for linear_q8_team (model.weights = "int8"); the head stays as `amx` says.  Returns 0, or -1
 * when scratch memory could not be had (then nothing is written). */
int decode_stack(int B, int S, int D, int H, int K, int E, int F, int layer0, int L, const uint16_t *const *w,
                 float eps, int el_kv, uint16_t *x, const uint16_t *cs, const uint16_t *sn, void *const *kbase,
                 void *const *vbase, const int64_t *cap, const int64_t *len, const uint8_t *const *masks, float scale,
                 int chunk, const uint16_t *normf, const uint16_t *head, int V, int last_only, uint16_t *logits,
                 const QHead *qhead, int amx, int q8) {
    void (*const lin)(int, int, int, const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *) =
        amx ? linear_team_amx : linear_team; /* every matrix, the head's too */
    /* a layer's matrix: int8 (`q8`) or as the head */
#define LAYER_LIN(M_, N_, K_, X_, W_, B_, Y_)                                                                   \
    (q8 ? linear_q8_team(M_, N_, K_, X_, (const int8_t *)(W_), B_, Y_) : lin(M_, N_, K_, X_, W_, B_, Y_))
    const int M = B * S, W = (H + 2 * K) * E, HR = last_only ? B : M;
    const size_t n = (size_t)M * ((size_t)D + W + (size_t)H * E + D + 2 * (size_t)F + F + D) + (size_t)HR * D * 2;
    uint16_t *h = malloc(sizeof(uint16_t) * n);
    AttnScratch s;
    if (!h || attn_alloc(&s, B, K, H / K, E, S, el_kv, chunk, scale, kbase, vbase, cap, len, masks) != 0) {
        free(h);
        return -1;
    }
    uint16_t *qkv = h + (size_t)M * D, *att = qkv + (size_t)M * W, *a = att + (size_t)M * H * E;
    uint16_t *gu = a + (size_t)M * D, *g = gu + (size_t)M * 2 * F, *m = g + (size_t)M * F;
    uint16_t *last = m + (size_t)M * D, *hn = last + (size_t)HR * D;
    /* the greedy head's scratch: rows' int8 copies, their bounds [HR, Vp], per-thread maxima, thresholds */
    void *gs = NULL;
    QRow *qr = NULL;
    int8_t *qb = NULL;
    float *hi = NULL, *thr = NULL, *T = NULL;
    if (qhead && head && head_greedy_native()) {
        const size_t vp = (size_t)(V + 15) / 16 * 16;
        gs = malloc(sizeof(QRow) * HR + sizeof(float) * (vp * HR + (size_t)(s.threads + 1) * HR) + (size_t)HR * 2 * qhead->Kp + 64);
        if (!gs) {
            attn_free(&s);
            free(h);
            return -1;
        }
        qr = gs;
        hi = (float *)(qr + HR);
        thr = hi + vp * HR;
        T = thr + (size_t)s.threads * HR;
        qb = (int8_t *)(T + HR);
    }
#pragma omp parallel num_threads(s.threads)
    {
        for (int l = 0; l < L; l++) {
            const uint16_t *const *lw = w + (size_t)l * W_PER_LAYER;
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++) rms_norm(1, D, 2, x + (size_t)r * D, NULL, NULL, lw[W_NORM1], eps, h + (size_t)r * D);
            LAYER_LIN(M, W, D, h, lw[W_QKV], lw[W_BQKV], qkv);
#pragma omp barrier
            attention_team(&s, layer0 + l, 2, qkv, cs, sn, att);
            LAYER_LIN(M, D, H * E, att, lw[W_O], NULL, a);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++) /* x = x + a, h = norm2(x) */
                rms_norm(1, D, 2, x + (size_t)r * D, a + (size_t)r * D, x + (size_t)r * D, lw[W_NORM2], eps,
                         h + (size_t)r * D);
            LAYER_LIN(M, 2 * F, D, h, lw[W_13], NULL, gu);
#pragma omp barrier
            silu_team(M, F, gu, g);
            LAYER_LIN(M, D, F, g, lw[W_2], NULL, m);
#pragma omp barrier
#pragma omp for schedule(static)
            for (size_t i = 0; i < (size_t)M * D; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(m[i]));
        }
        if (head) {
#pragma omp for schedule(static)
            for (int r = 0; r < HR; r++) {
                const uint16_t *src = x + (size_t)(last_only ? r * S + S - 1 : r) * D;
                memcpy(last + (size_t)r * D, src, sizeof(uint16_t) * D);
                rms_norm(1, D, 2, last + (size_t)r * D, NULL, NULL, normf, eps, hn + (size_t)r * D);
            }
            if (gs)
                head_greedy_team(HR, V, D, hn, head, qhead, qr, qb, hi, thr, T, logits, amx);
            else
                lin(HR, V, D, hn, head, NULL, logits);
        }
    }
    attn_free(&s);
    free(gs);
    free(h);
    return 0;
#undef LAYER_LIN
}

/* The greedy choice of each of `rows` rows of n bf16 logits (row r at x + r * n): the first index of
 * its largest value, as torch.argmax picks it (a NaN counts as the largest, the first NaN wins;
 * -0 and +0 tie).  bf16 bits as int16 order like the numbers once a negative's other 15 bits are
 * flipped; adding 1 to the negatives makes -0 the key of +0.  Two passes over a row (the largest
 * key, then where it first is), both vectorisable; this replaces an fp32 copy of every logit and
 * numpy's argmax after a verification pass (~0.6 ms for 16 rows of 49k here, on cold caches). */
static inline int16_t bf16_key(uint16_t u) {
    const int16_t x = (int16_t)u, s = (int16_t)(x >> 15);
    return (int16_t)((x ^ (s & 0x7fff)) - s);
}

/* the first index in p[0, n) whose key is `best` (nan: the first NaN) */
static int64_t first_at(const uint16_t *p, int64_t n, int16_t best, int nan) {
    for (int64_t i = 0; i < n; i++)
        if (nan ? (p[i] & 0x7fff) > 0x7f80 : bf16_key(p[i]) == best) return i;
    return 0;
}

#ifdef __AVX512BW__
/* bf16_key of 32 values */
static inline __m512i bf16_keys32(__m512i v) {
    const __m512i s = _mm512_srai_epi16(v, 15);
    return _mm512_sub_epi16(_mm512_xor_si512(v, _mm512_and_si512(s, _mm512_set1_epi16(0x7fff))), s);
}
#endif

void argmax_bf16(int64_t rows, int64_t n, const uint16_t *x, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *p = x + r * n;
        int16_t best = INT16_MIN;
        int nan = 0;
        int64_t i = 0;
#ifdef __AVX512BW__
        /* 32 keys a vector: the largest, and whether any is a NaN */
        __m512i vbest = _mm512_set1_epi16(INT16_MIN);
        __mmask32 vnan = 0;
        for (; i + 32 <= n; i += 32) {
            const __m512i v = _mm512_loadu_si512((const void *)(p + i));
            vbest = _mm512_max_epi16(vbest, bf16_keys32(v));
            vnan |= _mm512_cmpgt_epi16_mask(_mm512_and_si512(v, _mm512_set1_epi16(0x7fff)), _mm512_set1_epi16(0x7f80));
        }
        int16_t lanes[32];
        _mm512_storeu_si512((void *)lanes, vbest);
        for (int l = 0; l < 32; l++) best = lanes[l] > best ? lanes[l] : best;
        nan = vnan != 0;
#endif
        for (; i < n; i++) {
            const int16_t k = bf16_key(p[i]);
            best = k > best ? k : best;
            nan |= (p[i] & 0x7fff) > 0x7f80;
        }
        int64_t j = 0;
#ifdef __AVX512BW__
        if (!nan) /* the first block of 32 that holds the largest key */
            for (const __m512i vb = _mm512_set1_epi16(best); j + 32 <= n; j += 32)
                if (_mm512_cmpeq_epi16_mask(bf16_keys32(_mm512_loadu_si512((const void *)(p + j))), vb)) break;
#endif
        out[r] = j + first_at(p + j, n - j, best, nan);
    }
}

/* top-1 minus top-2 softmax probability over n bf16 logits (0 where none is finite) */
static float softmax_margin(int N, const uint16_t *logits) {
    float m1 = -INFINITY, m2 = -INFINITY;
    for (int i = 0; i < N; i++) {
        const float v = bf16_to_f32(logits[i]);
        if (v > m1) {
            m2 = m1;
            m1 = v;
        } else if (v > m2) {
            m2 = v;
        }
    }
    if (!(m1 > -INFINITY) || m1 != m1) return 0.0f;
    float s = 0.0f;
    for (int i = 0; i < N; i++) s += expf(bf16_to_f32(logits[i]) - m1);
    return (1.0f - expf(m2 - m1)) / s;
}

/* Both checks' tail, inside their parallel region: y = h + delta (delta NULL: y = h), hn = norm(y),
 * logits = hn S^T. */
static void exit_head_team(int D, int N, const uint16_t *h, const uint16_t *delta, const uint16_t *w, float eps,
                           const uint16_t *subset, uint16_t *y, uint16_t *hn, uint16_t *logits) {
#pragma omp single
    {
        for (int d = 0; d < D; d++) y[d] = delta ? f32_to_bf16(bf16_to_f32(h[d]) + bf16_to_f32(delta[d])) : h[d];
        rms_norm(1, D, 2, y, NULL, NULL, w, eps, hn);
    }
    linear_team(1, N, D, hn, subset, NULL, logits);
}

/* An early exit's softmax check of one row (issue #9) in one call and one parallel region: the exit
 * state y = h + h A^T (A: the exit's adapter packed for linear_bf16; NULL: y = h), its norm
 * hn = norm(y) (weight w, HF Llama's order as rms_norm), the exit head over the vocabulary subset
 * logits = hn S^T (S packed for linear_bf16, N rows), and the softmax margin over the subset (top-1
 * minus top-2 probability: (1 - exp(l2 - l1)) / sum exp(l - l1)), returned.  y [D], hn [D] and
 * logits [N] (bf16) are written for the caller; tmp [D] is scratch.  The same products, roundings
 * and order as Exits.confidence's PyTorch path, whose dispatch cost ~0.55 ms a check inside a decode
 * step on the AVX2 EPYC (its caches cold from the layers' weights) beside the products' ~0.35. */
float exit_check(int D, int N, const uint16_t *h, const uint16_t *adapter, const uint16_t *w, float eps,
                 const uint16_t *subset, uint16_t *y, uint16_t *hn, uint16_t *logits, uint16_t *tmp) {
#pragma omp parallel
    {
        if (adapter) {
            linear_team(1, D, D, h, adapter, NULL, tmp);
#pragma omp barrier
        }
        exit_head_team(D, N, h, adapter ? tmp : NULL, w, eps, subset, y, hn, logits);
    }
    return softmax_margin(N, logits);
}

/* exit_check with an MLP adapter (exit_stream's "mlp" kind): the exit state y = h + silu(h A1^T) A2^T
 * (A1 [H, D] and A2 [D, H] packed by pack_linear), each product and the silu rounded to bf16 as
 * PyTorch's bf16 ops round (the silu from exp_neg's sigmoid, as the MLP's gate: PyTorch's own exp may
 * differ in the last fp32 bit, so a rare silu value one bf16 step apart); then as exit_check.
 * tmp [H + D] is scratch. */
float exit_check_mlp(int D, int N, int H, const uint16_t *h, const uint16_t *a1, const uint16_t *a2,
                     const uint16_t *w, float eps, const uint16_t *subset, uint16_t *y, uint16_t *hn,
                     uint16_t *logits, uint16_t *tmp) {
    uint16_t *mid = tmp, *delta = tmp + H;
#pragma omp parallel
    {
        linear_team(1, H, D, h, a1, NULL, mid);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int j = 0; j < H; j++) {
            const float g = bf16_to_f32(mid[j]);
            mid[j] = f32_to_bf16(g * sigmoid(g));
        }
        linear_team(1, D, H, mid, a2, NULL, delta);
#pragma omp barrier
        exit_head_team(D, N, h, delta, w, eps, subset, y, hn, logits);
    }
    return softmax_margin(N, logits);
}

/* Early exit's KV filling of one token (issue #9; early_exit.fill_kv with FoldedKV) in one call, instead
 * of ~12 PyTorch ops: the exit layer's state h [D] (bf16) normalised without a weight, u = h / rms(h)
 * computed in fp32 and rounded to bf16 once (F.rms_norm of the fp32 row; FoldedKV's rows carry each
 * layer's norm weight); kv = u W^T (+ bias) over the n skipped layers' K and V rows (``rows``: their
 * [n * 2 K E, D] rows packed by pack_linear, the AMX layout when ``amx``; bias [n * 2 K E] bf16 or NULL);
 * then for layer first + l the keys' rotary embedding at the token's position (cs, sn [E] bf16 from
 * Transformer.rope, rounded as apply_rope rounds) and keys and values written at position ``pos`` of
 * the caches kbase, vbase ([L, K, cap, E], dtype el_kv).  u [D] and kv [n * 2 K E] are scratch. */
void fill_kv_folded(int D, int K, int E, int first, int n, const uint16_t *h, float eps, const uint16_t *rows,
                    const uint16_t *bias, int amx, const uint16_t *cs, const uint16_t *sn, int el_kv, void *kbase,
                    void *vbase, int64_t cap, int64_t pos, uint16_t *u, uint16_t *kv) {
    float ss = 0.0f;
    for (int d = 0; d < D; d++) {
        const float v = bf16_to_f32(h[d]);
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    for (int d = 0; d < D; d++) u[d] = f32_to_bf16(bf16_to_f32(h[d]) * inv);
    const int W = 2 * K * E; /* one layer's K and V rows */
#pragma omp parallel
    {
        if (amx)
            linear_team_amx(1, n * W, D, u, rows, bias, kv);
        else
            linear_team(1, n * W, D, u, rows, bias, kv);
    }
    for (int l = 0; l < n; l++) {
        for (int hh = 0; hh < K; hh++) {
            const size_t d = (((size_t)(first + l) * K + hh) * (size_t)cap + (size_t)pos) * E;
            const size_t ko = (size_t)l * W + (size_t)hh * E, vo = (size_t)l * W + (size_t)(K + hh) * E;
            for (int e = 0; e < E; e++) {
                st(kbase, d + e, rope_at(kv, ko, cs, sn, 0, e, E, 2), el_kv);
                st(vbase, d + e, bf16_to_f32(kv[vo + e]), el_kv);
            }
        }
    }
}

/* Rows ids[0, n) of a bf16 weight that pack_linear (native/__init__.py) packed, its padding
 * dropped: out [n, k] bf16.  layout 0: [N/4, Kp/32, 4, 32]; 1: the AVX2 panels [N/16, K, 8, 2];
 * 2: the AMX tiles' [N/16, K/32, 16, 16, 2] (k even); kp: the packed K.  The embedding's lookup
 * from a tied head's copy, every step and pass: PyTorch's advanced indexing over those layouts
 * took 22-46 us for 1-16 rows on idle cores (docs/decisions.md, 2026-12-02). */
void lookup_rows_bf16(const uint16_t *w, int layout, int64_t kp, const int64_t *ids, int64_t n, int64_t k,
                      uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids[i];
        uint16_t *o = out + i * k;
        if (layout == 2) {
            const uint32_t *base = (const uint32_t *)w + (r / 16) * (kp / 32) * 256 + r % 16;
            for (int64_t c = 0; c < k / 2; c++) {
                const uint32_t pair = base[(c / 16) * 256 + (c % 16) * 16];
                memcpy(o + 2 * c, &pair, 4);
            }
        } else if (layout == 1) {
            const uint16_t *base = w + (r / 16) * kp * 16 + (r % 8) * 2 + (r % 16) / 8;
            for (int64_t c = 0; c < k; c++) o[c] = base[c * 16];
        } else {
            const uint16_t *base = w + (r / 4) * (kp / 32) * 128 + (r % 4) * 32;
            for (int64_t c = 0; c < k; c++) o[c] = base[(c / 32) * 128 + c % 32];
        }
    }
}
