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

/* Copy `n` chunks of `chunk` bytes, `s` bytes apart in the array, back to back in
 * the buffer. A chunk is one element, or a whole contiguous innermost row; fixed
 * sizes become single moves instead of memcpy calls. */
static inline void copy_chunks(char *arr, char *buf, int64_t n, int64_t s,
                               int64_t chunk, dp_direction dir) {
    /* Four independent moves per iteration keep several cache misses in flight. */
#define DP_MOVE(T)                                                             \
    do {                                                                       \
        T *b = (T *)buf;                                                       \
        char *p = arr;                                                         \
        int64_t i = 0;                                                         \
        if (dir == DP_PACK) {                                                  \
            for (; i + 4 <= n; i += 4, p += 4 * s) {                           \
                T v0, v1, v2, v3;                                              \
                memcpy(&v0, p, sizeof(T));                                     \
                memcpy(&v1, p + s, sizeof(T));                                 \
                memcpy(&v2, p + 2 * s, sizeof(T));                             \
                memcpy(&v3, p + 3 * s, sizeof(T));                             \
                b[i] = v0; b[i + 1] = v1; b[i + 2] = v2; b[i + 3] = v3;        \
            }                                                                  \
            for (; i < n; ++i, p += s) memcpy(b + i, p, sizeof(T));            \
        } else {                                                               \
            for (; i + 4 <= n; i += 4, p += 4 * s) {                           \
                memcpy(p, b + i, sizeof(T));                                   \
                memcpy(p + s, b + i + 1, sizeof(T));                           \
                memcpy(p + 2 * s, b + i + 2, sizeof(T));                       \
                memcpy(p + 3 * s, b + i + 3, sizeof(T));                       \
            }                                                                  \
            for (; i < n; ++i, p += s) memcpy(p, b + i, sizeof(T));            \
        }                                                                      \
    } while (0)
    typedef struct { uint64_t w[2]; } dp16;
    typedef struct { uint64_t w[4]; } dp32;
    switch (chunk) {
    case 1: DP_MOVE(uint8_t); return;
    case 2: DP_MOVE(uint16_t); return;
    case 4: DP_MOVE(uint32_t); return;
    case 8: DP_MOVE(uint64_t); return;
    case 16: DP_MOVE(dp16); return;
    case 32: DP_MOVE(dp32); return;
    default:
        for (int64_t i = 0; i < n; ++i) {
            if (dir == DP_PACK) memcpy(buf + i * chunk, arr + i * s, (size_t)chunk);
            else memcpy(arr + i * s, buf + i * chunk, (size_t)chunk);
        }
    }
#undef DP_MOVE
}

static int walk(char *arr, char *buf, int ndim, const int64_t *shape,
                const int64_t *strides, int64_t item, dp_direction dir) {
    if (ndim < 1 || ndim > DP_MAX_DIMS) return -1;
    for (int d = 0; d < ndim; ++d)
        if (shape[d] == 0) return 0;
    int64_t chunk = item;
    if (strides[ndim - 1] == item) { /* a contiguous innermost row is one chunk */
        chunk = item * shape[ndim - 1];
        if (--ndim == 0) {
            if (dir == DP_PACK) memcpy(buf, arr, (size_t)chunk);
            else memcpy(arr, buf, (size_t)chunk);
            return 0;
        }
    }
    int64_t idx[DP_MAX_DIMS] = {0};
    const int inner = ndim - 1;
    const int64_t n = shape[inner], row_bytes = n * chunk;
    int64_t offset = 0; /* byte offset of the current row in the array */
    int64_t pos = 0;    /* byte offset of the current row in the buffer */
    for (;;) {
        copy_chunks(arr + offset, buf + pos, n, strides[inner], chunk, dir);
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
    return walk((char *)arr, buf, ndim, shape, strides, itemsize, DP_PACK);
}

int dp_unpack(char *arr, int ndim, const int64_t *shape, const int64_t *strides,
              int64_t itemsize, const char *buf) {
    return walk(arr, (char *)buf, ndim, shape, strides, itemsize, DP_UNPACK);
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
