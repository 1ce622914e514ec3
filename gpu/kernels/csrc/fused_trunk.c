/* A step's decoder layers in one call, for quantized weights on the CPU.
 *
 * A decode step of a 135M model is about 20 small torch ops and 5 kernel calls a layer,
 * 30 layers: at batch 1 its matmuls take ~4-6 ms and the dispatch around them (op
 * overhead, ctypes, Python) about as much again. This function runs the same layer
 * (gpu/model/decoder.py, Llama._layer) for every layer with no Python between ops:
 *
 *   h = rms_norm(x) * attn_norm;  qkv = h @ Wqkv^T          (q_linear, quant_linear.c;
 *                                 OLMo 2 has no attn_norm: h = x)
 *   qkv += bqkv                   (Qwen2's biases, when the layer has them)
 *   q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm per head  (Qwen3, Gemma 3; over
 *                                 the whole projection for OLMo 2: qk_whole)
 *   q, k = rope(q), rope(k)       (x * cos + roll(x, hd / 2) * sin, sin sign-folded; the
 *                                  layer's own tables: Gemma 3's local layers have theirs)
 *   K/V cache rows `slots` <- k, v;  o = paged attention   (paged_attention.c: the
 *                                  layer's sliding window, the scores' soft cap)
 *   y = o @ Wo^T;  y = rms_norm(y) * post_attn_norm (Gemma 2/3);  x += r * y
 *                                 (r: the layer's residual scale, Granite's; else 1)
 *   h = rms_norm(x) * ffn_norm;   g, u = h @ Wgu^T
 *   y = (act(g) * u) @ Wdown^T    (act: SiLU, or GELU's tanh form for Gemma)
 *   y = rms_norm(y) * post_ffn_norm (Gemma 2/3);  x += r * y
 *
 * Every row is one query: a decoding sequence's new token, or one token of a short
 * prompt chunk. Each row has its own block table and key count (a prompt token's is
 * its position + 1), and every row's K/V is written before any row attends, so a chunk
 * attends causally to itself and to its cached prefix. The same kernels compute the
 * matmuls and the attention as the torch path calls; only the norms, RoPE and the gated
 * activation are written here, in fp32, in another summation order than torch's (about
 * 1e-6 relative before the int8 rounding of the next matmul's input). Every row is one
 * function of its own token, position and cache rows, on every build: the sums and the
 * exponential follow fixed_order.h, and q_linear and the attention are row-invariant
 * themselves (docs/determinism.md).
 *
 *   x [M, hidden] fp32 in/out (the embedded tokens in, the last layer's output out)
 *   pos [M] int64 positions
 *   slots [M] int64 cache row of each new token; tables [M, maxnb], lens [M] int32
 *   layers[n_layers]: weights (GGUF blocks, GGML type codes), the layer's K/V cache
 *   [KV, rows, HD] of kv_kind's element (fp32, fp16, q8_0 or q4_0: each row HD / 32
 *   blocks of 34 or 18 bytes, paged_attention.c), its RoPE tables cos/sin [ctx, hd]
 *   (gpu/model/decoder.py) and its window
 *   act: 0 SiLU, 1 GELU (tanh form); softcap: the attention scores' cap (0: none)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fixed_order.h"

int q_linear(const float *x, const uint8_t *w, float *y, int32_t qtype, int32_t m, int64_t n,
             int64_t k, int32_t threads);
int paged_attention(const float *q, int64_t q_stride, const void *kc, const void *vc,
                    int32_t kv_kind, const int32_t *tables, const int32_t *lens, float *out,
                    int32_t d, int32_t h, int32_t kv, int32_t hd, int64_t rows, int32_t bs,
                    int32_t maxnb, float scale, int32_t window, float softcap, int32_t threads);
int kv_store_rows(const float *x, uint8_t *out, int32_t kind, int64_t rows, int32_t hd);

typedef struct {
    const float *attn_norm, *ffn_norm;
    const uint8_t *wqkv, *wo, *wgu, *wdown;
    int32_t t_qkv, t_o, t_gu, t_down;
    void *kc, *vc; /* the layer's cache: fp32, fp16, q8_0 or q4_0 (trunk_layers' kv_kind) */
    const float *bqkv, *q_norm, *k_norm;     /* NULL where the architecture has none */
    const float *post_attn_norm, *post_ffn_norm; /* NULL but for Gemma 2/3 */
    const float *cos, *sin;                  /* the layer's RoPE tables [ctx, hd]; NULL: none */
    int32_t window;                          /* sliding window in keys; 0: none */
    float residual_scale;                    /* y times this before x += y (Granite; 1) */
    int32_t qk_whole;                        /* q/k norms over the whole projection (OLMo 2) */
} trunk_layer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* out = x / sqrt(mean(x^2) + eps) * w per row; also the model's final norm
 * (gpu/model/decoder.py, Llama.final_norm), so a token's hidden state is one function too. */
void rms_norm_rows(const float *x, const float *w, float *out, int32_t m, int32_t n, float eps) {
    for (int32_t r = 0; r < m; r++) {
        const float *xr = x + (int64_t)r * n;
        float *o = out + (int64_t)r * n;
        float inv = 1.0f / sqrtf(fo_sumsq(xr, n) / (float)n + eps);
        for (int32_t i = 0; i < n; i++) o[i] = xr[i] * inv * w[i];
    }
}

/* x = cap * tanh(x / cap), n values in place: the final logits' soft cap (Gemma 2),
 * the same function the attention applies to its scores. */
void softcap_rows(float *x, int64_t n, float cap) { fo_softcap(x, n, cap); }

/* RoPE in place on `heads` heads of hd at v (rotate-half with the folded sign). */
static void rope(float *v, int32_t heads, int32_t hd, const float *cos, const float *sin) {
    float tmp[512];
    int32_t half = hd / 2;
    for (int32_t hh = 0; hh < heads; hh++) {
        float *p = v + (int64_t)hh * hd;
        memcpy(tmp, p, sizeof(float) * (size_t)hd);
        for (int32_t i = 0; i < hd; i++) p[i] = tmp[i] * cos[i] + tmp[(i + half) % hd] * sin[i];
    }
}

enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2, KV_Q4 = 3 }; /* paged_attention.c's kv_kind */

/* One row of n fp32 values into the cache as its row `row`: fp32 copied; fp16 rounded to
 * nearest even (F16C where built); q8_0 and q4_0 rotated and quantized once, here, by
 * their one portable writer (kv_store_rows, paged_attention.c), so every build writes the
 * same bytes. */
static void to_cache(void *cache, int64_t row, const float *src, int32_t n, int32_t kind) {
    if (kind == KV_F32) {
        memcpy((float *)cache + row * n, src, sizeof(float) * (size_t)n);
        return;
    }
    if (kind == KV_Q8 || kind == KV_Q4) {
        kv_store_rows(src, (uint8_t *)cache + row * (n / 32 * (kind == KV_Q8 ? 34 : 18)), kind, 1, n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + row * n;
    int32_t i = 0;
#ifdef FO_AVX2
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), 0));
#endif
    for (; i < n; i++) dst[i] = fo_float_to_half(src[i]);
}

/* Returns 0; -1 when scratch memory cannot be had; -2 for a shape it does not take (a
 * q8_0 or q4_0 cache's head_dim not a multiple of 32 among them). */
int trunk_layers(float *x, int32_t m, const int64_t *pos, const trunk_layer *layers,
                 int32_t n_layers, int32_t hidden, int32_t inter, int32_t h, int32_t kv,
                 int32_t hd, float eps, const int64_t *slots, const int32_t *tables,
                 const int32_t *lens, int32_t maxnb, int64_t rows, int32_t bs, int32_t kv_kind,
                 float scale, int32_t act, float softcap, int32_t threads) {
    if (hd > 512 || hd % 2 || m < 1 || (act != ACT_SILU && act != ACT_GELU_TANH)) return -2;
    if (kv_kind < KV_F32 || kv_kind > KV_Q4 || (kv_kind >= KV_Q8 && hd % 32)) return -2;
    int64_t qkv_w = (int64_t)(h + 2 * kv) * hd, q_w = (int64_t)h * hd;
    float *hbuf = malloc(sizeof(float) * (size_t)m * (size_t)hidden);
    float *qkv = malloc(sizeof(float) * (size_t)m * (size_t)qkv_w);
    float *att = malloc(sizeof(float) * (size_t)m * (size_t)q_w);
    float *gu = malloc(sizeof(float) * (size_t)m * (size_t)(2 * inter));
    float *gated = malloc(sizeof(float) * (size_t)m * (size_t)inter);
    float *y = malloc(sizeof(float) * (size_t)m * (size_t)hidden);
    int rc = 0;
    if (!hbuf || !qkv || !att || !gu || !gated || !y) rc = -1;
    for (int32_t l = 0; l < n_layers && rc == 0; l++) {
        const trunk_layer *L = layers + l;
        /* no norm before attention (OLMo 2): the projection reads the rows as they are */
        if (L->attn_norm) rms_norm_rows(x, L->attn_norm, hbuf, m, hidden, eps);
        else memcpy(hbuf, x, sizeof(float) * (size_t)m * (size_t)hidden);
        if ((rc = q_linear(hbuf, L->wqkv, qkv, L->t_qkv, m, qkv_w, hidden, threads))) break;
        for (int32_t r = 0; r < m; r++) {
            float *row = qkv + (int64_t)r * qkv_w;
            if (L->bqkv)
                for (int64_t i = 0; i < qkv_w; i++) row[i] += L->bqkv[i];
            if (L->q_norm && L->k_norm && L->qk_whole) { /* one norm over all of q, of k */
                rms_norm_rows(row, L->q_norm, row, 1, q_w, eps);
                rms_norm_rows(row + q_w, L->k_norm, row + q_w, 1, (int64_t)kv * hd, eps);
            } else if (L->q_norm && L->k_norm) {
                rms_norm_rows(row, L->q_norm, row, h, hd, eps);
                rms_norm_rows(row + q_w, L->k_norm, row + q_w, kv, hd, eps);
            }
            if (L->cos) /* NULL: the layer rotates nothing (SmolLM3's every fourth) */
                rope(row, h + kv, hd, L->cos + pos[r] * hd, L->sin + pos[r] * hd);
            for (int32_t j = 0; j < kv; j++) {
                int64_t at = (int64_t)j * rows + slots[r]; /* the cache row */
                to_cache(L->kc, at, row + q_w + (int64_t)j * hd, hd, kv_kind);
                to_cache(L->vc, at, row + q_w + (int64_t)(kv + j) * hd, hd, kv_kind);
            }
        }
        rc = paged_attention(qkv, qkv_w, L->kc, L->vc, kv_kind, tables, lens, att, m, h, kv, hd,
                             rows, bs, maxnb, scale, L->window, softcap, threads);
        if (rc) break;
        if ((rc = q_linear(att, L->wo, y, L->t_o, m, hidden, q_w, threads))) break;
        if (L->post_attn_norm) rms_norm_rows(y, L->post_attn_norm, y, m, hidden, eps);
        /* y * 1 is y: the same bits where there is no multiplier (no fused multiply-add:
           -ffp-contract=off, so each product is rounded as the torch path's) */
        for (int64_t i = 0; i < (int64_t)m * hidden; i++) x[i] += L->residual_scale * y[i];
        if (L->ffn_norm) rms_norm_rows(x, L->ffn_norm, hbuf, m, hidden, eps);
        else memcpy(hbuf, x, sizeof(float) * (size_t)m * (size_t)hidden);
        if ((rc = q_linear(hbuf, L->wgu, gu, L->t_gu, m, 2 * inter, hidden, threads))) break;
        for (int32_t r = 0; r < m; r++) {
            const float *g = gu + (int64_t)r * 2 * inter;
            float *a = gated + (int64_t)r * inter;
            if (act == ACT_GELU_TANH) fo_geglu(g, g + inter, a, inter);
            else fo_swiglu(g, g + inter, a, inter);
        }
        if ((rc = q_linear(gated, L->wdown, y, L->t_down, m, hidden, inter, threads))) break;
        if (L->post_ffn_norm) rms_norm_rows(y, L->post_ffn_norm, y, m, hidden, eps);
        for (int64_t i = 0; i < (int64_t)m * hidden; i++) x[i] += L->residual_scale * y[i];
    }
    free(hbuf);
    free(qkv);
    free(att);
    free(gu);
    free(gated);
    free(y);
    return rc;
}
