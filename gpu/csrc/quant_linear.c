/* y = x @ w^T, w kept in its GGUF quantized blocks: decode and prefill alike.
 *
 * At decode row counts a linear layer is one pass over its weights, so its time is the
 * bytes it reads: fp32 is 4 bytes a weight, Q8_0 1.06, Q4_1 0.625. At prefill row counts
 * it is the arithmetic: an int8 dot product of 32 pairs is a few AVX2 instructions, about
 * an fp32 FMA's rate per weight, and the rows go in tiles (ROW_TILE) so the weights
 * stream once a tile. As llama.cpp does
 * (ggml-cpu quants.c, ggml_vec_dot_q4_1_q8_1 / ggml_vec_dot_q8_0_q8_0), each row of x is
 * quantized once per call to blocks of 32 int8 with an fp32 scale (and, for Q4_1's
 * offset term, the block's scaled sum), and every weight block meets it in an int8 dot
 * product (maddubs + madd), accumulated in fp32 per block. The only approximation is
 * x's rounding to int8 (relative error about 2^-8 per block); what the weights
 * dequantize to is exactly what gguf.quants computes:
 *
 *   Q8_0 block, 34 bytes: fp16 d, int8 q[32];            w[i] = d * q[i]
 *   Q4_1 block, 20 bytes: fp16 d, fp16 m, uint8 qs[16];  w[i] = d * nib[i] + m, where
 *                         nib[i] = qs[i] & 15 and nib[i + 16] = qs[i] >> 4 (i < 16)
 *
 *   x [M, K] fp32 contiguous, K % 32 == 0; w [N, K / 32 * block bytes] (GGUF row-major);
 *   y [M, N] fp32 contiguous. x's rows are quantized in parallel, then each tile of
 *   rows runs in parallel over output rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#endif

enum { QK = 32, GGML_Q4_1 = 3, GGML_Q8_0 = 8, MAX_ROWS = 4 };

/* One quantized block of x: scale, scale * sum(q) (Q4_1's m term), 32 int8. */
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
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0) bits = sign;
    else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* llama.cpp's quantize_row_q8_1 with an fp32 scale: d = amax / 127, q = round(x / d)
 * (to nearest even on the AVX2 path, as llama.cpp's; half away from zero in portable C:
 * the two differ only on exact ties). */
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
            int q = (int)roundf(v[i] * id);
            out[b].q[i] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
#endif
    }
}

#ifdef QL_AVX2
static inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Sum of unsigned(a) * signed(b) over 32 bytes, as 8 fp32 partial sums. */
static inline __m256 dot_us8(__m256i a, __m256i b) {
    __m256i p16 = _mm256_maddubs_epi16(a, b);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

/* One weight block against one block of x, added to acc. */
static inline __m256 block_q8_0(const uint8_t *blk, __m256i aw, __m256i qw, const xblock *xb,
                                __m256 acc) {
    __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);
    __m256 p = dot_us8(aw, _mm256_sign_epi8(qx, qw));
    return _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blk) * xb->d), p, acc);
}

/* One output row against MR rows of x; MR is a constant after inlining. Even and odd
 * blocks go to separate accumulators: one chain of FMAs would wait on its latency. */
static inline __attribute__((always_inline)) void row_q8_0(const uint8_t *w, const xblock *xq,
                                                           int64_t nb, int MR, float *acc_out) {
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *blk = w + (b + h) * 34;
            __m256i qw = _mm256_loadu_si256((const __m256i *)(blk + 2));
            __m256i aw = _mm256_sign_epi8(qw, qw); /* |w|: maddubs wants one unsigned side */
            for (int r = 0; r < MR; r++)
                acc[r][h] = block_q8_0(blk, aw, qw, xq + r * nb + b + h, acc[r][h]);
        }
    }
    for (; b < nb; b++) {
        const uint8_t *blk = w + b * 34;
        __m256i qw = _mm256_loadu_si256((const __m256i *)(blk + 2));
        __m256i aw = _mm256_sign_epi8(qw, qw);
        for (int r = 0; r < MR; r++) acc[r][0] = block_q8_0(blk, aw, qw, xq + r * nb + b, acc[r][0]);
    }
    for (int r = 0; r < MR; r++) acc_out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* d and m are adjacent fp16s, x's d and s adjacent fp32s: one conversion and one
 * multiply give [d * dx, m * sx]; lane 1 sums the offset terms in macc. */
static inline __m256 block_q4_1(const uint8_t *blk, __m256i qw, const xblock *xb, __m128 *macc,
                                __m256 acc) {
    uint32_t dm;
    memcpy(&dm, blk, 4);
    __m128 xds = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&xb->d));
    __m128 prod = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)), xds);
    *macc = _mm_add_ps(*macc, prod);
    __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);
    return _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), dot_us8(qw, qx), acc);
}

static inline __m256i nibbles_q4_1(const uint8_t *blk) {
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
    /* low nibbles are elements 0..15, high nibbles 16..31 */
    return _mm256_and_si256(
        _mm256_insertf128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1),
        _mm256_set1_epi8(0x0f));
}

static inline __attribute__((always_inline)) void row_q4_1(const uint8_t *w, const xblock *xq,
                                                           int64_t nb, int MR, float *acc_out) {
    __m256 acc[MAX_ROWS][2];
    __m128 macc[MAX_ROWS];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps(), macc[r] = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *blk = w + (b + h) * 20;
            __m256i qw = nibbles_q4_1(blk);
            for (int r = 0; r < MR; r++)
                acc[r][h] = block_q4_1(blk, qw, xq + r * nb + b + h, &macc[r], acc[r][h]);
        }
    }
    for (; b < nb; b++) {
        const uint8_t *blk = w + b * 20;
        __m256i qw = nibbles_q4_1(blk);
        for (int r = 0; r < MR; r++)
            acc[r][0] = block_q4_1(blk, qw, xq + r * nb + b, &macc[r], acc[r][0]);
    }
    for (int r = 0; r < MR; r++)
        acc_out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) +
                     _mm_cvtss_f32(_mm_shuffle_ps(macc[r], macc[r], 1));
}
#else
static inline void row_q8_0(const uint8_t *w, const xblock *xq, int64_t nb, int MR,
                            float *acc_out) {
    for (int r = 0; r < MR; r++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * 34;
            const int8_t *qw = (const int8_t *)(blk + 2);
            const xblock *xb = xq + r * nb + b;
            int dot = 0;
            for (int i = 0; i < QK; i++) dot += qw[i] * xb->q[i];
            acc += half_to_float(blk) * xb->d * (float)dot;
        }
        acc_out[r] = acc;
    }
}

static inline void row_q4_1(const uint8_t *w, const xblock *xq, int64_t nb, int MR,
                            float *acc_out) {
    for (int r = 0; r < MR; r++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * 20;
            const xblock *xb = xq + r * nb + b;
            int dot = 0;
            for (int i = 0; i < QK / 2; i++)
                dot += (blk[4 + i] & 15) * xb->q[i] + (blk[4 + i] >> 4) * xb->q[i + QK / 2];
            acc += half_to_float(blk) * xb->d * (float)dot + half_to_float(blk + 2) * xb->s;
        }
        acc_out[r] = acc;
    }
}
#endif

/* One output row against mr (<= MAX_ROWS) rows of x, each case specialized so the
 * accumulators stay in registers. */
static inline void row_chunk(int32_t qtype, const uint8_t *wr, const xblock *xq, int64_t nb,
                             int32_t mr, float *a) {
    if (qtype == GGML_Q8_0) {
        switch (mr) {
        case 1: row_q8_0(wr, xq, nb, 1, a); break;
        case 2: row_q8_0(wr, xq, nb, 2, a); break;
        case 3: row_q8_0(wr, xq, nb, 3, a); break;
        default: row_q8_0(wr, xq, nb, 4, a); break;
        }
    } else {
        switch (mr) {
        case 1: row_q4_1(wr, xq, nb, 1, a); break;
        case 2: row_q4_1(wr, xq, nb, 2, a); break;
        case 3: row_q4_1(wr, xq, nb, 3, a); break;
        default: row_q4_1(wr, xq, nb, 4, a); break;
        }
    }
}

/* Dequantize blocks [nrows, nb] to fp32 rows [nrows, nb * 32] (what q_dequantize gives). */
static void dequant_rows(const uint8_t *w, float *out, int32_t qtype, int64_t nrows, int64_t nb) {
    int64_t bs = qtype == GGML_Q8_0 ? 34 : 20;
    for (int64_t b = 0; b < nrows * nb; b++) {
        const uint8_t *blk = w + b * bs;
        float *o = out + b * QK, d = half_to_float(blk);
#ifdef QL_AVX2
        __m256 vd = _mm256_set1_ps(d);
        if (qtype == GGML_Q8_0) {
            for (int i = 0; i < QK; i += 8) {
                __m128i q8 = _mm_loadl_epi64((const __m128i *)(blk + 2 + i));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
            }
        } else {
            __m256 vm = _mm256_set1_ps(half_to_float(blk + 2));
            __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4)), mask = _mm_set1_epi8(0x0f);
            __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int i = 0; i < 4; i++) {
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
                _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(f, vd, vm));
            }
        }
#else
        if (qtype == GGML_Q8_0) {
            for (int i = 0; i < QK; i++) o[i] = d * (float)(int8_t)blk[2 + i];
        } else {
            float mw = half_to_float(blk + 2);
            for (int i = 0; i < QK / 2; i++) {
                o[i] = d * (float)(blk[4 + i] & 15) + mw;
                o[i + QK / 2] = d * (float)(blk[4 + i] >> 4) + mw;
            }
        }
#endif
    }
}

/* Prefill and batched decode: arithmetic, not bytes, is the cost (maddubs + madd run at
 * about an fp32 FMA's rate per weight on AVX2, plus their scale work). So each thread
 * dequantizes PANEL = 16 output rows at a time (32 with AVX-512) and transposes them
 * into an fp32 panel [K][PANEL] (L2-resident), and multiplies rows of x by it the way
 * BLAS kernels do: on AVX2 MR = 6 rows of x against the panel's 16 columns in 12
 * accumulators, per k two panel loads, six broadcasts of x and twelve FMAs, no
 * horizontal sums. K goes in slices of KC so a slice of the panel (KC x PANEL x 4
 * bytes: 16-32 KiB) stays in L1 while every row of x
 * passes it; y accumulates across slices. The weights stream from memory once per call.
 * x is first rounded to the same int8 grid as the decode path's (each value replaced by
 * d * q of its block), so both paths compute one function up to fp32 summation order:
 * a token's logits do not depend on how many rows its step had. */
#if defined(QL_AVX2) && defined(__AVX512F__)
/* With AVX-512 the panel is 32 wide, two registers a k: MR = 12 rows of x each take two
 * FMAs a k (the broadcast of x folds into them), 24 accumulators in registers; per k two
 * panel loads and 12 broadcasts feed 24 FMAs, where a 16-wide panel left the loads the
 * limit. Each y element still sums its k in the same order as the AVX2 kernel. */
#define QL_AVX512 1
enum { PANEL = 32, MR = 12, KC = 128 }; /* a K slice of the panel: 16 KiB */
#else
enum { PANEL = 16, MR = 6, KC = 256 }; /* 16 KiB */
#endif

#ifdef QL_AVX2
/* dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block. */
static inline void transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

/* y[r, 0:16] (+)= x[r, 0:len] @ pt[0:len, 0:16] for r < MR; x rows ldx apart, y rows ldy.
 * Named accumulators: gcc keeps an array of __m256 on the stack. */
#define ROWK(r) const float *x##r = x + r * ldx; __m256 a##r##0, a##r##1;                   \
    if (add) { a##r##0 = _mm256_loadu_ps(y + r * ldy); a##r##1 = _mm256_loadu_ps(y + r * ldy + 8); } \
    else a##r##0 = a##r##1 = _mm256_setzero_ps();
#define STEPK(r) { __m256 b = _mm256_broadcast_ss(x##r + i);                                 \
    a##r##0 = _mm256_fmadd_ps(b, b0, a##r##0); a##r##1 = _mm256_fmadd_ps(b, b1, a##r##1); }
#define STOREK(r) _mm256_storeu_ps(y + r * ldy, a##r##0); _mm256_storeu_ps(y + r * ldy + 8, a##r##1);

#define KERN(name, ROWS, STEPS, STORES)                                                   \
    static void name(const float *x, int64_t ldx, const float *pt, int64_t len, float *y,     \
                     int64_t ldy, int add) {                                                  \
        ROWS                                                                                  \
        for (int64_t i = 0; i < len; i++) {                                                   \
            __m256 b0 = _mm256_load_ps(pt + i * PANEL), b1 = _mm256_load_ps(pt + i * PANEL + 8); \
            STEPS                                                                             \
        }                                                                                     \
        STORES                                                                                \
    }
KERN(kern1, ROWK(0), STEPK(0), STOREK(0))
KERN(kern2, ROWK(0) ROWK(1), STEPK(0) STEPK(1), STOREK(0) STOREK(1))
KERN(kern3, ROWK(0) ROWK(1) ROWK(2), STEPK(0) STEPK(1) STEPK(2), STOREK(0) STOREK(1) STOREK(2))
KERN(kern4, ROWK(0) ROWK(1) ROWK(2) ROWK(3), STEPK(0) STEPK(1) STEPK(2) STEPK(3),
     STOREK(0) STOREK(1) STOREK(2) STOREK(3))
KERN(kern5, ROWK(0) ROWK(1) ROWK(2) ROWK(3) ROWK(4), STEPK(0) STEPK(1) STEPK(2) STEPK(3) STEPK(4),
     STOREK(0) STOREK(1) STOREK(2) STOREK(3) STOREK(4))
KERN(kern6, ROWK(0) ROWK(1) ROWK(2) ROWK(3) ROWK(4) ROWK(5),
     STEPK(0) STEPK(1) STEPK(2) STEPK(3) STEPK(4) STEPK(5),
     STOREK(0) STOREK(1) STOREK(2) STOREK(3) STOREK(4) STOREK(5))

#ifdef QL_AVX512
/* y[r, 0:32] (+)= x[r, 0:len] @ pt[0:len, 0:32] for r < R (a constant after inlining). */
static inline __attribute__((always_inline)) void kern512(const float *x, int64_t ldx,
                                                          const float *pt, int64_t len, float *y,
                                                          int64_t ldy, int add, int R) {
    __m512 a[MR], c[MR];
    for (int r = 0; r < R; r++) {
        a[r] = add ? _mm512_loadu_ps(y + r * ldy) : _mm512_setzero_ps();
        c[r] = add ? _mm512_loadu_ps(y + r * ldy + 16) : _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < len; i++) {
        __m512 b0 = _mm512_load_ps(pt + i * PANEL), b1 = _mm512_load_ps(pt + i * PANEL + 16);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(x[r * ldx + i]);
            a[r] = _mm512_fmadd_ps(xb, b0, a[r]);
            c[r] = _mm512_fmadd_ps(xb, b1, c[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, a[r]);
        _mm512_storeu_ps(y + r * ldy + 16, c[r]);
    }
}
#define K512(n) \
    static void kz##n(const float *x, int64_t ldx, const float *pt, int64_t len, float *y, \
                      int64_t ldy, int add) { kern512(x, ldx, pt, len, y, ldy, add, n); }
K512(1) K512(2) K512(3) K512(4) K512(5) K512(6) K512(7) K512(8) K512(9) K512(10) K512(11) K512(12)
#endif

static void kern_any(const float *x, int64_t ldx, const float *pt, int64_t len, int mr, float *y,
                     int64_t ldy, int add) {
#ifdef QL_AVX512
    static void (*const kerns[MR])(const float *, int64_t, const float *, int64_t, float *,
                                   int64_t, int) = {kz1, kz2, kz3, kz4, kz5, kz6,
                                                    kz7, kz8, kz9, kz10, kz11, kz12};
#else
    static void (*const kerns[MR])(const float *, int64_t, const float *, int64_t, float *,
                                   int64_t, int) = {kern1, kern2, kern3, kern4, kern5, kern6};
#endif
    kerns[mr - 1](x, ldx, pt, len, y, ldy, add);
}
#else
static inline void transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 8; c++) dst[c * ldd + r] = src[r * lds + c];
}

static void kern_any(const float *x, int64_t ldx, const float *pt, int64_t len, int mr,
                     float *y, int64_t ldy, int add) {
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < PANEL; c++) {
            float a = add ? y[r * ldy + c] : 0.0f;
            for (int64_t i = 0; i < len; i++) a += x[r * ldx + i] * pt[i * PANEL + c];
            y[r * ldy + c] = a;
        }
}
#endif

static int panel_linear(const float *x, const uint8_t *w, float *y, int32_t qtype, int32_t m,
                        int64_t n, int64_t k, int32_t threads) {
    int64_t nb = k / QK, row_bytes = nb * (qtype == GGML_Q8_0 ? 34 : 20);
    int64_t tiles = (n + PANEL - 1) / PANEL;
    int failed = 0;
    float *xr = malloc((size_t)(m * k) * sizeof(float)); /* x on the int8 grid */
    if (!xr) return -1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int32_t r = 0; r < m; r++) {
            for (int64_t b = 0; b < nb; b++) {
                xblock q;
                quantize_row(x + (int64_t)r * k + b * QK, 1, &q);
                for (int i = 0; i < QK; i++) xr[(int64_t)r * k + b * QK + i] = q.d * (float)q.q[i];
            }
        }
        /* rows: the tile dequantized [16][K]; panel: transposed [K][16]; edge: y's
         * columns of a last tile narrower than 16, [m][16] */
        float *rows = aligned_alloc(64, (size_t)(PANEL * k) * sizeof(float));
        float *panel = aligned_alloc(64, (size_t)(PANEL * k) * sizeof(float));
        float *edge = n % PANEL ? aligned_alloc(64, (size_t)(((m * PANEL + 15) / 16) * 16) * sizeof(float)) : NULL;
        int ok = rows && panel && (edge || n % PANEL == 0);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!ok) continue;
            int64_t j0 = t * PANEL, cols = n - j0 < PANEL ? n - j0 : PANEL;
            dequant_rows(w + j0 * row_bytes, rows, qtype, cols, nb);
            if (cols < PANEL) memset(rows + cols * k, 0, (size_t)((PANEL - cols) * k) * sizeof(float));
            for (int64_t i = 0; i < k; i += 8)
                for (int g = 0; g < PANEL; g += 8)
                    transpose8(rows + g * k + i, k, panel + i * PANEL + g, PANEL);
            float *out = cols == PANEL ? y + j0 : edge;
            int64_t ldy = cols == PANEL ? n : PANEL;
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                int64_t len = k - k0 < KC ? k - k0 : KC;
                for (int32_t r = 0; r < m; r += MR) {
                    int mr = m - r < MR ? m - r : MR;
                    kern_any(xr + (int64_t)r * k + k0, k, panel + k0 * PANEL, len, mr,
                             out + (int64_t)r * ldy, ldy, k0 > 0);
                }
            }
            if (cols < PANEL)
                for (int32_t r = 0; r < m; r++) memcpy(y + (int64_t)r * n + j0, edge + (int64_t)r * PANEL, (size_t)cols * sizeof(float));
        }
        free(rows);
        free(panel);
        free(edge);
    }
    free(xr);
    return failed ? -1 : 0;
}

/* Rows of x from which the panel path is faster than the int8 one (bench/qlinear.py). */
enum { PANEL_MIN_ROWS = 8 };
/* How far ahead of the row it is reading each thread asks for the weights. The
 * hardware prefetcher follows one matrix streamed alone (30 gate_up projections in a
 * row: ~22 GB/s), but not a decode step, which reads four matrices a layer for ~40-160
 * us each: there all four at one row took 10.5 ms a step without this and 3.0-3.2 ms
 * with it (66 MB, ~21 GB/s; 1-8 KiB ahead measured alike, 2026-12-04). */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

/* Returns 0, -1 when scratch memory cannot be allocated, -2 for a type or shape this
 * kernel does not take. */
int q_linear(const float *x, const uint8_t *w, float *y, int32_t qtype, int32_t m, int64_t n,
             int64_t k, int32_t threads) {
    if (threads < 1) threads = 1;
    if (k % QK || (qtype != GGML_Q8_0 && qtype != GGML_Q4_1)) return -2;
    if (m >= PANEL_MIN_ROWS) return panel_linear(x, w, y, qtype, m, n, k, threads);
    int64_t nb = k / QK, row_bytes = nb * (qtype == GGML_Q8_0 ? 34 : 20);
    xblock *xq = malloc(sizeof(xblock) * (size_t)(nb * (m > 0 ? m : 1)));
    if (!xq) return -1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int32_t r = 0; r < m; r++) quantize_row(x + (int64_t)r * k, nb, xq + r * nb);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *wr = w + j * row_bytes;
#ifdef QL_AVX2
            if ((j + 1) * row_bytes + PF_BYTES <= n * row_bytes)
                for (int64_t o = 0; o < row_bytes; o += 64)
                    _mm_prefetch((const char *)(wr + PF_BYTES + o), _MM_HINT_T0);
#endif
            for (int32_t c = 0; c < m; c += MAX_ROWS) {
                int32_t mr = m - c < MAX_ROWS ? m - c : MAX_ROWS;
                float a[MAX_ROWS];
                row_chunk(qtype, wr, xq + (int64_t)c * nb, nb, mr, a);
                for (int32_t r = 0; r < mr; r++) y[(int64_t)(c + r) * n + j] = a[r];
            }
        }
    }
    free(xq);
    return 0;
}

/* w's blocks as fp32, [N, K]: what the kernel multiplies by, for tests to compare with
 * gguf.quants' dequantization exactly. */
int q_dequantize(const uint8_t *w, float *out, int32_t qtype, int64_t n, int64_t k) {
    if (k % QK || (qtype != GGML_Q8_0 && qtype != GGML_Q4_1)) return -2;
    dequant_rows(w, out, qtype, n, k / QK);
    return 0;
}
