#include "chain_kernels.cuh"

template void brrr::chain_bwd_typed<double>(const brrr_chain_launch &, int, cudaStream_t);
