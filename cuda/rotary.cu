// Rotary position embedding (the launch and the formulas: brrr_cuda.h). Two kernels, picked by
// BRRR_ROTARY_KERNEL (docs/kernel-switches.md):
//
// units: one thread per unit of one row, grid-stride: a unit is VEC consecutive
// pairs p .. p + VEC (their features e0 and e1 at p and p + half, or 2p .. 2p + 2 VEC
// interleaved), then, where out is not x, VEC of the features past the rotated ones, copied. With
// stride-1 last dims, 16-byte aligned rows and half and pass multiples of VEC, every read and
// write is one 16-byte access (x and out: two, cos and sin: two, or one of angles per pair);
// otherwise VEC = 1. The row index is decomposed once per unit for all four tensors, in 32 bits
// unless the rows or units exceed that.
//
// token (the default where it applies): the rows split into positions and heads, where some row dim is one over which cos and
// sin are broadcast (the heads of q and k as Llama-style attention rotates them). A group of
// threads takes one position: each thread one unit of a head, its angles read once and kept in
// registers for every head it takes (slot s of the group: heads s, s + slots, ...), the position's
// offsets decomposed once, the loads of kAhead heads issued before their stores. A pair (q and k
// of apply_rotary_pos_emb, dq and dk of its backward) is one launch where both tensors have the
// same positions (the same position dims, the angles at the same offsets): a position's heads
// are q's followed by k's (k's may be fewer: GQA), so its angles are read once for both; else the
// pair is two launches. x and out are streamed (evict-first in L1 and L2), so that cos and sin,
// read once per position, stay in L2 for the next launch; a launch on the angles of the one
// before (the next layer's, or k's after q's where the pair is two launches) runs its positions
// from the last, so that it starts on those that launch read last. 16-byte units only; otherwise
// units, which takes a pair as two launches.
#include <string.h>

#include <atomic>

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

// The pairs' rotated values written back where load_pairs read them.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void store_pairs(T *base, int64_t stride, int64_t p, int64_t h, bool interleaved,
                                            const A (&lo)[VEC], const A (&hi)[VEC]) {
    if (interleaved) {
        A both[2 * VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            both[2 * k] = lo[k];
            both[2 * k + 1] = hi[k];
        }
        store<T, VEC>(base + 2 * p * stride, both);
        store<T, VEC>(base + (2 * p + VEC) * stride, both + VEC);
    } else {
        store<T, VEC>(base + p * stride, lo);
        store<T, VEC>(base + (p + h) * stride, hi);
    }
}

// The VEC pairs (a, b) rotated by the angles' (c0, s0) and (c1, s1), or by the transpose.
// Written as fma so that both kernels round alike (contraction left to the compiler differs with
// the surrounding code).
template <int VEC, typename A>
__device__ __forceinline__ void rotate(bool backward, const A (&a)[VEC], const A (&b)[VEC], const A (&c0)[VEC],
                                       const A (&c1)[VEC], const A (&s0)[VEC], const A (&s1)[VEC], A (&lo)[VEC],
                                       A (&hi)[VEC]) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        if (backward) {
            lo[k] = fma(a[k], c0[k], b[k] * s1[k]);
            hi[k] = fma(b[k], c1[k], -(a[k] * s0[k]));
        } else {
            lo[k] = fma(a[k], c0[k], -(b[k] * s0[k]));
            hi[k] = fma(b[k], c1[k], a[k] * s1[k]);
        }
    }
}

// The VEC pairs' angles from cos at c and sin at s (stride 1 when VEC > 1): per feature, or one
// per pair (both features of pair p take angle p).
template <typename T, int VEC, typename A>
__device__ __forceinline__ void load_angles(const brrr_rotary_launch &L, const T *c, const T *s, int64_t p,
                                            A (&c0)[VEC], A (&c1)[VEC], A (&s0)[VEC], A (&s1)[VEC]) {
    const int64_t sc = L.col_stride[2], ss = L.col_stride[3];
    if (L.pair_angles) {
        load<T, VEC>(c + p * sc, c0);
        load<T, VEC>(s + p * ss, s0);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            c1[k] = c0[k];
            s1[k] = s0[k];
        }
    } else {
        load_pairs<T, VEC>(c, sc, p, L.half, L.interleaved, c0, c1);
        load_pairs<T, VEC>(s, ss, p, L.half, L.interleaved, s0, s1);
    }
}

template <typename T, int VEC, typename Index>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const __grid_constant__ brrr_rotary_launch L) {
    using A = typename Compute<T>::type;
    const Index rotated = (Index)(L.half / VEC), per_row = rotated + (Index)(L.pass / VEC);
    const int64_t total = L.rows * (int64_t)per_row, h = L.half;
    const int64_t sx = L.col_stride[0], so = L.col_stride[1];
    const bool interleaved = L.interleaved;
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
        A a[VEC], b[VEC], c0[VEC], c1[VEC], s0[VEC], s1[VEC], lo[VEC], hi[VEC];
        load_pairs<T, VEC>(x, sx, p, h, interleaved, a, b);
        load_angles<T, VEC>(L, static_cast<const T *>(L.cos.data) + off[2], static_cast<const T *>(L.sin.data) + off[3],
                            p, c0, c1, s0, s1);
        rotate<VEC>((bool)L.backward, a, b, c0, c1, s0, s1, lo, hi);
        store_pairs<T, VEC>(o, so, p, h, interleaved, lo, hi);
    }
}

// ---- token: a position's heads on one group of threads, sharing their angles ---------------------

// Heads of one thread whose loads are issued before any of their stores: 4 x 32 bytes of x in
// flight a thread beside its angles (in float32). Within 128 registers (2 blocks an SM, 64 KB of
// loads in flight); at 2 heads, 90-110 registers still kept 2 blocks an SM, with half the loads.
constexpr int kAhead = 4;

// The token kernel's launch: the rows as positions (the row dims but the heads', merged where
// every view allows) times heads (a row dim over which cos and sin are broadcast).
struct TokenLaunch {
    brrr_rotary_launch L;    // row_ndim, row_shape and the views' strides over the position dims
                             // (x2's and out2's too, for a pair)
    int64_t positions, heads;
    int64_t head_stride[2];  // x's and out's
    int64_t heads2;          // the pair's second tensor's heads after x's (0: none)
    int64_t head_stride2[2]; // x2's and out2's
    int32_t group;           // threads a position: its units times slots
    int32_t slots;           // slot s of a group takes heads s, s + slots, ...
    int32_t descending;      // positions from the last
};

// A unit's two 16-byte packs (of x, streamed, or of cos or sin) from `first`, the unit's first
// pack, and first + `second`: p and p + h, or 2p and 2p + VEC interleaved.
template <bool Stream, typename T>
__device__ __forceinline__ void load_unit(const T *first, int64_t second, uint4 (&raw)[2]) {
    const uint4 *a = reinterpret_cast<const uint4 *>(first), *b = reinterpret_cast<const uint4 *>(first + second);
    raw[0] = Stream ? __ldcs(a) : *a;
    raw[1] = Stream ? __ldcs(b) : *b;
}

// The unit's VEC pairs, (first, second) features, in the compute type.
template <typename T, int VEC, bool Interleaved, typename A>
__device__ __forceinline__ void unpack_pairs(const uint4 (&raw)[2], A (&first)[VEC], A (&second)[VEC]) {
    Pack<T, VEC> pk[2];
    memcpy(pk, raw, sizeof pk);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        if constexpr (Interleaved) {  // pair k: elements 2k and 2k + 1 of the unit's 2 VEC
            first[k] = to_float(pk[2 * k / VEC].v[2 * k % VEC]);
            second[k] = to_float(pk[(2 * k + 1) / VEC].v[(2 * k + 1) % VEC]);
        } else {
            first[k] = to_float(pk[0].v[k]);
            second[k] = to_float(pk[1].v[k]);
        }
    }
}

// One pack of VEC angles, one a pair, as both features' angles.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void unpack_pair_angles(const uint4 &raw, A (&a0)[VEC], A (&a1)[VEC]) {
    Pack<T, VEC> pk;
    memcpy(&pk, &raw, sizeof pk);
#pragma unroll
    for (int k = 0; k < VEC; ++k) a0[k] = a1[k] = to_float(pk.v[k]);
}

// The rotated pairs stored (streamed) where load_unit read them.
template <typename T, int VEC, bool Interleaved, typename A>
__device__ __forceinline__ void store_unit(T *first, int64_t second, const A (&lo)[VEC], const A (&hi)[VEC]) {
    Pack<T, VEC> pk[2];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        if constexpr (Interleaved) {
            pk[2 * k / VEC].v[2 * k % VEC] = to_storage<T, A>(lo[k]);
            pk[(2 * k + 1) / VEC].v[(2 * k + 1) % VEC] = to_storage<T, A>(hi[k]);
        } else {
            pk[0].v[k] = to_storage<T, A>(lo[k]);
            pk[1].v[k] = to_storage<T, A>(hi[k]);
        }
    }
    uint4 raw[2];
    memcpy(raw, pk, sizeof raw);
    __stcs(reinterpret_cast<uint4 *>(first), raw[0]);
    __stcs(reinterpret_cast<uint4 *>(first + second), raw[1]);
}

// The features past the rotated ones of n heads (from x and o, a step apart), copied as they are.
template <typename T>
__device__ __forceinline__ void copy_heads(const T *x, T *o, int n, int64_t x_step, int64_t o_step) {
    for (int first = 0; first < n; first += kAhead, x += kAhead * x_step, o += kAhead * o_step) {
        uint4 v[kAhead];
#pragma unroll
        for (int k = 0; k < kAhead; ++k)
            if (first + k < n) v[k] = __ldcs(reinterpret_cast<const uint4 *>(x + k * x_step));
#pragma unroll
        for (int k = 0; k < kAhead; ++k)
            if (first + k < n) __stcs(reinterpret_cast<uint4 *>(o + k * o_step), v[k]);
    }
}

// The unit of n heads (from x and o, a step apart) rotated by the unit's angles.
template <typename T, int VEC, bool Interleaved, bool Backward, typename A>
__device__ __forceinline__ void rotate_heads(const T *x, T *o, int n, int64_t x_step, int64_t o_step, int64_t second,
                                             const A (&c0)[VEC], const A (&c1)[VEC], const A (&s0)[VEC],
                                             const A (&s1)[VEC]) {
    for (int first = 0; first < n; first += kAhead, x += kAhead * x_step, o += kAhead * o_step) {
        uint4 xr[kAhead][2];
#pragma unroll
        for (int k = 0; k < kAhead; ++k)
            if (first + k < n) load_unit<true>(x + k * x_step, second, xr[k]);
#pragma unroll
        for (int k = 0; k < kAhead; ++k) {
            if (first + k >= n) continue;
            A a[VEC], b[VEC], lo[VEC], hi[VEC];
            unpack_pairs<T, VEC, Interleaved>(xr[k], a, b);
            rotate<VEC>(Backward, a, b, c0, c1, s0, s1, lo, hi);
            store_unit<T, VEC, Interleaved>(o + k * o_step, second, lo, hi);
        }
    }
}

template <typename T, int VEC, bool Interleaved, bool PairAngles, bool Backward>
__global__ void __launch_bounds__(kThreads, 2) rotary_token_kernel(const __grid_constant__ TokenLaunch K) {
    using A = typename Compute<T>::type;
    const brrr_rotary_launch &L = K.L;
    const int per_block = kThreads / K.group, g = (int)threadIdx.x / K.group;
    if (g >= per_block) return;  // past the block's last whole group
    const int units = (int)((L.half + L.pass) / VEC), rotated = (int)(L.half / VEC);
    const int lane = (int)threadIdx.x - g * K.group, slot = lane / units, u = lane - slot * units;
    // This thread's heads: slot, slot + slots, ... of x's heads followed by x2's (k's after q's),
    // n of x's from `slot`, then n2 of x2's from `first2`, kAhead at a time. Its unit: the
    // features from `at` (in x, out, and the angles per feature) and `at + second`, or the VEC
    // copied from `at`.
    const int n = (int)((K.heads - slot + K.slots - 1) / K.slots);
    const int64_t first2 = slot + (int64_t)n * K.slots - K.heads;  // in [0, slots)
    const int n2 = first2 < K.heads2 ? (int)((K.heads2 - first2 + K.slots - 1) / K.slots) : 0;
    const int64_t p = (int64_t)u * VEC, second = Interleaved ? VEC : L.half;
    const int64_t at = u >= rotated ? L.half + p : Interleaved ? 2 * p : p;
    const int64_t x_step = K.slots * K.head_stride[0], o_step = K.slots * K.head_stride[1];
    const int64_t x2_step = K.slots * K.head_stride2[0], o2_step = K.slots * K.head_stride2[1];
    const int64_t *const strides[6] = {L.x.strides,   L.out.strides, L.cos.strides,
                                       L.sin.strides, L.x2.strides,  L.out2.strides};
    for (int64_t i = (int64_t)blockIdx.x * per_block + g; i < K.positions; i += (int64_t)gridDim.x * per_block) {
        int64_t off[6];
        unravel_offsets<uint32_t, BRRR_MAX_DIMS>(L.row_ndim, L.row_shape, K.descending ? K.positions - 1 - i : i,
                                                 strides, off);
        const T *x = static_cast<const T *>(L.x.data) + off[0] + slot * K.head_stride[0] + at;
        T *o = static_cast<T *>(L.out.data) + off[1] + slot * K.head_stride[1] + at;
        const T *x2 = n2 ? static_cast<const T *>(L.x2.data) + off[4] + first2 * K.head_stride2[0] + at : nullptr;
        T *o2 = n2 ? static_cast<T *>(L.out2.data) + off[5] + first2 * K.head_stride2[1] + at : nullptr;
        if (u >= rotated) {  // the features past the rotated ones
            copy_heads(x, o, n, x_step, o_step);
            copy_heads(x2, o2, n2, x2_step, o2_step);
            continue;
        }
        // This unit's angles, once for every head of the position it takes.
        const T *c = static_cast<const T *>(L.cos.data) + off[2], *s = static_cast<const T *>(L.sin.data) + off[3];
        A c0[VEC], c1[VEC], s0[VEC], s1[VEC];
        if constexpr (PairAngles) {
            unpack_pair_angles<T, VEC>(*reinterpret_cast<const uint4 *>(c + p), c0, c1);
            unpack_pair_angles<T, VEC>(*reinterpret_cast<const uint4 *>(s + p), s0, s1);
        } else {
            uint4 cr[2], sr[2];
            load_unit<false>(c + at, second, cr);
            load_unit<false>(s + at, second, sr);
            unpack_pairs<T, VEC, Interleaved>(cr, c0, c1);
            unpack_pairs<T, VEC, Interleaved>(sr, s0, s1);
        }
        rotate_heads<T, VEC, Interleaved, Backward>(x, o, n, x_step, o_step, second, c0, c1, s0, s1);
        rotate_heads<T, VEC, Interleaved, Backward>(x2, o2, n2, x2_step, o2_step, second, c0, c1, s0, s1);
    }
}

// BRRR_ROTARY_KERNEL (docs/kernel-switches.md): `units`; `token-ascending`, token with its
// positions always from the first; unset, empty, `token` or any other value, token (measured
// faster everywhere it applies: 85-97% of the floor against units' 53-75%).
enum class Choice { kUnits, kToken, kTokenAscending };
static Choice choice() {
    const char *v = getenv("BRRR_ROTARY_KERNEL");
    if (v == nullptr) return Choice::kToken;
    if (strcmp(v, "units") == 0) return Choice::kUnits;
    if (strcmp(v, "token-ascending") == 0) return Choice::kTokenAscending;
    return Choice::kToken;
}

// The pair's second tensor as a launch of its own.
static brrr_rotary_launch second_of(const brrr_rotary_launch &L) {
    brrr_rotary_launch S = L;
    S.pair = 0;
    S.row_ndim = L.row_ndim2;
    S.rows = L.rows2;
    memcpy(S.row_shape, L.row_shape2, sizeof S.row_shape);
    S.x = L.x2;
    S.out = L.out2;
    S.cos = L.cos2;
    S.sin = L.sin2;
    memcpy(S.col_stride, L.col_stride2, sizeof S.col_stride);
    return S;
}

// The launch of x alone (the pair's x2 left out) as positions times heads for units of `vec`
// elements, or false where it does not fit the token kernel: no row dim of size > 1 over which
// cos and sin are broadcast (no angles to share), or one head's units past a block. The heads'
// dim is the last such dim of the coalesced row shape (ordered by x's strides, largest first: the
// heads of a (batch, seq, heads, d) tensor, viewed as (batch, heads, seq, d) or not).
static bool token_split(const brrr_rotary_launch &L, int vec, TokenLaunch *K) {
    const int64_t units = (L.half + L.pass) / vec;
    if (units > kThreads) return false;
    int hd = -1;
    for (int d = L.row_ndim - 1; d >= 0 && hd < 0; --d)
        if (L.cos.strides[d] == 0 && L.sin.strides[d] == 0 && L.row_shape[d] > 1) hd = d;
    if (hd < 0) return false;
    K->L = L;
    K->heads = L.row_shape[hd];
    K->heads2 = 0;
    K->head_stride2[0] = K->head_stride2[1] = 0;
    K->positions = L.rows / K->heads;
    if (K->positions > (int64_t)UINT32_MAX) return false;  // positions decomposed in 32 bits
    K->head_stride[0] = L.x.strides[hd];
    K->head_stride[1] = L.out.strides[hd];
    // The position dims: the rest, merged where each view's strides allow (a (batch, seq) pair of
    // dims becomes one for per-batch angles: no division a position).
    const brrr_view *from[4] = {&L.x, &L.out, &L.cos, &L.sin};
    brrr_view *to[4] = {&K->L.x, &K->L.out, &K->L.cos, &K->L.sin};
    int n = 0;
    for (int d = 0; d < L.row_ndim; ++d) {
        if (d == hd) continue;
        bool merge = n > 0;
        for (int k = 0; k < 4 && merge; ++k) merge = to[k]->strides[n - 1] == from[k]->strides[d] * L.row_shape[d];
        if (merge) {
            K->L.row_shape[n - 1] *= L.row_shape[d];
        } else {
            K->L.row_shape[n] = L.row_shape[d];
            ++n;
        }
        for (int k = 0; k < 4; ++k) to[k]->strides[n - 1] = from[k]->strides[d];
    }
    if (n == 0) {  // a single position
        K->L.row_shape[0] = 1;
        for (int k = 0; k < 4; ++k) to[k]->strides[0] = 0;
        n = 1;
    }
    K->L.row_ndim = n;
    return true;
}

// The pair as one launch: x's heads then x2's a position, where both split into the same
// positions (the same merged position dims, the angles at the same offsets); false otherwise.
static bool token_pair(const brrr_rotary_launch &L, int vec, TokenLaunch *K) {
    TokenLaunch K2;
    if (!token_split(L, vec, K) || !token_split(second_of(L), vec, &K2)) return false;
    const brrr_rotary_launch &A = K->L, &B = K2.L;
    if (A.row_ndim != B.row_ndim) return false;
    for (int d = 0; d < A.row_ndim; ++d)
        if (A.row_shape[d] != B.row_shape[d] || A.cos.strides[d] != B.cos.strides[d] ||
            A.sin.strides[d] != B.sin.strides[d])
            return false;
    K->L.x2 = B.x;
    K->L.out2 = B.out;
    K->heads2 = K2.heads;
    K->head_stride2[0] = K2.head_stride[0];
    K->head_stride2[1] = K2.head_stride[1];
    return true;
}

// Slots: one unless the positions' units leave the SMs short of 512 threads each; then the fewest
// that give that many, taking as few heads a thread as that many slots would (over both tensors'
// heads for a pair).
static void token_slots(TokenLaunch *K, int vec, int device) {
    const int64_t units = (K->L.half + K->L.pass) / vec, heads = K->heads + K->heads2;
    const int64_t want = (int64_t)sm_count(device) * 512, have = K->positions * units;
    int64_t slots = have >= want ? 1 : (want + have - 1) / have;
    slots = slots < heads ? slots : heads;
    slots = slots < kThreads / units ? slots : kThreads / units;
    const int64_t per_thread = (heads + slots - 1) / slots;
    K->slots = (int32_t)((heads + per_thread - 1) / per_thread);
    K->group = (int32_t)(units * K->slots);
}

// Whether this launch runs its positions from the last: where the launch before it (of the token
// kernel, on any stream) read the same cos and ran from the first. The previous angles' address
// keeps that direction in its bit 0 (token launches are 16-byte aligned); a race between threads
// costs only L2 hits.
static bool descending_after_previous(const brrr_rotary_launch &L) {
    static std::atomic<uintptr_t> previous{0};
    const uintptr_t angles = reinterpret_cast<uintptr_t>(L.cos.data), before = previous.load(std::memory_order_relaxed);
    const bool descending = (before & ~(uintptr_t)1) == angles && (before & 1) == 0;
    previous.store(angles | (descending ? 1 : 0), std::memory_order_relaxed);
    return descending;
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

template <typename T, bool Interleaved, bool PairAngles>
static void launch_token_layout(const TokenLaunch &K, unsigned grid, cudaStream_t stream) {
    constexpr int P = 16 / sizeof(T);
    if (K.L.backward) rotary_token_kernel<T, P, Interleaved, PairAngles, true><<<grid, kThreads, 0, stream>>>(K);
    else rotary_token_kernel<T, P, Interleaved, PairAngles, false><<<grid, kThreads, 0, stream>>>(K);
}

template <typename T>
static void launch_token(TokenLaunch &K, bool ascending, int device, cudaStream_t stream) {
    K.descending = !ascending && descending_after_previous(K.L);
    const int64_t per_block = kThreads / K.group, blocks = (K.positions + per_block - 1) / per_block;
    const int64_t cap = (int64_t)sm_count(device) * 32;
    const unsigned grid = (unsigned)(blocks < cap ? blocks : cap);
    if (K.L.interleaved) {
        if (K.L.pair_angles) launch_token_layout<T, true, true>(K, grid, stream);
        else launch_token_layout<T, true, false>(K, grid, stream);
    } else {
        if (K.L.pair_angles) launch_token_layout<T, false, true>(K, grid, stream);
        else launch_token_layout<T, false, false>(K, grid, stream);
    }
}

// One tensor (L.pair ignored).
template <typename T>
static cudaError_t rotary_one(const brrr_rotary_launch &L, Choice kernel, int device, cudaStream_t stream) {
    constexpr int P = 16 / sizeof(T);
    const bool vector = vectorizable<T>(L);
    TokenLaunch K;
    if (vector && kernel != Choice::kUnits && token_split(L, P, &K)) {
        token_slots(&K, P, device);
        launch_token<T>(K, kernel == Choice::kTokenAscending, device, stream);
        return cudaGetLastError();
    }
    const int64_t work = L.rows * ((L.half + L.pass) / (vector ? P : 1));
    const int64_t blocks = (work + kThreads - 1) / kThreads, cap = (int64_t)sm_count(device) * 32;
    const unsigned grid = (unsigned)(blocks < cap ? blocks : cap);
    if (vector) launch<T, P>(L, grid, stream);
    else launch<T, 1>(L, grid, stream);
    return cudaGetLastError();
}

// A pair as one token launch where it fits, else as two launches, x's then x2's.
template <typename T>
static cudaError_t rotary_typed(const brrr_rotary_launch &L, int device, cudaStream_t stream) {
    constexpr int P = 16 / sizeof(T);
    const Choice kernel = choice();
    if (!L.pair) return rotary_one<T>(L, kernel, device, stream);
    const brrr_rotary_launch S = second_of(L);
    TokenLaunch K;
    if (kernel != Choice::kUnits && vectorizable<T>(L) && vectorizable<T>(S) && token_pair(L, P, &K)) {
        token_slots(&K, P, device);
        launch_token<T>(K, kernel == Choice::kTokenAscending, device, stream);
        return cudaGetLastError();
    }
    const cudaError_t first = rotary_one<T>(L, kernel, device, stream);
    return first != cudaSuccess ? first : rotary_one<T>(S, kernel, device, stream);
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
