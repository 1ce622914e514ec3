/* Grammar masks on logits, in place: the rows of constrained samples keep only the tokens
 * their grammar allows (gpu/runtime/grammar.py). `mask` holds llguidance's packed bitmask, one row
 * of `words` int32 per constrained row, token t at bit t % 32 of word t / 32. A word of
 * all ones (the common case inside a JSON string) is skipped, so a row costs a pass over
 * its 6 KiB of mask plus the writes of the tokens it bans.
 * alive[r] is 1 when row r still has an allowed logit that is not -inf afterwards (0: the
 * caller falls back). The library is built with -ffast-math, which assumes no infinities
 * in arithmetic, so -inf is written and recognised by its bit pattern only.
 */
#include <stdint.h>
#include <string.h>

#define NEG_INF_BITS 0xFF800000u

void apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *mask,
                         const int64_t *rows, int32_t nrows, int32_t words, int32_t vocab,
                         int32_t *alive)
{
    #pragma omp parallel for schedule(static) if (nrows > 4)
    for (int32_t r = 0; r < nrows; r++) {
        uint32_t *x = (uint32_t *)(logits + rows[r] * row_stride);
        const uint32_t *m = (const uint32_t *)(mask + (int64_t)r * words);
        int any = 0;
        for (int32_t w = 0; w < words; w++) {
            int32_t base = w * 32;
            int32_t n = vocab - base < 32 ? vocab - base : 32;
            if (n <= 0)
                break;
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu && n == 32) {
                if (!any)
                    for (int32_t b = 0; b < 32; b++)
                        any |= x[base + b] != NEG_INF_BITS;
                continue;
            }
            for (int32_t b = 0; b < n; b++) {
                if (bits >> b & 1u)
                    any |= x[base + b] != NEG_INF_BITS;
                else
                    x[base + b] = NEG_INF_BITS;
            }
        }
        alive[r] = any;
    }
}
