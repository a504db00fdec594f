// Softmax cross-entropy kernels (the launch and the formulas: brrr_cuda.h).
//
// xent_fwd_kernel     RT threads per row (8, 32 or 256 by the class count; a block of 256 holds
//                     256 / RT rows). One pass over the row: each thread keeps an online
//                     softmax state (running max m, sum of exp(v - m), with label smoothing the
//                     sum of v / C), absorbing kUnroll 16-byte packs per step with one rescale per
//                     step; the states are merged by shuffles (and, for RT = 256, in warp order
//                     through shared memory), and the row's first thread writes lse (relative to
//                     the target's logit, brrr_cuda.h) and loss. Rows whose start is not 16-byte
//                     aligned peel their head element by element; the tail goes element by
//                     element too, as do strided classes. With kGrad (the fused forward and
//                     backward) the row's lse and target logit then go to every thread of the
//                     row, and a second pass writes the gradient as xent_bwd_kernel does: every
//                     read of the row comes before the merge that the writes wait on, so the
//                     gradient may overwrite the logits.
// xent_reduce_kernel  one block: loss summed over rows in a fixed order (each thread its rows in
//                     turn, then a tree in shared memory), the counted rows, total and count.
// xent_bwd_kernel     the same row groups, streaming: grad = g (exp(v - shift - lse) - smoothing / C
//                     - (1 - smoothing) [c == t]), nothing saved but lse.
// With a softcap every logit v is read as cap * tanh(v / cap) and its gradient taken through it
// (kSoftcap: no tanh in the loops without one). Deterministic: no atomics, the same order on
// every GPU.
#pragma once

#include <math.h>

#include <type_traits>

#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
namespace xent {

constexpr int kUnroll = 4;  // packs per thread per step
// The forward keeps 4 blocks of 256 per SM (at most 64 registers) where that costs no spills;
// float64 would spill, as would the backward (74 registers: 3 blocks, 4 packs in flight each) and
// so the forward that writes the gradient too.
template <typename T, bool kGrad> constexpr int fwd_min_blocks() { return sizeof(T) == 8 || kGrad ? 1 : 4; }

// exp as ex2.approx.ftz (exp_ftz, cuda/elementary.cuh): __expf and exp2f compile to the non-ftz
// form, which scales around subnormal results with four more instructions per call; terms below
// 2^-126 of a sum that holds a 1 (the row's max) do not change it.
__device__ __forceinline__ float exp_(float x) { return exp_ftz(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }
__device__ __forceinline__ float tanh_(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_(double x) { return tanh(x); }

// The logit the loss sees (brrr_cuda.h): cap * tanh(v / cap) under a softcap, v itself without.
template <typename A>
struct Softcap {
    A cap, inv;  // cap and 1 / cap (0 and 0 without one)
};

template <typename A> __device__ __forceinline__ Softcap<A> softcap_of(const brrr_xent_launch &L) {
    return {A(L.softcap), L.softcap != 0.0 ? A(1.0 / L.softcap) : A(0)};
}

template <bool kSoftcap, typename A>
__device__ __forceinline__ A capped(A v, const Softcap<A> &k) {
    return kSoftcap ? k.cap * tanh_(v * k.inv) : v;
}

__device__ __forceinline__ int64_t load_target(const brrr_xent_launch &L, int64_t off) {
    switch (L.target_dtype) {
    case BRRR_I32: return static_cast<const int32_t *>(L.target)[off];
    case BRRR_U8: return static_cast<const uint8_t *>(L.target)[off];
    default: return static_cast<const int64_t *>(L.target)[off];
    }
}

__device__ __forceinline__ int64_t row_off(const brrr_xent_launch &L, const int64_t *s, int64_t r) {
    if (L.row_ndim == 1) return r * s[0];
    int64_t off = 0;
#pragma unroll
    for (int d = BRRR_MAX_DIMS - 1; d >= 0; --d) {
        if (d >= L.row_ndim) continue;
        off += (r % L.row_shape[d]) * s[d];
        r /= L.row_shape[d];
    }
    return off;
}

// Elements before the first 16-byte boundary of a row that starts at p (p is T-aligned).
template <typename T>
__device__ __forceinline__ int64_t head_elements(const T *p, int64_t classes) {
    const int64_t h = (int64_t)(((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(T));
    return h < classes ? h : classes;
}

// One thread's share of a row: running max m, sum of exp(v - m), and (label smoothing) sum of
// v / classes: each term at most max |v| / classes, so no partial sum overflows (a sum of v
// reached inf at a few logits near FLT_MAX, and a NaN or a -inf loss from it).
// m starts at the lowest finite value rather than -inf, so that exp(v - m) is 0 for v = -inf and
// never -inf - -inf = NaN: no special cases in the loop. NaN values make s NaN (fmax skips them).
template <typename A>
struct Online {
    A m, s, sx;
};

template <typename A> __device__ __forceinline__ A lowest();
template <> __device__ __forceinline__ float lowest<float>() { return -3.402823466e38f; }
template <> __device__ __forceinline__ double lowest<double>() { return -1.7976931348623157e308; }

// Absorb v: one rescale for all of them; the max over W interleaved chains (one chain of N
// dependent FMNMX would be N latencies long, a full tree N more registers).
template <bool kSmooth, typename A, int N>
__device__ __forceinline__ void absorb(Online<A> &o, const A (&v)[N], A inv_classes) {
    constexpr int W = N < 4 ? N : 4;
    A top[W];
#pragma unroll
    for (int j = 0; j < W; ++j) top[j] = v[j];
#pragma unroll
    for (int j = W; j < N; ++j) top[j % W] = fmax(top[j % W], v[j]);
#pragma unroll
    for (int j = 1; j < W; ++j) top[0] = fmax(top[0], top[j]);
    if (top[0] > o.m) {
        o.s *= exp_(o.m - top[0]);
        o.m = top[0];
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
        o.s += exp_(v[j] - o.m);
        if (kSmooth) o.sx = fma(v[j], inv_classes, o.sx);
    }
}

template <typename A>
__device__ __forceinline__ Online<A> merge(const Online<A> &a, const Online<A> &b) {
    const A m = fmax(a.m, b.m);
    return {m, a.s * exp_(a.m - m) + b.s * exp_(b.m - m), a.sx + b.sx};
}

template <typename A>
__device__ __forceinline__ Online<A> shuffle_xor(const Online<A> &o, int lane_mask) {
    return {__shfl_xor_sync(0xffffffffu, o.m, lane_mask), __shfl_xor_sync(0xffffffffu, o.s, lane_mask),
            __shfl_xor_sync(0xffffffffu, o.sx, lane_mask)};
}

template <bool kSoftcap, typename A, int N>
__device__ __forceinline__ void cap_all(A (&v)[N], const Softcap<A> &k) {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = capped<kSoftcap>(v[j], k);
}

// The online state of one row's classes [0, classes) at stride cs, as thread `lane` of RT sees it.
template <bool kSmooth, bool kSoftcap, typename T, int RT>
__device__ __forceinline__ Online<typename Compute<T>::type> scan_row(const T *x, int64_t classes, int64_t cs, int lane,
                                                                      const Softcap<typename Compute<T>::type> &cap) {
    using A = typename Compute<T>::type;
    constexpr int P = 16 / sizeof(T);
    Online<A> o = {lowest<A>(), A(0), A(0)};
    const A inv_classes = A(1) / A(classes);
    int64_t c = 0;
    if (cs == 1) {
        const int64_t head = head_elements(x, classes), packs = (classes - head) / P;
        for (int64_t k = lane; k < head; k += RT) {
            const A v[1] = {capped<kSoftcap>(to_float(x[k]), cap)};
            absorb<kSmooth>(o, v, inv_classes);
        }
        const T *body = x + head;
        // Steps of kUnroll whole packs (no per-element predicates), then the packs left one by one.
        int64_t k = lane;
        for (; k + (int64_t)(kUnroll - 1) * RT < packs; k += (int64_t)RT * kUnroll) {
            A v[kUnroll * P];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) load_pack<T, P>(body + (k + (int64_t)u * RT) * P, v + u * P);
            cap_all<kSoftcap>(v, cap);
            absorb<kSmooth>(o, v, inv_classes);
        }
        for (; k < packs; k += RT) {
            A v[P];
            load_pack<T, P>(body + k * P, v);
            cap_all<kSoftcap>(v, cap);
            absorb<kSmooth>(o, v, inv_classes);
        }
        c = head + packs * P;
    }
    for (int64_t k = c + lane; k < classes; k += RT) {
        const A v[1] = {capped<kSoftcap>(to_float(x[k * cs]), cap)};
        absorb<kSmooth>(o, v, inv_classes);
    }
    return o;
}

// What lse is kept relative to (brrr_cuda.h): the target's logit where finite, else 0.
template <typename A> __device__ __forceinline__ A row_shift(A z_t) { return isfinite(z_t) ? z_t : A(0); }

// exp(d - lse) for d = v - shift: one FFMA and ex2 for float (ex2 of a product rounded once).
__device__ __forceinline__ float softmax_of(float d, float lse_log2e) {
    return exp2_ftz(fmaf(d, 1.4426950408889634f, -lse_log2e));
}
__device__ __forceinline__ double softmax_of(double d, double lse) { return exp(d - lse); }

// The factor a row's gradient is scaled by: its grad_loss (1 in the forward) over the count.
template <typename A>
__device__ __forceinline__ A row_scale(const brrr_xent_launch &L, int64_t r, A divisor) {
    const A g = L.grad_loss ? static_cast<const A *>(L.grad_loss)[row_off(L, L.grad_loss_rows, r)] : A(1);
    return g / divisor;
}

// Row r's gradient (brrr_cuda.h), as thread `lane` of the row's RT writes it: xent_bwd_kernel's
// body and the fused forward's second pass. x_t is the target's logit as stored (not capped),
// read by the caller before any thread of the row writes (the fused forward writes in place);
// scale is row_scale's (0 for an ignored row); lse is NaN for a target outside [0, classes).
// Every element is read and written by the same thread.
template <typename T, int RT, bool kSoftcap>
__device__ __forceinline__ void write_grad_row(const brrr_xent_launch &L, int64_t r, int64_t t, const T *x,
                                               typename Compute<T>::type x_t, typename Compute<T>::type lse,
                                               typename Compute<T>::type scale, int lane,
                                               const Softcap<typename Compute<T>::type> &cap) {
    using A = typename Compute<T>::type;
    constexpr int P = 16 / sizeof(T);
    constexpr bool kF64 = sizeof(A) == 8;
    T *g = static_cast<T *>(L.grad_logits) + row_off(L, L.grad_rows, r);
    const int64_t cs = L.logits_class_stride, gs = L.grad_class_stride;
    const bool ignored = t == L.ignore_index;
    const A shift = row_shift(capped<kSoftcap>(x_t, cap));
    // grad = (scale_p * p - smooth, and at_target less at the target) * dz/dx; the z-loss scales p.
    const A scale_p = L.z_loss != 0.0 ? scale * (A(1) + A(2 * L.z_loss) * (lse + shift)) : scale;
    const A smooth = scale * (A(L.smoothing) / A(L.classes)), at_target = scale * (A(1) - A(L.smoothing));
    const A lse_arg = kF64 ? lse : lse * A(1.4426950408889634);
    auto grad = [&](A v, A hot) {
        A z = v, dz = A(1);
        if (kSoftcap) {
            const A th = tanh_(v * cap.inv);
            z = cap.cap * th;
            dz = A(1) - th * th;
        }
        return (fma(scale_p, softmax_of(z - shift, lse_arg), -smooth) - hot) * dz;
    };
    int64_t c = 0;
    // 16-byte packs where both rows have stride-1 classes and the same offset from a boundary.
    if (!ignored && cs == 1 && gs == 1 &&
        ((reinterpret_cast<uintptr_t>(x) ^ reinterpret_cast<uintptr_t>(g)) & 15u) == 0) {
        const int64_t head = head_elements(x, L.classes), packs = (L.classes - head) / P;
        for (int64_t k = lane; k < head; k += RT) g[k] = to_storage<T, A>(grad(to_float(x[k]), k == t ? at_target : A(0)));
        const T *xb = x + head;
        T *gb = g + head;
        const int64_t tb = t - head;  // the target's index in the packed body
        // Steps of kUnroll packs, all loaded before any is stored: several loads in flight per
        // thread (the compiler cannot hoist loads over stores it cannot prove apart).
        int64_t k = lane;
        for (; k + (int64_t)(kUnroll - 1) * RT < packs; k += (int64_t)RT * kUnroll) {
            A v[kUnroll][P];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) load_pack<T, P>(xb + (k + (int64_t)u * RT) * P, v[u]);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
                for (int j = 0; j < P; ++j) v[u][j] = grad(v[u][j], A(0));
                store_pack<T, P>(gb + (k + (int64_t)u * RT) * P, v[u]);
            }
        }
        for (; k < packs; k += RT) {
            A v[P];
            load_pack<T, P>(xb + k * P, v);
#pragma unroll
            for (int j = 0; j < P; ++j) v[j] = grad(v[j], A(0));
            store_pack<T, P>(gb + k * P, v);
        }
        // The target's element, if in the packs, again by the thread that wrote it (program
        // order: this write lands last), so the loops above carry no per-element compare.
        if (tb >= 0 && tb < packs * P && lane == (tb / P) % RT) gb[tb] = to_storage<T, A>(grad(x_t, at_target));
        c = head + packs * P;
    }
    for (int64_t k = c + lane; k < L.classes; k += RT)
        g[k * gs] = ignored ? to_storage<T, A>(A(0)) : to_storage<T, A>(grad(to_float(x[k * cs]), k == t ? at_target : A(0)));
}

template <typename T, int RT, bool kSmooth, bool kSoftcap, bool kGrad>
__global__ void __launch_bounds__(kThreads, fwd_min_blocks<T, kGrad>()) xent_fwd_kernel(const __grid_constant__ brrr_xent_launch L) {
    using A = typename Compute<T>::type;
    constexpr int kRows = kThreads / RT, kWarps = kThreads / 32;
    __shared__ Online<A> warp_states[RT == kThreads ? kWarps : 1];
    __shared__ A row_stats[2];  // RT == kThreads with kGrad: the block's row's lse and target logit
    const int lane = threadIdx.x % RT, sub = threadIdx.x / RT;
    const T *logits = static_cast<const T *>(L.logits);
    const int64_t cs = L.logits_class_stride;
    const Softcap<A> cap = softcap_of<A>(L);
    const A divisor = kGrad && L.count ? *static_cast<const A *>(L.count) : A(1);
    // Uniform over the block, so that every lane of a warp reaches the shuffles together.
    for (int64_t first = (int64_t)blockIdx.x * kRows; first < L.rows; first += (int64_t)gridDim.x * kRows) {
        const int64_t r = first + sub;
        const int64_t t = r < L.rows ? load_target(L, row_off(L, L.target_rows, r)) : L.ignore_index;
        const bool counted = t != L.ignore_index, valid = counted && t >= 0 && t < L.classes;
        const T *x = logits + (r < L.rows ? row_off(L, L.logits_rows, r) : 0);
        // The target's logit, loaded first to be in flight during the scan.
        A x_t = lane == 0 && valid ? to_float(x[t * cs]) : A(0);
        Online<A> o = {lowest<A>(), A(0), A(0)};
        if (counted) o = scan_row<kSmooth, kSoftcap, T, RT>(x, L.classes, cs, lane, cap);
#pragma unroll
        for (int mask = (RT < 32 ? RT : 32) / 2; mask > 0; mask /= 2) o = merge(o, shuffle_xor(o, mask));
        if constexpr (RT == kThreads) {
            if (threadIdx.x % 32 == 0) warp_states[threadIdx.x / 32] = o;
            __syncthreads();
            if (threadIdx.x == 0)
                for (int w = 1; w < kWarps; ++w) o = merge(o, warp_states[w]);
            __syncthreads();
        }
        A lse = A(0);
        if (lane == 0 && r < L.rows) {
            A loss = A(0);
            if (!valid && counted) {
                lse = loss = A(NAN);
            } else if (counted) {
                // Relative to the shift (exact differences for nearby values): no rounding at the
                // scale of a large offset common to the row, whose softmax the backward recomputes.
                const A z_t = capped<kSoftcap>(x_t, cap), shift = row_shift(z_t);
                lse = (o.m - shift) + log_(o.s);
                loss = (A(1) - A(L.smoothing)) * (lse - (z_t - shift));
                if (kSmooth) loss += A(L.smoothing) * (lse - (o.sx - shift));
                if (L.z_loss != 0.0) loss += A(L.z_loss) * (lse + shift) * (lse + shift);
            }
            if (L.lse) static_cast<A *>(L.lse)[r] = lse;
            static_cast<A *>(L.loss)[r] = loss;
        }
        if constexpr (kGrad) {
            // The row's lse and target logit from its first thread: the writes below depend on
            // them, so they follow every read of the row (each thread's by the merge above).
            if constexpr (RT == kThreads) {
                if (threadIdx.x == 0) {
                    row_stats[0] = lse;
                    row_stats[1] = x_t;
                }
                __syncthreads();  // the next row's writes to row_stats follow the merge's barriers
                lse = row_stats[0];
                x_t = row_stats[1];
            } else {
                const int first_lane = (threadIdx.x % 32) & ~(RT - 1);
                lse = __shfl_sync(0xffffffffu, lse, first_lane);
                x_t = __shfl_sync(0xffffffffu, x_t, first_lane);
            }
            if (r < L.rows)
                write_grad_row<T, RT, kSoftcap>(L, r, t, x, x_t, lse, counted ? row_scale(L, r, divisor) : A(0), lane, cap);
        }
    }
}

constexpr int kReduceThreads = 1024;

template <typename A>
__global__ void __launch_bounds__(kReduceThreads) xent_reduce_kernel(const __grid_constant__ brrr_xent_launch L) {
    __shared__ double sums[kReduceThreads];
    __shared__ long long counts[kReduceThreads];
    double s = 0.0;
    long long n = 0;
    for (int64_t r = threadIdx.x; r < L.rows; r += kReduceThreads) {
        s += (double)static_cast<const A *>(L.loss)[r];
        n += load_target(L, row_off(L, L.target_rows, r)) != L.ignore_index;
    }
    sums[threadIdx.x] = s;
    counts[threadIdx.x] = n;
    __syncthreads();
    for (int half = kReduceThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            sums[threadIdx.x] += sums[threadIdx.x + half];
            counts[threadIdx.x] += counts[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (L.total) *static_cast<A *>(L.total) = (A)(L.mean ? sums[0] / (double)counts[0] : sums[0]);
        if (L.count_out) *static_cast<A *>(L.count_out) = (A)counts[0];
    }
}

template <typename T, int RT, bool kSoftcap>
__global__ void __launch_bounds__(kThreads) xent_bwd_kernel(const __grid_constant__ brrr_xent_launch L) {
    using A = typename Compute<T>::type;
    constexpr int kRows = kThreads / RT;
    const int lane = threadIdx.x % RT;
    const Softcap<A> cap = softcap_of<A>(L);
    const A divisor = L.count ? *static_cast<const A *>(L.count) : A(1);
    const int64_t cs = L.logits_class_stride;
    for (int64_t r = (int64_t)blockIdx.x * kRows + threadIdx.x / RT; r < L.rows; r += (int64_t)gridDim.x * kRows) {
        const int64_t t = load_target(L, row_off(L, L.target_rows, r));
        const T *x = static_cast<const T *>(L.logits) + row_off(L, L.logits_rows, r);
        A scale = A(0), lse = A(NAN), x_t = A(0);
        if (t != L.ignore_index) {
            scale = row_scale(L, r, divisor);
            if (t >= 0 && t < L.classes) {
                lse = static_cast<const A *>(L.lse)[r];
                x_t = to_float(x[t * cs]);  // g never overlaps x (the glue checks): no write can race this
            }
        }
        write_grad_row<T, RT, kSoftcap>(L, r, t, x, x_t, lse, scale, lane, cap);
    }
}

// ---- launchers ------------------------------------------------------------------------------

inline unsigned grid_for(int64_t rows, int rows_per_block) {
    const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block, cap = ((int64_t)1 << 31) - 1;
    return (unsigned)(blocks < cap ? blocks : cap);
}

template <typename T, template <typename, int> class Kernel>
static cudaError_t launch_rows(const brrr_xent_launch &L, cudaStream_t stream) {
    if (L.rows == 0) return cudaSuccess;
    if (L.classes <= 64) Kernel<T, 8>::launch(L, grid_for(L.rows, kThreads / 8), stream);
    else if (L.classes <= 4096) Kernel<T, 32>::launch(L, grid_for(L.rows, kThreads / 32), stream);
    else Kernel<T, kThreads>::launch(L, grid_for(L.rows, 1), stream);
    return cudaGetLastError();
}

// f(std::true_type) or f(std::false_type): a run-time flag as a template argument.
template <typename F> void with_flag(bool on, F &&f) {
    if (on) f(std::true_type{});
    else f(std::false_type{});
}

template <typename T, int RT> struct Forward {
    static void launch(const brrr_xent_launch &L, unsigned grid, cudaStream_t s) {
        with_flag(L.smoothing != 0.0, [&](auto smooth) {
            with_flag(L.softcap != 0.0, [&](auto cap) {
                with_flag(L.grad_logits != nullptr, [&](auto grad) {
                    xent_fwd_kernel<T, RT, decltype(smooth)::value, decltype(cap)::value, decltype(grad)::value>
                        <<<grid, kThreads, 0, s>>>(L);
                });
            });
        });
    }
};
template <typename T, int RT> struct Backward {
    static void launch(const brrr_xent_launch &L, unsigned grid, cudaStream_t s) {
        with_flag(L.softcap != 0.0, [&](auto cap) { xent_bwd_kernel<T, RT, decltype(cap)::value><<<grid, kThreads, 0, s>>>(L); });
    }
};

// Defined here, instantiated once per dtype by the BRRR_INSTANTIATE block at the end.
template <typename T>
cudaError_t xent_fwd_typed(const brrr_xent_launch &L, cudaStream_t stream) {
    const cudaError_t err = launch_rows<T, Forward>(L, stream);
    if (err != cudaSuccess || (!L.total && !L.count_out)) return err;
    xent_reduce_kernel<typename Compute<T>::type><<<1, kReduceThreads, 0, stream>>>(L);
    return cudaGetLastError();
}

template <typename T>
cudaError_t xent_bwd_typed(const brrr_xent_launch &L, cudaStream_t stream) {
    return launch_rows<T, Backward>(L, stream);
}

}  // namespace xent
}  // namespace brrr

// setup.py compiles this header once per dtype, naming it BRRR_INSTANTIATE, each in a translation
// unit of its own so that the dtypes compile in parallel.
#ifdef BRRR_INSTANTIATE
template cudaError_t brrr::xent::xent_fwd_typed<BRRR_INSTANTIATE>(const brrr_xent_launch &, cudaStream_t);
template cudaError_t brrr::xent::xent_bwd_typed<BRRR_INSTANTIATE>(const brrr_xent_launch &, cudaStream_t);
#endif
