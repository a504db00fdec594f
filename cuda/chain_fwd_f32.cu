#include "chain_kernels.cuh"

template void brrr::chain_fwd_typed<float>(const brrr_chain_launch &, int, cudaStream_t);
