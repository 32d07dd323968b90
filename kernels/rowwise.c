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
 * and the group norm's arithmetic on the few numbers per (sample, group) between
 * those passes, in double (torch's ops would take a few dozen calls of a few
 * microseconds each on tensors of a few elements):
 *
 *   dp_group_coefs_T      the members' (mean, M2) rows combined into each group's
 *                         statistics (Chan et al.) and each row's a, c of the forward;
 *   dp_group_grad_sums_T  per group, A = sum w g and B = sum w g (x - mean) from
 *                         the rows' dots, before they are summed over the members;
 *   dp_group_grad_coefs_T the rows' a, c, b of the input gradient and the weight
 *                         and bias gradients.
 *
 * Rows (sample, channel) of a group are consecutive: row k * per + j is channel
 * (k % groups) * per + j of sample k / groups, for (sample, group) k.
 *
 * Sums go in blocks of DP_BLOCK elements over eight independent partial sums of
 * the element type (the compiler keeps them in vector registers), and the blocks'
 * sums are added in double: the error of a row of 2^21 float32 values is ~1e-9 of
 * the sum of magnitudes, below torch's cascaded float32 sum. Results are double.
 * One thread: the caller uses these where torch runs on one thread too.
 */
#include <math.h>
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

#define DP_GROUPS(T, S)                                                            \
    /* stats: members x 2 x ng (each member's mean row, then its M2 row); counts:  \
     * cells of one group per member (0: no block, left out). w, b may be NULL.  */\
    void dp_group_coefs_##S(int64_t members, const double *stats,                  \
                            const double *counts, int64_t ng, int64_t groups,      \
                            int64_t per, double eps, const T *w, const T *b,       \
                            double *mean, double *invstd, T *a, T *c) {            \
        double n = 0.0;                                                            \
        int64_t first = -1;                                                        \
        for (int64_t m = 0; m < members; ++m)                                      \
            if (counts[m] > 0) { n += counts[m]; if (first < 0) first = m; }       \
        for (int64_t k = 0; k < ng; ++k) {                                         \
            double mu = 0.0, m2 = 0.0;                                             \
            if (first >= 0) { /* shifts from the first mean: an offset costs no digits */ \
                double ref = stats[2 * first * ng + k], shift = 0.0;               \
                for (int64_t m = 0; m < members; ++m)                              \
                    if (counts[m] > 0)                                             \
                        shift += (stats[2 * m * ng + k] - ref) * (counts[m] / n);  \
                mu = ref + shift;                                                  \
                for (int64_t m = 0; m < members; ++m)                              \
                    if (counts[m] > 0) {                                           \
                        double d = stats[2 * m * ng + k] - mu;                     \
                        m2 += stats[(2 * m + 1) * ng + k] + counts[m] * d * d;     \
                    }                                                              \
            }                                                                      \
            double r = 1.0 / sqrt(m2 / (n > 1.0 ? n : 1.0) + eps);                 \
            mean[k] = mu;                                                          \
            invstd[k] = r;                                                         \
            for (int64_t j = 0; j < per; ++j) {                                    \
                int64_t ch = (k % groups) * per + j, row = k * per + j;            \
                double ar = w ? r * (double)w[ch] : r;                             \
                a[row] = (T)ar;                                                    \
                c[row] = (T)((b ? (double)b[ch] : 0.0) - mu * ar);                 \
            }                                                                      \
        }                                                                          \
    }                                                                              \
    /* sg, sgx: each row's sum g and sum g * x. ab: A (ng values), then B. */      \
    void dp_group_grad_sums_##S(int64_t ng, int64_t groups, int64_t per,           \
                                const double *sg, const double *sgx,               \
                                const double *mean, const T *w, double *ab) {      \
        for (int64_t k = 0; k < ng; ++k) {                                         \
            double sa = 0.0, sb = 0.0;                                             \
            for (int64_t j = 0; j < per; ++j) {                                    \
                int64_t row = k * per + j;                                         \
                double wc = w ? (double)w[(k % groups) * per + j] : 1.0;           \
                sa += wc * sg[row];                                                \
                sb += wc * (sgx[row] - mean[k] * sg[row]);                         \
            }                                                                      \
            ab[k] = sa;                                                            \
            ab[ng + k] = sb;                                                       \
        }                                                                          \
    }                                                                              \
    /* dx = x * a + c + g * b per row, from the groups' A, B summed over the       \
     * members; gw, gb (groups * per, zeroed by the caller) get this block's sums. \
     * count: cells of one group over all members. */                             \
    void dp_group_grad_coefs_##S(int64_t ng, int64_t groups, int64_t per,          \
                                 const double *ab, const double *mean,             \
                                 const double *invstd, const T *w, double count,   \
                                 const double *sg, const double *sgx, T *a, T *c,  \
                                 T *b, double *gw, double *gb) {                   \
        double inv_n = 1.0 / (count > 1.0 ? count : 1.0);                          \
        for (int64_t k = 0; k < ng; ++k) {                                         \
            double r = invstd[k];                                                  \
            double k1 = -(r * r * r) * ab[ng + k] * inv_n;                         \
            double k0 = -r * ab[k] * inv_n - k1 * mean[k];                         \
            for (int64_t j = 0; j < per; ++j) {                                    \
                int64_t ch = (k % groups) * per + j, row = k * per + j;            \
                a[row] = (T)k1;                                                    \
                c[row] = (T)k0;                                                    \
                b[row] = (T)(w ? r * (double)w[ch] : r);                           \
                gw[ch] += r * (sgx[row] - mean[k] * sg[row]);                      \
                gb[ch] += sg[row];                                                 \
            }                                                                      \
        }                                                                          \
    }

DP_ROWS(float, f)
DP_ROWS(double, d)
DP_GROUPS(float, f)
DP_GROUPS(double, d)
