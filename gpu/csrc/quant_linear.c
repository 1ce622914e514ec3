/* y = x @ w^T for a few rows of x (decode), w kept in its GGUF quantized blocks.
 *
 * At decode row counts a linear layer is one pass over its weights, so its time is the
 * bytes it reads: fp32 is 4 bytes a weight, Q8_0 1.06, Q4_1 0.625. As llama.cpp does
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
 *   y [M, N] fp32 contiguous. Parallel over output rows.
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

/* llama.cpp's quantize_row_q8_1 with an fp32 scale: d = amax / 127, q = round(x / d). */
static void quantize_row(const float *x, int64_t nb, xblock *out) {
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + b * QK;
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

#define DISPATCH(fn, MR)                                                                   \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                     \
    for (int64_t j = 0; j < n; j++) {                                                      \
        float a[MAX_ROWS];                                                                 \
        fn(w + j * row_bytes, xq, nb, MR, a);                                              \
        for (int r = 0; r < MR; r++) y[r * n + j] = a[r];                                  \
    }

static void rows_chunk(int32_t qtype, const uint8_t *w, const xblock *xq, float *y, int32_t mr,
                       int64_t n, int64_t nb, int64_t row_bytes, int32_t threads) {
    /* One specialized loop per (type, row count): the accumulators stay in registers. */
    if (qtype == GGML_Q8_0) {
        switch (mr) {
        case 1: DISPATCH(row_q8_0, 1) break;
        case 2: DISPATCH(row_q8_0, 2) break;
        case 3: DISPATCH(row_q8_0, 3) break;
        default: DISPATCH(row_q8_0, 4) break;
        }
    } else {
        switch (mr) {
        case 1: DISPATCH(row_q4_1, 1) break;
        case 2: DISPATCH(row_q4_1, 2) break;
        case 3: DISPATCH(row_q4_1, 3) break;
        default: DISPATCH(row_q4_1, 4) break;
        }
    }
}

/* Returns 0, -1 when the scratch for x's blocks cannot be allocated, -2 for a type or
 * shape this kernel does not take. */
int q_linear(const float *x, const uint8_t *w, float *y, int32_t qtype, int32_t m, int64_t n,
             int64_t k, int32_t threads) {
    if (threads < 1) threads = 1;
    if (k % QK || (qtype != GGML_Q8_0 && qtype != GGML_Q4_1)) return -2;
    int64_t nb = k / QK, row_bytes = nb * (qtype == GGML_Q8_0 ? 34 : 20);
    xblock *xq = malloc(sizeof(xblock) * (size_t)(nb * (m < MAX_ROWS ? m : MAX_ROWS)));
    if (!xq) return -1;
    for (int32_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
        int32_t mr = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
        for (int32_t r = 0; r < mr; r++) quantize_row(x + (r0 + r) * k, nb, xq + r * nb);
        rows_chunk(qtype, w, xq, y + r0 * n, mr, n, nb, row_bytes, threads);
    }
    free(xq);
    return 0;
}

/* w's blocks as fp32, [N, K]: what the kernel multiplies by, for tests to compare with
 * gguf.quants' dequantization exactly. */
int q_dequantize(const uint8_t *w, float *out, int32_t qtype, int64_t n, int64_t k) {
    if (k % QK || (qtype != GGML_Q8_0 && qtype != GGML_Q4_1)) return -2;
    int64_t nb = k / QK, bs = qtype == GGML_Q8_0 ? 34 : 20;
    for (int64_t b = 0; b < n * nb; b++) {
        const uint8_t *blk = w + b * bs;
        float *o = out + b * QK, d = half_to_float(blk);
        if (qtype == GGML_Q8_0) {
            for (int i = 0; i < QK; i++) o[i] = d * (float)(int8_t)blk[2 + i];
        } else {
            float mw = half_to_float(blk + 2);
            for (int i = 0; i < QK / 2; i++) {
                o[i] = d * (float)(blk[4 + i] & 15) + mw;
                o[i + QK / 2] = d * (float)(blk[4 + i] >> 4) + mw;
            }
        }
    }
    return 0;
}
