/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * The torch path (gpu/cache/kv_cache.py, PagedKVCache._decode) gathers every sequence's
 * blocks into a contiguous copy and runs batched matmuls of 3 x head_dim rows on it:
 * the KV is read from DRAM, written, read again, and each tiny matmul pays its own
 * setup. This kernel reads each key and value once, from where they lie.
 *
 * Layout (row-major, as PagedKVCache stores one layer):
 *   q      [D, H, HD]       fp32, the step's queries, RoPE applied; sequence s starts at
 *                           q + s * q_stride (the rows may be a strided slice)
 *   kc, vc [KV, ROWS, HD]   cache rows, fp32, fp16, q8_0 or q4_0 (kv_kind; read as fp32,
 *                           exactly); row = block * BS + offset. A q8_0 row is HD / 32
 *                           of llama.cpp's block_q8_0, 34 bytes each: the scale d as
 *                           fp16, then 32 int8 q; value i is q[i] * d (kv_q8_quantize).
 *                           A q4_0 row is HD / 32 of block_q4_0, 18 bytes each: d as
 *                           fp16, then 16 bytes, value j's 4 bits q low in byte j and
 *                           value j + 16's high; value i is (q[i] - 8) * d (kv_q4_quantize).
 *                           Both hold the rotated row (kv_store_rows): each query is
 *                           rotated the same way, and each output back (kv_rotate)
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
 * weight * v[d], one fused multiply-add a key. Work items are (run of rows, kv head):
 * a run is up to RUN consecutive rows of one block table, fewer where the items would
 * not fill the threads; which run a row is in changes nothing of its result.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* n fp16 values at src as fp32 at dst (exact). */
static inline void halves_to_floats(float *restrict dst, const uint16_t *restrict src, int64_t n) {
    int64_t i = 0;
#ifdef FO_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = fo_half_to_float(src[i]);
}

/* The cache's elements (kv_kind): what one row of hd values takes. */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2, KV_Q4 = 3 };
enum { Q8_BLOCK = 32, Q8_BYTES = 34, Q4_BYTES = 18 }; /* a block's values (q4_0's too), bytes */

static inline size_t kv_row_bytes(int32_t kind, int32_t hd) {
    if (kind == KV_Q8) return (size_t)hd / Q8_BLOCK * Q8_BYTES;
    if (kind == KV_Q4) return (size_t)hd / Q8_BLOCK * Q4_BYTES;
    return (size_t)hd * (kind == KV_F16 ? 2 : 4);
}

/* llama.cpp's quantize_row_q8_0_ref (ggml-quants.c), for each of n blocks of 32 values:
 * amax = the largest |x| (fabsf, a running maximum); d = amax / 127 in fp32; id = 1 / d
 * (0 when d is 0); q[i] = roundf(x[i] * id), half away from zero; d stored as fp16,
 * rounded to nearest even (GGML_FP32_TO_FP16: F16C's vcvtps2ph, fo_float_to_half here).
 * id comes from the fp32 d, not the stored one, as there. Plain C with no reduction the
 * compiler may reorder (a maximum is exact in any order), so every build gives the
 * same bytes; called per row as the cache is written (gpu/kernels/csrc/fused_trunk.c). */
void kv_q8_quantize(const float *restrict x, uint8_t *restrict out, int64_t nblocks) {
    for (int64_t b = 0; b < nblocks; b++) {
        const float *v = x + b * Q8_BLOCK;
        uint8_t *o = out + b * Q8_BYTES;
        float amax = 0.0f;
        for (int i = 0; i < Q8_BLOCK; i++) {
            float a = fabsf(v[i]);
            amax = amax > a ? amax : a; /* MAX(amax, fabsf(v)) */
        }
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = fo_float_to_half(d);
        memcpy(o, &dh, 2);
        for (int i = 0; i < Q8_BLOCK; i++) o[2 + i] = (uint8_t)(int8_t)roundf(v[i] * id);
    }
}

/* The rotation of a q8_0 or q4_0 cache's rows. One K or V row of hd values (hd a
 * multiple of 32) is rotated before it is quantized, in groups of G = the largest power
 * of two dividing hd (64 for head_dim 64, 128 for 128, 32 for 96), by the Walsh-Hadamard
 * matrix H of order G, unnormalized (+-1 entries; H H = G I). A few channels of K are
 * often far larger than the rest (RoPE's low frequencies), and one such channel sets its
 * block's scale, so the other 31 keep few of their 8 or 4 bits; H spreads every channel
 * over the whole group, and the block's steps shrink with its largest value. Attention
 * needs no unrotated key: scores are (H q / G) . (H k) = q . k, and the output is
 * H (sum_t w_t H v_t) / G = sum_t w_t v_t (paged_attention below). Products by 1 / G are
 * exact (a power of two), and the butterflies are one add or subtract each in a fixed
 * order, so every build rotates to the same bits. With H k in place of k the quantizers
 * below are unchanged: llama.cpp's, byte for byte. */
void kv_rotate(float *restrict x, int64_t rows, int32_t hd, float scale) {
    int32_t g = hd & -hd;
    for (int64_t r = 0; r < rows * (hd / g); r++) {
        float *v = x + r * g;
        for (int32_t len = 1; len < g; len <<= 1)
            for (int32_t i = 0; i < g; i += 2 * len)
                for (int32_t j = i; j < i + len; j++) {
                    float a = v[j], b = v[j + len];
                    v[j] = a + b;
                    v[j + len] = a - b;
                }
        if (scale != 1.0f)
            for (int32_t i = 0; i < g; i++) v[i] *= scale;
    }
}

/* A q8_0 or q4_0 block's scale d: its first two bytes, an fp16. */
static inline float block_scale(const uint8_t *block) {
    uint16_t dh;
    memcpy(&dh, block, 2);
    return fo_half_to_float(dh);
}

/* One 4-bit q of llama.cpp's quantize_row_q4_0_ref from y = x * id + 8.5f: MIN(15,
 * (int8_t)y), which for every y a finite id gives (about 0.5 to 16.5) is the truncation
 * clamped to 15. y is infinite or NaN only where id overflowed (|max| below 2^-125):
 * there the C conversion is undefined, x86's gives 0 (what llama.cpp's scalar code
 * stores), and so does this, on every build. */
static inline uint8_t q4_nibble(float y) {
    if (!(y >= 0.0f && y < INFINITY)) return 0; /* NaN, infinities (and no finite y < 0) */
    return y >= 15.0f ? 15 : (uint8_t)(int32_t)y;
}

/* llama.cpp's quantize_row_q4_0_ref (ggml-quants.c), for each of n blocks of 32 values:
 * max = the value of the largest |x| (the first of equals); d = max / -8 in fp32; id =
 * 1 / d (0 when d is 0); q[j] = MIN(15, (int8_t)(x[j] * id + 8.5f)), the product and
 * the sum each rounded to fp32 (no contraction: -ffp-contract=off); byte j holds q[j] in
 * its low 4 bits and q[j + 16] in its high 4; d stored as fp16 rounded to nearest even.
 * Plain C, as kv_q8_quantize: every build gives the same bytes. */
void kv_q4_quantize(const float *restrict x, uint8_t *restrict out, int64_t nblocks) {
    for (int64_t b = 0; b < nblocks; b++) {
        const float *v = x + b * Q8_BLOCK;
        uint8_t *o = out + b * Q4_BYTES;
        float amax = 0.0f, max = 0.0f;
        for (int i = 0; i < Q8_BLOCK; i++) {
            if (amax < fabsf(v[i])) amax = fabsf(v[i]), max = v[i];
        }
        float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = fo_float_to_half(d);
        memcpy(o, &dh, 2);
        for (int j = 0; j < Q8_BLOCK / 2; j++) {
            float y0 = v[j] * id, y1 = v[j + Q8_BLOCK / 2] * id;
            o[2 + j] = (uint8_t)(q4_nibble(y0 + 8.5f) | q4_nibble(y1 + 8.5f) << 4);
        }
    }
}

/* n q4_0 blocks at src as fp32 at dst: (q - 8) * d, exact (q - 8 has 4 bits and d's
 * mantissa 11), so the vector path and the C loop give the same bits. */
static inline void q4_to_floats(float *restrict dst, const uint8_t *restrict src, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += Q4_BYTES, dst += Q8_BLOCK) {
        float d = block_scale(src);
        const uint8_t *qs = src + 2;
        int j = 0;
#ifdef FO_AVX2
        __m256 vd = _mm256_set1_ps(d), eight = _mm256_set1_ps(8.0f);
        for (; j < Q8_BLOCK / 2; j += 8) {
            __m128i q8 = _mm_loadl_epi64((const __m128i *)(qs + j));
            __m256i lo = _mm256_cvtepu8_epi32(_mm_and_si128(q8, _mm_set1_epi8(0x0F)));
            __m256i hi = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q8, 4),
                                                            _mm_set1_epi8(0x0F)));
            __m256 l = _mm256_sub_ps(_mm256_cvtepi32_ps(lo), eight);
            __m256 h = _mm256_sub_ps(_mm256_cvtepi32_ps(hi), eight);
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(l, vd));
            _mm256_storeu_ps(dst + j + Q8_BLOCK / 2, _mm256_mul_ps(h, vd));
        }
#endif
        for (; j < Q8_BLOCK / 2; j++) {
            dst[j] = (float)((qs[j] & 0x0F) - 8) * d;
            dst[j + Q8_BLOCK / 2] = (float)((qs[j] >> 4) - 8) * d;
        }
    }
}

/* n q8_0 blocks at src as fp32 at dst: q * d, exact (|q| <= 128 has 8 bits and d's
 * fp16 mantissa 11, so the product fits fp32's 24), so the vector path and the C loop
 * give the same bits. */
static inline void q8_to_floats(float *restrict dst, const uint8_t *restrict src, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += Q8_BYTES, dst += Q8_BLOCK) {
        float d = block_scale(src);
        const int8_t *qs = (const int8_t *)(src + 2);
        int i = 0;
#ifdef FO_AVX2
        __m256 vd = _mm256_set1_ps(d);
        for (; i < Q8_BLOCK; i += 8) {
            __m128i q8 = _mm_loadl_epi64((const __m128i *)(qs + i));
            __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(qf, vd));
        }
#endif
        for (; i < Q8_BLOCK; i++) dst[i] = (float)qs[i] * d;
    }
}

/* `rows` cache rows of hd values at src, of element `kind` (not fp32), as fp32 at dst. */
static inline void rows_to_floats(float *restrict dst, const void *restrict src, int32_t kind,
                                  int64_t rows, int32_t hd) {
    if (kind == KV_Q8) q8_to_floats(dst, src, rows * (hd / Q8_BLOCK));
    else if (kind == KV_Q4) q4_to_floats(dst, src, rows * (hd / Q8_BLOCK));
    else halves_to_floats(dst, src, rows * hd);
}

/* `rows` rows of hd fp32 values at x as a q8_0 (kind KV_Q8) or q4_0 (KV_Q4) cache
 * stores them, at out (kv_row_bytes apart): each row rotated (kv_rotate), then quantized
 * (kv_q8_quantize, kv_q4_quantize). The one writer of those caches: the fused trunk's
 * rows (fused_trunk.c) and the torch path's (gpu/cache/kv_cache.py). Returns 0, -2 for
 * another kind or an hd that is not a multiple of 32 or above 512. */
int kv_store_rows(const float *restrict x, uint8_t *restrict out, int32_t kind, int64_t rows,
                  int32_t hd) {
    if ((kind != KV_Q8 && kind != KV_Q4) || hd % Q8_BLOCK || hd > 512) return -2;
    float tmp[512];
    size_t rb = kv_row_bytes(kind, hd);
    for (int64_t r = 0; r < rows; r++) {
        memcpy(tmp, x + r * hd, sizeof(float) * (size_t)hd);
        kv_rotate(tmp, 1, hd, 1.0f);
        if (kind == KV_Q8) kv_q8_quantize(tmp, out + r * rb, hd / Q8_BLOCK);
        else kv_q4_quantize(tmp, out + r * rb, hd / Q8_BLOCK);
    }
    return 0;
}

/* The values `rows` q8_0 or q4_0 rows at src stand for, as fp32 at dst: the blocks read
 * back (q * d, (q - 8) * d: exact), then rotated back (H / G: kv_rotate). What the torch
 * path attends to where it gathers a prompt's keys; the kernel below instead rotates the
 * query and the output. Returns as kv_store_rows. */
int kv_load_rows(const uint8_t *restrict src, float *restrict dst, int32_t kind, int64_t rows,
                 int32_t hd) {
    if ((kind != KV_Q8 && kind != KV_Q4) || hd % Q8_BLOCK || hd > 512) return -2;
    rows_to_floats(dst, src, kind, rows, hd);
    kv_rotate(dst, rows, hd, 1.0f / (float)(hd & -hd));
    return 0;
}

/* Where one (sequence, kv head) pair's key and value blocks come from, as fp32: the
 * cache's own rows when it holds fp32; when it holds fp16, q8_0 or q4_0, either the blocks
 * from `from` on converted ahead for a run of rows of one sequence (kconv, vconv), or
 * each block converted into buf when it is read, once for all the pair's query heads. */
typedef struct {
    const void *k, *v; /* the kv head's cache rows */
    const int32_t *table;
    int32_t kind, bs, hd, from; /* kind: KV_F32, KV_F16, KV_Q8 or KV_Q4 */
    const float *kconv, *vconv; /* NULL: not converted ahead */
    float *buf;                 /* one block */
} kv_src;

static inline const void *raw_block(const kv_src *src, const void *base, int32_t b) {
    return (const char *)base +
           kv_row_bytes(src->kind, src->hd) * (size_t)src->table[b] * (size_t)src->bs;
}

/* Block b's first n rows as fp32. */
static inline const float *kv_block(const kv_src *src, const void *base, const float *conv,
                                    int32_t b, int32_t n) {
    if (src->kind == KV_F32) return raw_block(src, base, b);
    if (conv) return conv + (int64_t)(b - src->from) * src->bs * src->hd;
    rows_to_floats(src->buf, raw_block(src, base, b), src->kind, n, src->hd);
    return src->buf;
}

#ifdef FO_AVX2
/* Ask for `bytes` at p ahead of use: each block's rows start where the hardware
 * prefetcher would start cold. */
static inline void prefetch(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

/* head_dim HD, a multiple of 8: eight keys' dot products per query at a time, one
 * horizontal reduction for all eight; the weighted sum of values block by block, each
 * query's outputs in registers across the block, 64 at a time. Keys first .. len - 1
 * (first > 0 under a sliding window); scores[p - first] is key p's. Each lane sums what
 * one_pair's l[d % 8] and o[d] sum, in the same order: the same bits. Instantiated for
 * 64, 128 and 256 (constants: unrolled) and for any other multiple of 8. */
static inline __attribute__((always_inline)) void
one_pair_v(const int32_t HD, const float *restrict q, const kv_src *src, int32_t first,
           int32_t len, int32_t g, float scale, float softcap, float *restrict scores,
           float *restrict out) {
    int32_t bs = src->bs, nb = (len + bs - 1) / bs, b0 = first / bs, nk = len - first;
    size_t bytes = kv_row_bytes(src->kind, HD) * (size_t)bs;
    int ahead = !src->kconv; /* blocks read where they lie: prefetch the next */
    __m256 vscale = _mm256_set1_ps(scale);
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs;
        const float *kb = kv_block(src, src->k, src->kconv, b, n);
        if (ahead && b + 1 < nb) prefetch(raw_block(src, src->k, b + 1), bytes);
        else if (ahead) prefetch(raw_block(src, src->v, b0), bytes);
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
        const float *vb = kv_block(src, src->v, src->vconv, b, n);
        if (ahead && b + 1 < nb) prefetch(raw_block(src, src->v, b + 1), bytes);
        for (int32_t j = 0; j < g; j++) {
            const float *sc = scores + (int64_t)j * nk + b * bs - first;
            for (int32_t c = 0; c < HD; c += 64) { /* 64 outputs (or the last few) at a time */
                const int nr = HD - c < 64 ? (HD - c) / 8 : 8;
                float *o = out + (int64_t)j * HD + c;
                __m256 a[8];
                for (int r = 0; r < nr; r++) a[r] = _mm256_loadu_ps(o + r * 8);
                for (int32_t t = t0; t < n; t++) {
                    __m256 w = _mm256_broadcast_ss(sc + t);
                    const float *v = vb + (int64_t)t * HD + c;
                    for (int r = 0; r < nr; r++)
                        a[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + r * 8), a[r]);
                }
                for (int r = 0; r < nr; r++) _mm256_storeu_ps(o + r * 8, a[r]);
            }
        }
    }
}

#define ONE_PAIR_V(NAME, HD)                                                                  \
    static void NAME(const float *restrict q, const kv_src *src, int32_t first, int32_t len,  \
                     int32_t g, float scale, float softcap, float *restrict scores,           \
                     float *restrict out) {                                                   \
        one_pair_v(HD, q, src, first, len, g, scale, softcap, scores, out);                   \
    }
ONE_PAIR_V(one_pair64, 64)
ONE_PAIR_V(one_pair128, 128)
ONE_PAIR_V(one_pair256, 256)
ONE_PAIR_V(one_pair8, src->hd)
#endif

/* Any head_dim that is a multiple of 8: the same function in portable C. */
static void one_pair(const float *restrict q, const kv_src *src, int32_t first, int32_t len,
                     int32_t g, float scale, float softcap, float *restrict scores,
                     float *restrict out) {
    int32_t bs = src->bs, hd = src->hd, nb = (len + bs - 1) / bs, b0 = first / bs;
    int32_t nk = len - first;
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs;
        const float *kb = kv_block(src, src->k, src->kconv, b, n);
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
        const float *vb = kv_block(src, src->v, src->vconv, b, n);
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

/* Consecutive rows of one sequence (a prompt chunk: the same block table) take at most
 * RUN rows a work item, its fp16, q8_0 or q4_0 blocks converted once for all of them. */
enum { RUN = 16 };

/* Returns 0, -1 when scratch memory could not be allocated (out is then unset), -2 for
 * a kv_kind it does not know or a q8_0 / q4_0 cache whose head_dim is not a multiple of
 * 32. kv_kind: the cache holds fp32 (0), fp16 (1), q8_0 (2) or q4_0 (3); window: keys
 * per sequence a query attends to, its own included (0: all); softcap: the scores' cap
 * (0: none). */
int paged_attention(const float *q, int64_t q_stride, const void *kc, const void *vc,
                    int32_t kv_kind, const int32_t *tables, const int32_t *lens, float *out,
                    int32_t d, int32_t h, int32_t kv, int32_t hd, int64_t rows, int32_t bs,
                    int32_t maxnb, float scale, int32_t window, float softcap, int32_t threads) {
    int32_t g = h / kv;
    int32_t maxlen = 1;
    if (kv_kind < KV_F32 || kv_kind > KV_Q4) return -2;
    if ((kv_kind == KV_Q8 || kv_kind == KV_Q4) && hd % Q8_BLOCK) return -2;
    for (int32_t s = 0; s < d; s++) maxlen = lens[s] > maxlen ? lens[s] : maxlen;
    if (threads < 1) threads = 1;
    /* the runs: rows [run[i], run[i + 1]) */
    int32_t *run = malloc(sizeof(int32_t) * ((size_t)d + 1));
    if (!run) return -1;
    /* rows a run takes: RUN, or fewer where the work items (runs times KV heads) would
       not fill the threads: a short prompt chunk or a speculative check of one sequence
       over one or two KV heads (the rows are the same functions whichever run they are in) */
    int32_t cap = RUN, fill = (threads + kv - 1) / kv;
    if (fill > 1 && (d + fill - 1) / fill < cap) cap = (d + fill - 1) / fill;
    int32_t nrun = 0, multi = 0;
    for (int32_t s = 0; s < d; s++) {
        const int32_t *t = tables + (int64_t)s * maxnb;
        if (s == 0 || s - run[nrun - 1] >= cap || memcmp(t, t - maxnb, sizeof(int32_t) * maxnb))
            run[nrun++] = s;
        else multi = 1;
    }
    run[nrun] = d;
    /* per thread: one row's scores, one block, and (not fp32, runs of rows) a
     * sequence's blocks */
    size_t conv = kv_kind != KV_F32 && multi ? (size_t)maxnb * bs * hd : 0;
    /* q8_0 and q4_0 rows are rotated (kv_rotate): so is each query, into its own room */
    int rotated = kv_kind == KV_Q8 || kv_kind == KV_Q4;
    size_t qroom = rotated ? (size_t)g * hd : 0;
    size_t per_thread = (size_t)g * maxlen + (size_t)bs * hd + 2 * conv + qroom;
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)threads);
    if (!scratch) {
        free(run);
        return -1;
    }
    size_t row_bytes = kv_row_bytes(kv_kind, hd);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < (int64_t)nrun * kv; i++) {
#ifdef _OPENMP
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *scores = scratch;
#endif
        int32_t r = (int32_t)(i / kv), kvh = (int32_t)(i % kv);
        size_t at = row_bytes * (size_t)kvh * (size_t)rows;
        kv_src src = {.k = (const char *)kc + at, .v = (const char *)vc + at,
                      .table = tables + (int64_t)run[r] * maxnb, .kind = kv_kind, .bs = bs,
                      .hd = hd, .buf = scores + (size_t)g * maxlen};
        if (kv_kind != KV_F32 && run[r + 1] - run[r] > 1) { /* convert the run's blocks once */
            int32_t lo = maxnb, hi = 0;
            for (int32_t s = run[r]; s < run[r + 1]; s++) {
                int32_t n = lens[s], first = window > 0 && n > window ? n - window : 0;
                if (n < 1) continue;
                lo = first / bs < lo ? first / bs : lo;
                hi = (n + bs - 1) / bs > hi ? (n + bs - 1) / bs : hi;
            }
            float *kbuf = src.buf + (size_t)bs * hd + qroom, *vbuf = kbuf + conv;
            for (int32_t b = lo; b < hi; b++) {
                size_t off = (size_t)(b - lo) * bs * hd;
                rows_to_floats(kbuf + off, raw_block(&src, src.k, b), kv_kind, bs, hd);
                rows_to_floats(vbuf + off, raw_block(&src, src.v, b), kv_kind, bs, hd);
            }
            src.from = lo, src.kconv = kbuf, src.vconv = vbuf;
        }
        for (int32_t s = run[r]; s < run[r + 1]; s++) {
            const float *qs = q + (int64_t)s * q_stride + (int64_t)kvh * g * hd;
            float *os = out + ((int64_t)s * h + (int64_t)kvh * g) * hd;
            int32_t n = lens[s];
            if (n < 1) {
                for (int32_t j = 0; j < g * hd; j++) os[j] = 0.0f;
                continue;
            }
            int32_t first = window > 0 && n > window ? n - window : 0;
            float rot = 1.0f / (float)(hd & -hd);
            if (rotated) { /* H q / G against the stored H k */
                float *qr = src.buf + (size_t)bs * hd;
                memcpy(qr, qs, sizeof(float) * (size_t)g * hd);
                kv_rotate(qr, g, hd, rot);
                qs = qr;
            }
#ifdef FO_AVX2
            if (hd == 64) one_pair64(qs, &src, first, n, g, scale, softcap, scores, os);
            else if (hd == 128) one_pair128(qs, &src, first, n, g, scale, softcap, scores, os);
            else if (hd == 256) one_pair256(qs, &src, first, n, g, scale, softcap, scores, os);
            else if (hd % 8 == 0) one_pair8(qs, &src, first, n, g, scale, softcap, scores, os);
            else
#endif
                one_pair(qs, &src, first, n, g, scale, softcap, scores, os);
            if (rotated) kv_rotate(os, g, hd, rot); /* sum_t w_t H v_t, back: H . / G */
        }
    }
    free(scratch);
    free(run);
    return 0;
}
