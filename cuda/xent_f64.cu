#include "xent_kernels.cuh"

template cudaError_t brrr::xent::xent_fwd_typed<double>(const brrr_xent_launch &, cudaStream_t);
template cudaError_t brrr::xent::xent_bwd_typed<double>(const brrr_xent_launch &, cudaStream_t);
