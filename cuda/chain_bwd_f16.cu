#include "chain_kernels.cuh"

template void brrr::chain_bwd_typed<__half>(const brrr_chain_launch &, int, cudaStream_t);
