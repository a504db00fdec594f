/* Ends an instance begun by cpu_real_f32.h or cpu_real_f64.h. */
#undef REAL
#undef REAL_DTYPE
#undef FN
#undef CPU_LOAD
#undef CPU_STORE
#undef EXP
#undef TANH
#undef BLOCK_MAX
