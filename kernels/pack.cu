// Pack and unpack an N-d strided box of a device array to and from a contiguous
// device buffer: the GPU twin of pack.c. domainpar compiles this file at run time
// with NVRTC through CuPy (domainpar/comm/packing.py); CMake or a plain
// `nvcc -c kernels/pack.cu` compiles it ahead, which the tests check.
//
// `layout` points to 1 + 2 * DP_MAX_DIMS int64 values in device memory:
// ndim, then shape[DP_MAX_DIMS], then byte strides[DP_MAX_DIMS]. Element i of
// the buffer is the box element whose C-order index is i. Kernels are named by
// what they move: dp_pack_<bytes per element>, dp_unpack_<bytes>, and
// dp_unpack_add_<type> for the adjoint of a halo fill (buffer added into box).

#define DP_MAX_DIMS 8

typedef long long dp_i64;
struct dp_bytes16 { unsigned long long w[2]; };

__device__ __forceinline__ dp_i64 dp_offset(dp_i64 i, const dp_i64 *layout) {
    const int ndim = (int)layout[0];
    const dp_i64 *shape = layout + 1, *strides = layout + 1 + DP_MAX_DIMS;
    dp_i64 off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
        const dp_i64 c = i % shape[d];
        i /= shape[d];
        off += c * strides[d];
    }
    return off;
}

#define DP_GRID_LOOP(i, n)                                                        \
    for (dp_i64 i = blockIdx.x * (dp_i64)blockDim.x + threadIdx.x; i < (n);     \
         i += (dp_i64)gridDim.x * blockDim.x)

#define DP_COPY_KERNELS(T, SUFFIX)                                                \
    extern "C" __global__ void dp_pack_##SUFFIX(const char *arr, T *buf,         \
                                                const dp_i64 *layout, dp_i64 n) { \
        DP_GRID_LOOP(i, n) buf[i] = *(const T *)(arr + dp_offset(i, layout));   \
    }                                                                             \
    extern "C" __global__ void dp_unpack_##SUFFIX(char *arr, const T *buf,       \
                                                  const dp_i64 *layout, dp_i64 n) { \
        DP_GRID_LOOP(i, n) *(T *)(arr + dp_offset(i, layout)) = buf[i];          \
    }

DP_COPY_KERNELS(unsigned char, 1)
DP_COPY_KERNELS(unsigned short, 2)
DP_COPY_KERNELS(unsigned int, 4)
DP_COPY_KERNELS(unsigned long long, 8)
DP_COPY_KERNELS(dp_bytes16, 16)

#define DP_ADD_KERNEL(T, SUFFIX)                                                  \
    extern "C" __global__ void dp_unpack_add_##SUFFIX(char *arr, const T *buf,   \
                                                      const dp_i64 *layout, dp_i64 n) { \
        DP_GRID_LOOP(i, n) *(T *)(arr + dp_offset(i, layout)) += buf[i];         \
    }

DP_ADD_KERNEL(float, f)
DP_ADD_KERNEL(double, d)
DP_ADD_KERNEL(int, i)
DP_ADD_KERNEL(long long, l)
