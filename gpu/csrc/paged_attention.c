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

/* Block rows [row0, row0 + n) of one kv head's cache as fp32: the cache's own rows when
 * it holds fp32, else its fp16 converted (exactly) into buf, once for all the queries
 * that read them. */
static inline const float *block_rows(const void *base, int64_t row0, int32_t n, int32_t hd,
                                      int32_t half, float *restrict buf) {
    if (!half) return (const float *)base + row0 * hd;
    const uint16_t *src = (const uint16_t *)base + row0 * hd;
    int64_t count = (int64_t)n * hd, i = 0;
#ifdef FO_AVX2
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < count; i++) buf[i] = fo_half_to_float(src[i]);
    return buf;
}

#ifdef FO_AVX2
/* Ask for `bytes` at p ahead of use: each block's rows start where the hardware
 * prefetcher would start cold. */
static inline void prefetch(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

/* head_dim 64: eight keys' dot products per query at a time, one horizontal reduction
 * for all eight; the weighted sum of values block by block, each query's 64 outputs in
 * registers across the block. Keys first .. len - 1 (first > 0 under a sliding window);
 * scores[p - first] is key p's. buf: a block's rows as fp32 (block_rows). */
static void one_pair64(const float *restrict q, const void *kbase, const void *vbase,
                       int32_t half, const int32_t *restrict table, int32_t first, int32_t len,
                       int32_t bs, int32_t g, float scale, float softcap, float *restrict scores,
                       float *restrict buf, float *restrict out) {
    enum { HD = 64 };
    int32_t nb = (len + bs - 1) / bs, b0 = first / bs, nk = len - first;
    size_t elem = half ? 2 : 4, bytes = elem * (size_t)bs * HD;
#define AT(base, blk) ((const char *)(base) + elem * (size_t)(blk) * (size_t)bs * HD)
    __m256 vscale = _mm256_set1_ps(scale);
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs;
        const float *kb = block_rows(kbase, (int64_t)table[b] * bs, n, HD, half, buf);
        if (b + 1 < nb) prefetch(AT(kbase, table[b + 1]), bytes);
        else prefetch(AT(vbase, table[b0]), bytes);
        int32_t t = b == b0 ? first - b * bs : 0;
        float *sb = scores + (int64_t)b * bs - first; /* key b * bs + t scores at sb[t] */
        for (; t + 8 <= n; t += 8) {
            const float *k = kb + (int64_t)t * HD;
            for (int32_t j = 0; j < g; j++) {
                const float *qj = q + (int64_t)j * HD;
                __m256 a[8];
                for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
                for (int d = 0; d < HD; d += 8) {
                    __m256 qv = _mm256_loadu_ps(qj + d);
                    for (int r = 0; r < 8; r++)
                        a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + r * HD + d), a[r]);
                }
                __m256 sums = fo_tree8x8(a);
                _mm256_storeu_ps(sb + (int64_t)j * nk + t, _mm256_mul_ps(sums, vscale));
            }
        }
        for (; t < n; t++) {
            const float *k = kb + (int64_t)t * HD;
            for (int32_t j = 0; j < g; j++) {
                const float *qj = q + (int64_t)j * HD;
                __m256 a = _mm256_setzero_ps();
                for (int d = 0; d < HD; d += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d), _mm256_loadu_ps(k + d), a);
                sb[(int64_t)j * nk + t] = fo_tree8_v(a) * scale;
            }
        }
    }
    softmax_rows(scores, g, nk, softcap);
    for (int32_t d = 0; d < g * HD; d++) out[d] = 0.0f;
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs, t0 = b == b0 ? first - b * bs : 0;
        const float *vb = block_rows(vbase, (int64_t)table[b] * bs, n, HD, half, buf);
        if (b + 1 < nb) prefetch(AT(vbase, table[b + 1]), bytes);
        for (int32_t j = 0; j < g; j++) {
            const float *sc = scores + (int64_t)j * nk + b * bs - first;
            float *o = out + (int64_t)j * HD;
            __m256 a[8];
            for (int r = 0; r < 8; r++) a[r] = _mm256_loadu_ps(o + r * 8);
            for (int32_t t = t0; t < n; t++) {
                __m256 w = _mm256_broadcast_ss(sc + t);
                const float *v = vb + (int64_t)t * HD;
                for (int r = 0; r < 8; r++)
                    a[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + r * 8), a[r]);
            }
            for (int r = 0; r < 8; r++) _mm256_storeu_ps(o + r * 8, a[r]);
        }
    }
#undef AT
}
#endif

/* Any head_dim that is a multiple of 8: the same function in portable C. */
static void one_pair(const float *restrict q, const void *kbase, const void *vbase, int32_t half,
                     const int32_t *restrict table, int32_t first, int32_t len, int32_t bs,
                     int32_t g, int32_t hd, float scale, float softcap, float *restrict scores,
                     float *restrict buf, float *restrict out) {
    int32_t nb = (len + bs - 1) / bs, b0 = first / bs, nk = len - first;
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs;
        const float *kb = block_rows(kbase, (int64_t)table[b] * bs, n, hd, half, buf);
        for (int32_t t = b == b0 ? first - b * bs : 0; t < n; t++) {
            const float *k = kb + (int64_t)t * hd;
            for (int32_t j = 0; j < g; j++) {
                const float *qj = q + (int64_t)j * hd;
                float l[8] = {0};
                for (int32_t d = 0; d < hd; d++) l[d % 8] = fmaf(qj[d], k[d], l[d % 8]);
                scores[(int64_t)j * nk + b * bs + t - first] = fo_tree8(l) * scale;
            }
        }
    }
    softmax_rows(scores, g, nk, softcap);
    for (int32_t d = 0; d < g * hd; d++) out[d] = 0.0f;
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs;
        const float *vb = block_rows(vbase, (int64_t)table[b] * bs, n, hd, half, buf);
        for (int32_t t = b == b0 ? first - b * bs : 0; t < n; t++) {
            const float *v = vb + (int64_t)t * hd;
            for (int32_t j = 0; j < g; j++) {
                float w = scores[(int64_t)j * nk + b * bs + t - first];
                float *o = out + (int64_t)j * hd;
                for (int32_t d = 0; d < hd; d++) o[d] = fmaf(w, v[d], o[d]);
            }
        }
    }
}

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
    size_t per_thread = (size_t)g * maxlen + (size_t)bs * hd; /* one pair's scores, a block */
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
        int32_t n = lens[s];
        if (n < 1) {
            for (int32_t j = 0; j < g * hd; j++) os[j] = 0.0f;
            continue;
        }
        int32_t first = window > 0 && n > window ? n - window : 0;
        float *buf = scores + (size_t)g * maxlen;
#ifdef FO_AVX2
        if (hd == 64) {
            one_pair64(qs, kb, vb, kv_half, table, first, n, bs, g, scale, softcap, scores, buf,
                       os);
            continue;
        }
#endif
        one_pair(qs, kb, vb, kv_half, table, first, n, bs, g, hd, scale, softcap, scores, buf, os);
    }
    free(scratch);
    return 0;
}
