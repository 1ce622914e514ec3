/* y = x @ w^T for one or two rows of x (decode at batch 1-2), fp32.
 *
 * At one or two rows a linear layer is one pass over its weights: its time is how fast
 * they stream from memory. torch's paths (oneDNN, MKL) reach about 17 GB/s on the 2-core
 * machine this was written on. Here the weight is stored once more with eight output rows
 * interleaved, w8 [N/8, K, 8], so each thread reads one sequential stream and every load
 * is eight outputs' weights for one input: an FMA against a broadcast input, with no
 * horizontal sums (about 32 GB/s there, the memory's ceiling).
 *
 *   x [M, K] contiguous, w8 [N/8, K, 8] contiguous, y [M, N] contiguous; N % 8 == 0.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

void small_linear(const float *x, const float *w8, float *y, int32_t m, int64_t n, int64_t k,
                  int32_t threads) {
    if (threads < 1) threads = 1;
    int64_t blocks = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const float *wb = w8 + b * k * 8;
        for (int32_t r = 0; r < m; r++) {
            const float *xr = x + r * k;
#if defined(__AVX2__) && defined(__FMA__)
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t i = 0;
            for (; i + 4 <= k; i += 4) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wb + (i + 0) * 8), _mm256_broadcast_ss(xr + i + 0), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wb + (i + 1) * 8), _mm256_broadcast_ss(xr + i + 1), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wb + (i + 2) * 8), _mm256_broadcast_ss(xr + i + 2), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wb + (i + 3) * 8), _mm256_broadcast_ss(xr + i + 3), a3);
            }
            for (; i < k; i++)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wb + i * 8), _mm256_broadcast_ss(xr + i), a0);
            _mm256_storeu_ps(y + r * n + b * 8, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
            float a[8] = {0};
            for (int64_t i = 0; i < k; i++)
                for (int j = 0; j < 8; j++) a[j] += wb[i * 8 + j] * xr[i];
            for (int j = 0; j < 8; j++) y[r * n + b * 8 + j] = a[j];
#endif
        }
    }
}
