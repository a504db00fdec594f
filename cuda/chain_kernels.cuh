// Elementwise chain kernels, forward and backward.
//
// chain_fwd_contig_kernel   dense tensors. Formula: out[i] = program(x[i], operands[.][i]).
//                           Each thread owns kUnroll 16-byte packs (VEC elements each) spaced one
//                           block apart, so a warp's accesses stay coalesced; every pack is loaded
//                           before any is computed. Steps are dispatched once per pack (the
//                           program is warp-uniform), not once per element.
//                           Assumes: 16-byte aligned pointers, vector operands only when
//                           row_length % VEC == 0 (else VEC = 1 is launched).
// chain_fwd_strided_kernel  any strides over the coalesced shape (<= BRRR_MAX_DIMS dims); one
//                           element per thread per grid-stride step.
// chain_bwd_contig_kernel   grad_x = grad_out * d program / dx, and x-shaped operand gradients,
// chain_bwd_strided_kernel  recomputing the program from x in registers (nothing was saved).
// chain_{fwd,bwd}_rows_kernel  row layout: the last dim is a row of columns with stride 1 (or any
//                           stride, VEC = 1), rows have any strides. A block owns a column tile
//                           (32 threads x VEC columns) and a slice of rows that its 8 warps walk,
//                           the next rows staged in shared memory (RowPipeline); vector operands
//                           (a bias) are read once per thread. The backward sums
//                           a bias gradient over its rows in a fixed order (see the kernel).
// chain_vector_grad_kernel  sums those per-slice partials in order into the bias gradient.
#pragma once

#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "brrr_cuda.h"
#include "chain_math.cuh"
#include "common.cuh"

namespace brrr {

template <typename T> struct MathFor { using type = Fast32; };
template <> struct MathFor<float> { using type = Precise32; };
template <> struct MathFor<double> { using type = Precise64; };

constexpr int kUnroll = 2;
// A register budget for ptxas, which otherwise chose 64 registers and spilled in the bf16
// backward: 3 blocks of 256 threads per SM allow 85 registers, 2 allow 128 (operand packs).
constexpr int contig_blocks_per_sm(int ops) { return ops == 0 ? 3 : 2; }

// Offsets of element i in each tensor's strides over the launch shape.
struct Offsets {
    int64_t x, out, grad_out, op[BRRR_MAX_CHAIN_OPERANDS], grad_op[BRRR_MAX_CHAIN_OPERANDS];
};

template <int kOps>
__device__ __forceinline__ Offsets strided_offsets(const brrr_chain_launch &L, int64_t i, bool backward) {
    Offsets o = {};
#pragma unroll
    for (int d = BRRR_MAX_DIMS - 1; d >= 0; --d) {
        if (d < L.ndim) {
            const int64_t c = i % L.shape[d];
            i /= L.shape[d];
            o.x += c * L.x.strides[d];
            o.out += c * L.out.strides[d];
            if (backward) o.grad_out += c * L.grad_out.strides[d];
#pragma unroll
            for (int b = 0; b < kOps; ++b) {
                o.op[b] += c * L.operands[b].strides[d];
                if (backward) o.grad_op[b] += c * L.grad_operands[b].strides[d];
            }
        }
    }
    return o;
}

template <typename T, typename V> __device__ __forceinline__ const T *in_ptr(const V &v) { return static_cast<const T *>(v.data); }
template <typename T, typename V> __device__ __forceinline__ T *out_ptr(const V &v) { return static_cast<T *>(v.data); }

// What a contiguous launch needs: no shapes or strides. A fifth of brrr_chain_launch, which
// matters for the host: kernel parameters are copied at every launch.
struct FlatView {
    void *data;
};
struct FlatLaunch {
    brrr_chain_program program;
    int64_t numel, row_length;
    int32_t operand_is_vector[BRRR_MAX_CHAIN_OPERANDS];
    FlatView x, out, grad_out, operands[BRRR_MAX_CHAIN_OPERANDS], grad_operands[BRRR_MAX_CHAIN_OPERANDS];
};

static FlatLaunch flat_launch(const brrr_chain_launch &L) {
    FlatLaunch f;
    f.program = L.program;
    f.numel = L.numel;
    f.row_length = L.row_length;
    f.x.data = L.x.data;
    f.out.data = L.out.data;
    f.grad_out.data = L.grad_out.data;
    for (int b = 0; b < BRRR_MAX_CHAIN_OPERANDS; ++b) {
        f.operand_is_vector[b] = L.operand_is_vector[b];
        f.operands[b].data = L.operands[b].data;
        f.grad_operands[b].data = L.grad_operands[b].data;
    }
    return f;
}

// Element index of operand b at flat index i of a contiguous launch.
__device__ __forceinline__ int64_t operand_index(const FlatLaunch &L, int b, int64_t i) {
    return L.operand_is_vector[b] ? i % L.row_length : i;
}

// The forward program over N values at once: one dispatch per step (the program is
// warp-uniform), operand slot `slot` of v joining at its tensor step (kOps bounds the slots).
template <typename M, int kOps, int N, int kSlots, typename A>
__device__ __forceinline__ void program_fwd_pack(const brrr_chain_program &p, A (&y)[N], const A (&v)[kSlots][N]) {
    for (int k = 0; k < p.n_steps; ++k) {
        const int op = p.steps[k].op;
        if (op == BRRR_OP_ADD_TENSOR || op == BRRR_OP_MUL_TENSOR) {
            const int slot = p.steps[k].operand;
#pragma unroll
            for (int b = 0; b < kOps; ++b) {
                if (b != slot) continue;
#pragma unroll
                for (int j = 0; j < N; ++j) y[j] = op == BRRR_OP_ADD_TENSOR ? y[j] + v[b][j] : y[j] * v[b][j];
            }
        } else {
            M::apply(op, static_cast<A>(p.steps[k].scalar), y);
        }
    }
}

// kOps: an upper bound on the program's operands (0, 1 or 4), so unused slots cost no registers.
template <typename T, int VEC, int kOps>
__global__ void __launch_bounds__(kThreads, contig_blocks_per_sm(kOps)) chain_fwd_contig_kernel(const __grid_constant__ FlatLaunch L) {
    using A = typename Compute<T>::type;
    using M = typename MathFor<T>::type;
    constexpr int N = VEC * kUnroll;
    const int64_t n_packs = L.numel / VEC;
    const int64_t first = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;

    A y[N] = {}, operand[kOps > 0 ? kOps : 1][N] = {};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t pack = first + (int64_t)u * kThreads;
        if (pack >= n_packs) continue;
        load_pack<T, VEC>(in_ptr<T>(L.x) + pack * VEC, y + u * VEC);
#pragma unroll
        for (int b = 0; b < kOps; ++b)
            if (b < L.program.n_operands)
                load_pack<T, VEC>(in_ptr<T>(L.operands[b]) + operand_index(L, b, pack * VEC), operand[b] + u * VEC);
    }
    program_fwd_pack<M, kOps>(L.program, y, operand);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t pack = first + (int64_t)u * kThreads;
        if (pack < n_packs) store_pack<T, VEC>(out_ptr<T>(L.out) + pack * VEC, y + u * VEC);
    }
    // The last numel % VEC elements, one per thread of block 0.
    if (VEC > 1 && blockIdx.x == 0) {
        const int64_t i = n_packs * VEC + threadIdx.x;
        if (i < L.numel) {
            A v[BRRR_MAX_CHAIN_OPERANDS] = {};
#pragma unroll
            for (int b = 0; b < kOps; ++b)
                if (b < L.program.n_operands) v[b] = to_float(in_ptr<T>(L.operands[b])[operand_index(L, b, i)]);
            out_ptr<T>(L.out)[i] = to_storage<T, A>(M::program_fwd(L.program.steps, L.program.n_steps, to_float(in_ptr<T>(L.x)[i]), v));
        }
    }
}

template <typename T, int kOps>
__global__ void __launch_bounds__(kThreads) chain_fwd_strided_kernel(const __grid_constant__ brrr_chain_launch L) {
    using A = typename Compute<T>::type;
    for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < L.numel; i += (int64_t)gridDim.x * kThreads) {
        const Offsets o = strided_offsets<kOps>(L, i, false);
        A v[BRRR_MAX_CHAIN_OPERANDS] = {};
#pragma unroll
        for (int b = 0; b < kOps; ++b)
            if (b < L.program.n_operands) v[b] = to_float(in_ptr<T>(L.operands[b])[o.op[b]]);
        const A y = to_float(in_ptr<T>(L.x)[o.x]);
        out_ptr<T>(L.out)[o.out] = to_storage<T, A>(MathFor<T>::type::program_fwd(L.program.steps, L.program.n_steps, y, v));
    }
}

// The backward sweep over N values at once: replays the program from y = x, returning in total
// d out / d x and in grads d out / d operand (one dispatch per step, as in the forward).
template <typename M, int N, int kSlots, typename A>
__device__ __forceinline__ void program_grad_pack(const brrr_chain_program &p, A (&y)[N], const A (&v)[kSlots][N],
                                                  A (&total)[N], A (&grads)[kSlots][N]) {
    int active = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        total[j] = A(1);
#pragma unroll
        for (int b = 0; b < kSlots; ++b) grads[b][j] = A(0);
    }
    for (int k = 0; k < p.n_steps; ++k) {
        const int op = p.steps[k].op;
        if (op == BRRR_OP_ADD_TENSOR || op == BRRR_OP_MUL_TENSOR)
            M::tensor_step_grad(op, p.steps[k].operand, v, y, total, grads, active);
        else
            M::apply_grad(op, static_cast<A>(p.steps[k].scalar), y, total, grads, active);
    }
}

// Backward of dense tensors: packs as in the forward.
template <typename T, int VEC, int kOps>
__global__ void __launch_bounds__(kThreads, contig_blocks_per_sm(kOps)) chain_bwd_contig_kernel(const __grid_constant__ FlatLaunch L) {
    using A = typename Compute<T>::type;
    using M = typename MathFor<T>::type;
    constexpr int N = VEC * kUnroll;
    constexpr int kSlots = kOps > 0 ? kOps : 1;
    const int64_t n_packs = L.numel / VEC;
    const int64_t first = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;
    const int nops = L.program.n_operands;

    A y[N] = {}, g[N] = {}, operand[kSlots][N] = {};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t pack = first + (int64_t)u * kThreads;
        if (pack >= n_packs) continue;
        load_pack<T, VEC>(in_ptr<T>(L.x) + pack * VEC, y + u * VEC);
        load_pack<T, VEC>(in_ptr<T>(L.grad_out) + pack * VEC, g + u * VEC);
#pragma unroll
        for (int b = 0; b < kOps; ++b)
            if (b < nops) load_pack<T, VEC>(in_ptr<T>(L.operands[b]) + operand_index(L, b, pack * VEC), operand[b] + u * VEC);
    }
    A total[N], grads[kSlots][N];
    program_grad_pack<M>(L.program, y, operand, total, grads);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        total[j] *= g[j];
#pragma unroll
        for (int b = 0; b < kSlots; ++b) grads[b][j] *= g[j];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t pack = first + (int64_t)u * kThreads;
        if (pack >= n_packs) continue;
        store_pack<T, VEC>(out_ptr<T>(L.out) + pack * VEC, total + u * VEC);
#pragma unroll
        for (int b = 0; b < kOps; ++b)
            if (b < nops && L.grad_operands[b].data)
                store_pack<T, VEC>(out_ptr<T>(L.grad_operands[b]) + pack * VEC, grads[b] + u * VEC);
    }
    if (VEC > 1 && blockIdx.x == 0) {
        const int64_t i = n_packs * VEC + threadIdx.x;
        if (i < L.numel) {
            A vals[BRRR_MAX_CHAIN_OPERANDS] = {}, gr[BRRR_MAX_CHAIN_OPERANDS];
#pragma unroll
            for (int b = 0; b < kOps; ++b)
                if (b < nops) vals[b] = to_float(in_ptr<T>(L.operands[b])[operand_index(L, b, i)]);
            const A gi = to_float(in_ptr<T>(L.grad_out)[i]);
            out_ptr<T>(L.out)[i] = to_storage<T, A>(gi * M::program_grad(L.program.steps, L.program.n_steps, to_float(in_ptr<T>(L.x)[i]), vals, gr));
#pragma unroll
            for (int b = 0; b < kOps; ++b)
                if (b < nops && L.grad_operands[b].data) out_ptr<T>(L.grad_operands[b])[i] = to_storage<T, A>(gi * gr[b]);
        }
    }
}


// GLUs (the program act, mul_tensor with an x-shaped operand; dense tensors) with the activation
// fixed at compile time. The generic contiguous kernels interpret the program per pack and hold a
// pack per operand slot, which kept them at their 128-register cap (2 blocks of 256 per SM): in a
// Llama step's SwiGLU (bf16 16384 x 2816, H200) the backward ran at 58% of the floor and the
// forward at about 60%. Same arithmetic, in the same order, as the generic kernels:
// out = act(x) * up, grad_x = (act'(x) * up) * g, grad_up = act(x) * g.
// kGeluLean: gelu (erf form) through fast_gelu (elementary.cuh) in half-precision storage, the
// same function with its constants folded and one exp shared by the value and the derivative
// (the row kernels' BRRR_CHAIN_ROWS_PROGRAM=lean); the step math in float32 and float64.
constexpr int kGeluLean = -2;
template <int kAct, typename M, typename A>
__device__ __forceinline__ A glu_act(A x) {
    if constexpr (kAct == BRRR_OP_SILU) return M::silu_fwd(x);
    else if constexpr (kAct == kGeluLean && std::is_same<M, Fast32>::value) return fast_gelu(x);
    else if constexpr (kAct == BRRR_OP_GELU || kAct == kGeluLean) return M::gelu_fwd(x);
    else return M::gelu_tanh_fwd(x);
}
template <int kAct, typename M, typename A>
__device__ __forceinline__ A glu_act_grad(A x, A *d) {
    if constexpr (kAct == BRRR_OP_SILU) return M::silu_fwd_grad(x, d);
    else if constexpr (kAct == kGeluLean && std::is_same<M, Fast32>::value) return fast_gelu_grad(x, d);
    else if constexpr (kAct == BRRR_OP_GELU || kAct == kGeluLean) return M::gelu_fwd_grad(x, d);
    else return M::gelu_tanh_fwd_grad(x, d);
}

template <typename T, int VEC, int kAct>
__global__ void __launch_bounds__(kThreads) glu_fwd_contig_kernel(const __grid_constant__ FlatLaunch L) {
    using A = typename Compute<T>::type;
    using M = typename MathFor<T>::type;
    const int64_t n_packs = L.numel / VEC;
    const int64_t first = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;
    const T *x = in_ptr<T>(L.x), *up = in_ptr<T>(L.operands[0]);
    T *out = out_ptr<T>(L.out);
    A xv[kUnroll][VEC], uv[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t pack = first + (int64_t)u * kThreads;
        if (pack >= n_packs) continue;
        load_pack<T, VEC>(x + pack * VEC, xv[u]);
        load_pack<T, VEC>(up + pack * VEC, uv[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t pack = first + (int64_t)u * kThreads;
        if (pack >= n_packs) continue;
        A y[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) y[j] = glu_act<kAct, M>(xv[u][j]) * uv[u][j];
        store_pack<T, VEC>(out + pack * VEC, y);
    }
    if (VEC > 1 && blockIdx.x == 0) {  // the last numel % VEC elements
        const int64_t i = n_packs * VEC + threadIdx.x;
        if (i < L.numel) out[i] = to_storage<T, A>(glu_act<kAct, M>(to_float(x[i])) * to_float(up[i]));
    }
}

template <typename T, int VEC, int kAct>
__global__ void __launch_bounds__(kThreads) glu_bwd_contig_kernel(const __grid_constant__ FlatLaunch L) {
    using A = typename Compute<T>::type;
    using M = typename MathFor<T>::type;
    const int64_t n_packs = L.numel / VEC;
    const int64_t first = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;
    const T *x = in_ptr<T>(L.x), *up = in_ptr<T>(L.operands[0]), *grad = in_ptr<T>(L.grad_out);
    T *grad_x = out_ptr<T>(L.out), *grad_up = out_ptr<T>(L.grad_operands[0]);
    A xv[kUnroll][VEC], uv[kUnroll][VEC], gv[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t pack = first + (int64_t)u * kThreads;
        if (pack >= n_packs) continue;
        load_pack<T, VEC>(x + pack * VEC, xv[u]);
        load_pack<T, VEC>(up + pack * VEC, uv[u]);
        load_pack<T, VEC>(grad + pack * VEC, gv[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t pack = first + (int64_t)u * kThreads;
        if (pack >= n_packs) continue;
        A dx[VEC], du[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            A d;
            const A a = glu_act_grad<kAct, M>(xv[u][j], &d);
            dx[j] = d * uv[u][j] * gv[u][j];
            du[j] = a * gv[u][j];
        }
        store_pack<T, VEC>(grad_x + pack * VEC, dx);
        if (grad_up) store_pack<T, VEC>(grad_up + pack * VEC, du);
    }
    if (VEC > 1 && blockIdx.x == 0) {  // the last numel % VEC elements
        const int64_t i = n_packs * VEC + threadIdx.x;
        if (i < L.numel) {
            A d;
            const A g = to_float(grad[i]), a = glu_act_grad<kAct, M>(to_float(x[i]), &d);
            grad_x[i] = to_storage<T, A>(d * to_float(up[i]) * g);
            if (grad_up) grad_up[i] = to_storage<T, A>(a * g);
        }
    }
}

// The GLU activation of a program (see glu_bwd_contig_kernel), or -1.
static int glu_activation(const brrr_chain_launch &L) {
    const brrr_chain_program &p = L.program;
    if (p.n_steps != 2 || p.n_operands != 1 || L.operand_is_vector[0] || p.steps[1].op != BRRR_OP_MUL_TENSOR)
        return -1;
    const int act = p.steps[0].op;
    return act == BRRR_OP_SILU || act == BRRR_OP_GELU || act == BRRR_OP_GELU_TANH ? act : -1;
}

template <typename T, int kOps>
__global__ void __launch_bounds__(kThreads) chain_bwd_strided_kernel(const __grid_constant__ brrr_chain_launch L) {
    using A = typename Compute<T>::type;
    const int nops = L.program.n_operands;
    for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < L.numel; i += (int64_t)gridDim.x * kThreads) {
        const Offsets o = strided_offsets<kOps>(L, i, true);
        A vals[BRRR_MAX_CHAIN_OPERANDS] = {}, grads[BRRR_MAX_CHAIN_OPERANDS];
#pragma unroll
        for (int b = 0; b < kOps; ++b)
            if (b < nops) vals[b] = to_float(in_ptr<T>(L.operands[b])[o.op[b]]);
        const A g = to_float(in_ptr<T>(L.grad_out)[o.grad_out]);
        const A total = MathFor<T>::type::program_grad(L.program.steps, L.program.n_steps, to_float(in_ptr<T>(L.x)[o.x]), vals, grads);
        out_ptr<T>(L.out)[o.out] = to_storage<T, A>(g * total);
#pragma unroll
        for (int b = 0; b < kOps; ++b)
            if (b < nops && L.grad_operands[b].data) out_ptr<T>(L.grad_operands[b])[o.grad_op[b]] = to_storage<T, A>(g * grads[b]);
    }
}

// Row kernels hold a pack per operand and per gradient: left alone, ptxas gave the bf16 backward
// 95 registers (2 blocks, 25% occupancy) and it ran latency-bound; 3 blocks cap it at 85.
constexpr int kRowBlocksPerSM = 3;

__device__ __forceinline__ int64_t row_element(const brrr_chain_launch &L, const brrr_view &v, int64_t r, int64_t c) {
    return row_offset(L, v.strides, r) + c * v.strides[L.ndim - 1];
}

// The slice of rows block row blockIdx.y owns; its kRowLanes warps take every kRowLanes-th row.
struct RowSlice {
    int64_t begin, end;
    __device__ RowSlice(int64_t rows) {
        const int64_t per_block = (rows + gridDim.y - 1) / gridDim.y;
        begin = blockIdx.y * per_block;
        end = min(rows, begin + per_block);
    }
};

__device__ __forceinline__ const void *row_address(const brrr_chain_launch &L, const brrr_view &v, int64_t r, int64_t col, int size) {
    return static_cast<const char *>(v.data) + row_element(L, v, r, col) * size;
}

// A thread's pack of a pipeline stage, read back from shared memory. `whole`: one 16-byte load
// (LDS.128, 4 wavefronts a warp). Otherwise element by element (BRRR_CHAIN_ROWS_READ=element),
// as the row kernels read it before: for 2-byte types ptxas emits 8 LDS.U16, each spanning the
// warp's 512 bytes (4 wavefronts), so 32 wavefronts a pack; float32 got one LDS.128 either way.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void unpack(const Pack<T, VEC> &pk, A *out, bool whole) {
    if (sizeof(Pack<T, VEC>) == 16 && whole) {
        const uint4 raw = *reinterpret_cast<const uint4 *>(&pk);
        Pack<T, VEC> v;
        memcpy(&v, &raw, sizeof v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = to_float(v.v[j]);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = to_float(pk.v[j]);
    }
}

template <typename T, int VEC, typename A>
__device__ __forceinline__ void store_row(const brrr_chain_launch &L, const brrr_view &v, int64_t r, int64_t col, const A *in) {
    Pack<T, VEC> pk;
#pragma unroll
    for (int j = 0; j < VEC; ++j) pk.v[j] = to_storage<T, A>(in[j]);
    *reinterpret_cast<Pack<T, VEC> *>(out_ptr<T>(v) + row_element(L, v, r, col)) = pk;
}

// Vector operands are the same on every row: each thread reads its columns of them once.
template <typename T, int VEC, int kSlots, typename A>
__device__ __forceinline__ void load_vector_operands(const brrr_chain_launch &L, int64_t col, bool active, A (&v)[kSlots][VEC]) {
#pragma unroll
    for (int b = 0; b < kSlots; ++b) {
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            v[b][j] = (b < L.program.n_operands && L.operand_is_vector[b] && active)
                ? to_float(in_ptr<T>(L.operands[b])[(col + j) * L.operands[b].strides[L.ndim - 1]]) : A(0);
    }
}

// The row kernels keep kStages rows per tensor in flight for each thread: its 16-byte slices of
// the next rows are copied into shared memory (cp.async, no registers held) while it computes the
// current one. Each thread reads back only the slots it filled, so no barrier is needed. Loading
// into registers instead held two rows per warp at most: ~24 KB in flight per SM, too little to
// cover the memory latency (the bf16 row kernels ran at 45-60% of the copy bandwidth); more rows
// in registers spilled (the step math over a pack needs most of the 80-register budget).
// Slots: x, grad_out (backward), then one per operand (a vector operand's slot stays unused).
template <int kOps, bool kBackward> constexpr int row_stages() { return kOps <= 1 ? (kBackward ? 3 : 4) : (kBackward ? 1 : 2); }

template <typename T, int VEC, int kOps, bool kBackward>
struct RowPipeline {
    static constexpr int kStages = row_stages<kOps, kBackward>();
    static constexpr int kTensors = (kBackward ? 2 : 1) + kOps;
    Pack<T, VEC> slot[kStages][kTensors][kRowLanes][kTileCols];

    __device__ const brrr_view &view(const brrr_chain_launch &L, int t) const {
        return t == 0 ? L.x : (kBackward && t == 1) ? L.grad_out : L.operands[t - (kBackward ? 2 : 1)];
    }
    __device__ bool used(const brrr_chain_launch &L, int t) const {
        const int b = t - (kBackward ? 2 : 1);
        return b < 0 || (b < L.program.n_operands && !L.operand_is_vector[b]);
    }
    // Starts the copies of row `row` (none past the slice's end) into stage s, as one group.
    __device__ void fetch(const brrr_chain_launch &L, int64_t row, int64_t end, int64_t col, int s) {
        if (row < end) {
#pragma unroll
            for (int t = 0; t < kTensors; ++t) {
                if (!used(L, t)) continue;
                const void *src = row_address(L, view(L, t), row, col, sizeof(T));
                Pack<T, VEC> *dst = &slot[s][t][threadIdx.y][threadIdx.x];
                if (VEC > 1) copy_async16(dst, src);
                else *dst = *static_cast<const Pack<T, VEC> *>(src);  // strided columns: no 16-byte copy
            }
        }
        copy_async_commit();  // an empty group past the end keeps the wait counts in step
    }
    __device__ const Pack<T, VEC> &get(int s, int t) const { return slot[s][t][threadIdx.y][threadIdx.x]; }
};

// One row's operand values: its row of each tensor operand (from the pipeline), the resident
// columns of each vector operand.
template <int VEC, int kOps, int kSlots, typename P, typename A>
__device__ __forceinline__ void row_operands(const brrr_chain_launch &L, const P &pipe, int s, int first_operand_slot, bool whole,
                                             const A (&vector_value)[kSlots][VEC], A (&v)[kSlots][VEC]) {
#pragma unroll
    for (int b = 0; b < kSlots; ++b) {
        if (b < kOps && b < L.program.n_operands && L.operand_is_vector[b]) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[b][j] = vector_value[b][j];
        } else if (b < kOps && b < L.program.n_operands) {
            unpack(pipe.get(s, first_operand_slot + b), v[b], whole);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[b][j] = A(0);
        }
    }
}

// The row kernels' program: interpreted step by step, or one of the two programs of one operand
// that bias+activation and the GLUs on a row's halves run, fixed at compile time
// (BRRR_CHAIN_ROWS_PROGRAM). The interpreter dispatches every step of every row through a jump
// table over all ops, and in half storage the loop is issue-bound, not memory-bound (bfloat16
// bias_gelu forward, sm_90 SASS: gelu takes 18 instructions an element, the row's addresses,
// staging and store about 13 more). kBiasAct: act(x + b); kActMul: act(x) * up. Fixed, the same
// arithmetic in the same order as the interpreter (so the same bits), except kGeluLean's gelu.
enum RowForm { kInterpreted, kBiasAct, kActMul };

template <int kForm, int kAct, typename M, int kOps, int VEC, int kSlots, typename A>
__device__ __forceinline__ void row_fwd_pack(const brrr_chain_program &p, A (&y)[VEC], const A (&v)[kSlots][VEC]) {
    if constexpr (kForm == kInterpreted) {
        program_fwd_pack<M, kOps>(p, y, v);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) y[j] = kForm == kBiasAct ? glu_act<kAct, M>(y[j] + v[0][j]) : glu_act<kAct, M>(y[j]) * v[0][j];
    }
}

// dx = d out / dx and d_operand = d out / d operand, as program_grad_pack returns them: for
// act(x + b) both act'(x + b) (the interpreter's 1 * act'), for act(x) * up act'(x) * up and act(x).
template <int kForm, int kAct, typename M, int VEC, int kSlots, typename A>
__device__ __forceinline__ void row_grad_pack(const brrr_chain_program &p, A (&y)[VEC], const A (&v)[kSlots][VEC], A (&dx)[VEC],
                                              A (&d_operand)[kSlots][VEC]) {
    static_assert(kForm == kInterpreted || kSlots == 1, "fixed row programs take one operand");
    if constexpr (kForm == kInterpreted) {
        program_grad_pack<M>(p, y, v, dx, d_operand);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            A d;
            if constexpr (kForm == kBiasAct) {
                glu_act_grad<kAct, M>(y[j] + v[0][j], &d);
                dx[j] = d;
                d_operand[0][j] = d;
            } else {
                d_operand[0][j] = glu_act_grad<kAct, M>(y[j], &d);
                dx[j] = d * v[0][j];
            }
        }
    }
}

// Row layout, forward: rows with arbitrary strides, columns with stride 1 (VEC > 1) or any.
template <typename T, int VEC, int kOps, int kForm, int kAct>
__global__ void __launch_bounds__(kTileCols *kRowLanes, kRowBlocksPerSM) chain_fwd_rows_kernel(const __grid_constant__ brrr_chain_launch L, bool whole) {
    using A = typename Compute<T>::type;
    using M = typename MathFor<T>::type;
    using Pipe = RowPipeline<T, VEC, kOps, false>;
    constexpr int kSlots = kOps > 0 ? kOps : 1;
    constexpr int S = Pipe::kStages;
    __shared__ Pipe pipe;
    const int64_t cols = L.row_length;
    const RowSlice slice(L.numel / cols);
    const int64_t col = ((int64_t)blockIdx.x * kTileCols + threadIdx.x) * VEC;
    if (col >= cols) return;  // no barrier in this kernel
    A vector_value[kSlots][VEC];
    load_vector_operands<T, VEC, kSlots>(L, col, true, vector_value);
    const int64_t first = slice.begin + threadIdx.y;
#pragma unroll
    for (int s = 0; s < S; ++s) pipe.fetch(L, first + (int64_t)s * kRowLanes, slice.end, col, s);
    int s = 0;
    for (int64_t r = first; r < slice.end; r += kRowLanes) {
        copy_async_wait<S - 1>();  // row r's group, the oldest, has landed
        A y[VEC], v[kSlots][VEC];
        unpack(pipe.get(s, 0), y, whole);
        row_operands<VEC, kOps>(L, pipe, s, 1, whole, vector_value, v);
        row_fwd_pack<kForm, kAct, M, kOps>(L.program, y, v);
        store_row<T, VEC>(L, L.out, r, col, y);
        // Refilled only after its values were used, so the copy cannot overwrite them unread.
        pipe.fetch(L, r + (int64_t)S * kRowLanes, slice.end, col, s);
        s = s + 1 == S ? 0 : s + 1;
    }
}

// Row layout, backward. Vector operand gradients are summed over the block's rows: each thread
// sums its rows in order, the block's row lanes are summed in order through shared memory, and
// chain_vector_grad_kernel sums the blocks in order. Bitwise reproducible; no atomics.
template <typename T, int VEC, int kOps, int kForm, int kAct>
__global__ void __launch_bounds__(kTileCols *kRowLanes, kRowBlocksPerSM) chain_bwd_rows_kernel(const __grid_constant__ brrr_chain_launch L, bool whole) {
    using A = typename Compute<T>::type;
    using M = typename MathFor<T>::type;
    using Pipe = RowPipeline<T, VEC, kOps, true>;
    constexpr int kSlots = kOps > 0 ? kOps : 1;
    constexpr int S = Pipe::kStages;
    __shared__ Pipe pipe;
    __shared__ A lanes[kRowLanes][kTileCols * VEC];
    const int nops = L.program.n_operands;
    const int64_t cols = L.row_length;
    const RowSlice slice(L.numel / cols);
    const int64_t col = ((int64_t)blockIdx.x * kTileCols + threadIdx.x) * VEC;
    const bool active = col < cols;

    A vector_value[kSlots][VEC], acc[kSlots][VEC];
    load_vector_operands<T, VEC, kSlots>(L, col, active, vector_value);
#pragma unroll
    for (int b = 0; b < kSlots; ++b)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[b][j] = A(0);
    const int64_t first = slice.begin + threadIdx.y;
    const int64_t end = active ? slice.end : first;  // idle columns fetch and compute nothing
#pragma unroll
    for (int s = 0; s < S; ++s) pipe.fetch(L, first + (int64_t)s * kRowLanes, end, col, s);
    int s = 0;
    for (int64_t r = first; r < end; r += kRowLanes) {
        copy_async_wait<S - 1>();
        A y[VEC], g[VEC], v[kSlots][VEC], dx[VEC], d_operand[kSlots][VEC];
        unpack(pipe.get(s, 0), y, whole);
        unpack(pipe.get(s, 1), g, whole);
        row_operands<VEC, kOps>(L, pipe, s, 2, whole, vector_value, v);
        row_grad_pack<kForm, kAct, M>(L.program, y, v, dx, d_operand);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            dx[j] *= g[j];
#pragma unroll
            for (int b = 0; b < kSlots; ++b) d_operand[b][j] *= g[j];
        }
        store_row<T, VEC>(L, L.out, r, col, dx);
#pragma unroll
        for (int b = 0; b < kOps; ++b) {
            if (b >= nops || !L.grad_operands[b].data) continue;
            if (L.operand_is_vector[b]) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[b][j] += d_operand[b][j];
            } else {
                store_row<T, VEC>(L, L.grad_operands[b], r, col, d_operand[b]);
            }
        }
        pipe.fetch(L, r + (int64_t)S * kRowLanes, end, col, s);
        s = s + 1 == S ? 0 : s + 1;
    }
    if (!L.partials) return;  // uniform across the block: no vector operand needs a gradient
#pragma unroll
    for (int b = 0; b < kOps; ++b) {
        if (b >= nops || !L.operand_is_vector[b] || !L.grad_operands[b].data) continue;
        store_block_column_sums<VEC>(lanes, acc[b], static_cast<A *>(L.partials) + ((int64_t)b * L.partial_rows + blockIdx.y) * cols,
                                     col, active);
        __syncthreads();  // lanes is reused by the next operand
    }
}

// BRRR_CHAIN_ROWS_PROGRAM=lean2: `lean`'s programs in a loop cut down to what a pack needs. The
// row kernels above spend about 100 instructions a pack outside the math (bfloat16, sm_90 SASS):
// every tensor's row address recomputed from the row index in 64-bit products (a division per
// dim beyond 2), the stage index and its shared-memory addresses, the `whole` and ndim branches.
// Here, for 2-d launches (bias+activation and the GLU halves coalesce to one row stride per
// tensor), each tensor's pointer is set once and advanced by kRowLanes rows; the loop is unrolled
// over the S stages, so every shared-memory address is a constant offset and the stage index is
// gone; the trip count is a 32-bit counter; kBiasAct's operand (the bias, a vector) stays in
// registers for all the thread's rows and takes no stage (the staging is there to keep rows in
// flight, not for the bias). The same arithmetic as `lean`, so the same bits.
template <typename T>
__device__ __forceinline__ char *row_pointer(const brrr_view &v, int64_t r, int64_t col) {
    return static_cast<char *>(v.data) + (r * v.strides[0] + col) * (int64_t)sizeof(T);
}
template <typename T> __device__ __forceinline__ int64_t row_step(const brrr_view &v) { return (int64_t)kRowLanes * v.strides[0] * (int64_t)sizeof(T); }

// Starts the copies of every input's pack at in[t] into stage `stage` if `live`, as one group
// (an empty group past the slice's end keeps the wait counts in step), and moves in[] a row step on.
template <int kTensors, typename P>
__device__ __forceinline__ void fetch_rows(P (&stage)[kTensors][kRowLanes][kTileCols], const char *(&in)[kTensors], const int64_t (&step)[kTensors],
                                           bool live) {
    if (live) {
#pragma unroll
        for (int t = 0; t < kTensors; ++t) copy_async16(&stage[t][threadIdx.y][threadIdx.x], in[t]);
    }
    copy_async_commit();
#pragma unroll
    for (int t = 0; t < kTensors; ++t) in[t] += step[t];
}

// The rows of a thread: in its block's slice, every kRowLanes-th from slice.begin + threadIdx.y.
__device__ __forceinline__ int thread_row_count(const RowSlice &slice, int64_t first) {
    return first < slice.end ? (int)((slice.end - first + kRowLanes - 1) / kRowLanes) : 0;
}

template <typename T, int VEC, int kForm, int kAct>
__global__ void __launch_bounds__(kTileCols *kRowLanes, kRowBlocksPerSM) chain_fwd_rows_lean2_kernel(const __grid_constant__ brrr_chain_launch L) {
    using A = typename Compute<T>::type;
    using M = typename MathFor<T>::type;
    constexpr int kTensors = kForm == kActMul ? 2 : 1;  // x, and up in act(x) * up
    constexpr int S = row_stages<1, false>();
    __shared__ Pack<T, VEC> slot[S][kTensors][kRowLanes][kTileCols];
    const int64_t cols = L.row_length;
    const RowSlice slice(L.numel / cols);
    const int64_t col = ((int64_t)blockIdx.x * kTileCols + threadIdx.x) * VEC;
    if (col >= cols) return;  // no barrier in this kernel
    A v[1][VEC];
    load_vector_operands<T, VEC, 1>(L, col, true, v);  // kBiasAct: the bias; kActMul: read per row below
    const int64_t first = slice.begin + threadIdx.y;
    const int n = thread_row_count(slice, first);
    const char *in[kTensors];
    int64_t step[kTensors];
#pragma unroll
    for (int t = 0; t < kTensors; ++t) {
        const brrr_view &view = t == 0 ? L.x : L.operands[0];
        in[t] = row_pointer<T>(view, first, col);
        step[t] = row_step<T>(view);
    }
    char *out = row_pointer<T>(L.out, first, col);
    const int64_t out_step = row_step<T>(L.out);
#pragma unroll
    for (int s = 0; s < S; ++s) fetch_rows(slot[s], in, step, s < n);
    for (int i = 0; i < n; i += S) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            if (i + s >= n) break;
            copy_async_wait<S - 1>();  // row i + s's group, the oldest, has landed
            A y[VEC];
            unpack(slot[s][0][threadIdx.y][threadIdx.x], y, true);
            if constexpr (kForm == kActMul) unpack(slot[s][1][threadIdx.y][threadIdx.x], v[0], true);
            row_fwd_pack<kForm, kAct, M, 1>(L.program, y, v);
            store_pack<T, VEC>(reinterpret_cast<T *>(out), y);
            out += out_step;
            // Refilled only after its values were used, so the copy cannot overwrite them unread.
            fetch_rows(slot[s], in, step, i + s + S < n);
        }
    }
}

// The backward of lean2; the bias gradient summed as chain_bwd_rows_kernel sums it (the same order).
template <typename T, int VEC, int kForm, int kAct>
__global__ void __launch_bounds__(kTileCols *kRowLanes, kRowBlocksPerSM) chain_bwd_rows_lean2_kernel(const __grid_constant__ brrr_chain_launch L) {
    using A = typename Compute<T>::type;
    using M = typename MathFor<T>::type;
    constexpr int kTensors = kForm == kActMul ? 3 : 2;  // x, grad_out, and up in act(x) * up
    constexpr int S = row_stages<1, true>();
    __shared__ Pack<T, VEC> slot[S][kTensors][kRowLanes][kTileCols];
    __shared__ A lanes[kRowLanes][kTileCols * VEC];
    const int64_t cols = L.row_length;
    const RowSlice slice(L.numel / cols);
    const int64_t col = ((int64_t)blockIdx.x * kTileCols + threadIdx.x) * VEC;
    const bool active = col < cols;  // idle columns fetch and compute nothing, but reach the barriers
    A v[1][VEC], acc[VEC];
    load_vector_operands<T, VEC, 1>(L, col, active, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = A(0);
    const int64_t first = slice.begin + threadIdx.y;
    const int n = active ? thread_row_count(slice, first) : 0;
    const char *in[kTensors];
    int64_t step[kTensors];
#pragma unroll
    for (int t = 0; t < kTensors; ++t) {
        const brrr_view &view = t == 0 ? L.x : t == 1 ? L.grad_out : L.operands[0];
        in[t] = row_pointer<T>(view, first, col);
        step[t] = row_step<T>(view);
    }
    char *grad_x = row_pointer<T>(L.out, first, col);
    const int64_t grad_x_step = row_step<T>(L.out);
    // act(x) * up: up's gradient where it is asked for (uniform across the grid).
    const bool grad_up = kForm == kActMul && L.grad_operands[0].data;
    char *grad_u = grad_up ? row_pointer<T>(L.grad_operands[0], first, col) : nullptr;
    const int64_t grad_u_step = grad_up ? row_step<T>(L.grad_operands[0]) : 0;
#pragma unroll
    for (int s = 0; s < S; ++s) fetch_rows(slot[s], in, step, s < n);
    for (int i = 0; i < n; i += S) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            if (i + s >= n) break;
            copy_async_wait<S - 1>();
            A y[VEC], g[VEC], dx[VEC], d_operand[1][VEC];
            unpack(slot[s][0][threadIdx.y][threadIdx.x], y, true);
            unpack(slot[s][1][threadIdx.y][threadIdx.x], g, true);
            if constexpr (kForm == kActMul) unpack(slot[s][2][threadIdx.y][threadIdx.x], v[0], true);
            row_grad_pack<kForm, kAct, M>(L.program, y, v, dx, d_operand);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                dx[j] *= g[j];
                d_operand[0][j] *= g[j];
            }
            store_pack<T, VEC>(reinterpret_cast<T *>(grad_x), dx);
            grad_x += grad_x_step;
            if constexpr (kForm == kBiasAct) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[j] += d_operand[0][j];
            } else if (grad_up) {
                store_pack<T, VEC>(reinterpret_cast<T *>(grad_u), d_operand[0]);
                grad_u += grad_u_step;
            }
            fetch_rows(slot[s], in, step, i + s + S < n);
        }
    }
    // The bias gradient's per-slice partials, as chain_bwd_rows_kernel writes them (uniform test).
    if (kForm != kBiasAct || !L.partials || !L.grad_operands[0].data) return;
    store_block_column_sums<VEC>(lanes, acc, static_cast<A *>(L.partials) + (int64_t)blockIdx.y * cols, col, active);
}

// grad_operand[c] = the per-slice partials[b][p][c] summed in a fixed order
// (block_sum_column_partials). A block per 32 columns.
template <typename T>
__global__ void __launch_bounds__(kTileCols *kRowLanes) chain_vector_grad_kernel(const __grid_constant__ brrr_chain_launch L) {
    using A = typename Compute<T>::type;
    __shared__ A lanes[kRowLanes][kTileCols];
    const int64_t cols = L.row_length;
    const int64_t c = (int64_t)blockIdx.x * kTileCols + threadIdx.x;
    for (int b = 0; b < L.program.n_operands; ++b) {
        if (!L.operand_is_vector[b] || !L.grad_operands[b].data) continue;  // uniform across the block
        const A *part = static_cast<const A *>(L.partials) + (int64_t)b * L.partial_rows * cols;
        const A total = block_sum_column_partials(lanes, part, L.partial_rows, cols, c);
        if (threadIdx.y == 0 && c < cols)
            out_ptr<T>(L.grad_operands[b])[c * L.grad_operands[b].strides[0]] = to_storage<T, A>(total);
    }
}

// ---- launchers ------------------------------------------------------------------------------

static bool all_aligned(const brrr_chain_launch &L, bool backward) {
    bool ok = aligned16(L.x.data) && aligned16(L.out.data) && (!backward || aligned16(L.grad_out.data));
    for (int b = 0; b < L.program.n_operands; ++b) {
        ok = ok && aligned16(L.operands[b].data);
        if (backward && L.grad_operands[b].data && !L.operand_is_vector[b]) ok = ok && aligned16(L.grad_operands[b].data);
    }
    return ok;
}

static bool has_vector_operand(const brrr_chain_launch &L) {
    for (int b = 0; b < L.program.n_operands; ++b)
        if (L.operand_is_vector[b]) return true;
    return false;
}

// A row-layout launch can move VEC-element packs when every row starts 16-byte aligned and the
// columns are dense: each tensor's row strides are multiples of VEC and its column stride is 1.
template <int VEC>
static bool rows_vectorizable(const brrr_chain_launch &L, bool backward) {
    if (L.row_length % VEC != 0 || !all_aligned(L, backward)) return false;
    const brrr_view *views[3 + 2 * BRRR_MAX_CHAIN_OPERANDS];
    int n = 0;
    views[n++] = &L.x;
    views[n++] = &L.out;
    if (backward) views[n++] = &L.grad_out;
    for (int b = 0; b < L.program.n_operands; ++b) {
        if (!L.operand_is_vector[b]) views[n++] = &L.operands[b];
        if (backward && L.grad_operands[b].data && !L.operand_is_vector[b]) views[n++] = &L.grad_operands[b];
    }
    for (int i = 0; i < n; ++i) {
        if (views[i]->strides[L.ndim - 1] != 1) return false;
        for (int d = 0; d < L.ndim - 1; ++d)
            if (views[i]->strides[d] % VEC != 0) return false;
    }
    for (int b = 0; b < L.program.n_operands; ++b)
        if (L.operand_is_vector[b] && L.operands[b].strides[L.ndim - 1] != 1) return false;
    return true;
}

static unsigned grid_for(int64_t items, int per_block, int device) {
    const int64_t blocks = (items + per_block - 1) / per_block;
    const int64_t cap = (int64_t)sm_count(device) * 16;  // grid-stride beyond this
    return (unsigned)(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

static unsigned grid_for_packs(int64_t packs) {
    const int64_t blocks = (packs + kThreads * kUnroll - 1) / (kThreads * kUnroll);
    return (unsigned)(blocks < 1 ? 1 : blocks);
}

// Row-layout grid: column tiles across, row slices down. Without a vector gradient, enough
// slices for four waves of resident blocks, so each warp walks many rows (short-lived blocks ran
// latency-bound); with one, the fixed partial_rows slices, so its summation order never changes.
static dim3 rows_grid(const brrr_chain_launch &L, int vec, int device) {
    const int64_t rows = L.numel / L.row_length;
    const int64_t tiles = (L.row_length + (int64_t)kTileCols * vec - 1) / ((int64_t)kTileCols * vec);
    int64_t slices = L.partials ? L.partial_rows : (int64_t)sm_count(device) * kRowBlocksPerSM * 4 / tiles;
    slices = slices < 1 ? 1 : (slices > rows ? rows : slices);
    slices = slices > 65535 ? 65535 : slices;
    return dim3((unsigned)tiles, (unsigned)slices);
}

// BRRR_CHAIN_ROWS_READ (docs/kernel-switches.md): `element` reads the row kernels' stages back
// element by element, as before; unset or `pack`, a pack at a time (unpack above).
static bool rows_read_whole() {
    const char *v = getenv("BRRR_CHAIN_ROWS_READ");
    return !(v && strcmp(v, "element") == 0);
}

// BRRR_CHAIN_ROWS_PROGRAM (docs/kernel-switches.md): unset or `interpret`, the row kernels
// interpret every program; `fixed`, the programs of bias+activation and of the GLUs on a row's
// halves run fixed at compile time (RowForm), the same bits; `lean`, fixed with gelu as kGeluLean;
// `lean2`, `lean` in the lean2 kernels where they apply (lean2_applies), else as `lean`.
struct RowProgram {
    int form, act;
    bool lean2;
};
// Unset: lean2 in float16 and bfloat16 (H200, bf16, 16384 x 4096, device time: bias_gelu
// forward+backward 0.295 -> 0.172 ms, bias_silu 0.237 -> 0.171, the split GLUs 0.288 -> 0.262),
// the interpreter in float32 and float64 (lean2 not yet timed there).
static RowProgram row_program(const brrr_chain_launch &L, bool half) {
    const char *v = getenv("BRRR_CHAIN_ROWS_PROGRAM");
    if (!v && half) v = "lean2";
    const bool fixed = v && strcmp(v, "fixed") == 0, lean2 = v && strcmp(v, "lean2") == 0;
    const bool lean = lean2 || (v && strcmp(v, "lean") == 0);
    const brrr_chain_program &p = L.program;
    if (!(fixed || lean) || p.n_steps != 2 || p.n_operands != 1) return {kInterpreted, 0, false};
    RowProgram r;
    if (p.steps[0].op == BRRR_OP_ADD_TENSOR) r = {kBiasAct, p.steps[1].op, lean2};
    else if (p.steps[1].op == BRRR_OP_MUL_TENSOR) r = {kActMul, p.steps[0].op, lean2};
    else return {kInterpreted, 0, false};
    if (r.act != BRRR_OP_SILU && r.act != BRRR_OP_GELU && r.act != BRRR_OP_GELU_TANH) return {kInterpreted, 0, false};
    if (lean && r.act == BRRR_OP_GELU) r.act = kGeluLean;
    return r;
}

template <typename T, int VEC, int kOps, int kForm, int kAct>
static void rows_kernel(const brrr_chain_launch &L, bool backward, dim3 grid, bool whole, cudaStream_t stream) {
    const dim3 block(kTileCols, kRowLanes);
    if (backward) chain_bwd_rows_kernel<T, VEC, kOps, kForm, kAct><<<grid, block, 0, stream>>>(L, whole);
    else chain_fwd_rows_kernel<T, VEC, kOps, kForm, kAct><<<grid, block, 0, stream>>>(L, whole);
}

// The lean2 kernels take 2-d launches (a row stride per tensor), bias+activation with a vector
// operand (the bias) and the GLUs with a tensor one, and fewer than 2^30 rows (32-bit counts).
static bool lean2_applies(const brrr_chain_launch &L, int form) {
    return L.ndim == 2 && (L.operand_is_vector[0] != 0) == (form == kBiasAct) && L.numel / L.row_length < ((int64_t)1 << 30);
}

template <typename T, int VEC, int kForm, int kAct>
static void lean2_kernel(const brrr_chain_launch &L, bool backward, dim3 grid, cudaStream_t stream) {
    const dim3 block(kTileCols, kRowLanes);
    if (backward) chain_bwd_rows_lean2_kernel<T, VEC, kForm, kAct><<<grid, block, 0, stream>>>(L);
    else chain_fwd_rows_lean2_kernel<T, VEC, kForm, kAct><<<grid, block, 0, stream>>>(L);
}

template <typename T, int VEC, int kForm>
static void lean2_rows_kernel(const brrr_chain_launch &L, int act, bool backward, dim3 grid, cudaStream_t stream) {
    if (act == BRRR_OP_SILU) lean2_kernel<T, VEC, kForm, BRRR_OP_SILU>(L, backward, grid, stream);
    else if (act == BRRR_OP_GELU_TANH) lean2_kernel<T, VEC, kForm, BRRR_OP_GELU_TANH>(L, backward, grid, stream);
    else lean2_kernel<T, VEC, kForm, kGeluLean>(L, backward, grid, stream);  // lean2 implies lean's gelu
}

template <typename T, int VEC, int kForm>
static void fixed_rows_kernel(const brrr_chain_launch &L, int act, bool backward, dim3 grid, bool whole, cudaStream_t stream) {
    if (act == BRRR_OP_SILU) rows_kernel<T, VEC, 1, kForm, BRRR_OP_SILU>(L, backward, grid, whole, stream);
    else if (act == BRRR_OP_GELU) rows_kernel<T, VEC, 1, kForm, BRRR_OP_GELU>(L, backward, grid, whole, stream);
    else if (act == BRRR_OP_GELU_TANH) rows_kernel<T, VEC, 1, kForm, BRRR_OP_GELU_TANH>(L, backward, grid, whole, stream);
    else rows_kernel<T, VEC, 1, kForm, kGeluLean>(L, backward, grid, whole, stream);
}

// The row kernels of a launch; programs are fixed only over 16-byte packs (the fast path).
template <typename T, int VEC, int kOps>
static void launch_rows(const brrr_chain_launch &L, bool backward, int device, cudaStream_t stream) {
    const dim3 grid = rows_grid(L, VEC, device);
    const bool whole = rows_read_whole();
    if constexpr (kOps == 1 && VEC > 1) {
        const RowProgram f = row_program(L, sizeof(T) == 2);
        if (f.form != kInterpreted && f.lean2 && lean2_applies(L, f.form)) {
            if (f.form == kBiasAct) return lean2_rows_kernel<T, VEC, kBiasAct>(L, f.act, backward, grid, stream);
            return lean2_rows_kernel<T, VEC, kActMul>(L, f.act, backward, grid, stream);
        }
        if (f.form == kBiasAct) return fixed_rows_kernel<T, VEC, kBiasAct>(L, f.act, backward, grid, whole, stream);
        if (f.form == kActMul) return fixed_rows_kernel<T, VEC, kActMul>(L, f.act, backward, grid, whole, stream);
    }
    rows_kernel<T, VEC, kOps, kInterpreted, 0>(L, backward, grid, whole, stream);
}

template <typename T> void chain_vector_grad_typed(const brrr_chain_launch &L, cudaStream_t stream);

template <typename T, int kOps>
static void launch_fwd(const brrr_chain_launch &L, int device, cudaStream_t stream) {
    constexpr int VEC = 16 / sizeof(T);
    if (L.row_layout && rows_vectorizable<VEC>(L, false))
        launch_rows<T, VEC, kOps>(L, false, device, stream);
    else if (L.row_layout)
        launch_rows<T, 1, kOps>(L, false, device, stream);
    else if (L.contiguous && all_aligned(L, false) && (!has_vector_operand(L) || L.row_length % VEC == 0)) {
        const unsigned grid = grid_for_packs(L.numel / VEC);
        const int act = kOps == 1 ? glu_activation(L) : -1;
        if (act == BRRR_OP_SILU) glu_fwd_contig_kernel<T, VEC, BRRR_OP_SILU><<<grid, kThreads, 0, stream>>>(flat_launch(L));
        else if (act == BRRR_OP_GELU) glu_fwd_contig_kernel<T, VEC, BRRR_OP_GELU><<<grid, kThreads, 0, stream>>>(flat_launch(L));
        else if (act == BRRR_OP_GELU_TANH) glu_fwd_contig_kernel<T, VEC, BRRR_OP_GELU_TANH><<<grid, kThreads, 0, stream>>>(flat_launch(L));
        else chain_fwd_contig_kernel<T, VEC, kOps><<<grid, kThreads, 0, stream>>>(flat_launch(L));
    }
    else if (L.contiguous)
        chain_fwd_contig_kernel<T, 1, kOps><<<grid_for_packs(L.numel), kThreads, 0, stream>>>(flat_launch(L));
    else
        chain_fwd_strided_kernel<T, kOps><<<grid_for(L.numel, kThreads, device), kThreads, 0, stream>>>(L);
}

template <typename T, int kOps>
static void launch_bwd(const brrr_chain_launch &L, int device, cudaStream_t stream) {
    constexpr int VEC = 16 / sizeof(T);
    if (L.row_layout) {
        if (rows_vectorizable<VEC>(L, true))
            launch_rows<T, VEC, kOps>(L, true, device, stream);
        else
            launch_rows<T, 1, kOps>(L, true, device, stream);
        if (L.partials) chain_vector_grad_typed<T>(L, stream);
    } else if (L.contiguous && all_aligned(L, true) && (!has_vector_operand(L) || L.row_length % VEC == 0)) {
        const unsigned grid = grid_for_packs(L.numel / VEC);
        const int act = kOps == 1 ? glu_activation(L) : -1;
        if (act == BRRR_OP_SILU) glu_bwd_contig_kernel<T, VEC, BRRR_OP_SILU><<<grid, kThreads, 0, stream>>>(flat_launch(L));
        else if (act == BRRR_OP_GELU) glu_bwd_contig_kernel<T, VEC, BRRR_OP_GELU><<<grid, kThreads, 0, stream>>>(flat_launch(L));
        else if (act == BRRR_OP_GELU_TANH) glu_bwd_contig_kernel<T, VEC, BRRR_OP_GELU_TANH><<<grid, kThreads, 0, stream>>>(flat_launch(L));
        else chain_bwd_contig_kernel<T, VEC, kOps><<<grid, kThreads, 0, stream>>>(flat_launch(L));
    } else if (L.contiguous) {
        chain_bwd_contig_kernel<T, 1, kOps><<<grid_for_packs(L.numel), kThreads, 0, stream>>>(flat_launch(L));
    } else {
        chain_bwd_strided_kernel<T, kOps><<<grid_for(L.numel, kThreads, device), kThreads, 0, stream>>>(L);
    }
}

// Defined here, instantiated once per dtype by the BRRR_INSTANTIATE block at the end.
template <typename T>
void chain_vector_grad_typed(const brrr_chain_launch &L, cudaStream_t stream) {
    chain_vector_grad_kernel<T><<<(unsigned)((L.row_length + kTileCols - 1) / kTileCols), dim3(kTileCols, kRowLanes), 0, stream>>>(L);
}

template <typename T>
void chain_fwd_typed(const brrr_chain_launch &L, int device, cudaStream_t stream) {
    const int nops = L.program.n_operands;
    if (nops == 0) launch_fwd<T, 0>(L, device, stream);
    else if (nops == 1) launch_fwd<T, 1>(L, device, stream);
    else launch_fwd<T, BRRR_MAX_CHAIN_OPERANDS>(L, device, stream);
}

template <typename T>
void chain_bwd_typed(const brrr_chain_launch &L, int device, cudaStream_t stream) {
    const int nops = L.program.n_operands;
    if (nops == 0) launch_bwd<T, 0>(L, device, stream);
    else if (nops == 1) launch_bwd<T, 1>(L, device, stream);
    else launch_bwd<T, BRRR_MAX_CHAIN_OPERANDS>(L, device, stream);
}

}  // namespace brrr

// setup.py compiles this header once per dtype, naming it BRRR_INSTANTIATE, each in a translation
// unit of its own so that the dtypes compile in parallel.
#ifdef BRRR_INSTANTIATE
// The forward (part 0) and the backward (part 1) in translation units of their own: the
// longest units of a parallel build, each of them alone compiles in about half the time.
#if BRRR_INSTANTIATE_PART == 0
template void brrr::chain_fwd_typed<BRRR_INSTANTIATE>(const brrr_chain_launch &, int, cudaStream_t);
template void brrr::chain_vector_grad_typed<BRRR_INSTANTIATE>(const brrr_chain_launch &, cudaStream_t);
#else
template void brrr::chain_bwd_typed<BRRR_INSTANTIATE>(const brrr_chain_launch &, int, cudaStream_t);
#endif
#endif
