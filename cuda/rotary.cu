// Rotary position embedding (the launch and the formulas: brrr_cuda.h). One thread per VEC
// consecutive pairs (j .. j + VEC, and their partners at + half) of one row, grid-stride: with
// stride-1 last dims, 16-byte aligned rows and half % VEC == 0, each of its six reads and two
// writes is one 16-byte access; otherwise VEC = 1. The row index is decomposed once per pack for
// all four tensors, in 32 bits unless the rows or packs exceed that.
#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
namespace rotary {

// VEC values from p: one 16-byte pack, or the one element at p.
template <typename T, int VEC>
__device__ __forceinline__ void load(const T *p, typename Compute<T>::type (&v)[VEC]) {
    if constexpr (VEC > 1) load_pack<T, VEC>(p, v);
    else v[0] = to_float(p[0]);
}

template <typename T, int VEC, typename Index>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const __grid_constant__ brrr_rotary_launch L) {
    using A = typename Compute<T>::type;
    const Index per_row = (Index)(L.half / VEC);
    const int64_t total = L.rows * (int64_t)per_row, h = L.half;
    const int64_t sx = L.col_stride[0], so = L.col_stride[1], sc = L.col_stride[2], ss = L.col_stride[3];
    const int64_t *const strides[4] = {L.x.strides, L.out.strides, L.cos.strides, L.sin.strides};
    for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < total; i += (int64_t)gridDim.x * kThreads) {
        const Index r = (Index)i / per_row, j = ((Index)i - r * per_row) * VEC;
        int64_t off[4];
        unravel_offsets<Index, BRRR_MAX_DIMS>(L.row_ndim, L.row_shape, r, strides, off);
        const T *x = static_cast<const T *>(L.x.data) + off[0];
        T *o = static_cast<T *>(L.out.data) + off[1];
        const T *c = static_cast<const T *>(L.cos.data) + off[2];
        const T *s = static_cast<const T *>(L.sin.data) + off[3];
        A a[VEC], b[VEC], c_lo[VEC], c_hi[VEC], s_lo[VEC], s_hi[VEC];
        load<T, VEC>(x + j * sx, a);
        load<T, VEC>(x + (j + h) * sx, b);
        load<T, VEC>(c + j * sc, c_lo);
        load<T, VEC>(c + (j + h) * sc, c_hi);
        load<T, VEC>(s + j * ss, s_lo);
        load<T, VEC>(s + (j + h) * ss, s_hi);
        A lo[VEC], hi[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            if (L.backward) {
                lo[k] = a[k] * c_lo[k] + b[k] * s_hi[k];
                hi[k] = b[k] * c_hi[k] - a[k] * s_lo[k];
            } else {
                lo[k] = a[k] * c_lo[k] - b[k] * s_lo[k];
                hi[k] = b[k] * c_hi[k] + a[k] * s_hi[k];
            }
        }
        if constexpr (VEC > 1) {
            store_pack<T, VEC>(o + j, lo);
            store_pack<T, VEC>(o + j + h, hi);
        } else {
            o[j * so] = to_storage<T, A>(lo[0]);
            o[(j + h) * so] = to_storage<T, A>(hi[0]);
        }
    }
}

// 16-byte packs: stride-1 last dims, every row start of every tensor 16-byte aligned, half % P == 0.
template <typename T>
static bool vectorizable(const brrr_rotary_launch &L) {
    constexpr int P = 16 / sizeof(T);
    if (L.half % P != 0) return false;
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
    const int64_t packs = L.rows * (L.half / VEC);
    if (packs <= (int64_t)UINT32_MAX) rotary_kernel<T, VEC, uint32_t><<<grid, kThreads, 0, stream>>>(L);
    else rotary_kernel<T, VEC, uint64_t><<<grid, kThreads, 0, stream>>>(L);
}

template <typename T>
static cudaError_t rotary_typed(const brrr_rotary_launch &L, int device, cudaStream_t stream) {
    constexpr int P = 16 / sizeof(T);
    const bool vector = vectorizable<T>(L);
    const int64_t work = L.rows * (L.half / (vector ? P : 1));
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
