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

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* exp(x) for x <= 0 (softmax after subtracting the max): Cephes-style range reduction
 * and a degree-6 polynomial, written so the compiler vectorises it; relative error ~1e-7. */
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

/* Rows [t0, t1) of a [T, E] fp32 or bf16 matrix as fp32: a pointer into it, or into `buf`
 * after converting. */
static inline const float *rows_f32(const void *base, int elsize, int E, int64_t t0, int64_t n, float *buf) {
    if (elsize == 4) return (const float *)base + t0 * E;
    const uint16_t *src = (const uint16_t *)base + t0 * E;
#pragma omp simd
    for (int64_t i = 0; i < n * E; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
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
            const int64_t i = r % S;                                                                       \
            if (mask) {                                                                                    \
                const uint8_t *mi = mask + i * T + t0;                                                     \
                _Pragma("omp simd") for (int64_t t = 0; t < n; t++) s[t] = mi[t] ? s[t] : -INFINITY;       \
            } else {                                                                                       \
                for (int64_t t = len + i + 1 - t0 > 0 ? len + i + 1 - t0 : 0; t < n; t++) s[t] = -INFINITY; \
            }                                                                                              \
            float mr = -INFINITY;                                                                          \
            _Pragma("omp simd reduction(max : mr)") for (int64_t t = 0; t < n; t++) mr = fmaxf(mr, s[t]);  \
            float sum = 0.0f;                                                                              \
            if (mr == -INFINITY) {                                                                         \
                for (int64_t t = 0; t < n; t++) s[t] = 0.0f;                                               \
            } else {                                                                                       \
                _Pragma("omp simd reduction(+ : sum)") for (int64_t t = 0; t < n; t++) {                   \
                    float p = s[t] == -INFINITY ? 0.0f : exp_neg(s[t] - mr);                               \
                    s[t] = p;                                                                              \
                    sum += p;                                                                              \
                }                                                                                          \
            }                                                                                              \
            m[r] = mr;                                                                                     \
            l[r] = sum;                                                                                    \
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

    const chunk_fn fn = E == 64 ? attend_chunk_64 : E == 128 ? attend_chunk_128 : attend_chunk_any;
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
