/* The kernels of one (sequence, kv head) pair for one element type of the cache,
 * included by paged_attention.c once per type it stores: KV_T the element, KV_LOAD8(p)
 * eight of them as an __m256 of fp32, KV_GET(e) one as a float (both exact), PAIR64 and
 * PAIR the functions' names. See paged_attention.c for the layout and the function. */
#ifdef FO_AVX2

/* head_dim 64: eight keys' dot products per query at a time, one horizontal reduction
 * for all eight; the weighted sum of values keeps the 64 outputs in registers. Keys
 * first .. len - 1 (first > 0 under a sliding window); scores[p - first] is key p's. */
static void PAIR64(const float *restrict q, const KV_T *restrict kbase,
                       const KV_T *restrict vbase, const int32_t *restrict table, int32_t first,
                       int32_t len, int32_t bs, int32_t g, float scale, float softcap,
                       float *restrict scores, float *restrict out) {
    enum { HD = 64 };
    int32_t nb = (len + bs - 1) / bs, b0 = first / bs, nk = len - first;
    __m256 vscale = _mm256_set1_ps(scale);
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs;
        const KV_T *kb = kbase + (int64_t)table[b] * bs * HD;
        if (b + 1 < nb) prefetch_block(kbase + (int64_t)table[b + 1] * bs * HD, sizeof(KV_T) * bs * HD);
        else prefetch_block(vbase + (int64_t)table[b0] * bs * HD, sizeof(KV_T) * bs * HD);
        int32_t t = b == b0 ? first - b * bs : 0;
        float *sb = scores + (int64_t)b * bs - first; /* key b * bs + t scores at sb[t] */
        for (; t + 8 <= n; t += 8) {
            const KV_T *k = kb + (int64_t)t * HD;
            for (int32_t j = 0; j < g; j++) {
                const float *qj = q + (int64_t)j * HD;
                __m256 a[8];
                for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
                for (int d = 0; d < HD; d += 8) {
                    __m256 qv = _mm256_loadu_ps(qj + d);
                    for (int r = 0; r < 8; r++)
                        a[r] = _mm256_fmadd_ps(qv, KV_LOAD8(k + r * HD + d), a[r]);
                }
                __m256 sums = fo_tree8x8(a);
                _mm256_storeu_ps(sb + (int64_t)j * nk + t, _mm256_mul_ps(sums, vscale));
            }
        }
        for (; t < n; t++) {
            const KV_T *k = kb + (int64_t)t * HD;
            for (int32_t j = 0; j < g; j++) {
                const float *qj = q + (int64_t)j * HD;
                __m256 a = _mm256_setzero_ps();
                for (int d = 0; d < HD; d += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d), KV_LOAD8(k + d), a);
                sb[(int64_t)j * nk + t] = fo_tree8_v(a) * scale;
            }
        }
    }
    softmax_rows(scores, g, nk, softcap);
    for (int32_t j = 0; j < g; j++) {
        const float *sc = scores + (int64_t)j * nk;
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
        for (int32_t b = b0; b < nb; b++) {
            int32_t n = len - b * bs < bs ? len - b * bs : bs;
            const KV_T *vb = vbase + (int64_t)table[b] * bs * HD;
            if (j == 0 && b + 1 < nb) prefetch_block(vbase + (int64_t)table[b + 1] * bs * HD, sizeof(KV_T) * bs * HD);
            for (int32_t t = b == b0 ? first - b * bs : 0; t < n; t++) {
                __m256 w = _mm256_broadcast_ss(sc + b * bs + t - first);
                const KV_T *v = vb + (int64_t)t * HD;
                for (int r = 0; r < 8; r++)
                    a[r] = _mm256_fmadd_ps(w, KV_LOAD8(v + r * 8), a[r]);
            }
        }
        for (int r = 0; r < 8; r++) _mm256_storeu_ps(out + (int64_t)j * HD + r * 8, a[r]);
    }
}
#endif

/* Any head_dim that is a multiple of 8: the same function in portable C. */
static void PAIR(const float *restrict q, const KV_T *restrict kbase,
                     const KV_T *restrict vbase, const int32_t *restrict table, int32_t first,
                     int32_t len, int32_t bs, int32_t g, int32_t hd, float scale, float softcap,
                     float *restrict scores, float *restrict out) {
    int32_t nb = (len + bs - 1) / bs, b0 = first / bs, nk = len - first;
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs;
        const KV_T *kb = kbase + (int64_t)table[b] * bs * hd;
        for (int32_t t = b == b0 ? first - b * bs : 0; t < n; t++) {
            const KV_T *k = kb + (int64_t)t * hd;
            for (int32_t j = 0; j < g; j++) {
                const float *qj = q + (int64_t)j * hd;
                float l[8] = {0};
                for (int32_t d = 0; d < hd; d++)
                    l[d % 8] = fmaf(qj[d], KV_GET(k[d]), l[d % 8]);
                scores[(int64_t)j * nk + b * bs + t - first] = fo_tree8(l) * scale;
            }
        }
    }
    softmax_rows(scores, g, nk, softcap);
    for (int32_t d = 0; d < g * hd; d++) out[d] = 0.0f;
    for (int32_t b = b0; b < nb; b++) {
        int32_t n = len - b * bs < bs ? len - b * bs : bs;
        const KV_T *vb = vbase + (int64_t)table[b] * bs * hd;
        for (int32_t t = b == b0 ? first - b * bs : 0; t < n; t++) {
            const KV_T *v = vb + (int64_t)t * hd;
            for (int32_t j = 0; j < g; j++) {
                float w = scores[(int64_t)j * nk + b * bs + t - first];
                float *o = out + (int64_t)j * hd;
                for (int32_t d = 0; d < hd; d++) o[d] = fmaf(w, KV_GET(v[d]), o[d]);
            }
        }
    }
}

