/* The float64 instance of a CPU kernel template (see cpu_real_f32.h). */
#define REAL double
#define REAL_DTYPE BRRR_F64
#define FN(name) name##_f64
#define CPU_LOAD brrr_cpu_load_f64
#define CPU_STORE brrr_cpu_store_f64
#define EXP exp
#define TANH tanh
#define BLOCK_MAX brrr_block_max
