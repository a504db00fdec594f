/* Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
 * SC 2011), the counter-based generator of brrr's dropout masks. One definition, compiled into
 * the CPU twin (csrc/dropout.c) and the CUDA kernels, so that both draw the same bits.
 *
 * Host and device code; every function is a pure function of its arguments. */
#ifndef BRRR_PHILOX_H
#define BRRR_PHILOX_H

#include <stdint.h>

#ifndef BRRR_HD
#ifdef __CUDACC__
#define BRRR_HD __host__ __device__ __forceinline__
#else
#define BRRR_HD static inline
#endif
#endif

typedef struct {
    uint32_t v[4];
} brrr_philox4;

/* Ten rounds of the Philox S-box (two 32x32->64 multiplies) with the key bumped by the Weyl
 * constants between rounds: Random123's philox4x32_10. */
BRRR_HD brrr_philox4 brrr_philox4x32_10(brrr_philox4 ctr, uint32_t k0, uint32_t k1) {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint64_t p0 = (uint64_t)0xD2511F53u * ctr.v[0], p1 = (uint64_t)0xCD9E8D57u * ctr.v[2];
        const brrr_philox4 next = {{(uint32_t)(p1 >> 32) ^ ctr.v[1] ^ k0, (uint32_t)p1,
                                    (uint32_t)(p0 >> 32) ^ ctr.v[3] ^ k1, (uint32_t)p0}};
        ctr = next;
    }
    return ctr;
}

/* The dropout randoms of logical elements 4 * group .. 4 * group + 3: counter (group, offset) as
 * two 64-bit halves, key = seed. Distinct offsets are disjoint streams for any tensor size. */
BRRR_HD brrr_philox4 brrr_dropout_randoms(uint64_t seed, uint64_t offset, uint64_t group) {
    const brrr_philox4 ctr = {{(uint32_t)group, (uint32_t)(group >> 32), (uint32_t)offset, (uint32_t)(offset >> 32)}};
    return brrr_philox4x32_10(ctr, (uint32_t)seed, (uint32_t)(seed >> 32));
}

/* An element is kept iff its random >= threshold = floor(p * 2^32), which lies in [0, 2^32].
 * Randoms are needed only when some elements are kept and some dropped; otherwise a random of 0
 * gives the same answer. */
BRRR_HD int brrr_dropout_draws(uint64_t threshold) { return threshold != 0 && threshold <= 0xFFFFFFFFu; }

#endif
