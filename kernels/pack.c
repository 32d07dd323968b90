/* Pack and unpack an N-d strided box of an array to and from a contiguous buffer.
 *
 * Halo faces along the last axes of a C-ordered array are strided: one element
 * (or a few) per row. numpy copies such views one element at a time through a
 * generic iterator; these loops copy whole contiguous runs with memcpy and
 * strided single elements with a fixed-size move, and walk the outer dims with an
 * odometer. The caller (domainpar/comm/packing.py) first merges dims that are
 * contiguous with each other, so the innermost run is as long as it can be.
 *
 * shape and strides (in bytes) describe the box inside the array; ndim >= 1.
 * unpack_add adds instead of storing (the adjoint of a halo fill); it knows the
 * element type through a code: 'f' float32, 'd' float64, 'i' int32, 'l' int64;
 * complex types are passed as their real type with a trailing dim of 2.
 */
#include <stdint.h>
#include <string.h>

#define DP_MAX_DIMS 32

typedef enum { DP_PACK, DP_UNPACK } dp_direction;

/* Copy one innermost row of `n` elements between array (stride `s`) and buffer. */
static inline void copy_row(char *arr, const char *buf_in, char *buf_out, int64_t n,
                            int64_t s, int64_t item, dp_direction dir) {
    if (s == item) {
        if (dir == DP_PACK) memcpy(buf_out, arr, (size_t)(n * item));
        else memcpy(arr, buf_in, (size_t)(n * item));
        return;
    }
#define DP_STRIDED(T)                                                          \
    do {                                                                       \
        if (dir == DP_PACK) {                                                  \
            T *o = (T *)buf_out;                                               \
            for (int64_t i = 0; i < n; ++i) o[i] = *(const T *)(arr + i * s);  \
        } else {                                                               \
            const T *in = (const T *)buf_in;                                   \
            for (int64_t i = 0; i < n; ++i) *(T *)(arr + i * s) = in[i];       \
        }                                                                      \
    } while (0)
    switch (item) {
    case 1: DP_STRIDED(uint8_t); return;
    case 2: DP_STRIDED(uint16_t); return;
    case 4: DP_STRIDED(uint32_t); return;
    case 8: DP_STRIDED(uint64_t); return;
    default:
        for (int64_t i = 0; i < n; ++i) {
            if (dir == DP_PACK) memcpy(buf_out + i * item, arr + i * s, (size_t)item);
            else memcpy(arr + i * s, buf_in + i * item, (size_t)item);
        }
    }
#undef DP_STRIDED
}

static int walk(char *arr, const char *buf_in, char *buf_out, int ndim,
                const int64_t *shape, const int64_t *strides, int64_t item,
                dp_direction dir) {
    if (ndim < 1 || ndim > DP_MAX_DIMS) return -1;
    for (int d = 0; d < ndim; ++d)
        if (shape[d] == 0) return 0;
    int64_t idx[DP_MAX_DIMS] = {0};
    const int inner = ndim - 1;
    const int64_t row_bytes = shape[inner] * item;
    int64_t offset = 0; /* byte offset of the current row in the array */
    int64_t pos = 0;    /* byte offset of the current row in the buffer */
    for (;;) {
        copy_row(arr + offset, buf_in ? buf_in + pos : NULL, buf_out ? buf_out + pos : NULL,
                 shape[inner], strides[inner], item, dir);
        pos += row_bytes;
        int d = inner - 1;
        for (; d >= 0; --d) { /* odometer over the outer dims */
            offset += strides[d];
            if (++idx[d] < shape[d]) break;
            offset -= strides[d] * shape[d];
            idx[d] = 0;
        }
        if (d < 0) return 0;
    }
}

int dp_pack(const char *arr, int ndim, const int64_t *shape, const int64_t *strides,
            int64_t itemsize, char *buf) {
    return walk((char *)arr, NULL, buf, ndim, shape, strides, itemsize, DP_PACK);
}

int dp_unpack(char *arr, int ndim, const int64_t *shape, const int64_t *strides,
              int64_t itemsize, const char *buf) {
    return walk(arr, buf, NULL, ndim, shape, strides, itemsize, DP_UNPACK);
}

/* arr[box] += buf, typed. */
int dp_unpack_add(char *arr, int ndim, const int64_t *shape, const int64_t *strides,
                  char type, const char *buf) {
    if (ndim < 1 || ndim > DP_MAX_DIMS) return -1;
    for (int d = 0; d < ndim; ++d)
        if (shape[d] == 0) return 0;
    int64_t idx[DP_MAX_DIMS] = {0};
    const int inner = ndim - 1;
    const int64_t n = shape[inner], s = strides[inner];
    int64_t offset = 0, count = 0;
#define DP_ADD_LOOP(T)                                                         \
    for (;;) {                                                                 \
        const T *in = (const T *)buf + count;                                  \
        char *row = arr + offset;                                              \
        for (int64_t i = 0; i < n; ++i) *(T *)(row + i * s) += in[i];          \
        count += n;                                                            \
        int d = inner - 1;                                                     \
        for (; d >= 0; --d) {                                                  \
            offset += strides[d];                                              \
            if (++idx[d] < shape[d]) break;                                    \
            offset -= strides[d] * shape[d];                                   \
            idx[d] = 0;                                                        \
        }                                                                      \
        if (d < 0) return 0;                                                   \
    }
    switch (type) {
    case 'f': DP_ADD_LOOP(float);
    case 'd': DP_ADD_LOOP(double);
    case 'i': DP_ADD_LOOP(int32_t);
    case 'l': DP_ADD_LOOP(int64_t);
    default: return -2;
    }
#undef DP_ADD_LOOP
}
