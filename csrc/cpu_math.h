/* Float transcendentals for the CPU twins, written so that GCC vectorises a loop that calls them:
 * branch-free (selects, not jumps), no libm calls, bit reinterpretation through unions, and no
 * float-to-int conversion of values that may be out of range. Each is accurate to a few float
 * ulps (tests/test_cpu_math.py measures them against float64 references).
 *
 *   brrr_expf      Cody-Waite reduction by ln 2, Taylor polynomial of degree 7 on |r| <= ln2/2
 *                  (truncation below 6e-9 relative), 2^n applied in two halves so that results
 *                  down into the subnormals and up to infinity come out right; the input is
 *                  clamped by integer minimums, not branches, which AVX2 vectorises too.
 *   brrr_tanhf     x + x^3 P(x^2) below 0.625 (Cephes' tanhf polynomial), 1 - 2 / (e^2|x| + 1)
 *                  above, where nothing cancels badly.
 *   brrr_erfcf     t Q(t) e^(-z^2) with z = |x|, t = 1 / (1 + 0.42 z), 2 - erfc(-x) below zero;
 *                  1 + erf(z) is erfc(-z), accurate in the tail. brrr_erfcf_gauss also gives
 *                  e^(-x^2), for the erf GELU's derivative.
 *   brrr_erfcf_half  the same form for half storage: no division, shorter polynomials.
 *   brrr_exp_le0_scaled  e^a 2^64 for a <= 0 (softmax): one scaling, a shorter polynomial.
 *   brrr_sincosf_reduced  sin and cos for |x| <= BRRR_TRIG_REDUCED_MAX: x = q pi/2 + r by a
 *                  three-part Cody-Waite reduction, then Taylor polynomials on |r| <= pi/4
 *                  (truncation below 3e-9). A few ulps of 1 in absolute terms: pi/2 is carried to
 *                  1.7e-15, so near a zero of sin or cos (x close to q pi/2, q up to 5215) the
 *                  relative error grows to hundreds of ulps, below 1e-11 absolute. Larger
 *                  arguments need the caller's scalar pass with libm (Payne-Hanek reduction), see
 *                  brrr_trig_needs_libm. */
#ifndef BRRR_CPU_MATH_H
#define BRRR_CPU_MATH_H

#include <math.h>
#include <stdint.h>

typedef union {
    float f;
    uint32_t u;
} brrr_f32_bits;

/* x clamped into [-104, 88.8] (e^88.8 overflows, e^-104 rounds to 0; a NaN comes out as one of
 * them) by two integer minimums of its bits: as a signed integer every float above 88.8 (a
 * positive NaN too) is larger than 88.8's bits and every negative float smaller; as an unsigned
 * one every float below -104 (a negative NaN too) is larger than -104's bits and every positive
 * float smaller. Float selects would do, but GCC turns a select of constants into branches (each
 * constant's result folded), which AVX2 cannot vectorise. */
static inline float brrr_exp_clamp(float x) {
    brrr_f32_bits b = {x};
    const brrr_f32_bits hi = {88.8f}, lo = {-104.0f};
    const int32_t s = (int32_t)b.u < (int32_t)hi.u ? (int32_t)b.u : (int32_t)hi.u;
    b.u = (uint32_t)s < lo.u ? (uint32_t)s : lo.u;
    return b.f;
}

/* e^x for x not NaN (a NaN comes out as a number: brrr_expf passes it through): the reduction r
 * of the clamped x never leaves the polynomial's range (|r| < 0.35). */
static inline float brrr_exp_not_nan(float x) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = brrr_exp_clamp(x);
    const brrr_f32_bits t = {x * 1.44269504088896341f + round_magic};
    const float n = t.f - round_magic;
    /* ln 2 = 0.693359375 (9 bits: n * it is exact) - 2.12194440e-4 */
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* n in [-150, 128] sits in t's low mantissa bits; 2^n = 2^(n/2) 2^(n - n/2), both normal. */
    const int32_t ni = (int32_t)(t.u - 0x4B400000u), n1 = ni >> 1, n2 = ni - n1;
    const brrr_f32_bits s1 = {.u = (uint32_t)(n1 + 127) << 23}, s2 = {.u = (uint32_t)(n2 + 127) << 23};
    return p * s1.f * s2.f;
}

static inline float brrr_expf(float x) {
    const float e = brrr_exp_not_nan(x);
    return x == x ? e : x;
}

static inline float brrr_tanhf(float x) {
    brrr_f32_bits bits = {x}, sign = {x};
    bits.u &= 0x7FFFFFFFu;
    sign.u &= 0x80000000u;
    const float a = bits.f, z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = z == 0.0f ? x : x + x * z * p; /* x itself where x^2 is 0: the sum gives -0 as +0 */
    brrr_f32_bits large = {1.0f - 2.0f / (brrr_expf(2.0f * a) + 1.0f)};
    large.u |= sign.u;
    return a < 0.625f ? small : large.f; /* NaN: the exp branch's NaN */
}

/* e^a 2^64 for a <= 1 (not NaN): brrr_erfcf's exponential, whose argument is never positive.
 * The factor 2^64 keeps 2^n normal down to a = -104 (where e^a rounds to 0), so one integer add
 * and shift make it, and the caller's factor 2^-64 rounds a result below 2^-126 into the
 * subnormals once. Cheaper than brrr_expf, as erfc's accuracy allows: a minimax polynomial of
 * degree 6 on |r| <= ln2/2 (relative error 1e-8 with its coefficients rounded to float), one
 * term shorter than brrr_expf's Taylor polynomial; and r = a - n ln2 with ln 2 in one float (an
 * error of n 1.9e-9, at most 150 times that, where erfc's tolerance is about n ulps). */
static inline float brrr_exp_tail_scaled(float a) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23 */
    brrr_f32_bits b = {a};
    const brrr_f32_bits lo = {-104.0f};
    b.u = b.u < lo.u ? b.u : lo.u; /* unsigned: every float below -104 is larger than its bits */
    const brrr_f32_bits t = {b.f * 1.44269504088896341f + round_magic};
    const float n = t.f - round_magic, r = b.f - n * 0.693147182f;
    float p = 0.0013811663f;
    p = p * r + 0.008370135f;
    p = p * r + 0.041668527f;
    p = p * r + 0.16666509f;
    p = p * r + 0.49999994f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* n + 64 in [-86, 65] as the exponent field: n sits in t's low mantissa bits */
    const brrr_f32_bits s = {.u = (t.u + (127u + 64u - 0x4B400000u)) << 23};
    return p * s.f;
}

/* e^a 2^64 for a <= ln2 / 2, exactly 0 below -104 (where e^a rounds to 0 in float), a NaN passed
 * through: softmax's exponential, whose argument (x less its row's maximum) is never positive.
 * brrr_expf's two-constant reduction by ln 2 (exact to n 1e-12), brrr_exp_tail_scaled's
 * polynomial and one scaling: the factor 2^64 keeps 2^n normal down to -104, and the caller's
 * 2^-64, folded into its 1 / sum, rounds a result below 2^-126 into the subnormals once. No clamp
 * of a: the select of 0 drops whatever an argument below -104 (-inf too) computed. About two
 * thirds of brrr_expf's instructions. */
static inline float brrr_exp_le0_scaled(float a) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23 */
    const brrr_f32_bits t = {a * 1.44269504088896341f + round_magic};
    const float n = t.f - round_magic, r = (a - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 0.0013811663f;
    p = p * r + 0.008370135f;
    p = p * r + 0.041668527f;
    p = p * r + 0.16666509f;
    p = p * r + 0.49999994f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* n + 64 in [-86, 64] as the exponent field: n sits in t's low mantissa bits */
    const brrr_f32_bits s = {.u = (t.u + (127u + 64u - 0x4B400000u)) << 23};
    return a < -104.0f ? 0.0f : p * s.f;
}
static inline double brrr_exp_le0_scaled_f64(double a) { return exp(a) * 0x1p64; }
#define BRRR_EXP_LE0_SCALED(a) _Generic((a), float: brrr_exp_le0_scaled, default: brrr_exp_le0_scaled_f64)(a)

/* erfc(x), and *gauss = e^(-x^2), which the erf GELU's derivative takes from the same evaluation
 * (its density is e^(-x^2) / sqrt(pi) at x = y / sqrt 2): erfc(z) = t Q(t) e^(-z^2) for z = |x|,
 * t = 1 / (1 + 0.42 z), 2 - erfc(-x) below zero. Q is a fit of degree 7 in t for z in [0, 9.4]
 * (beyond, erfc(z) underflows), its relative error weighted by 1 / (1 + 2 z^2) (the tolerance of
 * gelu, whose argument's rounding moves the result by z^2 ulps): 0.4 ulp so weighted with its
 * coefficients rounded to float, which carry the factor 2^-64 brrr_exp_tail_scaled asks for. Two
 * multiply-adds fewer than the form t e^(-z^2 + s P(s)), s = 1 - t, of degree 6 that it replaced,
 * and the exponential is shared: float32 gelu 1.05 -> 0.78 ns an element on an AVX2 Zen 3, its
 * value and derivative 1.72 -> 0.85. A large z (infinity too) gives t = 0 and e^-z^2 = 0; a NaN
 * gives t NaN, and so the result. */
static inline float brrr_erfcf_gauss(float x, float *gauss) {
    brrr_f32_bits bits = {x};
    bits.u &= 0x7FFFFFFFu;
    const float z = bits.f, t = 1.0f / (1.0f + 0.42f * z);
    float q = 0.07278513f * 0x1p-64f;
    q = q * t - 0.33006388f * 0x1p-64f;
    q = q * t + 0.4558097f * 0x1p-64f;
    q = q * t - 0.14245665f * 0x1p-64f;
    q = q * t + 0.2737428f * 0x1p-64f;
    q = q * t + 0.19370157f * 0x1p-64f;
    q = q * t + 0.23965418f * 0x1p-64f;
    q = q * t + 0.23682716f * 0x1p-64f;
    /* -z^2 rounded once: it moves the result by up to z^2 ulps, less than the rounding of z
     * itself does in gelu's argument x / sqrt 2 (about 2 z^2 ulps). The scaled product rounds a
     * result below 2^-126 into the subnormals once. */
    const float e64 = brrr_exp_tail_scaled(-(z * z));
    *gauss = e64 * 0x1p-64f;
    const float tail = t * q * e64;
    return x >= 0.0f ? tail : 2.0f - tail;
}

static inline float brrr_erfcf(float x) {
    float gauss;
    return brrr_erfcf_gauss(x, &gauss);
}

/* e^a 2^64 as brrr_exp_tail_scaled, for results stored in float16 or bfloat16: a minimax
 * polynomial of degree 4 (relative error 2.8e-6), two terms shorter. */
static inline float brrr_exp_tail_scaled_half(float a) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23 */
    brrr_f32_bits b = {a};
    const brrr_f32_bits lo = {-104.0f};
    b.u = b.u < lo.u ? b.u : lo.u;
    const brrr_f32_bits t = {b.f * 1.44269504088896341f + round_magic};
    const float n = t.f - round_magic, r = b.f - n * 0.693147182f;
    float p = 0.04151375f;
    p = p * r + 0.16787458f;
    p = p * r + 0.50003014f;
    p = p * r + 0.99996685f;
    p = p * r + 1.0f;
    const brrr_f32_bits s = {.u = (t.u + (127u + 64u - 0x4B400000u)) << 23};
    return p * s.f;
}

/* erfc for results stored in float16 or bfloat16 (11 and 8 bits): brrr_erfcf's form without its
 * division and with shorter polynomials, relative error below 3e-5 (tests/test_chain.py checks
 * gelu and its derivative at every half value). The division was most of erfc's time: one
 * vector division occupies its port for 10 or more cycles. Instead t = 1 / (1 + 0.44 z) is a
 * reciprocal guessed from the bits (5% off) and refined by two Newton steps (6.5e-6). P, of
 * degree 4, is fitted with its error weighted 10 times for z in [0.45, 0.62] (2.5e-6 there, where
 * gelu's derivative crosses zero: 1/2 erfc(z) less z e^(-z^2) / sqrt(pi), both near 0.23, leave a
 * result near 8e-4 that bfloat16 rounds relative to itself). */
static inline float brrr_erfcf_half(float x) {
    brrr_f32_bits bits = {x};
    bits.u &= 0x7FFFFFFFu;
    const float z = bits.f;
    /* the reciprocal's z clamped by an integer minimum (9.5: erfc has underflowed; infinity and
     * NaN too): -z^2 in the exponent, from z itself, makes their results 0 and NaN */
    const brrr_f32_bits zmax = {9.5f};
    const brrr_f32_bits zc = {.u = bits.u < zmax.u ? bits.u : zmax.u};
    /* t64 = 2^-64 t, the factor brrr_exp_tail_scaled_half asks for, as the reciprocal of
     * d64 = 2^64 d: every step gives the bits it gives for t and d, scaled, one multiply fewer */
    const float d64 = 0x1p64f + 0x1p64f * 0.44f * zc.f;
    const brrr_f32_bits d_bits = {d64}, guess = {.u = 0x7EF31000u - d_bits.u};
    float t64 = guess.f;
    t64 = t64 * (2.0f - d64 * t64);
    t64 = t64 * (2.0f - d64 * t64);
    const float s = 1.0f - t64 * 0x1p64f;
    float poly = -0.20371377f;
    poly = poly * s + 0.22335263f;
    poly = poly * s + 0.34370056f;
    poly = poly * s - 0.19678356f;
    poly = poly * s - 1.5636739f;
    const float tail = t64 * brrr_exp_tail_scaled_half(s * poly - z * z);
    return x >= 0.0f ? tail : 2.0f - tail;
}

/* An order-preserving integer key of a float (x < y gives key(x) < key(y); -0 just below +0; a
 * NaN above +inf or below -inf by its sign bit) and its inverse: a maximum taken over keys is an
 * integer reduction, which GCC vectorises (a float one it vectorises only without NaN rules). */
static inline int32_t brrr_float_key(float x) {
    const brrr_f32_bits b = {x};
    const int32_t s = (int32_t)b.u;
    return s ^ (int32_t)((uint32_t)(s >> 31) >> 1); /* negative: flip all but the sign bit */
}
static inline float brrr_key_float(int32_t k) {
    const brrr_f32_bits b = {.u = (uint32_t)(k ^ (int32_t)((uint32_t)(k >> 31) >> 1))};
    return b.f;
}

/* The largest of z[0, n): -inf for n = 0, and possibly a NaN where z holds one. The float one
 * reduces integer keys, at the vector width; both are inlined always, so that a target clone of
 * their caller compiles them for its own width. */
static inline __attribute__((always_inline)) float brrr_block_maxf(const float *z, int64_t n) {
    int32_t k = brrr_float_key(-INFINITY);
    for (int64_t i = 0; i < n; i++) {
        const int32_t ki = brrr_float_key(z[i]);
        k = ki > k ? ki : k;
    }
    return brrr_key_float(k);
}
static inline __attribute__((always_inline)) double brrr_block_max(const double *z, int64_t n) {
    double m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = z[i] > m ? z[i] : m; /* passes a NaN over */
    return m;
}

#define BRRR_TRIG_REDUCED_MAX 8192.0f /* q < 2^13: q times each of the first two parts is exact */

/* Does x need libm's reduction (BRRR_TRIG_REDUCED_MAX < |x| < inf)? NaN and inf do not: the
 * reduced path gives NaN for them, as it should. */
static inline int brrr_trig_needs_libm(float x) {
    brrr_f32_bits bits = {x};
    const brrr_f32_bits max = {BRRR_TRIG_REDUCED_MAX};
    /* one unsigned range check on |x|'s bits (max, inf): no branch, so a loop of it vectorises */
    return (bits.u & 0x7FFFFFFFu) - (max.u + 1u) < 0x7F800000u - (max.u + 1u);
}

static inline void brrr_sincosf_reduced(float x, float *s, float *c) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23 */
    brrr_f32_bits t = {x * 0.636619772f + round_magic};
    const float q = t.f - round_magic;
    /* pi/2 = 1.5703125 + 4.837512969970703e-4 (8 and 11 bits) + 7.5497901264e-8 (to 1.7e-15) */
    const float r = ((x - q * 1.5703125f) - q * 4.837512969970703e-4f) - q * 7.549790126404332e-8f;
    const float r2 = r * r;
    float ps = 1.0f / 362880.0f;
    ps = ps * r2 - 1.0f / 5040.0f;
    ps = ps * r2 + 1.0f / 120.0f;
    ps = ps * r2 - 1.0f / 6.0f;
    const float sr = r2 == 0.0f ? r : r + r * r2 * ps; /* r itself where r^2 is 0: the sum gives -0 as +0 */
    float pc = -1.0f / 3628800.0f;
    pc = pc * r2 + 1.0f / 40320.0f;
    pc = pc * r2 - 1.0f / 720.0f;
    pc = pc * r2 + 1.0f / 24.0f;
    pc = pc * r2 - 0.5f;
    const float cr = 1.0f + r2 * pc;
    /* quadrant q mod 4: (sin, cos) = (s, c), (c, -s), (-s, -c), (-c, s) */
    const uint32_t quadrant = (uint32_t)t.u & 3u;
    const float sv = quadrant & 1u ? cr : sr, cv = quadrant & 1u ? sr : cr;
    *s = quadrant & 2u ? -sv : sv;
    *c = (quadrant + 1u) & 2u ? -cv : cv;
}
static inline float brrr_sinf_reduced(float x) {
    float s, c;
    brrr_sincosf_reduced(x, &s, &c);
    return s;
}
static inline float brrr_cosf_reduced(float x) {
    float s, c;
    brrr_sincosf_reduced(x, &s, &c);
    return c;
}

#endif
