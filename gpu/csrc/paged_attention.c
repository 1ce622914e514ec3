/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * The torch path (gpu/kv_cache.py, PagedKVCache._decode) gathers every sequence's
 * blocks into a contiguous copy and runs batched matmuls of 3 x head_dim rows on it:
 * the KV is read from DRAM, written, read again, and each tiny matmul pays its own
 * setup. This kernel reads each key and value once, from where they lie.
 *
 * Layout (row-major, as PagedKVCache stores one layer):
 *   q      [D, H, HD]       fp32, the step's queries, RoPE applied; sequence s starts at
 *                           q + s * q_stride (the rows may be a strided slice)
 *   kc, vc [KV, ROWS, HD]   cache rows, fp32 or fp16 (kv_half; read as fp32, exactly);
 *                           row = block * BS + offset
 *   tables [D, MAXNB]       int32 block table of each sequence
 *   lens   [D]              int32 keys per sequence (context including the new token)
 *   out    [D, H, HD]
 * Query head i reads kv head i / (H / KV) (grouped-query attention).
 * A layer with a sliding window (window > 0) attends to the last `window` keys of each
 * sequence only (its own included), as transformers and llama.cpp mask them; softcap > 0
 * caps the scores at +-softcap (cap * tanh(score / cap), Gemma 2) before the softmax.
 * Softmax in fp32 with the maximum subtracted, as torch computes it. Each (sequence,
 * kv head) pair is one function of its query, key count and cache rows, whatever else
 * is in the call and on every build (fixed_order.h): a score is the lanes-and-tree sum
 * of q[d] * k[d] (lane d % 8) times scale; the softmax's denominator the lanes-and-tree
 * sum of exp_fixed(score - max); each output the sum over keys in order of
 * weight * v[d], one fused multiply-add a key.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "fixed_order.h"

static void softmax_rows(float *restrict scores, int32_t g, int32_t len, float softcap) {
    for (int32_t j = 0; j < g; j++) {
        float *sc = scores + (int64_t)j * len;
        if (softcap > 0.0f) fo_softcap(sc, len, softcap);
        float m = sc[0];
        for (int32_t p = 1; p < len; p++) m = sc[p] > m ? sc[p] : m;
        fo_exp_sub(sc, len, m);
        float inv = 1.0f / fo_sum(sc, len);
        for (int32_t p = 0; p < len; p++) sc[p] *= inv;
    }
}

#ifdef FO_AVX2
/* Ask for a whole block (bs rows of head_dim elements, `bytes` in all) ahead of use: a
 * block's rows start where the hardware prefetcher would start cold. */
static inline void prefetch_block(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}
#endif

#define KV_T float
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_GET(e) (e)
#define PAIR64 pair64_f32
#define PAIR pair_f32
#include "paged_attention_pair.h"
#undef KV_T
#undef KV_LOAD8
#undef KV_GET
#undef PAIR64
#undef PAIR

#define KV_T uint16_t
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_GET(e) fo_half_to_float(e)
#define PAIR64 pair64_f16
#define PAIR pair_f16
#include "paged_attention_pair.h"
#undef KV_T
#undef KV_LOAD8
#undef KV_GET
#undef PAIR64
#undef PAIR

/* Returns 0, or -1 when scratch memory could not be allocated (out is then unset).
 * kv_half: the cache holds fp16 (else fp32); window: keys per sequence a query attends
 * to, its own included (0: all); softcap: the scores' cap (0: none). */
int paged_attention(const float *q, int64_t q_stride, const void *kc, const void *vc,
                    int32_t kv_half, const int32_t *tables, const int32_t *lens, float *out,
                    int32_t d, int32_t h, int32_t kv, int32_t hd, int64_t rows, int32_t bs,
                    int32_t maxnb, float scale, int32_t window, float softcap, int32_t threads) {
    int32_t g = h / kv;
    int32_t maxlen = 1;
    for (int32_t s = 0; s < d; s++) maxlen = lens[s] > maxlen ? lens[s] : maxlen;
    if (threads < 1) threads = 1;
    size_t per_thread = (size_t)g * maxlen; /* one pair's scores */
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)threads);
    if (!scratch) return -1;
    size_t elem = kv_half ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < (int64_t)d * kv; i++) {
#ifdef _OPENMP
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *scores = scratch;
#endif
        int32_t s = (int32_t)(i / kv), kvh = (int32_t)(i % kv);
        const float *qs = q + (int64_t)s * q_stride + (int64_t)kvh * g * hd;
        float *os = out + ((int64_t)s * h + (int64_t)kvh * g) * hd;
        size_t at = elem * (size_t)kvh * (size_t)rows * (size_t)hd;
        const void *kb = (const char *)kc + at, *vb = (const char *)vc + at;
        const int32_t *table = tables + (int64_t)s * maxnb;
        if (lens[s] < 1) {
            for (int32_t j = 0; j < g * hd; j++) os[j] = 0.0f;
            continue;
        }
        int32_t first = window > 0 && lens[s] > window ? lens[s] - window : 0;
#ifdef FO_AVX2
        if (hd == 64) {
            if (kv_half) pair64_f16(qs, kb, vb, table, first, lens[s], bs, g, scale, softcap, scores, os);
            else pair64_f32(qs, kb, vb, table, first, lens[s], bs, g, scale, softcap, scores, os);
            continue;
        }
#endif
        if (kv_half) pair_f16(qs, kb, vb, table, first, lens[s], bs, g, hd, scale, softcap, scores, os);
        else pair_f32(qs, kb, vb, table, first, lens[s], bs, g, hd, scale, softcap, scores, os);
    }
    free(scratch);
    return 0;
}
