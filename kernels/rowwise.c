/* Per-row sums and affine maps over the contiguous rows of a float32 or float64 array:
 * the passes of the sharded group norm (domainpar/ops/rowwise.py).
 *
 * A group norm block viewed as rows (one per sample and group for the moments,
 * one per sample and channel for the affine map) is read by torch's elementwise
 * ops four to six times a pass; these loops read each row once or twice and
 * write nothing but the result:
 *
 *   dp_row_moments_T  mean and M2 = sum (x - mean)^2 of each row: two reads (the
 *                     mean, then the squared deviations; never sum x^2 - n mean^2);
 *   dp_row_dots_T     sum g and sum g * x of each row pair: one read of each;
 *   dp_row_affine_T   out = x * a + c (+ g * b) with one (a, c, b) per row: one pass.
 *
 * Sums go in blocks of DP_BLOCK elements over eight independent partial sums of
 * the element type (the compiler keeps them in vector registers), and the blocks'
 * sums are added in double: the error of a row of 2^21 float32 values is ~1e-9 of
 * the sum of magnitudes, below torch's cascaded float32 sum. Results are double.
 * One thread: the caller uses these where torch runs on one thread too.
 */
#include <stdint.h>

#define DP_BLOCK 128

/* The sum of f(i) over one block [b, e), eight partial sums of type T, in double. */
#define DP_BLOCK_SUM(T, EXPR, b, e, out)                                            \
    do {                                                                           \
        T s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;          \
        int64_t i = (b);                                                           \
        for (; i + 8 <= (e); i += 8) {                                             \
            { int64_t j = i;     s0 += (EXPR); }                                   \
            { int64_t j = i + 1; s1 += (EXPR); }                                   \
            { int64_t j = i + 2; s2 += (EXPR); }                                   \
            { int64_t j = i + 3; s3 += (EXPR); }                                   \
            { int64_t j = i + 4; s4 += (EXPR); }                                   \
            { int64_t j = i + 5; s5 += (EXPR); }                                   \
            { int64_t j = i + 6; s6 += (EXPR); }                                   \
            { int64_t j = i + 7; s7 += (EXPR); }                                   \
        }                                                                          \
        for (; i < (e); ++i) { int64_t j = i; s0 += (EXPR); }                      \
        (out) = (double)(((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)));       \
    } while (0)

#define DP_ROWS(T, S)                                                              \
    static double sum_##S(const T *x, int64_t n) {                                 \
        double total = 0.0, part;                                                  \
        for (int64_t b = 0; b < n; b += DP_BLOCK) {                                \
            int64_t e = b + DP_BLOCK < n ? b + DP_BLOCK : n;                       \
            DP_BLOCK_SUM(T, x[j], b, e, part);                                     \
            total += part;                                                         \
        }                                                                          \
        return total;                                                              \
    }                                                                              \
    static double squares_##S(const T *x, int64_t n, T m) {                        \
        double total = 0.0, part;                                                  \
        for (int64_t b = 0; b < n; b += DP_BLOCK) {                                \
            int64_t e = b + DP_BLOCK < n ? b + DP_BLOCK : n;                       \
            DP_BLOCK_SUM(T, (x[j] - m) * (x[j] - m), b, e, part);                  \
            total += part;                                                         \
        }                                                                          \
        return total;                                                              \
    }                                                                              \
    /* Deviations are taken from the mean rounded to T; M2 is corrected to the    \
     * double mean exactly: sum (x - m)^2 = sum (x - mt)^2 - n (m - mt)^2. */      \
    void dp_row_moments_##S(const T *x, int64_t rows, int64_t n, double *mean,     \
                            double *m2) {                                          \
        for (int64_t r = 0; r < rows; ++r) {                                       \
            const T *p = x + r * n;                                                \
            double m = n ? sum_##S(p, n) / (double)n : 0.0;                        \
            T mt = (T)m;                                                           \
            double shift = m - (double)mt;                                         \
            mean[r] = m;                                                           \
            m2[r] = squares_##S(p, n, mt) - (double)n * shift * shift;             \
        }                                                                          \
    }                                                                              \
    void dp_row_dots_##S(const T *g, const T *x, int64_t rows, int64_t n,          \
                         double *sum_g, double *sum_gx) {                          \
        for (int64_t r = 0; r < rows; ++r) {                                       \
            const T *a = g + r * n, *b = x + r * n;                                \
            double tg = 0.0, tgx = 0.0, part;                                      \
            for (int64_t k = 0; k < n; k += DP_BLOCK) {                            \
                int64_t e = k + DP_BLOCK < n ? k + DP_BLOCK : n;                   \
                DP_BLOCK_SUM(T, a[j], k, e, part);                                 \
                tg += part;                                                        \
                DP_BLOCK_SUM(T, a[j] * b[j], k, e, part);                          \
                tgx += part;                                                       \
            }                                                                      \
            sum_g[r] = tg;                                                         \
            sum_gx[r] = tgx;                                                       \
        }                                                                          \
    }                                                                              \
    /* g and b may be NULL (out = x * a + c). out may be x or g. */                \
    void dp_row_affine_##S(const T *x, const T *g, T *out, int64_t rows,           \
                           int64_t n, const T *a, const T *c, const T *b) {        \
        for (int64_t r = 0; r < rows; ++r) {                                       \
            const T *p = x + r * n;                                                \
            T *o = out + r * n;                                                    \
            const T ar = a[r], cr = c[r];                                          \
            if (g) {                                                               \
                const T *q = g + r * n;                                            \
                const T br = b[r];                                                 \
                for (int64_t i = 0; i < n; ++i) o[i] = (p[i] * ar + cr) + q[i] * br; \
            } else {                                                               \
                for (int64_t i = 0; i < n; ++i) o[i] = p[i] * ar + cr;             \
            }                                                                      \
        }                                                                          \
    }

DP_ROWS(float, f)
DP_ROWS(double, d)
