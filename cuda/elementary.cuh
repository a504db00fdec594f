// The elementary functions of the elementwise kernels (the fast ones for half-precision storage,
// the exactly reduced sin and cos). Device code only, with no header but trig_reduce.h: the
// chains compiled at run time (csrc/chain_jit.c) include it through NVRTC as well, so that they
// compute exactly what the precompiled kernels compute.
#pragma once

#include "trig_reduce.h"

namespace brrr {

// Elementary functions. Two things keep elementwise kernels memory-bound on Hopper: no work on
// the conversion/MUFU pipe beyond one op per function (it runs at 1/8 of the FMA rate: F2I, I2F
// and FRND in a range reduction cost as much as the memory traffic of a bf16 element), and, for
// float16/bfloat16 storage, hardware approximations whose error (MUFU.SIN ~2^-21 absolute after
// an exact reduction, tanh.approx ~2^-11 relative) vanishes in the 8-11 bit result.
__device__ __forceinline__ float fast_exp(float x) { return __expf(x); }
// 1/x and 2^x as the MUFU op alone (.ftz). Without .ftz, ptxas wraps each in a check of the
// denormal range (3-4 more instructions: FSETP, FSEL or predicated FMULs around the MUFU).
__device__ __forceinline__ float rcp_ftz(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// exp(x) as exp2_ftz(x * log2(e)): a few float32 ulp, and 0 below 2^-126, where a sum that holds
// a row's max (1) or a half-precision result cannot tell.
__device__ __forceinline__ float exp_ftz(float x) { return exp2_ftz(x * 1.4426950408889634f); }
// 1 + erf(z) for half-precision storage, in two MUFU ops and 12 FMA-pipe instructions (erff is
// ~35; with 8 polynomial terms and the denormal checks of __fdividef and __expf this took 21,
// and bf16 gelu ran at about 50% of the memory floor, issue-bound): erfc(|z|) = t Q(t)
// exp(-z^2) with t = 1 / (1 + |z|/2) and Q a degree-6 fit of erfc(z) exp(z^2) / t on [0, 10],
// weighted to relative error and held to the true value and slope at z = 0 (t = 1), where
// 1 + erf(z) = 1 + 2z/sqrt(pi) meets values that bfloat16 holds exactly; then 1 + erf(z) =
// 2 - erfc(z) for z >= 0 and erfc(-z) below, so the left tail keeps its relative accuracy
// (fp32 1 + erff cancels to 0 there). Q's relative error: 1.5e-6. In a float32 simulation
// (exact exp and reciprocal) against float64, gelu of every bfloat16 from -12 up is the
// correctly rounded value, and of every float16 all but 6 (one ulp off). The two MUFU ops need
// no denormal checks: 1 + |z|/2 >= 1, and exp(-z^2) leaves the normal range only past |z| = 9.3
// (gelu's x below -13.2, where its value is under 1e-38 and now flushes to zero).
__device__ __forceinline__ float fast_one_plus_erf(float z) {
    const float a = fabsf(z);
    const float t = rcp_ftz(fmaf(0.5f, a, 1.0f));
    float q = 8.939192444e-02f;
    q = fmaf(q, t, -3.604077399e-01f);
    q = fmaf(q, t, 3.936676681e-01f);
    q = fmaf(q, t, 3.520651907e-02f);
    q = fmaf(q, t, 2.823530734e-01f);
    q = fmaf(q, t, 2.774490714e-01f);
    q = fmaf(q, t, 2.823394835e-01f);
    const float erfc_a = t * q * exp2_ftz(-a * a * 1.44269504088896341f);
    return z >= 0.0f ? 2.0f - erfc_a : erfc_a;
}
// Phi(x) = (1 + erf(x / sqrt 2)) / 2 for half-precision storage: fast_one_plus_erf's arithmetic
// with its constants folded (Q halved, exactly; x / sqrt 2 folded into t's and the exponent's
// constants), 3 instructions an element fewer. exp(-x^2/2) comes back in e for gelu's derivative
// Phi + x phi(x), which the chain step math computes with a MUFU op of its own. NaN stays NaN.
__device__ __forceinline__ float fast_normal_cdf(float x, float &e) {
    const float t = rcp_ftz(fmaf(0.353553390593273762f, fabsf(x), 1.0f));  // 1 / (1 + |x| / (2 sqrt 2))
    float q = 0.5f * 8.939192444e-02f;
    q = fmaf(q, t, 0.5f * -3.604077399e-01f);
    q = fmaf(q, t, 0.5f * 3.936676681e-01f);
    q = fmaf(q, t, 0.5f * 3.520651907e-02f);
    q = fmaf(q, t, 0.5f * 2.823530734e-01f);
    q = fmaf(q, t, 0.5f * 2.774490714e-01f);
    q = fmaf(q, t, 0.5f * 2.823394835e-01f);
    e = exp2_ftz(x * (x * -0.721347520444482f));  // exp(-x^2 / 2)
    const float half_erfc = t * q * e;              // erfc(|x| / sqrt 2) / 2
    return x >= 0.0f ? 1.0f - half_erfc : half_erfc;
}
// gelu(x) = x Phi(x), and its derivative Phi(x) + x exp(-x^2/2) / sqrt(2 pi) in *d.
__device__ __forceinline__ float fast_gelu(float x) {
    float e;
    return x * fast_normal_cdf(x, e);
}
__device__ __forceinline__ float fast_gelu_grad(float x, float *d) {
    float e;
    const float cdf = fast_normal_cdf(x, e);
    *d = fmaf(x * 0.398942280401432678f, e, cdf);
    return x * cdf;
}
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// x = k * pi/2 + r with |r| <= pi/4 (+ rounding), k's low bits in q. Rounding uses the 1.5 * 2^23
// trick (FMA pipe only); the three-part pi/2 (libdevice's) keeps r exact for |x| <= kTrigLimit.
constexpr float kTrigLimit = 105615.0f;
struct Reduced {
    float r;
    int q;
};
__device__ __forceinline__ Reduced reduce_half_pi(float x) {
    const float t = fmaf(x, 0.636619772367581343f, 12582912.0f);
    const float k = t - 12582912.0f;
    float r = fmaf(k, -1.57079625129699707031f, x);
    r = fmaf(k, -7.54978941586159635335e-08f, r);
    r = fmaf(k, -5.39030252995776476554e-15f, r);
    return {r, __float_as_int(t)};  // the integer k sits in the low mantissa bits: q & 3 == k & 3
}

// sin and cos of a reduced argument, |r| <= pi/4: minimax polynomials (Cephes), ~1 ulp. sin is r
// itself where r^2 is 0: r + P * (z * r) gives sin(-0) as +0 (P < 0, z * r = -0: their product
// is +0), where torch's and the CPU twin's give -0.
__device__ __forceinline__ void sincos_poly(float r, float &s, float &c) {
    const float z = r * r;
    s = z == 0.0f ? r : fmaf(fmaf(fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f), z * r, r);
    c = fmaf(fmaf(fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f), z, 4.166664568298827e-2f), z * z,
             fmaf(-0.5f, z, 1.0f));
}

// sin(k pi/2 + r) from sin r and cos r.
__device__ __forceinline__ float quadrant_sin(int q, float s, float c) {
    const float v = (q & 1) ? c : s;
    return (q & 2) ? -v : v;
}

// Exact float32 sin/cos (float32 storage) for |x| <= kTrigLimit; callers check the range once
// per pack and send the rest (large, inf, NaN) to large_sincos below.
__device__ __forceinline__ void precise_sincos_in_range(float x, float *s, float *c) {
    const Reduced a = reduce_half_pi(x);
    float ps, pc;
    sincos_poly(a.r, ps, pc);
    *s = quadrant_sin(a.q, ps, pc);
    *c = quadrant_sin(a.q + 1, ps, pc);
}
__device__ __forceinline__ float precise_sin_in_range(float x) {
    const Reduced a = reduce_half_pi(x);
    float s, c;
    sincos_poly(a.r, s, c);
    return quadrant_sin(a.q, s, c);
}
__device__ __forceinline__ float precise_cos_in_range(float x) {
    const Reduced a = reduce_half_pi(x);
    float s, c;
    sincos_poly(a.r, s, c);
    return quadrant_sin(a.q + 1, s, c);
}

// Half-storage sin/cos: the same exact reduction, then one MUFU.SIN on r or r + pi/2 (r itself,
// not r + 0, which gives sin(-0) as +0).
__device__ __forceinline__ float fast_sin_turns_in_range(float x, int turns) {
    const Reduced a = reduce_half_pi(x);
    const int q = a.q + turns;
    const float v = __sinf((q & 1) ? a.r + 1.57079632679489662f : a.r);
    return (q & 2) ? -v : v;
}
__device__ __forceinline__ float fast_sin_in_range(float x) { return fast_sin_turns_in_range(x, 0); }
__device__ __forceinline__ float fast_cos_in_range(float x) { return fast_sin_turns_in_range(x, 1); }
__device__ __forceinline__ void fast_sincos_in_range(float x, float *s, float *c) {
    const Reduced a = reduce_half_pi(x);
    const float ps = __sinf(a.r), pc = __cosf(a.r);
    *s = quadrant_sin(a.q, ps, pc);
    *c = quadrant_sin(a.q + 1, ps, pc);
}

// Beyond kTrigLimit: the exact Payne-Hanek reduction (trig_reduce.h), then the polynomials.
// Kernels compiled at run time call it (BRRR_LARGE_TRIG __noinline__): inlined at every trig
// step of a long unrolled chain it made NVRTC several times slower, for arguments that are rare.
// Sin and cos come back by value: a call that wrote them through pointers kept them in local
// memory, and the fast path then stored them there too (one STL per element and trig step).
struct SinCos {
    float s, c;
};
#ifndef BRRR_LARGE_TRIG
#define BRRR_LARGE_TRIG __forceinline__
#endif
__device__ BRRR_LARGE_TRIG SinCos large_sincos(float x) {
    if (!isfinite(x)) return {x - x, x - x};  // NaN for inf and NaN
    int q;
    const float r = (float)brrr_reduce_large(x, &q);
    float ps, pc;
    sincos_poly(r, ps, pc);
    return {quadrant_sin(q, ps, pc), quadrant_sin(q + 1, ps, pc)};
}
__device__ __forceinline__ float large_sin(float x) { return large_sincos(x).s; }
__device__ __forceinline__ float large_cos(float x) { return large_sincos(x).c; }

// The same with the range check, for code that handles one element at a time.
__device__ __forceinline__ bool trig_in_range(float x) { return fabsf(x) <= kTrigLimit; }
__device__ __forceinline__ float precise_sin(float x) { return trig_in_range(x) ? precise_sin_in_range(x) : large_sin(x); }
__device__ __forceinline__ float precise_cos(float x) { return trig_in_range(x) ? precise_cos_in_range(x) : large_cos(x); }
__device__ __forceinline__ float fast_sin(float x) { return trig_in_range(x) ? fast_sin_in_range(x) : large_sin(x); }
__device__ __forceinline__ float fast_cos(float x) { return trig_in_range(x) ? fast_cos_in_range(x) : large_cos(x); }
__device__ __forceinline__ void precise_sincos(float x, float *s, float *c) {
    if (trig_in_range(x)) {
        precise_sincos_in_range(x, s, c);
    } else {
        const SinCos v = large_sincos(x);
        *s = v.s, *c = v.c;
    }
}
__device__ __forceinline__ void fast_sincos(float x, float *s, float *c) {
    if (trig_in_range(x)) {
        fast_sincos_in_range(x, s, c);
    } else {
        const SinCos v = large_sincos(x);
        *s = v.s, *c = v.c;
    }
}

__device__ __forceinline__ void sincos_f64(double x, double *s, double *c) { sincos(x, s, c); }

}  // namespace brrr
