// Rotary position embedding (the launch and the formulas: brrr_cuda.h). One thread per unit of
// one row, grid-stride: a unit is VEC consecutive pairs p .. p + VEC (their features e0 and e1
// at p and p + half, or 2p .. 2p + 2 VEC interleaved), then, where out is not x, VEC of the
// features past the rotated ones, copied. With stride-1 last dims, 16-byte aligned rows and
// half and pass multiples of VEC, every read and write is one 16-byte access (x and out: two,
// cos and sin: two, or one of angles per pair); otherwise VEC = 1. The row index is decomposed
// once per unit for all four tensors, in 32 bits unless the rows or units exceed that.
#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
namespace rotary {

// VEC values from p: one 16-byte pack, or the one element at p.
template <typename T, int VEC>
__device__ __forceinline__ void load(const T *p, typename Compute<T>::type *v) {
    if constexpr (VEC > 1) load_pack<T, VEC>(p, v);
    else v[0] = to_float(p[0]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T *p, const typename Compute<T>::type *v) {
    if constexpr (VEC > 1) store_pack<T, VEC>(p, v);
    else p[0] = to_storage<T, typename Compute<T>::type>(v[0]);
}

// The VEC pairs from p of one row, as (first, second) features, from `base` at `stride` (1 when
// VEC > 1): at p and p + h, or deinterleaved from the 2 VEC features at 2p.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void load_pairs(const T *base, int64_t stride, int64_t p, int64_t h, bool interleaved,
                                           A (&first)[VEC], A (&second)[VEC]) {
    if (interleaved) {
        A both[2 * VEC];
        load<T, VEC>(base + 2 * p * stride, both);
        load<T, VEC>(base + (2 * p + VEC) * stride, both + VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            first[k] = both[2 * k];
            second[k] = both[2 * k + 1];
        }
    } else {
        load<T, VEC>(base + p * stride, first);
        load<T, VEC>(base + (p + h) * stride, second);
    }
}

template <typename T, int VEC, typename Index>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const __grid_constant__ brrr_rotary_launch L) {
    using A = typename Compute<T>::type;
    const Index rotated = (Index)(L.half / VEC), per_row = rotated + (Index)(L.pass / VEC);
    const int64_t total = L.rows * (int64_t)per_row, h = L.half;
    const int64_t sx = L.col_stride[0], so = L.col_stride[1], sc = L.col_stride[2], ss = L.col_stride[3];
    const bool interleaved = L.interleaved, pair_angles = L.pair_angles;
    const int64_t *const strides[4] = {L.x.strides, L.out.strides, L.cos.strides, L.sin.strides};
    for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < total; i += (int64_t)gridDim.x * kThreads) {
        const Index r = (Index)i / per_row, u = (Index)i - r * per_row;
        int64_t off[4];
        unravel_offsets<Index, BRRR_MAX_DIMS>(L.row_ndim, L.row_shape, r, strides, off);
        const T *x = static_cast<const T *>(L.x.data) + off[0];
        T *o = static_cast<T *>(L.out.data) + off[1];
        if (u >= rotated) {  // the features past the rotated ones, copied
            const int64_t j = 2 * h + (int64_t)(u - rotated) * VEC;
            A v[VEC];
            load<T, VEC>(x + j * sx, v);
            store<T, VEC>(o + j * so, v);
            continue;
        }
        const int64_t p = (int64_t)u * VEC;
        const T *c = static_cast<const T *>(L.cos.data) + off[2];
        const T *s = static_cast<const T *>(L.sin.data) + off[3];
        A a[VEC], b[VEC], c0[VEC], c1[VEC], s0[VEC], s1[VEC];
        load_pairs<T, VEC>(x, sx, p, h, interleaved, a, b);
        if (pair_angles) {
            load<T, VEC>(c + p * sc, c0);
            load<T, VEC>(s + p * ss, s0);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                c1[k] = c0[k];
                s1[k] = s0[k];
            }
        } else {
            load_pairs<T, VEC>(c, sc, p, h, interleaved, c0, c1);
            load_pairs<T, VEC>(s, ss, p, h, interleaved, s0, s1);
        }
        A lo[VEC], hi[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            if (L.backward) {
                lo[k] = a[k] * c0[k] + b[k] * s1[k];
                hi[k] = b[k] * c1[k] - a[k] * s0[k];
            } else {
                lo[k] = a[k] * c0[k] - b[k] * s0[k];
                hi[k] = b[k] * c1[k] + a[k] * s1[k];
            }
        }
        if (interleaved) {
            A both[2 * VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                both[2 * k] = lo[k];
                both[2 * k + 1] = hi[k];
            }
            store<T, VEC>(o + 2 * p * so, both);
            store<T, VEC>(o + (2 * p + VEC) * so, both + VEC);
        } else {
            store<T, VEC>(o + p * so, lo);
            store<T, VEC>(o + (p + h) * so, hi);
        }
    }
}

// 16-byte packs: stride-1 last dims, every row start of every tensor 16-byte aligned, half and
// pass multiples of P.
template <typename T>
static bool vectorizable(const brrr_rotary_launch &L) {
    constexpr int P = 16 / sizeof(T);
    if (L.half % P != 0 || L.pass % P != 0) return false;
    const brrr_view *views[4] = {&L.x, &L.out, &L.cos, &L.sin};
    for (int k = 0; k < 4; ++k) {
        if (L.col_stride[k] != 1 || !aligned16(views[k]->data)) return false;
        for (int d = 0; d < L.row_ndim; ++d)
            if (views[k]->strides[d] % P != 0) return false;
    }
    return true;
}

template <typename T, int VEC>
static void launch(const brrr_rotary_launch &L, unsigned grid, cudaStream_t stream) {
    const int64_t units = L.rows * ((L.half + L.pass) / VEC);
    if (units <= (int64_t)UINT32_MAX) rotary_kernel<T, VEC, uint32_t><<<grid, kThreads, 0, stream>>>(L);
    else rotary_kernel<T, VEC, uint64_t><<<grid, kThreads, 0, stream>>>(L);
}

template <typename T>
static cudaError_t rotary_typed(const brrr_rotary_launch &L, int device, cudaStream_t stream) {
    constexpr int P = 16 / sizeof(T);
    const bool vector = vectorizable<T>(L);
    const int64_t work = L.rows * ((L.half + L.pass) / (vector ? P : 1));
    const int64_t blocks = (work + kThreads - 1) / kThreads, cap = (int64_t)sm_count(device) * 32;
    const unsigned grid = (unsigned)(blocks < cap ? blocks : cap);
    if (vector) launch<T, P>(L, grid, stream);
    else launch<T, 1>(L, grid, stream);
    return cudaGetLastError();
}

}  // namespace rotary
}  // namespace brrr

extern "C" int brrr_cuda_rotary(const brrr_rotary_launch *L, int device, void *stream_ptr) {
    using namespace brrr::rotary;
    brrr::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    switch (L->dtype) {
    case BRRR_F32: return (int)rotary_typed<float>(*L, device, stream);
    case BRRR_F16: return (int)rotary_typed<__half>(*L, device, stream);
    case BRRR_BF16: return (int)rotary_typed<__nv_bfloat16>(*L, device, stream);
    case BRRR_F64: return (int)rotary_typed<double>(*L, device, stream);
    default: return (int)cudaErrorInvalidValue;
    }
}
