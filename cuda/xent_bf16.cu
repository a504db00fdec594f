#include "xent_kernels.cuh"

template cudaError_t brrr::xent::xent_fwd_typed<__nv_bfloat16>(const brrr_xent_launch &, cudaStream_t);
template cudaError_t brrr::xent::xent_bwd_typed<__nv_bfloat16>(const brrr_xent_launch &, cudaStream_t);
