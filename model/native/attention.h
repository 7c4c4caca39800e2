/* One layer's attention over a step's caches, as the phases decode_attention.c runs them, for
 * callers that run the phases inside a parallel region of their own (decode_stack). */
#ifndef CODECOMPLETE_NATIVE_ATTENTION_H
#define CODECOMPLETE_NATIVE_ATTENTION_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    int B, K, G, E, S, layer, elsize, chunk; /* as decode_attention's arguments */
    float scale;
    const float *q; /* [B, K*G, S, E] fp32 */
    void *const *kbase, *const *vbase;
    const int64_t *cap, *len;
    const uint8_t *const *masks;
    int64_t *first, W; /* set by attn_items */
    float *acc, *ms, *ls; /* W * G * S * E, W * G * S, W * G * S floats, the caller's */
    int32_t *vinfo; /* set by attn_items: rows attended over gathered positions (NULL: none) */
} AttnStep;

int64_t attn_items(AttnStep *a, int64_t *first);
void attn_release(AttnStep *a);
size_t attn_scratch(const AttnStep *a);
void attn_team(const AttnStep *a, float *scratch, float *out);
#endif
