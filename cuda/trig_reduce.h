/* Range reduction for large float arguments (|x| > 105615, where the three-part Cody-Waite
 * reduction stops being exact): Payne-Hanek with 96 bits of 2/pi, in integer arithmetic. Inline
 * and branch-light on purpose: a call into libdevice's slow path would cost every kernel that
 * contains trig registers and spills (the CUDA call ABI), for arguments that are rare.
 *
 * Host and device code, so that tests/trig_reduce_check.cc can check it against exact values. */
#ifndef BRRR_TRIG_REDUCE_H
#define BRRR_TRIG_REDUCE_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define BRRR_HD __host__ __device__ __forceinline__
#else
#define BRRR_HD static inline
#endif

/* Word k (k >= 1) holds bits 32(k-1)+1 .. 32k of the binary fraction 2/pi; word 0 is zero
 * padding for windows that start before the binary point. Picked from 64-bit pairs by selects
 * and a shift: a switch became jump tables that cost NVRTC 6 ms of every chain with a trig step. */
BRRR_HD uint32_t brrr_two_over_pi_word(int k) {
    const uint64_t pair = k <= 2 ? UINT64_C(0x4E441529A2F9836E) : k <= 4 ? UINT64_C(0xF534DDC0FC2757D1)
                        : k <= 6 ? UINT64_C(0x3C439041DB629599) : UINT64_C(0xDEBBC561FE5163AB);
    return k < 1 || k > 8 ? 0u : (uint32_t)(pair >> (32 * ((k - 1) & 1)));
}

BRRR_HD uint64_t brrr_mul_hi64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
    return __umul64hi(a, b);
#else
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
#endif
}

/* For finite |x| >= 2^16: x = k pi/2 + r with |r| <= pi/4; returns r and sets *q = k (mod 4 is
 * all that matters). x = m 2^s with m the 24-bit significand; x 2/pi mod 4 only needs the bits
 * of 2/pi from weight 2^(1-s) down, so a 96-bit window W of them gives
 * x 2/pi mod 4 = (m W mod 2^96) / 2^94. */
BRRR_HD double brrr_reduce_large(float x, int *q) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const int s = (int)((bits >> 23) & 0xFFu) - 150;
    const uint64_t m = (bits & 0x7FFFFFu) | 0x800000u;
    const int start = s + 30; /* window's first bit, counted from the padding word */
    const int w = start >> 5, o = start & 31;
    const uint32_t a = brrr_two_over_pi_word(w), b = brrr_two_over_pi_word(w + 1);
    const uint32_t c = brrr_two_over_pi_word(w + 2), d = brrr_two_over_pi_word(w + 3);
    const uint32_t hi = o ? (a << o) | (b >> (32 - o)) : a;
    const uint32_t mid = o ? (b << o) | (c >> (32 - o)) : b;
    const uint32_t lo = o ? (c << o) | (d >> (32 - o)) : c;
    const uint64_t low_word = ((uint64_t)mid << 32) | lo;
    const uint64_t low = m * low_word;                                              /* bits 0..63 */
    const uint32_t top = (uint32_t)(brrr_mul_hi64(m, low_word) + m * (uint64_t)hi); /* bits 64..95 */
    const uint64_t t = ((uint64_t)top << 32) | (low >> 32);                         /* bits 32..95 */
    int k = (int)(t >> 62);
    int64_t frac = (int64_t)(t & ((UINT64_C(1) << 62) - 1));
    if (frac >= (INT64_C(1) << 61)) { /* round to the nearest quadrant: |r| <= pi/4 */
        frac -= INT64_C(1) << 62;
        k += 1;
    }
    double r = (double)frac * 3.4061215800865545e-19; /* (pi/2) 2^-62 */
    if (bits >> 31) {
        r = -r;
        k = -k;
    }
    *q = k;
    return r;
}

#endif
