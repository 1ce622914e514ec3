/* y = x @ w^T, w kept in its GGUF quantized blocks: decode and prefill alike, one
 * function of each row whatever else the call holds.
 *
 * As llama.cpp does (ggml-cpu quants.c, ggml_vec_dot_q8_0_q8_0 and the k-quants' dot
 * products), each row of x is quantized once per call to blocks of 32 int8 with an fp32
 * scale (and the block's scaled sum, for the offset terms), and every weight block meets
 * it in an exact integer dot product. Every type the kernel reads is, per block of 32
 * weights, integers wq[i], a scale for elements 0-15 and one for 16-31 (the same but for
 * Q6_K, whose scales cover 16 weights) and an offset (Q4_1, Q5_1, Q4_K, Q5_K):
 *
 *   Q8_0  34 B: fp16 d, int8 q[32]                wq = q,                  scale d
 *   Q4_1  20 B: fp16 d, fp16 m, 16 B nibbles      wq = nib,                scale d, offset m
 *   Q4_0  18 B: fp16 d, 16 B nibbles              wq = nib - 8,            scale d
 *   Q5_0  22 B: fp16 d, 4 B high bits, 16 B       wq = (nib | hb << 4) - 16, scale d
 *   Q5_1  24 B: fp16 d, fp16 m, 4 B, 16 B         wq = nib | hb << 4,      scale d, offset m
 *   Q4_K 144 B per 256: fp16 d, fp16 dmin, 12 B of 6-bit (sc, m) pairs, 128 B nibbles;
 *         sub-block j: wq = nib, scale d * sc_j, offset -(dmin * m_j)
 *   Q5_K 176 B per 256: Q4_K plus 32 B of fifth bits
 *   Q6_K 210 B per 256: 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, fp16 d;
 *         wq = q6 - 32, scale d * sc per 16 weights
 *
 * (nib[i] = qs[i] & 15 and nib[i + 16] = qs[i] >> 4; ggml-quants.c's dequantize_row_*
 * give the layouts.) The scales are exact products (an fp16 times an integer of at most
 * 8 bits), so the weight is dw * wq + mw exactly as gguf.quants dequantizes it.
 *
 * THE FUNCTION (docs/determinism.md). Output y[r, j] is defined as follows, and every
 * path (any row count, any thread count, AVX-512 VNNI, AVX-VNNI, AVX2 or portable C)
 * computes exactly it, bit for bit:
 *
 *   x's block b of row r: d = amax / 127 (fp32), q[i] = round-half-even(x[i] * (1 / d)),
 *                         s = d * (float)sum(q)
 *   acc starts at +0; for each block b in order:
 *       all types but Q6_K: dot = sum over i < 32 of wq[i] * q[i]   (an exact integer)
 *                           acc = fma(dw_b * d_b, (float)dot, acc)  (the scale one fp32
 *                                                                    multiply, one rounding)
 *       Q6_K: the same for elements 0-15 with its scale, then for 16-31 with its own
 *   types with an offset: msum starts at +0; for each block in order
 *       msum = msum + (mw_b * s_b), the product rounded, then the sum
 *   y = acc [+ msum]
 *
 * The integers are exact (|dot| <= 32 * 128 * 127 < 2^24, so its conversion too), so
 * only the fp32 order matters, and it is fixed per output: one chain of one FMA per
 * block (llama.cpp's shape: an integer sum per block, then its scale), no path splitting
 * a row's blocks between accumulators or threads. Paths differ in how they form the
 * integers and how many outputs they compute at once, which changes speed, not results.
 *
 * Paths:
 *   - four or more rows of x (prefill, batched decode): PW weight rows (16 with
 *     AVX512-VNNI, else 8) are unpacked into a panel, their blocks' integers interleaved
 *     four bytes at a time ([block][group of 4][PW outputs][4]), so one dpbusd of four
 *     bytes of x broadcast against a group adds those four products into all PW
 *     outputs' integer sums at once: eight per block, then one conversion, scale multiply
 *     and FMA per PW outputs. x goes in biased (q + 128, unsigned) and each output's sum
 *     starts at -128 times the weights' sum over the block (the panel's seed), so the
 *     int32 lanes are sum(wq q) exactly. Without VNNI, maddubs + madd stand in for
 *     dpbusd: the same integers (every pair of products fits int16, |wq| <= 32 against
 *     x + 128 <= 255), and Q8_0 meets x's signed bytes by the sign trick instead.
 *     With AMX, each group of 16 rows takes one tile product per block instead (amx_rows).
 *   - one to three rows (decode): four weight rows streamed at a time, unpacked in
 *     registers; a block's 8 lanes of four products per weight row (dpbusd, or maddubs
 *     + madd) summed across lanes (hadd) into the four outputs' integers.
 *   - portable C (no AVX2): the definition, output by output.
 * Rows of x go in chunks of XCHUNK so a chunk's quantized rows stay in L2 while every
 * panel passes them; threads split the weight rows (each output is one thread's).
 * bench/qlinear.py times the shapes.
 *
 *   x [M, K] fp32 contiguous, K % 32 == 0; w [N, K / 32 * block bytes] (GGUF row-major);
 *   y [M, N] fp32 contiguous.
 */
#define _DEFAULT_SOURCE /* syscall() for AMX's permission request */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "fixed_order.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
/* VNNI (AVX512-VNNI with AVX512-VL, or AVX-VNNI): one vpdpbusd adds four unsigned-by-
 * signed byte products into each int32 lane, with no 16-bit step that could saturate:
 * the same integers as maddubs + madd give where those do not saturate. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QL_VNNI 1
#define QL_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define QL_VNNI 1
#define QL_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#if defined(QL_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QL_Z 1 /* 512-bit panels */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define QL_AMX 1 /* tile products for the panels' groups of 16 rows */
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#endif

enum {
    QK = 32, XCHUNK = 256,
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
};

/* One quantized block of x: scale, scale * sum(q) (the offset terms), 32 int8. */
typedef struct {
    float d;
    float s;
    int8_t q[QK];
} xblock;

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef QL_AVX2
    return _cvtsh_ss(h);
#else
    return fo_half_to_float(h);
#endif
}

/* llama.cpp's quantize_row_q8_1 with an fp32 scale: d = amax / 127, q = round(x / d) to
 * nearest even (nearbyintf in the default rounding mode; the AVX2 path's round_ps). */
static void quantize_row(const float *x, int64_t nb, xblock *out) {
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + b * QK;
#ifdef QL_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float d = _mm_cvtss_f32(m4) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), mode));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), mode));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), mode));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), mode));
        __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4e));
        s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1));
        /* packs work per 128-bit lane: the permute puts the 32 bytes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out[b].q, p);
        out[b].d = d;
        out[b].s = d * (float)_mm_cvtsi128_si32(s2);
#else
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int q = (int)nearbyintf(v[i] * id);
            out[b].q[i] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
#endif
    }
}


/* A weight row's blocks of 32 as integers and scales (lo: elements 0-15, hi: 16-31, mo:
 * the offset, 0 for types without), for the panels and the portable path. Unpacking is
 * integer work and exact products, so it is the same values on every build. */
typedef struct {
    int8_t *q;           /* [nb][32] */
    float *lo, *hi, *mo; /* [nb] each, fs apart (unpack_row; unpack_row_c: 1) */
    int64_t fs;
} unpacked;

static int unpacked_alloc(unpacked *u, int64_t nb) {
    *u = (unpacked){malloc((size_t)(nb * QK)), malloc(sizeof(float) * (size_t)nb),
                    malloc(sizeof(float) * (size_t)nb), malloc(sizeof(float) * (size_t)nb), 1};
    return u->q && u->lo && u->hi && u->mo;
}
static void unpacked_free(unpacked *u) { free(u->q), free(u->lo), free(u->hi), free(u->mo); }

static int has_offset(int32_t t) {
    return t == GGML_Q4_1 || t == GGML_Q5_1 || t == GGML_Q4_K || t == GGML_Q5_K;
}
/* Weights per block of the file's layout, and its bytes. */
static int block_elems(int32_t t) { return t >= GGML_Q4_K ? 256 : 32; }
static int block_bytes(int32_t t) {
    switch (t) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

/* ggml's get_scale_min_k4: the j-th 6-bit (scale, min) pair of a Q4_K / Q5_K block. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One row of nb blocks of 32 (w: the row's bytes) into u. */
static void unpack_row_c(int32_t t, const uint8_t *w, int64_t nb, const unpacked *u) {
    if (t == GGML_Q8_0 || t == GGML_Q4_1) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * block_bytes(t);
            int8_t *q = u->q + b * QK;
            u->lo[b] = u->hi[b] = half_to_float(blk);
            u->mo[b] = t == GGML_Q4_1 ? half_to_float(blk + 2) : 0.0f;
            for (int j = 0; j < QK; j++)
                q[j] = t == GGML_Q8_0 ? (int8_t)blk[2 + j]
                                      : (int8_t)(j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4);
        }
        return;
    }
    if (t == GGML_Q4_0 || t == GGML_Q5_0 || t == GGML_Q5_1) {
        int bytes = block_bytes(t);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bytes;
            int8_t *q = u->q + b * QK;
            float d = half_to_float(blk);
            u->lo[b] = u->hi[b] = d;
            u->mo[b] = 0.0f;
            if (t == GGML_Q4_0) {
                for (int j = 0; j < 16; j++) {
                    q[j] = (int8_t)((blk[2 + j] & 15) - 8);
                    q[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
                }
                continue;
            }
            int off = t == GGML_Q5_0 ? 16 : 0;
            const uint8_t *hb = blk + (t == GGML_Q5_0 ? 2 : 4), *qs = hb + 4;
            uint32_t qh;
            memcpy(&qh, hb, 4);
            if (t == GGML_Q5_1) u->mo[b] = half_to_float(blk + 2);
            for (int j = 0; j < 16; j++) {
                int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
                q[j] = (int8_t)(((qs[j] & 15) | h0) - off);
                q[j + 16] = (int8_t)(((qs[j] >> 4) | h1) - off);
            }
        }
        return;
    }
    int64_t nsb = nb / 8;
    for (int64_t s = 0; s < nsb; s++) {
        int8_t *q = u->q + s * 256;
        float *lo = u->lo + s * 8, *hi = u->hi + s * 8, *mo = u->mo + s * 8;
        if (t == GGML_Q6_K) {
            const uint8_t *blk = w + s * 210, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            float d = half_to_float(blk + 208);
            for (int h = 0; h < 2; h++) {
                const uint8_t *l4 = ql + 64 * h, *h2 = qh + 32 * h;
                int8_t *o = q + 128 * h;
                for (int l = 0; l < 32; l++) {
                    o[l] = (int8_t)(((l4[l] & 15) | ((h2[l] & 3) << 4)) - 32);
                    o[l + 32] = (int8_t)(((l4[l + 32] & 15) | (((h2[l] >> 2) & 3) << 4)) - 32);
                    o[l + 64] = (int8_t)(((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32);
                    o[l + 96] = (int8_t)(((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32);
                }
                for (int k = 0; k < 4; k++) {
                    lo[4 * h + k] = d * (float)sc[8 * h + 2 * k];
                    hi[4 * h + k] = d * (float)sc[8 * h + 2 * k + 1];
                    mo[4 * h + k] = 0.0f;
                }
            }
            continue;
        }
        /* Q4_K, Q5_K */
        const int five = t == GGML_Q5_K;
        const uint8_t *blk = w + s * (five ? 176 : 144), *scales = blk + 4;
        const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
        float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        for (int j = 0; j < 4; j++) {
            int sc0, m0, sc1, m1;
            scale_min_k4(2 * j, scales, &sc0, &m0);
            scale_min_k4(2 * j + 1, scales, &sc1, &m1);
            lo[2 * j] = hi[2 * j] = d * (float)sc0;
            lo[2 * j + 1] = hi[2 * j + 1] = d * (float)sc1;
            mo[2 * j] = -(dmin * (float)m0);
            mo[2 * j + 1] = -(dmin * (float)m1);
            int8_t *o = q + 64 * j;
            const uint8_t *n = qs + 32 * j;
            for (int l = 0; l < 32; l++) {
                int a = n[l] & 15, c = n[l] >> 4;
                if (five) {
                    a += (qh[l] >> (2 * j)) & 1 ? 16 : 0;
                    c += (qh[l] >> (2 * j + 1)) & 1 ? 16 : 0;
                }
                o[l] = (int8_t)a;
                o[l + 32] = (int8_t)c;
            }
        }
    }
}


#ifdef QL_AVX2

/* 16 bytes of nibbles as 32 bytes: low nibbles are elements 0..15, high nibbles 16..31.
 * The bytes in both halves, the upper half's 32-bit lanes shifted right by 4 (a byte's
 * high nibble lands in its low one; what crosses from the next byte is masked off). */
static inline __m256i nibbles16(const uint8_t *qs) {
    __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(0x0f));
}

/* llama.cpp's bytes_from_bits_32: byte i is 0xFF where bit i of the 32 bits is set. */
static inline __m256i bits_to_bytes(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* Q5's fifth bits: 16 added to byte i of nib (a nibble) where bit i of the 32 bits at qh
 * is set. */
static inline __m256i with_fifth_bit(__m256i nib, const uint8_t *qh) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    uint32_t bits;
    memcpy(&bits, qh, 4);
    return _mm256_mask_add_epi8(nib, (__mmask32)bits, nib, _mm256_set1_epi8(0x10));
#else
    return _mm256_or_si256(nib, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
#endif
}

/* The same integers as unpack_row_c (exact products for the scales), vectorized. */
static void unpack_row(int32_t t, const uint8_t *w, int64_t nb, const unpacked *u) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (t == GGML_Q8_0 || t == GGML_Q4_1) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * block_bytes(t);
            u->lo[b * u->fs] = u->hi[b * u->fs] = half_to_float(blk);
            u->mo[b * u->fs] = t == GGML_Q4_1 ? half_to_float(blk + 2) : 0.0f;
            _mm256_storeu_si256((__m256i *)(u->q + b * QK),
                                t == GGML_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2))
                                               : nibbles16(blk + 4));
        }
        return;
    }
    if (t == GGML_Q4_0 || t == GGML_Q5_0 || t == GGML_Q5_1) {
        int bytes = block_bytes(t);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bytes;
            float d = half_to_float(blk);
            u->lo[b * u->fs] = u->hi[b * u->fs] = d;
            u->mo[b * u->fs] = t == GGML_Q5_1 ? half_to_float(blk + 2) : 0.0f;
            const uint8_t *qs = blk + (t == GGML_Q4_0 ? 2 : t == GGML_Q5_0 ? 6 : 8);
            __m256i q = nibbles16(qs);
            if (t == GGML_Q4_0) {
                q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
            } else {
                q = with_fifth_bit(q, blk + (t == GGML_Q5_0 ? 2 : 4));
                if (t == GGML_Q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
            }
            _mm256_storeu_si256((__m256i *)(u->q + b * QK), q);
        }
        return;
    }
    int64_t nsb = nb / 8;
    for (int64_t s = 0; s < nsb; s++) {
        int8_t *q = u->q + s * 256;
        const int64_t fs = u->fs;
        float *lo = u->lo + s * 8 * fs, *hi = u->hi + s * 8 * fs, *mo = u->mo + s * 8 * fs;
        if (t == GGML_Q6_K) {
            const uint8_t *blk = w + s * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            float d = half_to_float(blk + 208);
            const __m256i three = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                __m256i hh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hh, three), 4);
                __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), three), 4);
                __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), three), 4);
                __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), three), 4);
                int8_t *o = q + 128 * h;
                _mm256_storeu_si256((__m256i *)o,
                                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, low4), h0), m32));
                _mm256_storeu_si256((__m256i *)(o + 32),
                                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, low4), h1), m32));
                _mm256_storeu_si256(
                    (__m256i *)(o + 64),
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), h2), m32));
                _mm256_storeu_si256(
                    (__m256i *)(o + 96),
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), h3), m32));
                for (int k = 0; k < 4; k++) {
                    lo[(4 * h + k) * fs] = d * (float)sc[8 * h + 2 * k];
                    hi[(4 * h + k) * fs] = d * (float)sc[8 * h + 2 * k + 1];
                    mo[(4 * h + k) * fs] = 0.0f;
                }
            }
            continue;
        }
        const int five = t == GGML_Q5_K;
        const uint8_t *blk = w + s * (five ? 176 : 144), *scales = blk + 4;
        const uint8_t *qs = blk + (five ? 48 : 16);
        float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        const __m256i one = _mm256_set1_epi8(1);
        for (int j = 0; j < 4; j++) {
            int sc0, m0, sc1, m1;
            scale_min_k4(2 * j, scales, &sc0, &m0);
            scale_min_k4(2 * j + 1, scales, &sc1, &m1);
            lo[(2 * j) * fs] = hi[(2 * j) * fs] = d * (float)sc0;
            lo[(2 * j + 1) * fs] = hi[(2 * j + 1) * fs] = d * (float)sc1;
            mo[(2 * j) * fs] = -(dmin * (float)m0);
            mo[(2 * j + 1) * fs] = -(dmin * (float)m1);
            __m256i n = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i a = _mm256_and_si256(n, low4), c = _mm256_and_si256(_mm256_srli_epi16(n, 4), low4);
            if (five) {
                __m256i b0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one);
                __m256i b1 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one);
                a = _mm256_or_si256(a, _mm256_slli_epi16(b0, 4));
                c = _mm256_or_si256(c, _mm256_slli_epi16(b1, 4));
            }
            _mm256_storeu_si256((__m256i *)(q + 64 * j), a);
            _mm256_storeu_si256((__m256i *)(q + 64 * j + 32), c);
        }
    }
}
#else
#define unpack_row unpack_row_c
#endif

/* ---- Portable C: the definition, one output at a time --------------------------------- */

/* y for one row of x (xq, nb blocks) against one unpacked weight row of type t. */
static float ref_dot(int32_t t, const unpacked *u, const xblock *xq, int64_t nb) {
    const int two = t == GGML_Q6_K, offset = has_offset(t);
    float acc = 0.0f, msum = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const xblock *xb = xq + b;
        const int8_t *qw = u->q + b * QK;
        int lo = 0, hi = 0;
        for (int i = 0; i < 16; i++) lo += qw[i] * xb->q[i];
        for (int i = 16; i < QK; i++) hi += qw[i] * xb->q[i];
        if (two) {
            acc = fmaf(u->lo[b] * xb->d, (float)lo, acc);
            acc = fmaf(u->hi[b] * xb->d, (float)hi, acc);
        } else {
            acc = fmaf(u->lo[b] * xb->d, (float)(lo + hi), acc);
        }
        if (offset) msum = msum + u->mo[b] * xb->s;
    }
    return offset ? acc + msum : acc;
}

#ifdef QL_AVX2
/* ---- Four or more rows: panels of PW weight rows, four bytes interleaved ---------------- */

#ifdef QL_Z
#define PW 16
typedef __m512i pvi;
typedef __m512 pvf;
#define PV_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define PV_LOADF(p) _mm512_loadu_ps(p)
#define PV_SET1F(v) _mm512_set1_ps(v)
#define PV_ZEROF() _mm512_setzero_ps()
#define PV_ZEROI() _mm512_setzero_si512()
#define PV_CVT(v) _mm512_cvtepi32_ps(v)
#define PV_MUL(a, b) _mm512_mul_ps(a, b)
#define PV_ADD(a, b) _mm512_add_ps(a, b)
#define PV_ADDI(a, b) _mm512_add_epi32(a, b)
#define PV_SUBI(a, b) _mm512_sub_epi32(a, b)
#define PV_STOREI(q, v) _mm512_storeu_si512((void *)(q), v)
#define PV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PV_STORE(p, v) _mm512_storeu_ps(p, v)
/* acc + four products of x's 4 bytes (x4, biased) with each output's 4 weights */
#define PV_DP(acc, x4, w) _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(x4), w)
#else
#define PW 8
typedef __m256i pvi;
typedef __m256 pvf;
#define PV_LOADI(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define PV_LOADF(p) _mm256_loadu_ps(p)
#define PV_SET1F(v) _mm256_set1_ps(v)
#define PV_ZEROF() _mm256_setzero_ps()
#define PV_ZEROI() _mm256_setzero_si256()
#define PV_CVT(v) _mm256_cvtepi32_ps(v)
#define PV_MUL(a, b) _mm256_mul_ps(a, b)
#define PV_ADD(a, b) _mm256_add_ps(a, b)
#define PV_ADDI(a, b) _mm256_add_epi32(a, b)
#define PV_SUBI(a, b) _mm256_sub_epi32(a, b)
#define PV_STOREI(q, v) _mm256_storeu_si256((__m256i *)(void *)(q), v)
#define PV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define PV_STORE(p, v) _mm256_storeu_ps(p, v)
#ifdef QL_VNNI
#define PV_DP(acc, x4, w) QL_DPBUSD(acc, _mm256_set1_epi32(x4), w)
#else
/* maddubs pairs: (x + 128) <= 255 against |wq| <= 32, at most 16,320: no saturation */
#define PV_DP(acc, x4, w)                                                                     \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(x4), w),   \
                                            _mm256_set1_epi16(1)))
#endif
#endif
/* Q8_0 without VNNI: x's signed bytes by the sign trick (|wq| <= 128 unsigned against
 * x with wq's sign, |x| <= 127: pairs within int16), no seed. */
#ifdef QL_VNNI
#define PV_DPS PV_DP /* not used: VNNI takes Q8_0 biased like the others */
#else
#define PV_DPS(acc, x4, w)                                                                    \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w),           \
                                                                 _mm256_sign_epi8(_mm256_set1_epi32(x4), w)), \
                                            _mm256_set1_epi16(1)))
#endif

/* Four bytes of x read in place as one int32 (broadcast straight from memory). */
typedef int32_t ql_i32 __attribute__((may_alias, aligned(1)));

/* PW weight rows' blocks: q [nb][8][PW][4] (group g of block b: elements 4g .. 4g+3 of
 * every output), seed [nb][2][PW] (-128 times the weights' sum: over the whole block
 * in [0] for one-scale types, over elements 0-15 and 16-31 for Q6_K; zero where x goes
 * in unbiased), scales lo / hi and offsets [nb][PW]. Rows past the matrix are zero. */
typedef struct {
    int8_t *q;
    int32_t *seed;
    float *lo, *hi, *mo;
} panel;

/* PW rows' block b (src[o]: row o's 32 bytes) into the panel's [8][PW][4]: a transpose
 * of four-byte groups. */
static inline void panel_transpose(const int8_t *const *src, int8_t *dst) {
#ifdef QL_Z
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)src[i])),
                                  _mm256_loadu_si256((const __m256i *)src[i + 8]), 1);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) { /* rows 0-3 (and 8-11), then 4-7 (12-15) */
        u[4 * h] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    const __m512i ia = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i ib = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int g = 0; g < 4; g++) {
        _mm512_storeu_si512(dst + g * 64, _mm512_permutex2var_epi64(u[g], ia, u[g + 4]));
        _mm512_storeu_si512(dst + (g + 4) * 64, _mm512_permutex2var_epi64(u[g], ib, u[g + 4]));
    }
#else
    __m256i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)src[i]);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int g = 0; g < 4; g++) {
        _mm256_storeu_si256((__m256i *)(dst + g * 32), _mm256_permute2x128_si256(u[g], u[g + 4], 0x20));
        _mm256_storeu_si256((__m256i *)(dst + (g + 4) * 32), _mm256_permute2x128_si256(u[g], u[g + 4], 0x31));
    }
#endif
}

/* rows (<= PW) weight rows into the panel: each unpacked into rq (PW rows of nb blocks,
 * the scales straight into the panel's [nb][PW]), then each block transposed; the seeds
 * from dpbusd of 128s against the interleaved weights. */
static void panel_build(int32_t t, const uint8_t *w, int64_t row_bytes, int rows, int64_t nb,
                        int8_t *rq, const panel *p, int biased) {
    for (int o = 0; o < PW; o++) {
        unpacked u = {rq + o * nb * QK, p->lo + o, p->hi + o, p->mo + o, PW};
        if (o < rows) {
            unpack_row(t, w + o * row_bytes, nb, &u);
            continue;
        }
        memset(u.q, 0, (size_t)(nb * QK));
        for (int64_t b = 0; b < nb; b++) p->lo[b * PW + o] = p->hi[b * PW + o] = p->mo[b * PW + o] = 0.0f;
    }
    const int two = t == GGML_Q6_K;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *src[PW];
        for (int o = 0; o < PW; o++) src[o] = rq + (o * nb + b) * QK;
        int8_t *dst = p->q + b * 8 * PW * 4;
        panel_transpose(src, dst);
        pvi lo = PV_ZEROI(), hi = PV_ZEROI();
        if (biased)
            for (int g = 0; g < 4; g++) {
                lo = PV_DP(lo, (int32_t)0x80808080, PV_LOADI(dst + g * PW * 4));
                hi = PV_DP(hi, (int32_t)0x80808080, PV_LOADI(dst + (g + 4) * PW * 4));
            }
        /* seeds: -128 times the sums */
        const pvi zero = PV_ZEROI();
        PV_STOREI(p->seed + b * 2 * PW, two ? PV_SUBI(zero, lo) : PV_SUBI(PV_SUBI(zero, lo), hi));
        PV_STOREI(p->seed + b * 2 * PW + PW, two ? PV_SUBI(zero, hi) : zero);
    }
}

/* RM rows of x against a panel: KIND 0 one scale, 1 one scale and an offset, 2 Q6_K's
 * halves, 3 Q8_0 without VNNI (x's signed bytes). xb: row r's block b's bytes at
 * xb + (r * nb + b) * xstride. cols: the panel's rows that are real. */
#define DEF_PANEL(RM, KIND)                                                                   \
    static void pk_##KIND##_##RM(const panel *p, const uint8_t *xb, int64_t xstride,          \
                                 const xblock *xq, int64_t nb, float *y, int64_t ldy, int cols) { \
        pvf acc[RM], ms[RM];                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) acc[r] = ms[r] = PV_ZEROF();     \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const int8_t *wq = p->q + b * 8 * PW * 4;                                         \
            const pvi s0 = PV_LOADI(p->seed + b * 2 * PW), s1 = PV_LOADI(p->seed + b * 2 * PW + PW); \
            const pvf lo = PV_LOADF(p->lo + b * PW);                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) {                            \
                const ql_i32 *x4 = (const ql_i32 *)(xb + (r * nb + b) * xstride);             \
                const xblock *xr = xq + r * nb + b;                                           \
                const pvf dx = PV_SET1F(xr->d);                                               \
                pvi i0 = s0, i1 = KIND == 2 ? s1 : PV_ZEROI();                                \
                _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {                         \
                    if (KIND == 3) {                                                          \
                        i0 = PV_DPS(i0, x4[g], PV_LOADI(wq + g * PW * 4));                    \
                        i1 = PV_DPS(i1, x4[g + 4], PV_LOADI(wq + (g + 4) * PW * 4));          \
                    } else {                                                                  \
                        i0 = PV_DP(i0, x4[g], PV_LOADI(wq + g * PW * 4));                     \
                        i1 = PV_DP(i1, x4[g + 4], PV_LOADI(wq + (g + 4) * PW * 4));           \
                    }                                                                         \
                }                                                                             \
                if (KIND == 2) {                                                              \
                    acc[r] = PV_FMA(PV_MUL(lo, dx), PV_CVT(i0), acc[r]);                      \
                    acc[r] = PV_FMA(PV_MUL(PV_LOADF(p->hi + b * PW), dx), PV_CVT(i1), acc[r]); \
                } else {                                                                      \
                    acc[r] = PV_FMA(PV_MUL(lo, dx), PV_CVT(PV_ADDI(i0, i1)), acc[r]);         \
                }                                                                             \
                if (KIND == 1)                                                                \
                    ms[r] = PV_ADD(ms[r], PV_MUL(PV_LOADF(p->mo + b * PW), PV_SET1F(xr->s))); \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) {                                \
            float out[PW];                                                                    \
            PV_STORE(out, KIND == 1 ? PV_ADD(acc[r], ms[r]) : acc[r]);                        \
            memcpy(y + r * ldy, out, sizeof(float) * (size_t)cols);                           \
        }                                                                                     \
    }
#ifdef QL_Z
#define PANEL_RM 8 /* 32 vector registers */
#else
#define PANEL_RM 4
#endif
#define DEF_PANEL_X(RM, KIND) DEF_PANEL(RM, KIND)
#define DEF_PANELS(KIND) DEF_PANEL_X(PANEL_RM, KIND) DEF_PANEL(2, KIND) DEF_PANEL(1, KIND)
DEF_PANELS(0) DEF_PANELS(1) DEF_PANELS(2)
#ifndef QL_VNNI
DEF_PANELS(3)
#endif
#define PK_CALL(KIND, RM) pk_##KIND##_##RM
#define PK(KIND, RM) PK_CALL(KIND, RM)

static int panel_kind(int32_t t) {
#ifndef QL_VNNI
    if (t == GGML_Q8_0) return 3;
#endif
    return t == GGML_Q6_K ? 2 : has_offset(t) ? 1 : 0;
}

#ifdef QL_AMX
/* AMX (tile matrix multiply, Sapphire Rapids and later): a panel block is laid out as
 * the B operand of a tile product ([8 groups][16 outputs][4 bytes]), so one TDPBSSD of
 * 16 rows of x's signed bytes (A: 16 x 32 bytes, rows nb blocks apart) by it gives the
 * 16 x 16 block integers, exact, without the bias and seeds (Q6_K: two products of 16
 * bytes, its halves). Then per row the same conversion, scale product and FMA as the
 * pk kernels, and the offset term in its own pass in the same order: the same function.
 * Linux hands out the tile registers only on request (arch_prctl); where the request
 * fails the vector panels run instead. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

static int amx_state = -1; /* -1 not asked yet, 0 refused, 1 granted */
static int amx_usable(void) {
    if (amx_state < 0) {
        const char *off = getenv("LIFECYCLE_NATIVE_AMX");
        amx_state = off && off[0] == '0' ? 0
                    : syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                              18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return amx_state;
}

/* Block b's tile products for 16 rows of x into c (two: Q6_K's halves, c[0] and c[1]). */
static inline __attribute__((always_inline)) void amx_block(const panel *p, const xblock *xq,
                                                            int64_t xs, int64_t b, int two,
                                                            int32_t (*c)[16][16]) {
    const int8_t *wq = p->q + b * 8 * PW * 4, *xb = xq[b].q;
    _tile_zero(0);
    _tile_loadd(2, xb, xs);
    _tile_loadd(4, wq, 64);
    _tile_dpbssd(0, 2, 4);
    _tile_stored(0, c[0], 64);
    if (two) {
        _tile_zero(1);
        _tile_loadd(3, xb + 16, xs);
        _tile_loadd(5, wq + 4 * PW * 4, 64);
        _tile_dpbssd(1, 3, 5);
        _tile_stored(1, c[1], 64);
    }
}

/* rows (a multiple of 16) rows of x against a built panel, 16 at a time: block b's tile
 * product is stored while block b - 1's integers go through the FMAs (in block order). */
static inline __attribute__((always_inline)) void amx_rows_k(const int kind, const panel *p,
                                                             const xblock *xq, int64_t nb,
                                                             int32_t rows, float *y,
                                                             int64_t ldy, int cols) {
    const int two = kind == 2;
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) { /* C: 16 x 16 int32; A: x; B: the panel block */
        cfg.rows[t] = 16, cfg.colsb[t] = 64;
        cfg.rows[2 + t] = 16, cfg.colsb[2 + t] = two ? 16 : 32;
        cfg.rows[4 + t] = two ? 4 : 8, cfg.colsb[4 + t] = 64;
    }
    _tile_loadconfig(&cfg);
    const int64_t xs = nb * (int64_t)sizeof(xblock);
    int32_t c[2][2][16][16] __attribute__((aligned(64)));
    for (int32_t r0 = 0; r0 < rows; r0 += 16) {
        const xblock *xr = xq + (int64_t)r0 * nb;
        __m512 acc[16];
        _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        amx_block(p, xr, xs, 0, two, c[0]);
        for (int64_t b = 0; b < nb; b++) {
            if (b + 1 < nb) amx_block(p, xr, xs, b + 1, two, c[(b + 1) & 1]);
            int32_t (*cb)[16][16] = c[b & 1];
            const __m512 lo = _mm512_loadu_ps(p->lo + b * PW);
            const __m512 hi = two ? _mm512_loadu_ps(p->hi + b * PW) : lo;
            _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) {
                const __m512 dx = _mm512_set1_ps(xr[r * nb + b].d);
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(lo, dx),
                                         _mm512_cvtepi32_ps(_mm512_load_si512(cb[0][r])), acc[r]);
                if (two)
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(hi, dx),
                                             _mm512_cvtepi32_ps(_mm512_load_si512(cb[1][r])), acc[r]);
            }
        }
        for (int r = 0; r < 16; r++) {
            __m512 v = acc[r];
            if (kind == 1) {
                __m512 ms = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++)
                    ms = _mm512_add_ps(ms, _mm512_mul_ps(_mm512_loadu_ps(p->mo + b * PW),
                                                         _mm512_set1_ps(xr[r * nb + b].s)));
                v = _mm512_add_ps(v, ms);
            }
            float out[PW];
            _mm512_storeu_ps(out, v);
            memcpy(y + (int64_t)(r0 + r) * ldy, out, sizeof(float) * (size_t)cols);
        }
    }
    _tile_release();
}
static void amx_rows(int kind, const panel *p, const xblock *xq, int64_t nb, int32_t rows,
                     float *y, int64_t ldy, int cols) {
    if (kind == 2) amx_rows_k(2, p, xq, nb, rows, y, ldy, cols);
    else if (kind == 1) amx_rows_k(1, p, xq, nb, rows, y, ldy, cols);
    else amx_rows_k(0, p, xq, nb, rows, y, ldy, cols);
}
#endif

/* rows rows of x (from row 0 of xq / xb) against a built panel. */
static void panel_rows(int kind, const panel *p, const uint8_t *xb, int64_t xstride,
                       const xblock *xq, int64_t nb, int32_t rows, float *y, int64_t ldy, int cols) {
    int32_t r = 0;
#define PK_RUN(RM)                                                                            \
    {                                                                                         \
        const uint8_t *x = xb + (int64_t)r * nb * xstride;                                    \
        const xblock *q = xq + (int64_t)r * nb;                                               \
        float *yy = y + r * ldy;                                                              \
        switch (kind) {                                                                       \
        case 0: PK(0, RM)(p, x, xstride, q, nb, yy, ldy, cols); break;                        \
        case 1: PK(1, RM)(p, x, xstride, q, nb, yy, ldy, cols); break;                        \
        case 2: PK(2, RM)(p, x, xstride, q, nb, yy, ldy, cols); break;                        \
        PK_Q8_0_CASE(RM)                                                                      \
        }                                                                                     \
    }
#ifndef QL_VNNI
#define PK_Q8_0_CASE(RM) case 3: PK(3, RM)(p, x, xstride, q, nb, yy, ldy, cols); break;
#else
#define PK_Q8_0_CASE(RM)
#endif
#ifdef QL_AMX
    if (amx_state == 1 && rows >= 16) {
        r = rows / 16 * 16;
        amx_rows(kind, p, xq, nb, r, y, ldy, cols);
    }
#endif
    for (; r + PANEL_RM <= rows; r += PANEL_RM) PK_RUN(PANEL_RM)
    for (; r + 2 <= rows; r += 2) PK_RUN(2)
    if (r < rows) PK_RUN(1)
#undef PK_RUN
#undef PK_Q8_0_CASE
}

/* ---- One to three rows: four weight rows streamed, unpacked in registers -------------- */

/* Lane l: the sum of unsigned(a) * signed(b) over bytes 4l .. 4l+3, exact (without VNNI:
 * where no pair of products passes int16). */
static inline __m256i lanes_us(__m256i a, __m256i b) {
#ifdef QL_VNNI
    return QL_DPBUSD(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}
/* Signed weights qw (-128 .. 127) against x: the sign trick. */
static inline __m256i lanes_ss(__m256i qw, __m256i qx) {
    return lanes_us(_mm256_abs_epi8(qw), _mm256_sign_epi8(qx, qw));
}
/* o times each lane's sum of x (o a power of two up to 32). */
static inline __m256i lanes_off(__m256i qx, int o) {
#ifdef QL_VNNI
    return QL_DPBUSD(_mm256_setzero_si256(), _mm256_set1_epi8((char)o), qx);
#else
    return _mm256_slli_epi32(lanes_us(_mm256_set1_epi8(1), qx), __builtin_ctz((unsigned)o));
#endif
}
/* Four vectors' lanes: [sum(a) over lanes 0-3, sum(b), sum(c), sum(d) | the same over
 * lanes 4-7] (Q6_K's halves). */
static inline __m256i halves4(__m256i a, __m256i b, __m256i c, __m256i d) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
}
static inline __m128i sums4(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i h = halves4(a, b, c, d);
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
static inline __m128 halfs4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2,
                            const uint8_t *p3) {
    uint16_t h[4];
    memcpy(h, p0, 2), memcpy(h + 1, p1, 2), memcpy(h + 2, p2, 2), memcpy(h + 3, p3, 2);
    return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
}

/* Blocks of 32 (Q8_0, Q4_1, Q4_0, Q5_0, Q5_1): rows r[0..3] (row pointers), one row of x. */
static inline __attribute__((always_inline)) void dec32(int32_t t, const uint8_t *const *r,
                                                        const xblock *xq, int64_t nb, float *y,
                                                        int rn) {
    const int bytes = block_bytes(t), offset = has_offset(t);
    __m128 acc = _mm_setzero_ps(), ms = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const xblock *xb = xq + b;
        const __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);
        const uint8_t *k[4] = {r[0] + b * bytes, r[1] + b * bytes, r[2] + b * bytes, r[3] + b * bytes};
        __m256i l[4];
        if (t == GGML_Q4_0 || t == GGML_Q5_0) {
            /* (u - o) q summed is u q summed minus o times x's sum: the same integers */
            const __m256i off = lanes_off(qx, t == GGML_Q4_0 ? 8 : 16);
            for (int c = 0; c < 4; c++) {
                __m256i u = t == GGML_Q4_0 ? nibbles16(k[c] + 2) : with_fifth_bit(nibbles16(k[c] + 6), k[c] + 2);
                l[c] = _mm256_sub_epi32(lanes_us(u, qx), off);
            }
        } else {
            for (int c = 0; c < 4; c++)
                l[c] = t == GGML_Q8_0   ? lanes_ss(_mm256_loadu_si256((const __m256i *)(k[c] + 2)), qx)
                       : t == GGML_Q4_1 ? lanes_us(nibbles16(k[c] + 4), qx)
                                        : lanes_us(with_fifth_bit(nibbles16(k[c] + 8), k[c] + 4), qx);
        }
        const __m128 sc = _mm_mul_ps(halfs4(k[0], k[1], k[2], k[3]), _mm_set1_ps(xb->d));
        acc = _mm_fmadd_ps(sc, _mm_cvtepi32_ps(sums4(l[0], l[1], l[2], l[3])), acc);
        if (offset)
            ms = _mm_add_ps(ms, _mm_mul_ps(halfs4(k[0] + 2, k[1] + 2, k[2] + 2, k[3] + 2),
                                           _mm_set1_ps(xb->s)));
    }
    float out[4];
    _mm_storeu_ps(out, offset ? _mm_add_ps(acc, ms) : acc);
    memcpy(y, out, sizeof(float) * (size_t)rn);
}

/* The k-quants (super-blocks of 256): rows r[0..3], one row of x. */
static inline __attribute__((always_inline)) void deck(int32_t t, const uint8_t *const *r,
                                                       const xblock *xq, int64_t nb, float *y,
                                                       int rn) {
    const int bytes = block_bytes(t), six = t == GGML_Q6_K, five = t == GGML_Q5_K;
    const __m256i low4 = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m128 acc = _mm_setzero_ps(), ms = _mm_setzero_ps();
    for (int64_t s = 0; s < nb / 8; s++) {
        const uint8_t *k[4] = {r[0] + s * bytes, r[1] + s * bytes, r[2] + s * bytes, r[3] + s * bytes};
        float lo[8][4], hi[8][4], mo[8][4];
        for (int c = 0; c < 4; c++) {
            if (six) {
                const int8_t *sc = (const int8_t *)(k[c] + 192);
                float d = half_to_float(k[c] + 208);
                for (int j = 0; j < 8; j++) lo[j][c] = d * (float)sc[2 * j], hi[j][c] = d * (float)sc[2 * j + 1];
            } else {
                float d = half_to_float(k[c]), dmin = half_to_float(k[c] + 2);
                for (int j = 0; j < 8; j++) {
                    int sc, m;
                    scale_min_k4(j, k[c] + 4, &sc, &m);
                    lo[j][c] = d * (float)sc;
                    mo[j][c] = -(dmin * (float)m);
                }
            }
        }
        for (int j = 0; j < 8; j++) {
            const xblock *xb = xq + s * 8 + j;
            const __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);
            const __m128 dx = _mm_set1_ps(xb->d);
            __m256i l[4];
            if (six) {
                const int h = j / 4, kk = j % 4;
                const __m256i off = lanes_off(qx, 32);
                for (int c = 0; c < 4; c++) {
                    __m256i lw = _mm256_loadu_si256((const __m256i *)(k[c] + 64 * h + 32 * (kk & 1)));
                    __m256i hh = _mm256_loadu_si256((const __m256i *)(k[c] + 128 + 32 * h));
                    __m256i nib = _mm256_and_si256(kk < 2 ? lw : _mm256_srli_epi16(lw, 4), low4);
                    __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hh, _mm_cvtsi32_si128(2 * kk)), three);
                    __m256i u = _mm256_or_si256(nib, _mm256_slli_epi16(hb, 4)); /* q6, 0..63 */
                    l[c] = _mm256_sub_epi32(lanes_us(u, qx), off);
                }
                __m256i hv = halves4(l[0], l[1], l[2], l[3]);
                acc = _mm_fmadd_ps(_mm_mul_ps(_mm_loadu_ps(lo[j]), dx),
                                   _mm_cvtepi32_ps(_mm256_castsi256_si128(hv)), acc);
                acc = _mm_fmadd_ps(_mm_mul_ps(_mm_loadu_ps(hi[j]), dx),
                                   _mm_cvtepi32_ps(_mm256_extracti128_si256(hv, 1)), acc);
                continue;
            }
            for (int c = 0; c < 4; c++) {
                const uint8_t *qs = k[c] + (five ? 48 : 16) + 32 * (j / 2);
                __m256i n = _mm256_loadu_si256((const __m256i *)qs);
                __m256i u = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(n, 4) : n, low4);
                if (five) {
                    __m256i qh = _mm256_loadu_si256((const __m256i *)(k[c] + 16));
                    u = _mm256_or_si256(u, _mm256_slli_epi16(
                                               _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4));
                }
                l[c] = lanes_us(u, qx);
            }
            acc = _mm_fmadd_ps(_mm_mul_ps(_mm_loadu_ps(lo[j]), dx),
                               _mm_cvtepi32_ps(sums4(l[0], l[1], l[2], l[3])), acc);
            ms = _mm_add_ps(ms, _mm_mul_ps(_mm_loadu_ps(mo[j]), _mm_set1_ps(xb->s)));
        }
    }
    float out[4];
    _mm_storeu_ps(out, six ? acc : _mm_add_ps(acc, ms));
    memcpy(y, out, sizeof(float) * (size_t)rn);
}

/* One function per type, so each compiles with its branches gone. */
#define DEF_DEC(T, F)                                                                         \
    static void dec_##T(const uint8_t *const *r, const xblock *xq, int64_t nb, float *y, int rn) { \
        F(GGML_##T, r, xq, nb, y, rn);                                                        \
    }
DEF_DEC(Q8_0, dec32) DEF_DEC(Q4_1, dec32) DEF_DEC(Q4_0, dec32) DEF_DEC(Q5_0, dec32)
DEF_DEC(Q5_1, dec32) DEF_DEC(Q4_K, deck) DEF_DEC(Q5_K, deck) DEF_DEC(Q6_K, deck)

static void decode_rows(int32_t t, const uint8_t *const *r, const xblock *xq, int64_t nb,
                        float *y, int rn) {
    switch (t) {
    case GGML_Q8_0: dec_Q8_0(r, xq, nb, y, rn); return;
    case GGML_Q4_1: dec_Q4_1(r, xq, nb, y, rn); return;
    case GGML_Q4_0: dec_Q4_0(r, xq, nb, y, rn); return;
    case GGML_Q5_0: dec_Q5_0(r, xq, nb, y, rn); return;
    case GGML_Q5_1: dec_Q5_1(r, xq, nb, y, rn); return;
    case GGML_Q4_K: dec_Q4_K(r, xq, nb, y, rn); return;
    case GGML_Q5_K: dec_Q5_K(r, xq, nb, y, rn); return;
    case GGML_Q6_K: dec_Q6_K(r, xq, nb, y, rn); return;
    default: return;
    }
}
#endif /* QL_AVX2 */

/* How far ahead of the rows it is reading each thread asks for the weights. The
 * hardware prefetcher follows one matrix streamed alone, but not a decode step, which
 * reads four matrices a layer for ~40-160 us each (all four at one row took 10.5 ms a
 * step without this and 3.0-3.2 ms with it, 2026-12-04). */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

/* Per thread: a panel and its rows unpacked (AVX2 builds), or one weight row unpacked
 * (portable C). */
typedef struct {
#ifdef QL_AVX2
    panel p;
    int8_t *rq; /* [PW][nb][32]: the panel's rows unpacked */
#else
    unpacked u;
#endif
} scratch;

static int scratch_alloc(scratch *s, int64_t nb) {
    memset(s, 0, sizeof *s);
#ifdef QL_AVX2
    s->p = (panel){malloc((size_t)(nb * 8 * PW * 4)), malloc(sizeof(int32_t) * (size_t)(nb * 2 * PW)),
                   malloc(sizeof(float) * (size_t)(nb * PW)), malloc(sizeof(float) * (size_t)(nb * PW)),
                   malloc(sizeof(float) * (size_t)(nb * PW))};
    s->rq = malloc((size_t)(PW * nb * QK));
    return s->p.q && s->p.seed && s->p.lo && s->p.hi && s->p.mo && s->rq;
#else
    return unpacked_alloc(&s->u, nb);
#endif
}
static void scratch_free(scratch *s) {
#ifdef QL_AVX2
    free(s->p.q), free(s->p.seed), free(s->p.lo), free(s->p.hi), free(s->p.mo), free(s->rq);
#else
    unpacked_free(&s->u);
#endif
}

/* ---- Panel-packed weights (q_pack): the decode and small-batch path ------------------- */

/* A weight packed once at load (q_pack) so the kernel never unpacks a row per call: its
 * rows in panels of QP_W = 16 outputs (the last panel padded with zero rows), and each
 * panel's blocks of 32, in order, as the panels above interleave them, but still at the
 * file's width: every weight an unsigned integer u = wq + z (z: 8 for Q4_0, 16 for Q5_0,
 * 32 for Q6_K, 128 for Q8_0, 0 for the types with an offset), in eight groups of four
 * elements ([group G][16 outputs][4 elements], elements 4G .. 4G+3):
 *
 *   4 bits (Q4_0, Q4_1, Q4_K): 256 B, [G < 4][16][4], low nibble element 4G+e, high
 *           nibble element 16+4G+e (group G + 4), as the file pairs them;
 *   5 bits (Q5_0, Q5_1, Q5_K): those 256 B, then 64 B [16][4] whose bit G is element
 *           4G+e's fifth bit;
 *   6 bits (Q6_K): the 256 B of low nibbles, then 128 B [H < 2][16][4] whose bits 2g, 2g+1
 *           are element 4(4H+g)+e's top two;
 *   8 bits (Q8_0): 512 B [G < 8][16][4].
 *
 * Before a block (types of 32) or a super-block of 8 blocks (k-quants), the scales, at
 * the file's width too: Q4_0, Q5_0, Q8_0: d [16] fp16; Q4_1, Q5_1: d, m [16] fp16; Q4_K,
 * Q5_K: d, dmin [16] fp16, sc [8][16] and m [8][16] uint8 (the 6-bit pairs); Q6_K: d [16]
 * fp16, sc [16][16] int8. A packed weight is the file's size (Q4_K and Q5_K 4 bytes more
 * per super-block), the same on every build.
 *
 * One dpbusd of x's four signed bytes (broadcast) against a group's unsigned weights adds
 * four products into all 16 outputs' sums (no horizontal sums, no per-call unpacking),
 * and the zero comes off as z times x's block sum: the same integer dot as the
 * definition, then the same scale product and FMA per block, in the same order. Rows of
 * x go 8 at a time (4 where vectors are 256 bits) against the panel's registers. With
 * AMX and qp_amx_rows(t) rows or more (a prefill, a step of many decodes), each panel is
 * widened to the int8 panel of the path above (no transpose) and groups of 16 rows take
 * its tile products: a 512-token prefill of the 0.5B shape 1,296 -> 1,113 ms. Where the
 * tiles start pays off depends on the type: a vector pass unpacks every block again for
 * each 8 rows, which costs most for the 5-bit type and least for the 4-bit ones with an
 * offset, whose tile products need the offset term besides. From cache, two threads,
 * 4,864 x 1,024, vector / tiles at 32 rows: Q4_0 0.74 / 0.59 ms, Q5_0 0.83 / 0.60, Q8_0
 * 0.80 / 0.70, Q4_1 0.69 / 0.72, and at 48 tiles win for those three and tie for Q4_1;
 * Q4_K and Q6_K (the 0.5B shape's ffn_down) were no faster at 32 (2026-12-07). So
 * Q4_0, Q5_0 and Q8_0 take tiles from QP_AMX_ROWS_SIMPLE rows, the others from
 * QP_AMX_ROWS. Without AVX2 nothing is packed (q_packed_bytes is 0). */
enum { QP_FLAG = 0x100, QP_W = 16 };
#ifndef QP_AMX_ROWS
#define QP_AMX_ROWS 64
#endif
#ifndef QP_AMX_ROWS_SIMPLE
#define QP_AMX_ROWS_SIMPLE 32
#endif

/* The rows from which a packed weight of type t takes AMX's tiles (above). */
static inline int32_t qp_amx_rows(int32_t t) {
    return t == GGML_Q4_0 || t == GGML_Q5_0 || t == GGML_Q8_0 ? QP_AMX_ROWS_SIMPLE : QP_AMX_ROWS;
}

static int qp_bits(int32_t t) {
    switch (t) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q4_K: return 4;
    case GGML_Q5_0: case GGML_Q5_1: case GGML_Q5_K: return 5;
    case GGML_Q6_K: return 6;
    case GGML_Q8_0: return 8;
    default: return 0;
    }
}
static int qp_zero(int32_t t) {
    return t == GGML_Q4_0 ? 8 : t == GGML_Q5_0 ? 16 : t == GGML_Q6_K ? 32 : t == GGML_Q8_0 ? 128 : 0;
}
/* Bytes of one block's weights in a panel, of the scales before a unit, of a unit (one
 * block, or a k-quant's super-block) and of a panel of rows of k. */
static int64_t qp_qbytes(int32_t t) {
    switch (qp_bits(t)) {
    case 4: return 256;
    case 5: return 320;
    case 6: return 384;
    default: return 512;
    }
}
static int64_t qp_head(int32_t t) {
    switch (t) {
    case GGML_Q4_1: case GGML_Q5_1: return 64;
    case GGML_Q4_K: case GGML_Q5_K: return 64 + 256;
    case GGML_Q6_K: return 32 + 256;
    default: return 32;
    }
}
static int64_t qp_unit(int32_t t) { return qp_head(t) + (block_elems(t) / QK) * qp_qbytes(t); }
static int64_t qp_panel_bytes(int32_t t, int64_t k) { return k / block_elems(t) * qp_unit(t); }

/* Bytes q_pack writes for n rows of k of type t: 0 where this build does not pack or
 * the shape is not whole blocks. */
int64_t q_packed_bytes(int32_t t, int64_t n, int64_t k) {
#ifdef QL_AVX2
    if (!qp_bits(t) || !block_bytes(t) || k <= 0 || k % block_elems(t) || n < 0) return 0;
    return (n + QP_W - 1) / QP_W * qp_panel_bytes(t, k);
#else
    (void)t, (void)n, (void)k;
    return 0;
#endif
}

/* The file's scales of a unit of row w (unit s): d, m (or dmin) as fp16 bits, sc, mn. */
static void qp_scales(int32_t t, const uint8_t *blk, uint16_t *d, uint16_t *m, uint8_t *sc,
                      uint8_t *mn) {
    *m = 0;
    if (t == GGML_Q6_K) {
        memcpy(d, blk + 208, 2);
        memcpy(sc, blk + 192, 16);
        return;
    }
    memcpy(d, blk, 2);
    if (has_offset(t)) memcpy(m, blk + 2, 2);
    if (t == GGML_Q4_K || t == GGML_Q5_K)
        for (int j = 0; j < 8; j++) {
            int a, b;
            scale_min_k4(j, blk + 4, &a, &b);
            sc[j] = (uint8_t)a, mn[j] = (uint8_t)b;
        }
}

/* n rows of type t (w, the file's blocks) into out (q_packed_bytes(t, n, k) bytes), the
 * panels split between threads. Returns 0, -1 without memory, -2 for a type or shape
 * this build does not pack. */
int q_pack(const uint8_t *w, uint8_t *out, int32_t t, int64_t n, int64_t k, int32_t threads) {
    if (!q_packed_bytes(t, n, k)) return -2;
    const int64_t nb = k / QK, row_bytes = k / block_elems(t) * block_bytes(t);
    const int64_t units = k / block_elems(t), per = block_elems(t) / QK, qb = qp_qbytes(t);
    const int64_t pb = qp_panel_bytes(t, k), panels = (n + QP_W - 1) / QP_W;
    const int bits = qp_bits(t), z = qp_zero(t), kq = per > 1;
    int failed = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        unpacked u;
        const int ok = unpacked_alloc(&u, nb);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            uint8_t *pp = out + pi * pb;
            memset(pp, 0, (size_t)pb);
            for (int o = 0; ok && o < QP_W && pi * QP_W + o < n; o++) {
                const uint8_t *row = w + (pi * QP_W + o) * row_bytes;
                unpack_row_c(t, row, nb, &u);
                for (int64_t s = 0; s < units; s++) {
                    uint8_t *head = pp + s * qp_unit(t);
                    uint16_t d, m;
                    uint8_t sc[16] = {0}, mn[8] = {0};
                    qp_scales(t, row + s * block_bytes(t), &d, &m, sc, mn);
                    memcpy(head + 2 * o, &d, 2);
                    if (t == GGML_Q6_K) {
                        for (int i = 0; i < 16; i++) head[32 + 16 * i + o] = sc[i];
                    } else if (kq) {
                        memcpy(head + 32 + 2 * o, &m, 2);
                        for (int i = 0; i < 8; i++) head[64 + 16 * i + o] = sc[i], head[192 + 16 * i + o] = mn[i];
                    } else if (has_offset(t)) {
                        memcpy(head + 32 + 2 * o, &m, 2);
                    }
                    for (int64_t jb = 0; jb < per; jb++) {
                        uint8_t *q = head + qp_head(t) + jb * qb;
                        const int8_t *wq = u.q + (s * per + jb) * QK;
                        for (int e = 0; e < 4; e++)
                            for (int g = 0; g < 8; g++) {
                                const int v = wq[4 * g + e] + z; /* 0 .. 2^bits - 1 */
                                const int at = o * 4 + e;
                                if (bits == 8) {
                                    q[g * 64 + at] = (uint8_t)v;
                                    continue;
                                }
                                q[(g & 3) * 64 + at] |= (uint8_t)((v & 15) << (g < 4 ? 0 : 4));
                                if (bits == 5) q[256 + at] |= (uint8_t)(((v >> 4) & 1) << g);
                                if (bits == 6) q[256 + (g / 4) * 64 + at] |= (uint8_t)(((v >> 4) & 3) << (2 * (g & 3)));
                            }
                    }
                }
            }
        }
        if (ok) unpacked_free(&u);
    }
    return failed ? -1 : 0;
}

/* Output o of a packed panel pp, block b: its integers u - z into wq[32] and its
 * scales (lo: elements 0-15, hi: 16-31, mo: the offset), as unpack_row_c has them. */
static void qp_block(int32_t t, const uint8_t *pp, int64_t b, int o, int8_t *wq, float *lo,
                     float *hi, float *mo) {
    const int64_t per = block_elems(t) / QK;
    const uint8_t *head = pp + b / per * qp_unit(t), *q = head + qp_head(t) + b % per * qp_qbytes(t);
    const int bits = qp_bits(t), z = qp_zero(t), jb = (int)(b % per);
    uint16_t h;
    memcpy(&h, head + 2 * o, 2);
    const float d = fo_half_to_float(h);
    *mo = 0.0f;
    if (t == GGML_Q6_K) {
        *lo = d * (float)(int8_t)head[32 + 16 * (2 * jb) + o];
        *hi = d * (float)(int8_t)head[32 + 16 * (2 * jb + 1) + o];
    } else if (per > 1) {
        memcpy(&h, head + 32 + 2 * o, 2);
        *lo = *hi = d * (float)head[64 + 16 * jb + o];
        *mo = -(fo_half_to_float(h) * (float)head[192 + 16 * jb + o]);
    } else {
        *lo = *hi = d;
        if (has_offset(t)) memcpy(&h, head + 32 + 2 * o, 2), *mo = fo_half_to_float(h);
    }
    for (int g = 0; g < 8; g++)
        for (int e = 0; e < 4; e++) {
            const int at = o * 4 + e;
            int v;
            if (bits == 8) {
                v = q[g * 64 + at];
            } else {
                v = (q[(g & 3) * 64 + at] >> (g < 4 ? 0 : 4)) & 15;
                if (bits == 5) v |= ((q[256 + at] >> g) & 1) << 4;
                if (bits == 6) v |= ((q[256 + (g / 4) * 64 + at] >> (2 * (g & 3))) & 3) << 4;
            }
            wq[4 * g + e] = (int8_t)(v - z);
        }
}

/* Rows ids[0 .. count) of a packed weight (n rows of k) as fp32 [count][k], what
 * q_dequantize gives for the file's blocks (the embedding's lookups). Returns 0, -2 for
 * a type or shape this build does not pack or an id out of range. */
int q_packed_rows(const uint8_t *wp, const int64_t *ids, int64_t count, float *out, int32_t t,
                  int64_t n, int64_t k) {
    if (!q_packed_bytes(t, n, k)) return -2;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -2;
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *pp = wp + ids[i] / QP_W * qp_panel_bytes(t, k);
        for (int64_t b = 0; b < nb; b++) {
            int8_t wq[QK];
            float lo, hi, mo;
            qp_block(t, pp, b, (int)(ids[i] % QP_W), wq, &lo, &hi, &mo);
            for (int e = 0; e < QK; e++)
                out[i * k + b * QK + e] = fmaf(e < 16 ? lo : hi, (float)wq[e], mo);
        }
    }
    return 0;
}

#ifdef QL_AVX2
/* Vectors of QV outputs: 16 with AVX512 (a panel), else 8 (half a panel). */
#ifdef QL_Z
#define QV 16
#define QP_ROWS 8
typedef __m512i qvi;
typedef __m512 qvf;
#define QV_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define QV_SET1B(v) _mm512_set1_epi8((char)(v))
#define QV_SET1I(v) _mm512_set1_epi32(v)
#define QV_AND(a, b) _mm512_and_si512(a, b)
#define QV_OR(a, b) _mm512_or_si512(a, b)
#define QV_XOR(a, b) _mm512_xor_si512(a, b)
#define QV_SRLI16(a, n) _mm512_srli_epi16(a, n)
#define QV_SLLI16(a, n) _mm512_slli_epi16(a, n)
#define QV_ADDI(a, b) _mm512_add_epi32(a, b)
#define QV_SUBI(a, b) _mm512_sub_epi32(a, b)
#define QV_HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define QV_U8F(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p))))
#define QV_I8F(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p))))
#define QV_DP(acc, w, x4) _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4))
#define QV_SET1F(v) _mm512_set1_ps(v)
#define QV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define QV_CVT(v) _mm512_cvtepi32_ps(v)
#define QV_STORE(p, v) _mm512_storeu_ps(p, v)
#else
#define QV 8
#define QP_ROWS 4
typedef __m256i qvi;
typedef __m256 qvf;
#define QV_LOADI(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define QV_SET1B(v) _mm256_set1_epi8((char)(v))
#define QV_SET1I(v) _mm256_set1_epi32(v)
#define QV_AND(a, b) _mm256_and_si256(a, b)
#define QV_OR(a, b) _mm256_or_si256(a, b)
#define QV_XOR(a, b) _mm256_xor_si256(a, b)
#define QV_SRLI16(a, n) _mm256_srli_epi16(a, n)
#define QV_SLLI16(a, n) _mm256_slli_epi16(a, n)
#define QV_ADDI(a, b) _mm256_add_epi32(a, b)
#define QV_SUBI(a, b) _mm256_sub_epi32(a, b)
#define QV_HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define QV_U8F(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p))))
#define QV_I8F(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p))))
#define QV_SET1F(v) _mm256_set1_ps(v)
#define QV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define QV_CVT(v) _mm256_cvtepi32_ps(v)
#define QV_STORE(p, v) _mm256_storeu_ps(p, v)
#ifdef QL_VNNI
#define QV_DP(acc, w, x4) QL_DPBUSD(acc, w, _mm256_set1_epi32(x4))
#else
/* maddubs pairs: u <= 63 against |x| <= 127, at most 16,002: no saturation (Q8_0 goes
 * by the sign trick, QV_DPS) */
#define QV_DP(acc, w, x4)                                                                     \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)),   \
                                            _mm256_set1_epi16(1)))
#endif
#endif
#if defined(QL_VNNI)
#define QP_SIGNED8 0 /* Q8_0 biased like the rest: u = wq + 128, less 128 times x's sum */
#else
#define QP_SIGNED8 1
/* Q8_0's u against x without VNNI: wq = u ^ 0x80 signed, the sign trick, no zero */
#define QV_DPS(acc, w, x4)                                                                    \
    _mm256_add_epi32(acc, _mm256_madd_epi16(                                                  \
                              _mm256_maddubs_epi16(_mm256_abs_epi8(_mm256_xor_si256(w, _mm256_set1_epi8((char)0x80))), \
                                                   _mm256_sign_epi8(_mm256_set1_epi32(x4),    \
                                                                    _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)))), \
                              _mm256_set1_epi16(1)))
#endif

/* Block b's eight groups of QV outputs' integers u (outputs h * QV onwards) into W. */
static inline __attribute__((always_inline)) void qp_weights(const int bits, const uint8_t *q,
                                                             int h, qvi *W) {
    const int at = h * QV * 4;
    if (bits == 8) {
        for (int g = 0; g < 8; g++) W[g] = QV_LOADI(q + g * 64 + at);
        return;
    }
    const qvi low4 = QV_SET1B(15);
    for (int g = 0; g < 4; g++) {
        const qvi v = QV_LOADI(q + g * 64 + at);
        W[g] = QV_AND(v, low4);
        W[g + 4] = QV_AND(QV_SRLI16(v, 4), low4);
    }
    if (bits == 5) {
        const qvi hb = QV_LOADI(q + 256 + at), b4 = QV_SET1B(0x10);
        W[0] = QV_OR(W[0], QV_AND(QV_SLLI16(hb, 4), b4));
        W[1] = QV_OR(W[1], QV_AND(QV_SLLI16(hb, 3), b4));
        W[2] = QV_OR(W[2], QV_AND(QV_SLLI16(hb, 2), b4));
        W[3] = QV_OR(W[3], QV_AND(QV_SLLI16(hb, 1), b4));
        W[4] = QV_OR(W[4], QV_AND(hb, b4));
        W[5] = QV_OR(W[5], QV_AND(QV_SRLI16(hb, 1), b4));
        W[6] = QV_OR(W[6], QV_AND(QV_SRLI16(hb, 2), b4));
        W[7] = QV_OR(W[7], QV_AND(QV_SRLI16(hb, 3), b4));
    } else if (bits == 6) {
        const qvi b45 = QV_SET1B(0x30);
        for (int H = 0; H < 2; H++) {
            const qvi hb = QV_LOADI(q + 256 + H * 64 + at);
            W[4 * H] = QV_OR(W[4 * H], QV_AND(QV_SLLI16(hb, 4), b45));
            W[4 * H + 1] = QV_OR(W[4 * H + 1], QV_AND(QV_SLLI16(hb, 2), b45));
            W[4 * H + 2] = QV_OR(W[4 * H + 2], QV_AND(hb, b45));
            W[4 * H + 3] = QV_OR(W[4 * H + 3], QV_AND(QV_SRLI16(hb, 2), b45));
        }
    }
}

/* Block jb of a unit's scales (head: the unit's; h: which QV outputs): lo, hi (Q6_K's
 * second half; the others' is lo) and mo (the offset, 0 for types without), as
 * unpack_row_c computes them; dv and dm carry a k-quant unit's d and dmin from its
 * first block to the rest. */
static inline __attribute__((always_inline)) void qp_block_scales(const int32_t t,
                                                                  const uint8_t *head, int jb,
                                                                  int h, qvf *dv, qvf *dm,
                                                                  qvf *lo, qvf *hi, qvf *mo) {
    const int per = block_elems(t) / QK, six = t == GGML_Q6_K;
    *mo = (qvf){0};
    if (per > 1) {
        if (jb == 0) {
            *dv = QV_HALVES(head + 2 * QV * h);
            if (!six) *dm = QV_HALVES(head + 32 + 2 * QV * h);
        }
        if (six) {
            *lo = *dv * QV_I8F(head + 32 + 16 * (2 * jb) + QV * h);
            *hi = *dv * QV_I8F(head + 32 + 16 * (2 * jb + 1) + QV * h);
        } else {
            *lo = *hi = *dv * QV_U8F(head + 64 + 16 * jb + QV * h);
            *mo = -(*dm * QV_U8F(head + 192 + 16 * jb + QV * h));
        }
    } else {
        *lo = *hi = QV_HALVES(head + 2 * QV * h);
        if (has_offset(t)) *mo = QV_HALVES(head + 32 + 2 * QV * h);
    }
}

/* R rows of x (xq, their block sums xs [r][nb][2]) against QV outputs (h: which half of
 * the panel where QV is 8) of a packed panel pp of type t: y[r][0 .. cols). */
static inline __attribute__((always_inline)) void qp_rows_k(const int32_t t, const int R,
                                                            const uint8_t *pp, int h,
                                                            const xblock *xq, const int32_t *xs,
                                                            int64_t nb, float *y, int64_t ldy,
                                                            int cols) {
    const int bits = qp_bits(t), offset = has_offset(t), six = t == GGML_Q6_K;
    const int per = block_elems(t) / QK;
    const int z = (t == GGML_Q8_0 && QP_SIGNED8) ? 0 : qp_zero(t);
    const int signed8 = t == GGML_Q8_0 && QP_SIGNED8;
    const int64_t unit = qp_unit(t), qb = qp_qbytes(t), hb = qp_head(t);
    qvf acc[R], ms[R];
    for (int r = 0; r < R; r++) acc[r] = ms[r] = (qvf){0};
    qvf dv = (qvf){0}, dm = (qvf){0};
    for (int64_t b = 0; b < nb; b++) {
        const int jb = (int)(b % per);
        const uint8_t *head = pp + b / per * unit, *q = head + hb + jb * qb;
        { /* every line of this block's bytes (and of its unit's scales), PF_BYTES ahead */
            const uint8_t *from = (per > 1 && jb) ? q : head, *to = q + qb;
            for (const uint8_t *a = from; a < to; a += 64)
                _mm_prefetch((const char *)(a + PF_BYTES), _MM_HINT_T0);
        }
        qvi W[8];
        qp_weights(bits, q, h, W);
        qvf lo, hi, mo;
        qp_block_scales(t, head, jb, h, &dv, &dm, &lo, &hi, &mo);
        for (int r = 0; r < R; r++) {
            const xblock *xr = xq + r * nb + b;
            const ql_i32 *x4 = (const ql_i32 *)xr->q;
            qvi i0 = (qvi){0}, i1 = (qvi){0};
            for (int g = 0; g < 4; g++) {
#ifdef QV_DPS
                if (signed8) {
                    i0 = QV_DPS(i0, W[g], x4[g]);
                    i1 = QV_DPS(i1, W[g + 4], x4[g + 4]);
                    continue;
                }
#endif
                i0 = QV_DP(i0, W[g], x4[g]);
                i1 = QV_DP(i1, W[g + 4], x4[g + 4]);
            }
            const int32_t *sx = xs + (r * nb + b) * 2;
            const qvf dx = QV_SET1F(xr->d);
            if (six) {
                i0 = QV_SUBI(i0, QV_SET1I(32 * sx[0]));
                i1 = QV_SUBI(i1, QV_SET1I(32 * sx[1]));
                acc[r] = QV_FMA(lo * dx, QV_CVT(i0), acc[r]);
                acc[r] = QV_FMA(hi * dx, QV_CVT(i1), acc[r]);
            } else {
                qvi dot = QV_ADDI(i0, i1);
                if (z) dot = QV_SUBI(dot, QV_SET1I(z * (sx[0] + sx[1])));
                acc[r] = QV_FMA(lo * dx, QV_CVT(dot), acc[r]);
            }
            if (offset) ms[r] = ms[r] + mo * QV_SET1F(xr->s);
        }
    }
    (void)signed8;
    for (int r = 0; r < R; r++) {
        float out[QV];
        if (offset) acc[r] = acc[r] + ms[r];
        QV_STORE(out, acc[r]);
        memcpy(y + r * ldy, out, sizeof(float) * (size_t)cols);
    }
}

#define DEF_QP(T, R)                                                                          \
    static void qp_##T##_##R(const uint8_t *pp, int h, const xblock *xq, const int32_t *xs,   \
                             int64_t nb, float *y, int64_t ldy, int cols) {                   \
        qp_rows_k(GGML_##T, R, pp, h, xq, xs, nb, y, ldy, cols);                              \
    }
#define DEF_QPS(R)                                                                            \
    DEF_QP(Q8_0, R) DEF_QP(Q4_1, R) DEF_QP(Q4_0, R) DEF_QP(Q5_0, R) DEF_QP(Q5_1, R)           \
    DEF_QP(Q4_K, R) DEF_QP(Q5_K, R) DEF_QP(Q6_K, R)
/* every row count up to QP_ROWS has its own kernel: the rows left after the full groups
 * (a speculative check's 1 + k, a step's decodes) take one pass over the panel, which
 * unpacks each block once for all of them (4 + 2 + 1 passes for 7 rows cost 1.7 times one
 * row on the 0.5B shape, against 1.5 for 8 in one) */
DEF_QPS(1) DEF_QPS(2) DEF_QPS(3) DEF_QPS(4)
#if QP_ROWS == 8
DEF_QPS(5) DEF_QPS(6) DEF_QPS(7) DEF_QPS(8)
#endif

/* rows rows of x against a packed panel (cols of its outputs real). */
static void qp_rows(int32_t t, const uint8_t *pp, const xblock *xq, const int32_t *xs, int64_t nb,
                    int32_t rows, float *y, int64_t ldy, int cols) {
#define QP_CALL(R)                                                                            \
    switch (t) {                                                                              \
    case GGML_Q8_0: qp_Q8_0_##R(pp, h, xr, sr, nb, yr, ldy, hc); break;                       \
    case GGML_Q4_1: qp_Q4_1_##R(pp, h, xr, sr, nb, yr, ldy, hc); break;                       \
    case GGML_Q4_0: qp_Q4_0_##R(pp, h, xr, sr, nb, yr, ldy, hc); break;                       \
    case GGML_Q5_0: qp_Q5_0_##R(pp, h, xr, sr, nb, yr, ldy, hc); break;                       \
    case GGML_Q5_1: qp_Q5_1_##R(pp, h, xr, sr, nb, yr, ldy, hc); break;                       \
    case GGML_Q4_K: qp_Q4_K_##R(pp, h, xr, sr, nb, yr, ldy, hc); break;                       \
    case GGML_Q5_K: qp_Q5_K_##R(pp, h, xr, sr, nb, yr, ldy, hc); break;                       \
    case GGML_Q6_K: qp_Q6_K_##R(pp, h, xr, sr, nb, yr, ldy, hc); break;                       \
    }
    for (int h = 0; h * QV < cols; h++) {
        const int hc = cols - h * QV < QV ? cols - h * QV : QV;
        for (int32_t r = 0; r < rows;) {
            const xblock *xr = xq + (int64_t)r * nb;
            const int32_t *sr = xs + (int64_t)r * nb * 2;
            float *yr = y + r * ldy + h * QV;
            const int32_t left = rows - r;
            const int32_t take = left < QP_ROWS ? left : QP_ROWS;
            switch (take) {
#if QP_ROWS == 8
            case 8: QP_CALL(8) break;
            case 7: QP_CALL(7) break;
            case 6: QP_CALL(6) break;
            case 5: QP_CALL(5) break;
#endif
            case 4: QP_CALL(4) break;
            case 3: QP_CALL(3) break;
            case 2: QP_CALL(2) break;
            default: QP_CALL(1) break;
            }
            r += take;
        }
    }
#undef QP_CALL
}

#ifdef QL_AMX
/* A packed panel's integers widened to the panels path's int8 (u - z) and its scales,
 * for amx_rows (which needs no seeds). */
static void qp_panel_build(int32_t t, const uint8_t *pp, int64_t nb, const panel *p) {
    const int bits = qp_bits(t), per = block_elems(t) / QK;
    const int64_t unit = qp_unit(t), qb = qp_qbytes(t), hb = qp_head(t);
    const __m512i zv = _mm512_set1_epi8((char)qp_zero(t));
    __m512 dv = _mm512_setzero_ps(), dm = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int jb = (int)(b % per);
        const uint8_t *head = pp + b / per * unit, *q = head + hb + jb * qb;
        __m512i W[8];
        qp_weights(bits, q, 0, W);
        for (int g = 0; g < 8; g++) _mm512_storeu_si512(p->q + b * 8 * PW * 4 + g * PW * 4, _mm512_sub_epi8(W[g], zv));
        __m512 lo, hi, mo;
        qp_block_scales(t, head, jb, 0, &dv, &dm, &lo, &hi, &mo);
        _mm512_storeu_ps(p->lo + b * PW, lo);
        _mm512_storeu_ps(p->hi + b * PW, hi);
        _mm512_storeu_ps(p->mo + b * PW, mo);
    }
}
#endif

/* A packed weight's part of a call (as run_part for the file's blocks): xs, x's block
 * sums [m][nb][2] (elements 0-15, 16-31). */
static void run_packed(const uint8_t *w, int32_t t, int64_t n, float *y, int64_t ldy,
                       const xblock *xq, const int32_t *xs, int32_t m, int64_t k, const scratch *s) {
    const int64_t nb = k / QK, pb = qp_panel_bytes(t, k), panels = (n + QP_W - 1) / QP_W;
    (void)s;
    for (int32_t r0 = 0; r0 < m; r0 += XCHUNK) {
        const int32_t rows = m - r0 < XCHUNK ? m - r0 : XCHUNK;
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            const int64_t j = pi * QP_W;
            const int cols = n - j < QP_W ? (int)(n - j) : QP_W;
            const uint8_t *pp = w + pi * pb;
            int32_t r = 0;
#ifdef QL_AMX
            if (amx_state == 1 && rows >= qp_amx_rows(t) && s) {
                qp_panel_build(t, pp, nb, &s->p);
                r = rows / 16 * 16;
                amx_rows(panel_kind(t), &s->p, xq + (int64_t)r0 * nb, nb, r, y + (int64_t)r0 * ldy + j, ldy, cols);
            }
#endif
            if (r < rows)
                qp_rows(t, pp, xq + (int64_t)(r0 + r) * nb, xs + (int64_t)(r0 + r) * nb * 2, nb, rows - r,
                        y + (int64_t)(r0 + r) * ldy + j, ldy, cols);
        }
    }
}
#endif /* QL_AVX2 */

/* One weight matrix's part of a call: n rows of w (GGML type qtype) into columns of y
 * (ldy apart), for the m rows of x already quantized (xq; xu: the same bytes + 128, for
 * four rows and more). Called inside the parallel region by every thread (its loops are
 * the region's worksharing). s: this thread's scratch, NULL where it could not be had
 * (the caller reports the failure; the loops still run so every thread meets every
 * barrier). */
static void run_part(const uint8_t *w, int32_t qtype, int64_t n, float *y, int64_t ldy,
                     const xblock *xq, const uint8_t *xu, int32_t m, int64_t k, const scratch *s) {
    int64_t nb = k / QK, row_bytes = k / block_elems(qtype) * block_bytes(qtype);
#ifdef QL_AVX2
    if (m < 4) { /* decode: each row of x against four weight rows at a time */
        int64_t tiles = (n + 3) / 4;
#pragma omp for schedule(static)
        for (int64_t tt = 0; tt < tiles; tt++) {
            int64_t j = tt * 4;
            int cols = n - j < 4 ? (int)(n - j) : 4;
            const uint8_t *wr = w + j * row_bytes;
            if ((j + cols) * row_bytes + PF_BYTES <= n * row_bytes)
                for (int64_t o = 0; o < cols * row_bytes; o += 64)
                    _mm_prefetch((const char *)(wr + PF_BYTES + o), _MM_HINT_T0);
            const uint8_t *rows[4];
            for (int c = 0; c < 4; c++) rows[c] = wr + (c < cols ? c : 0) * row_bytes;
            for (int32_t r = 0; r < m; r++)
                decode_rows(qtype, rows, xq + (int64_t)r * nb, nb, y + (int64_t)r * ldy + j, cols);
        }
        return;
    }
    const int kind = panel_kind(qtype);
    const uint8_t *xb = kind == 3 ? (const uint8_t *)xq[0].q : xu;
    const int64_t xstride = kind == 3 ? (int64_t)sizeof(xblock) : QK;
    int64_t panels = (n + PW - 1) / PW;
    for (int32_t r0 = 0; r0 < m; r0 += XCHUNK) {
        int32_t rows = m - r0 < XCHUNK ? m - r0 : XCHUNK;
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            if (!s) continue;
            int64_t j = pi * PW;
            int cols = n - j < PW ? (int)(n - j) : PW;
            panel_build(qtype, w + j * row_bytes, row_bytes, cols, nb, s->rq, &s->p, kind != 3);
            panel_rows(kind, &s->p, xb + (int64_t)r0 * nb * xstride, xstride, xq + (int64_t)r0 * nb,
                       nb, rows, y + (int64_t)r0 * ldy + j, ldy, cols);
        }
    }
#else
    (void)xu;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        if (!s) continue;
        unpack_row_c(qtype, w + j * row_bytes, nb, &s->u);
        for (int32_t r = 0; r < m; r++)
            y[(int64_t)r * ldy + j] = ref_dot(qtype, &s->u, xq + (int64_t)r * nb, nb);
    }
#endif
}

/* A weight stored in parts of different types, one after the other in the output's
 * columns (a fused q/k/v whose v the file stores in another type than q and k):
 * q_linear's qtype QL_PARTS and w pointing at this. */
enum { QL_PARTS = -1, QL_MAX_PARTS = 4 };
typedef struct {
    int32_t n;
    int32_t qtype[QL_MAX_PARTS];
    int64_t rows[QL_MAX_PARTS];
    const uint8_t *w[QL_MAX_PARTS];
} q_parts;

/* Returns 0, -1 when scratch memory cannot be allocated, -2 for a type or shape this
 * kernel does not take. qtype QL_PARTS: w is a q_parts whose rows add up to n. */
int q_linear(const float *x, const uint8_t *w, float *y, int32_t qtype, int32_t m, int64_t n,
             int64_t k, int32_t threads) {
    if (threads < 1) threads = 1;
    q_parts one = {1, {qtype}, {n}, {w}};
    const q_parts *parts = qtype == QL_PARTS ? (const q_parts *)(const void *)w : &one;
    if (parts->n < 1 || parts->n > QL_MAX_PARTS || m < 0 || k % QK) return -2;
    int64_t total = 0;
    int packed = 0, plain = 0, tiled = 0; /* tiled: a packed part takes AMX's tiles */
    for (int i = 0; i < parts->n; i++) {
        int32_t t = parts->qtype[i] & ~QP_FLAG;
        if (!block_bytes(t) || k % block_elems(t) || parts->rows[i] < 0) return -2;
        if (parts->qtype[i] & QP_FLAG) {
            if (!q_packed_bytes(t, parts->rows[i], k)) return -2;
            packed = 1;
            tiled = tiled || m >= qp_amx_rows(t);
        } else {
            plain = 1;
        }
        total += parts->rows[i];
    }
    if (total != n) return -2;
    if (m == 0 || n == 0) return 0;
    int64_t nb = k / QK;
    int failed = 0;
#ifdef QL_AMX
    if ((m >= 16 && plain) || tiled) amx_usable(); /* asked once, before the threads */
#endif
    xblock *xq = malloc(sizeof(xblock) * (size_t)(nb * m));
    /* x's bytes plus 128 (unsigned) for the panels; NULL below four rows */
    uint8_t *xu = NULL;
    /* packed weights: x's block sums, elements 0-15 and 16-31 */
    int32_t *xs = packed ? malloc(sizeof(int32_t) * 2 * (size_t)(nb * m)) : NULL;
#ifdef QL_AVX2
    if (m >= 4 && plain) xu = malloc((size_t)(m * nb * QK));
    if ((m >= 4 && plain && !xu) || (packed && !xs)) {
        free(xq), free(xu), free(xs);
        return -1;
    }
#endif
    if (!xq) {
        free(xu), free(xs);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int32_t r = 0; r < m; r++) {
            quantize_row(x + (int64_t)r * k, nb, xq + (int64_t)r * nb);
            if (xs)
                for (int64_t b = 0; b < nb; b++) {
                    const int8_t *q = xq[(int64_t)r * nb + b].q;
                    int32_t lo = 0, hi = 0;
                    for (int i = 0; i < 16; i++) lo += q[i], hi += q[i + 16];
                    xs[((int64_t)r * nb + b) * 2] = lo, xs[((int64_t)r * nb + b) * 2 + 1] = hi;
                }
#ifdef QL_AVX2
            if (xu)
                for (int64_t b = 0; b < nb; b++)
                    _mm256_storeu_si256(
                        (__m256i *)(xu + ((int64_t)r * nb + b) * QK),
                        _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)xq[(int64_t)r * nb + b].q),
                                         _mm256_set1_epi8((char)0x80)));
#endif
        }
        /* decode and packed weights stream without scratch (but for AMX's tiles) */
        scratch s, *sp = NULL;
        int need = plain;
#ifdef QL_AVX2
        need = m >= 4 && plain;
#endif
#ifdef QL_AMX
        need = need || (tiled && amx_state == 1);
#endif
        if (need) {
            if (scratch_alloc(&s, nb)) {
                sp = &s;
            } else {
#pragma omp atomic write
                failed = 1;
            }
        }
        int64_t col = 0;
        for (int i = 0; i < parts->n; i++) {
#ifdef QL_AVX2
            if (parts->qtype[i] & QP_FLAG)
                run_packed(parts->w[i], parts->qtype[i] & ~QP_FLAG, parts->rows[i], y + col, n, xq, xs, m, k,
                           sp);
            else
#endif
                run_part(parts->w[i], parts->qtype[i], parts->rows[i], y + col, n, xq, xu, m, k, sp);
            col += parts->rows[i];
        }
        if (need) scratch_free(&s);
    }
    free(xq);
    free(xu);
    free(xs);
    return failed ? -1 : 0;
}

/* THE FUNCTION as the header writes it, output by output, one thread, on every build:
 * what the tests hold every path to. Returns as q_linear. */
int q_linear_reference(const float *x, const uint8_t *w, float *y, int32_t qtype, int32_t m,
                       int64_t n, int64_t k) {
    if (!block_bytes(qtype) || k % block_elems(qtype) || m < 0 || n < 0) return -2;
    int64_t nb = k / QK, row_bytes = k / block_elems(qtype) * block_bytes(qtype);
    xblock *xq = malloc(sizeof(xblock) * (size_t)(nb * (m ? m : 1)));
    unpacked u;
    int ok = unpacked_alloc(&u, nb) && xq;
    for (int32_t r = 0; ok && r < m; r++) quantize_row(x + (int64_t)r * k, nb, xq + (int64_t)r * nb);
    for (int64_t j = 0; ok && j < n; j++) {
        unpack_row_c(qtype, w + j * row_bytes, nb, &u);
        for (int32_t r = 0; r < m; r++) y[(int64_t)r * n + j] = ref_dot(qtype, &u, xq + (int64_t)r * nb, nb);
    }
    unpacked_free(&u);
    free(xq);
    return ok ? 0 : -1;
}

/* w's blocks as fp32, [N, K]: what the kernel multiplies by, for tests to compare with
 * gguf.quants' dequantization exactly. */
int q_dequantize(const uint8_t *w, float *out, int32_t qtype, int64_t n, int64_t k) {
    if (!block_bytes(qtype) || k % block_elems(qtype)) return -2;
    int64_t nb = k / QK, row_bytes = k / block_elems(qtype) * block_bytes(qtype);
    unpacked u;
    int rc = unpacked_alloc(&u, nb) ? 0 : -1;
    for (int64_t j = 0; j < n && rc == 0; j++) {
        unpack_row(qtype, w + j * row_bytes, nb, &u);
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < QK; i++) /* dw * wq is exact: one rounding with the offset */
                out[j * k + b * QK + i] =
                    fmaf(i < 16 ? u.lo[b] : u.hi[b], (float)u.q[b * QK + i], u.mo[b]);
    }
    unpacked_free(&u);
    return rc;
}
