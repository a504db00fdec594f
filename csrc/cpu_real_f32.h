/* The float32 instance of a CPU kernel template (norm_cpu.inc, softmax_cpu.inc, xent_cpu.inc):
 * float math for float32, float16 and bfloat16 storage. Included before the template, and
 * cpu_real_end.h after it; no include guard, as each template is instantiated once per type. */
#define REAL float
#define REAL_DTYPE BRRR_F32
#define FN(name) name##_f32
#define CPU_LOAD brrr_cpu_load_f32
#define CPU_STORE brrr_cpu_store_f32
#define EXP brrr_expf
#define TANH brrr_tanhf
#define BLOCK_MAX brrr_block_maxf
