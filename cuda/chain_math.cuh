// The chain step math for CUDA, three times: exact float (float32 storage), fast float (half
// storage), double. Included by the precompiled kernels (chain_kernels.cuh) and, through NVRTC,
// by the chains compiled at run time (csrc/chain_jit.c), so that both compute the same function.
#pragma once

#include "brrr_cuda.h"
#include "elementary.cuh"

namespace brrr {

#define QUAL static __device__ __forceinline__
#define FN(name) name
// A chain compiled at run time needs one of the three, which it names in BRRR_CHAIN_MATH (1, 2
// or 3): parsing the other two cost NVRTC about 5 ms of every compile.
#if !defined(BRRR_CHAIN_MATH) || BRRR_CHAIN_MATH == 1
struct Precise32 {
#define REAL float
#define EXP expf
#define TANH tanhf
#define ONE_PLUS_ERF(z) (1.0f + erff(z))
#define COS precise_cos
#define SIN precise_sin
#define SINCOS precise_sincos
#define COS_IN_RANGE precise_cos_in_range
#define SIN_IN_RANGE precise_sin_in_range
#define SINCOS_IN_RANGE precise_sincos_in_range
#define TRIG_PACK_OK trig_in_range
#define DIV(a, b) __fdividef((a), (b)) /* 2 ulp; IEEE division would call a slow-path routine */
#define LOG logf
#define LOG1P log1pf
#define EXPM1 expm1f
#define SQRT sqrtf
#define RSQRT rsqrtf
#define POW powf
#define FABS fabsf
#include "chain_math.inc"
#include "chain_apply.inc"
#include "chain_math_end.inc"
};
#endif
#if !defined(BRRR_CHAIN_MATH) || BRRR_CHAIN_MATH == 2
struct Fast32 {
#define REAL float
#define EXP fast_exp
#define TANH fast_tanh
#define ONE_PLUS_ERF fast_one_plus_erf
#define COS fast_cos
#define SIN fast_sin
#define SINCOS fast_sincos
/* The MUFU's own reduction (x / 2pi rounded to fp32) errs in phase by about |x| * 2^-23: up to
 * |x| = 32, 4e-6, far below float16's resolution, for 2 instructions. The limit was 512 (6e-5),
 * and a backward multiplies that error by the chain's derivatives: a float16 gradient of
 * cos(2 sin(-x)) at x = 377 came out 4e-4 off (tests/test_chain.py's mixed packs). Larger values
 * take the exact reduction first (fast_sin). */
#define COS_IN_RANGE __cosf
#define SIN_IN_RANGE __sinf
#define SINCOS_IN_RANGE __sincosf
#define TRIG_PACK_OK(v) (fabsf(v) <= 32.0f)
#define DIV(a, b) __fdividef((a), (b))
/* The MUFU op alone (elementary.cuh): results under 2^-126 flush to zero, below float16's range
 * and among bfloat16's denormals (sigmoid and silu: the same values; gelu's derivative: past
 * |x| = 13.2). */
#define EXP_FTZ(x) exp_ftz(x)
#define LOG logf
#define LOG1P log1pf
#define EXPM1 expm1f
#define SQRT sqrtf
#define RSQRT rsqrtf
#define POW powf
#define FABS fabsf
#include "chain_math.inc"
#include "chain_apply.inc"
#include "chain_math_end.inc"
};
#endif
#if !defined(BRRR_CHAIN_MATH) || BRRR_CHAIN_MATH == 3
struct Precise64 {
#define REAL double
#define EXP exp
#define TANH tanh
#define ONE_PLUS_ERF(z) (1.0 + erf(z))
#define COS cos
#define SIN sin
#define SINCOS sincos_f64
#define COS_IN_RANGE cos
#define SIN_IN_RANGE sin
#define SINCOS_IN_RANGE sincos_f64
#define TRIG_PACK_OK(v) true
#define DIV(a, b) ((a) / (b))
#define LOG log
#define LOG1P log1p
#define EXPM1 expm1
#define SQRT sqrt
#define RSQRT rsqrt
#define POW pow
#define FABS fabs
#include "chain_math.inc"
#include "chain_apply.inc"
#include "chain_math_end.inc"
};
#endif
#undef FN
#undef QUAL

}  // namespace brrr
