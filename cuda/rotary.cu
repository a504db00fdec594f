// Rotary position embedding (the launch and the formulas: brrr_cuda.h). One thread per unit of
// one row, grid-stride: a unit is VEC consecutive pairs p .. p + VEC (their features e0 and e1
// at p and p + half, or 2p .. 2p + 2 VEC interleaved), then, where out is not x, VEC of the
// features past the rotated ones, copied. With stride-1 last dims, 16-byte aligned rows and
// half and pass multiples of VEC, every read and write is one 16-byte access (x and out: two,
// cos and sin: two, or one of angles per pair); otherwise VEC = 1. The row index is decomposed
// once per unit for all four tensors, in 32 bits unless the rows or units exceed that.
#include <stdlib.h>
#include <string.h>

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

// BRRR_ROTARY_KERNEL=heads: rows that differ only in a dim where cos and sin are broadcast (the
// heads of q and k) share their angles. rotary_kernel reads a unit's cos and sin again for every
// head, twice the bytes of x through the load pipe, and decomposes the row index (a division per
// row dim) for every unit. Here a thread takes a unit in kHeads heads: the index decomposed and
// the angles read once, then the heads' x loaded together (all loads in flight before any store,
// which also keeps it right in place) and rotated. The launcher makes the heads dim the innermost
// row dim; 16-byte packs only. The same arithmetic per element as rotary_kernel, so the same bits.
constexpr int kHeads = 4;

// A 16-byte pack stored by one st.global.v4: stored as a Pack (or a uint4), the heads kernel's
// stores came out of nvcc as 4-byte pairs of 2-byte values, 4 stores a pack.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void store16(T *p, const A *in) {
    static_assert(sizeof(Pack<T, VEC>) == 16, "16-byte packs only");
    Pack<T, VEC> pk;
#pragma unroll
    for (int j = 0; j < VEC; ++j) pk.v[j] = to_storage<T, A>(in[j]);
    uint4 raw;
    memcpy(&raw, &pk, sizeof raw);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(raw.x), "r"(raw.y), "r"(raw.z), "r"(raw.w) : "memory");
}

// kInterleaved is fixed at compile time: as a run-time flag nvcc merged the two layouts' stores
// into one and selected their data element by element (56 FSEL a unit in bfloat16).
template <typename T, int VEC, bool kInterleaved, typename Index>
__global__ void __launch_bounds__(kThreads) rotary_heads_kernel(const __grid_constant__ brrr_rotary_launch L) {
    using A = typename Compute<T>::type;
    const int inner = L.row_ndim - 1;
    const Index heads = (Index)L.row_shape[inner], chunks = (heads + kHeads - 1) / kHeads;
    const Index rotated = (Index)(L.half / VEC), per_row = rotated + (Index)(L.pass / VEC);
    const int64_t total = L.rows / heads * chunks * (int64_t)per_row, h = L.half;
    const int64_t hx = L.x.strides[inner], ho = L.out.strides[inner];
    const bool pair_angles = L.pair_angles;
    const int64_t *const strides[4] = {L.x.strides, L.out.strides, L.cos.strides, L.sin.strides};
    for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < total; i += (int64_t)gridDim.x * kThreads) {
        const Index q = (Index)i / per_row, u = (Index)i - q * per_row;
        const Index group = q / chunks, first = (q - group * chunks) * kHeads;
        const Index n = heads - first < (Index)kHeads ? heads - first : (Index)kHeads;
        int64_t off[4];
        unravel_offsets<Index, BRRR_MAX_DIMS>(inner, L.row_shape, group, strides, off);
        const T *x = static_cast<const T *>(L.x.data) + off[0] + (int64_t)first * hx;
        T *o = static_cast<T *>(L.out.data) + off[1] + (int64_t)first * ho;
        if (u >= rotated) {  // the features past the rotated ones, copied
            const int64_t j = 2 * h + (int64_t)(u - rotated) * VEC;
            A v[kHeads][VEC];
#pragma unroll
            for (int k = 0; k < kHeads; ++k)
                if ((Index)k < n) load<T, VEC>(x + k * hx + j, v[k]);
#pragma unroll
            for (int k = 0; k < kHeads; ++k)
                if ((Index)k < n) store16<T, VEC>(o + k * ho + j, v[k]);
            continue;
        }
        const int64_t p = (int64_t)u * VEC;
        const T *c = static_cast<const T *>(L.cos.data) + off[2];
        const T *s = static_cast<const T *>(L.sin.data) + off[3];
        // x stays in storage precision until its turn: kHeads heads of floats beside the angles
        // would not fit the register budget.
        Pack<T, VEC> xa[kHeads], xb[kHeads];
#pragma unroll
        for (int k = 0; k < kHeads; ++k) {
            if ((Index)k >= n) continue;
            const T *row = x + k * hx;
            const T *lo_at = row + (kInterleaved ? 2 * p : p), *hi_at = row + (kInterleaved ? 2 * p + VEC : p + h);
            xa[k] = *reinterpret_cast<const Pack<T, VEC> *>(lo_at);
            xb[k] = *reinterpret_cast<const Pack<T, VEC> *>(hi_at);
        }
        A c0[VEC], c1[VEC], s0[VEC], s1[VEC];
        if (pair_angles) {
            load<T, VEC>(c + p, c0);
            load<T, VEC>(s + p, s0);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                c1[k] = c0[k];
                s1[k] = s0[k];
            }
        } else {
            load_pairs<T, VEC>(c, 1, p, h, kInterleaved, c0, c1);
            load_pairs<T, VEC>(s, 1, p, h, kInterleaved, s0, s1);
        }
#pragma unroll
        for (int k = 0; k < kHeads; ++k) {
            if ((Index)k >= n) continue;
            A a[VEC], b[VEC];
            if constexpr (kInterleaved) {
                A both[2 * VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    both[e] = to_float(xa[k].v[e]);
                    both[VEC + e] = to_float(xb[k].v[e]);
                }
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    a[e] = both[2 * e];
                    b[e] = both[2 * e + 1];
                }
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    a[e] = to_float(xa[k].v[e]);
                    b[e] = to_float(xb[k].v[e]);
                }
            }
            A lo[VEC], hi[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                if (L.backward) {
                    lo[e] = a[e] * c0[e] + b[e] * s1[e];
                    hi[e] = b[e] * c1[e] - a[e] * s0[e];
                } else {
                    lo[e] = a[e] * c0[e] - b[e] * s0[e];
                    hi[e] = b[e] * c1[e] + a[e] * s1[e];
                }
            }
            T *row = o + k * ho;
            if constexpr (kInterleaved) {
                A both[2 * VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    both[2 * e] = lo[e];
                    both[2 * e + 1] = hi[e];
                }
                store16<T, VEC>(row + 2 * p, both);
                store16<T, VEC>(row + 2 * p + VEC, both + VEC);
            } else {
                store16<T, VEC>(row + p, lo);
                store16<T, VEC>(row + p + h, hi);
            }
        }
    }
}

// The row dim of a launch that BRRR_ROTARY_KERNEL=heads walks (cos and sin broadcast along it, x
// not, more than one row), or -1.
static int heads_dim(const brrr_rotary_launch &L) {
    const char *v = getenv("BRRR_ROTARY_KERNEL");
    if (!(v && strcmp(v, "heads") == 0)) return -1;
    int best = -1;
    for (int d = 0; d < L.row_ndim; ++d)
        if (L.cos.strides[d] == 0 && L.sin.strides[d] == 0 && L.row_shape[d] > 1 && (best < 0 || L.row_shape[d] > L.row_shape[best]))
            best = d;
    return best;
}

// L with row dim d moved innermost (rows are independent, so their order is free).
static brrr_rotary_launch with_innermost_row_dim(const brrr_rotary_launch &L, int d) {
    brrr_rotary_launch M = L;
    const brrr_view *from[4] = {&L.x, &L.out, &L.cos, &L.sin};
    brrr_view *to[4] = {&M.x, &M.out, &M.cos, &M.sin};
    for (int k = d; k < L.row_ndim - 1; ++k) {
        M.row_shape[k] = L.row_shape[k + 1];
        for (int t = 0; t < 4; ++t) to[t]->strides[k] = from[t]->strides[k + 1];
    }
    M.row_shape[L.row_ndim - 1] = L.row_shape[d];
    for (int t = 0; t < 4; ++t) to[t]->strides[L.row_ndim - 1] = from[t]->strides[d];
    return M;
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
    const int hd = vector ? heads_dim(L) : -1;
    if (hd >= 0) {
        const brrr_rotary_launch M = with_innermost_row_dim(L, hd);
        const int64_t heads = M.row_shape[M.row_ndim - 1];
        const int64_t work = L.rows / heads * ((heads + kHeads - 1) / kHeads) * ((L.half + L.pass) / P);
        const int64_t blocks = (work + kThreads - 1) / kThreads, cap = (int64_t)sm_count(device) * 32;
        const unsigned grid = (unsigned)(blocks < cap ? blocks : cap);
        const bool narrow = work <= (int64_t)UINT32_MAX;
        if (L.interleaved && narrow) rotary_heads_kernel<T, P, true, uint32_t><<<grid, kThreads, 0, stream>>>(M);
        else if (L.interleaved) rotary_heads_kernel<T, P, true, uint64_t><<<grid, kThreads, 0, stream>>>(M);
        else if (narrow) rotary_heads_kernel<T, P, false, uint32_t><<<grid, kThreads, 0, stream>>>(M);
        else rotary_heads_kernel<T, P, false, uint64_t><<<grid, kThreads, 0, stream>>>(M);
        return cudaGetLastError();
    }
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
