#include "chain_kernels.cuh"

template void brrr::chain_fwd_typed<__nv_bfloat16>(const brrr_chain_launch &, int, cudaStream_t);
