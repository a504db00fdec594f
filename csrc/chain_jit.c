/* Chains compiled for their exact sequence of steps.
 *
 * On first use of a chain on CUDA, a kernel is generated for its steps (unrolled, scalars as
 * immediates), its dtype, forward or backward, and its layout class (contiguous, strided of a
 * given rank, or rows for a bias gradient), compiled by NVRTC into a cubin for the device's
 * exact architecture, loaded with the CUDA runtime's library API (cuda/jit.cu) and launched.
 * The step math is the precompiled kernels' own: the generated source includes chain_math.cuh
 * and what it includes, embedded at build time (setup.py writes brrr_jit_headers.h).
 *
 * NVRTC is loaded at run time (dlopen), so brrr neither links it nor needs it: without it the
 * precompiled kernels interpret chains of up to BRRR_MAX_CHAIN_STEPS steps (a warning says so
 * once). Where it is looked for: $BRRR_NVRTC (a file; "none" disables compiling), then
 * libnvrtc.so.13 and .12 through the loader's search path, then $CUDA_HOME/lib64,
 * $CUDA_PATH/lib64, /usr/local/cuda/lib64, and the nvidia/cu13/lib and nvidia/cuda_nvrtc/lib
 * folders of NVIDIA's pip wheels along sys.path (where PyTorch's CUDA wheels put it).
 *
 * A program holds one kernel. A chain whose backward is wanted (chain_jit_with_backward: autograd
 * records the chain) builds its forward and its backward at once, on two threads: NVRTC compiles
 * programs in parallel, so a first call with autograd waits for the longer of the two compiles.
 * Compiled kernels are cached in memory (per process, keyed by the kernel's specification, steps,
 * architecture and generated variant, the BRRR_CHAIN_JIT_* switches) and on disk, in $BRRR_CACHE_DIR, else
 * $XDG_CACHE_HOME/brrr, else ~/.cache/brrr: one file per program, named by a hash of its identity
 * (brrr's version, the architecture, the embedded headers and the whole generated source, which
 * differs between the variants where one applies), holding that identity, the cubin and a checksum.
 * A file is written to a temporary name and renamed into place, so readers see a whole file or
 * none, and two processes compiling the same chain both succeed; a file whose identity or checksum
 * does not match is compiled again and replaced.
 * A kernel found on disk needs no NVRTC: NVRTC is loaded when a kernel is first compiled.
 *
 * The cache is process-wide, like the CUDA context the kernels load into; its table and the
 * compiler (NVRTC's loading included) are guarded by mutexes, and building runs without the GIL. */
#define _GNU_SOURCE
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "chain_jit.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "brrr_jit_headers.h"

/* ---- text ----------------------------------------------------------------------------------- */

typedef struct {
    char *data;
    size_t len, cap;
    int failed; /* out of memory: data is NULL from then on */
} text;

static void put(text *t, const char *fmt, ...) {
    if (t->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        const int n = vsnprintf(t->data ? t->data + t->len : NULL, t->data ? t->cap - t->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) break;
        if (t->data && t->len + (size_t)n < t->cap) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = t->cap ? t->cap : 4096;
        while (cap <= t->len + (size_t)n) cap *= 2;
        char *grown = realloc(t->data, cap);
        if (grown == NULL) break;
        t->data = grown;
        t->cap = cap;
    }
    free(t->data);
    t->data = NULL;
    t->failed = 1;
}

/* FNV-1a, 64 bits, continuing from h (start with FNV_OFFSET). */
#define FNV_OFFSET UINT64_C(14695981039346656037)
static uint64_t fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * UINT64_C(1099511628211);
    return h;
}

/* ---- source generation ------------------------------------------------------------------------ */

/* The chain_math.inc function of each op that has one, and whether it takes the scalar. */
static const char *op_function(int op, int *takes_scalar) {
    *takes_scalar = 0;
    switch (op) {
    case BRRR_OP_RELU: return "relu";
    case BRRR_OP_GELU: return "gelu";
    case BRRR_OP_GELU_TANH: return "gelu_tanh";
    case BRRR_OP_SILU: return "silu";
    case BRRR_OP_SIGMOID: return "sigmoid";
    case BRRR_OP_TANH: return "tanh";
    case BRRR_OP_EXP: return "exp";
    case BRRR_OP_COS: return "cos";
    case BRRR_OP_SIN: return "sin";
    case BRRR_OP_ABS: return "abs";
    case BRRR_OP_NEG: return "neg";
    case BRRR_OP_SQUARE: return "square";
    case BRRR_OP_SQRT: return "sqrt";
    case BRRR_OP_RSQRT: return "rsqrt";
    case BRRR_OP_LOG: return "log";
    case BRRR_OP_LOG1P: return "log1p";
    case BRRR_OP_EXPM1: return "expm1";
    case BRRR_OP_RECIPROCAL: return "reciprocal";
    case BRRR_OP_SOFTPLUS: return "softplus";
    case BRRR_OP_MISH: return "mish";
    case BRRR_OP_HARDSWISH: return "hardswish";
    default: break;
    }
    *takes_scalar = 1;
    switch (op) {
    case BRRR_OP_POW: return "pow";
    case BRRR_OP_CLAMP_MIN: return "clamp_min";
    case BRRR_OP_CLAMP_MAX: return "clamp_max";
    case BRRR_OP_LEAKY_RELU: return "leaky_relu";
    default: return NULL; /* add, mul and the tensor steps: written inline */
    }
}

/* A step's scalar as an immediate of the compute type, rounded as the interpreted kernels round
 * it (static_cast<A>(double)). */
static void put_scalar(text *t, double c) {
    if (isfinite(c)) {
        put(t, "(A)%a", c);
    } else {
        uint64_t bits;
        memcpy(&bits, &c, sizeof bits);
        put(t, "(A)__longlong_as_double(0x%016llxLL)", (unsigned long long)bits);
    }
}

/* Steps that call an elementary function (libdevice's or brrr's): tens of instructions each. */
static int is_heavy(int op) {
    switch (op) {
    case BRRR_OP_ADD_SCALAR: case BRRR_OP_MUL_SCALAR: case BRRR_OP_ADD_TENSOR: case BRRR_OP_MUL_TENSOR:
    case BRRR_OP_RELU: case BRRR_OP_ABS: case BRRR_OP_NEG: case BRRR_OP_SQUARE: case BRRR_OP_CLAMP_MIN:
    case BRRR_OP_CLAMP_MAX: case BRRR_OP_LEAKY_RELU: case BRRR_OP_HARDSWISH: return 0;
    default: return 1;
    }
}

/* Chains with more heavy steps than this get one copy of the element function, called for each
 * element, instead of a copy inlined per element (16 in a contiguous half-type kernel): NVRTC
 * took 0.3-0.45 s for a 12-step mixed bfloat16 chain inlined, 0.08-0.09 s called (2-core host);
 * the call's cost hides behind the steps' own. */
#define BRRR_JIT_INLINE_HEAVY_STEPS 4

static int is_trig(int op) { return op == BRRR_OP_COS || op == BRRR_OP_SIN; }

/* Whether the element function is inlined at every element (else called). */
static int inlined(const brrr_chain_steps *p) {
    int heavy = 0;
    for (int s = 0; s < p->n_steps; s++) heavy += is_heavy(p->steps[s].op);
    return heavy <= BRRR_JIT_INLINE_HEAVY_STEPS;
}

/* A forward kernel rolls a run of more than this many identical steps into a loop over this many
 * (unrolled) steps: NVRTC compiles one copy instead of the whole run, and the loop's few
 * instructions are lost among the steps' own (x * c 256 times in float32: 4 iterations of 64
 * multiplies of the thread's 4 values). Chains of up to this many steps, the repeat sweep's knee
 * among them, compile as before. Backward kernels keep their runs unrolled, which lets the
 * compiler fold a run's constant derivatives into one constant. */
#define BRRR_JIT_RUN_UNROLL 64

/* The number of steps from step s on that are the same step as s (op and scalar); tensor and
 * trig steps are runs of their own. */
static int run_length(const brrr_chain_steps *p, int s) {
    const brrr_chain_step *a = &p->steps[s];
    if (is_trig(a->op) || a->op == BRRR_OP_ADD_TENSOR || a->op == BRRR_OP_MUL_TENSOR) return 1;
    int e = s + 1;
    while (e < p->n_steps && p->steps[e].op == a->op && memcmp(&p->steps[e].scalar, &a->scalar, sizeof a->scalar) == 0) e++;
    return e - s;
}

/* Whether kernel k rolls the run starting at step s into a loop (BRRR_JIT_RUN_UNROLL). */
static int rolled(const brrr_chain_kernel *k, const brrr_chain_steps *p, int s) {
    return !k->backward && run_length(p, s) > BRRR_JIT_RUN_UNROLL;
}

/* Whether kernel k of the chain gets the pack function (put_element_functions): an inlined chain
 * with a trig step, or one whose forward rolls a run (the loop then runs over all the thread's
 * values at once, keeping their multiplies independent). Other chains gain nothing from it
 * (their inlined copies share one basic block, and its constants, already), and NVRTC folds them
 * faster as element functions: the backward of 256 multiplies by a scalar, a constant derivative,
 * compiled in 0.05 s as one, 0.14 s as a pack. */
static int packed(const brrr_chain_kernel *k, const brrr_chain_steps *p) {
    int trig = 0, runs = 0;
    for (int s = 0; s < p->n_steps; s += run_length(p, s)) trig |= is_trig(p->steps[s].op), runs |= rolled(k, p, s);
    return (trig || runs) && inlined(p);
}

/* Whether kernel k's pack function checks the range of all of a thread's values at once (a trig
 * step; put_element_functions), values of its packs past the end included. */
static int checks_pack_range(const brrr_chain_kernel *k, const brrr_chain_steps *p) {
    int trig = 0;
    for (int s = 0; s < p->n_steps; s++) trig |= is_trig(p->steps[s].op);
    return trig && packed(k, p);
}

/* The variants of a kernel's program, bits of one int (docs/kernel-switches.md). ORDER_PACKWISE
 * (BRRR_CHAIN_JIT_ORDER=packwise, else ORDER_INTERLEAVED): the order of a contiguous kernel's work
 * after its loads (put_contiguous_kernel). FORM_LEAN (unset or BRRR_CHAIN_JIT_FORM=lean; `wide`:
 * the wide form): a contiguous kernel's indices in 32 bits where they fit, its loads predicated at one
 * address a thread, half the fixed instructions a value (put_contiguous_kernel); and
 * VARIANT_BLOCKS; BLOCK_256 (BRRR_CHAIN_JIT_THREADS=256; unset or 128: 128 threads a block); BOUNDS_EXACT
 * (BRRR_CHAIN_JIT_BOUNDS=exact, a launch that fills every block, lean form: no bounds tests, no tail;
 * put_contiguous_kernel). */
enum { ORDER_INTERLEAVED = 0, ORDER_PACKWISE = 1, FORM_LEAN = 2, BLOCK_256 = 64, BOUNDS_EXACT = 128 };

/* The threads of a contiguous kernel's block in variant v: 128 (4 warps, as Triton's pointwise
 * kernels), or 256 with BLOCK_256 (BRRR_CHAIN_JIT_THREADS=256). On an H200 (c62e08c) the repeat
 * sweep's forward ran 1-3% faster at 128 than at 256 at every repeat count, float32 and
 * bfloat16 (docs/kernel-switches.md). */
static int block_threads(int v) { return v & BLOCK_256 ? 256 : 128; }

/* BRRR_CHAIN_JIT_BLOCKS=b (2 to 8): a contiguous kernel's launch bounds ask for at least b blocks
 * of 256 threads' worth an SM (2b blocks of 128; at most 65536 / (256 b) registers a thread), in
 * bits 2-5 of the variant.
 * 0 there (unset): auto_blocks's choice (build_run). */
#define VARIANT_BLOCKS(v) ((v) >> 2 & 15)
#define WITH_BLOCKS(v, b) (((v) & ~(15 << 2)) | (b) << 2)

/* BRRR_CHAIN_JIT_BLOCKS unset: a contiguous forward kernel asks for every warp slot of an SM (8
 * blocks of 256 threads, at most 32 registers) and keeps that program where ptxas gives its kernel
 * no stack frame (no spill; build_run), else it asks for 2 blocks (at most 128 registers, which no
 * chain spills under), as every backward does. H200 (docs/kernel-switches.md): cos.cos's float32 forward 5.6% faster at 8
 * (35 registers at 2: 6 blocks an SM), the 12-step chain's forward the same; at 8 the bfloat16
 * forwards spill, and the backwards spill or (the 12-step chain's float32 one) run 3% slower. */
static int auto_blocks(const brrr_chain_kernel *k) { return k->layout == BRRR_JIT_CONTIGUOUS && !k->backward ? 8 : 2; }

/* The most elements a contiguous kernel indexes in 32 bits (index32, in the lean form): the
 * indices of the packs past the end (fewer than 512 a block) and of the tail stay below 2^32. */
#define BRRR_JIT_CONTIGUOUS_INDEX32 0xFFFF0000LL

/* The steps of one inlined copy of kernel k's chain: a rolled run counts its BRRR_JIT_RUN_UNROLL. */
static int copy_steps(const brrr_chain_kernel *k, const brrr_chain_steps *p) {
    int n = 0;
    for (int s = 0; s < p->n_steps;) {
        const int run = run_length(p, s);
        n += rolled(k, p, s) ? BRRR_JIT_RUN_UNROLL : run;
        s += rolled(k, p, s) ? run / BRRR_JIT_RUN_UNROLL * BRRR_JIT_RUN_UNROLL : run;
    }
    return n;
}

/* The 16-byte packs a thread of a contiguous kernel in variant v (applied_variant) owns: 2 (the
 * bytes in flight that keep HBM busy at the repeat sweep's knee), or 1 where an inlined chain's
 * copies (one per value) would hold more than 1024 steps: such a chain is compute-bound, a
 * thread's 4 (float32) or 8 (half) values still hide the arithmetic's latency, and NVRTC compiles
 * half the copies: 256 multiplies in 0.07 s instead of 0.10 (float32), 0.11 s instead of 0.18
 * (bfloat16), before runs were rolled. The wide form counts a chain's steps, the lean one the
 * steps of its copy (a rolled run's 64): 128 and 256 multiplies forward keep 2 packs, which halves
 * the instructions a value spends outside the steps (its share of the thread's fixed ones). */
static int packs_per_thread(const brrr_chain_kernel *k, const brrr_chain_steps *p, int v) {
    const int vec = 16 / (int)brrr_dtype_size(k->dtype);
    return inlined(p) && 2 * vec * (v & FORM_LEAN ? copy_steps(k, p) : p->n_steps) > 1024 ? 1 : 2;
}

/* "fwd" or "bwd", in the names of a kernel's element functions (chain_fwd, chain_bwd_n, ...). */
static const char *direction(const brrr_chain_kernel *k) { return k->backward ? "bwd" : "fwd"; }
static const char *kernel_name(const brrr_chain_kernel *k) { return k->backward ? "brrr_chain_bwd" : "brrr_chain_fwd"; }

/* Whether forward kernel k is built along with its backward when the chain's backward is wanted: a
 * contiguous one without vector operands, whose backward (dense tensors as fresh as autograd's,
 * every operand's gradient) is contiguous too. A vector operand's gradient takes the row layout,
 * whose kernels are precompiled up to 16 steps. */
static int pairs_with_backward(const brrr_chain_kernel *k) {
    return !k->backward && k->layout == BRRR_JIT_CONTIGUOUS && !k->vector_mask;
}

/* The backward built along with forward kernel k (pairs_with_backward). */
static brrr_chain_kernel backward_of(const brrr_chain_kernel *k, int n_operands) {
    brrr_chain_kernel b = *k;
    b.backward = 1;
    b.grad_mask = (1 << n_operands) - 1;
    return b;
}

/* How a trig step of a pack function is computed: the pack is in range (M::pack_in_trig_range),
 * or it is not, and each value goes through one called copy of the whole function. */
enum { TRIG_INLINE, TRIG_IN_RANGE, TRIG_CALLED };

/* The statements of step st on element j of y, v0.. and, backward, t (d out / d x so far) and
 * g0.. (d out / d operand); j is "" in the element function, "[j]" in the pack one. trig: how
 * a trig step is computed. *active: the operands whose step has been passed. */
static void put_step(text *t, const brrr_chain_kernel *k, const brrr_chain_step *st, int nops, const char *j, int trig,
                     int *active) {
    int takes_scalar;
    const char *fn = op_function(st->op, &takes_scalar);
    const char *range = is_trig(st->op) && trig == TRIG_IN_RANGE ? "_in_range" : "";
    const int b = st->operand, called = is_trig(st->op) && trig == TRIG_CALLED;
    if (!k->backward) {
        if (st->op == BRRR_OP_ADD_TENSOR || st->op == BRRR_OP_MUL_TENSOR) {
            put(t, "    y%s = y%s %c v%d%s;\n", j, j, st->op == BRRR_OP_ADD_TENSOR ? '+' : '*', b, j);
        } else if (st->op == BRRR_OP_ADD_SCALAR || st->op == BRRR_OP_MUL_SCALAR) {
            put(t, "    y%s = y%s %c ", j, j, st->op == BRRR_OP_ADD_SCALAR ? '+' : '*');
            put_scalar(t, st->scalar);
            put(t, ";\n");
        } else if (called) {
            put(t, "    y%s = %s_fwd_any(y%s);\n", j, fn, j);
        } else {
            put(t, "    y%s = M::%s_fwd%s(y%s", j, fn, range, j);
            if (takes_scalar) {
                put(t, ", ");
                put_scalar(t, st->scalar);
            }
            put(t, ");\n");
        }
        return;
    }
    if (st->op == BRRR_OP_ADD_TENSOR) {
        put(t, "    y%s = y%s + v%d%s;\n    g%d%s = (A)1;\n", j, j, b, j, b, j);
        *active |= 1 << b;
        return;
    }
    if (st->op == BRRR_OP_ADD_SCALAR) {
        put(t, "    y%s = y%s + ", j, j);
        put_scalar(t, st->scalar);
        put(t, ";\n");
        return;
    }
    if (st->op == BRRR_OP_MUL_TENSOR) {
        put(t, "    d = v%d%s;\n    g%d%s = y%s;\n    y%s = y%s * d;\n", b, j, b, j, j, j, j);
    } else if (st->op == BRRR_OP_MUL_SCALAR) {
        put(t, "    d = ");
        put_scalar(t, st->scalar);
        put(t, ";\n    y%s = y%s * d;\n", j, j);
    } else if (called) {
        put(t, "    const Step r = %s_bwd_any(y%s);\n    y%s = r.y;\n    d = r.d;\n", fn, j, j);
    } else {
        put(t, "    y%s = M::%s_fwd_grad%s(y%s, ", j, fn, range, j);
        if (takes_scalar) {
            put_scalar(t, st->scalar);
            put(t, ", ");
        }
        put(t, "&d);\n");
    }
    put(t, "    t%s = t%s * d;\n", j, j);
    for (int o = 0; o < nops; o++)
        if (*active >> o & 1) put(t, "    g%d%s = g%d%s * d;\n", o, j, o, j);
    if (st->op == BRRR_OP_MUL_TENSOR) *active |= 1 << b;
}

/* The parameters of chain_fwd/chain_bwd (element function, which returns the value or the Grads)
 * or chain_fwd_n/chain_bwd_n (pack function, of arrays of N values, which it updates). */
static void put_parameters(text *t, const brrr_chain_kernel *k, int nops, int pack) {
    put(t, pack ? "A (&y)[N]" : "A y");
    for (int b = 0; b < nops; b++) put(t, pack ? ", const A (&v%d)[N]" : ", const A v%d", b);
    if (k->backward && pack) put(t, ", A (&t)[N]");
    for (int b = 0; k->backward && pack && b < nops; b++) put(t, ", A (&g%d)[N]", b);
}

/* "    return {t, g0, ...};" of a backward element function, each name followed by suffix. */
static void put_return_grads(text *t, int nops, const char *suffix) {
    put(t, "    return {t%s", suffix);
    for (int b = 0; b < nops; b++) put(t, ", g%d%s", b, suffix);
    put(t, "};\n}\n\n");
}

/* The step sequence, applied in one forward sweep as the interpreted program_grad does (the same
 * operations in the same order, so the same values up to the compiler's contraction of a
 * multiply and an add): the chain's value, and backward d out / d x and d out / d operand b.
 *
 * Element function: chain_fwd(y, v0, ...) returns the chain's value; chain_bwd(y, v0, ...) returns
 * Grads: t, d out / d x, and gb, d out / d operand b. By value: a called (__noinline__) chain_bwd
 * that set the gb through references kept them in memory, a stack frame in every backward of a
 * chain with tensor operands and more than BRRR_JIT_INLINE_HEAVY_STEPS heavy steps (80 bytes a
 * thread in a contiguous float32 backward of two operands, 144 in bfloat16); Grads comes back in
 * registers. Inlined chains with a trig step (packed) also get the
 * pack function chain_fwd_n / chain_bwd_n, which applies each step to all N values of a thread
 * before the next (the element function calls it with N = 1): a trig step then checks its range
 * once for the pack, as the interpreted kernels do, instead of branching around every value's
 * fast path (which kept the compiler from sharing the polynomials' constants across values:
 * cos.cos in float32 went from about 33 instructions a cos to 21). */
static void put_element_functions(text *t, const brrr_chain_kernel *k, const brrr_chain_steps *p) {
    const int nops = p->n_operands, pack = packed(k, p);
    const char *name = direction(k);
    int active = 0;
    if (k->backward) {
        put(t, "struct Grads {\n    A t");
        for (int b = 0; b < nops; b++) put(t, ", g%d", b);
        put(t, ";\n};\n");
    }
    if (pack) {
        /* Packs out of the fast range (a large, infinite or NaN value) are rare: their trig steps
         * call one copy of the function rather than inlining it for every value. */
        int trig_ops = 0;
        for (int s = 0; s < p->n_steps; s++) trig_ops |= is_trig(p->steps[s].op) << (p->steps[s].op == BRRR_OP_SIN);
        if (trig_ops && k->backward) put(t, "struct Step {\n    A y, d;\n};\n");
        for (int i = 0; i < 2; i++) {
            const char *fn = i ? "sin" : "cos";
            if (!(trig_ops >> i & 1)) continue;
            if (k->backward) put(t, "__device__ __noinline__ Step %s_bwd_any(A y) {\n    Step r;\n    r.y = M::%s_fwd_grad(y, &r.d);\n"
                                    "    return r;\n}\n", fn, fn);
            else put(t, "__device__ __noinline__ A %s_fwd_any(A y) {\n    return M::%s_fwd(y);\n}\n", fn, fn);
        }
        put(t, "template <int N>\n__device__ __forceinline__ void chain_%s_n(", name);
        put_parameters(t, k, nops, 1);
        put(t, ") {\n#pragma unroll\n    for (int j = 0; j < N; ++j) {\n");
        if (k->backward) put(t, "        t[j] = (A)1;\n");
        for (int b = 0; k->backward && b < nops; b++) put(t, "        g%d[j] = (A)0;\n", b);
        put(t, "    }\n");
        for (int s = 0; s < p->n_steps;) {
            const int op = p->steps[s].op;
            if (is_trig(op)) { /* the pack's range checked once: the fast path, else every value's own */
                put(t, "    if (M::pack_in_trig_range(y)) {\n");
                for (int trig = TRIG_IN_RANGE; trig <= TRIG_CALLED; trig++) {
                    int passed = active;
                    put(t, "#pragma unroll\n    for (int j = 0; j < N; ++j) {\n%s", k->backward ? "    A d;\n" : "");
                    put_step(t, k, &p->steps[s], nops, "[j]", trig, &passed);
                    put(t, trig == TRIG_IN_RANGE ? "    }\n    } else {\n" : "    }\n    }\n");
                }
                s++;
                continue;
            }
            if (rolled(k, p, s)) {
                const int loops = run_length(p, s) / BRRR_JIT_RUN_UNROLL;
                put(t, "#pragma unroll 1\n    for (int r = 0; r < %d; ++r) {\n#pragma unroll\n    for (int j = 0; j < N; ++j) {\n", loops);
                for (int i = 0; i < BRRR_JIT_RUN_UNROLL; i++) put_step(t, k, &p->steps[s], nops, "[j]", TRIG_INLINE, &active);
                put(t, "    }\n    }\n");
                s += loops * BRRR_JIT_RUN_UNROLL;
                continue;
            }
            /* The steps up to the next trig step or rolled run; whether one has a derivative. */
            int end = s, uses_d = 0;
            for (; end < p->n_steps && !is_trig(p->steps[end].op) && !rolled(k, p, end); end++)
                uses_d |= p->steps[end].op != BRRR_OP_ADD_TENSOR && p->steps[end].op != BRRR_OP_ADD_SCALAR;
            put(t, "#pragma unroll\n    for (int j = 0; j < N; ++j) {\n%s", k->backward && uses_d ? "    A d;\n" : "");
            for (; s < end; s++) put_step(t, k, &p->steps[s], nops, "[j]", TRIG_INLINE, &active);
            put(t, "    }\n");
        }
        put(t, "}\n\n__device__ __forceinline__ %s chain_%s(", k->backward ? "Grads" : "A", name);
        put_parameters(t, k, nops, 0);
        put(t, ") {\n    A y_[1] = {y}%s", k->backward ? ", t_[1]" : "");
        for (int b = 0; k->backward && b < nops; b++) put(t, ", g%d_[1]", b);
        put(t, ";\n");
        for (int b = 0; b < nops; b++) put(t, "    const A v%d_[1] = {v%d};\n", b, b);
        put(t, "    chain_%s_n<1>(y_", name);
        for (int b = 0; b < nops; b++) put(t, ", v%d_", b);
        if (k->backward) put(t, ", t_");
        for (int b = 0; k->backward && b < nops; b++) put(t, ", g%d_", b);
        put(t, ");\n");
        if (k->backward) put_return_grads(t, nops, "_[0]");
        else put(t, "    return y_[0];\n}\n\n");
        return;
    }
    put(t, "__device__ %s %s chain_%s(", inlined(p) ? "__forceinline__" : "__noinline__", k->backward ? "Grads" : "A",
        name);
    put_parameters(t, k, nops, 0);
    put(t, ") {\n");
    if (k->backward) {
        put(t, "    A t = (A)1, d;\n");
        for (int b = 0; b < nops; b++) put(t, "    A g%d = (A)0;\n", b);
    }
    for (int s = 0; s < p->n_steps; s++) put_step(t, k, &p->steps[s], nops, "", TRIG_INLINE, &active);
    if (k->backward) put_return_grads(t, nops, "");
    else put(t, "    return y;\n}\n\n");
}

/* The call of chain_fwd/chain_bwd on element j of the arrays y and v0.. */
static void put_call(text *t, const brrr_chain_kernel *k, int nops, const char *j) {
    put(t, "chain_%s(y%s", direction(k), j);
    for (int b = 0; b < nops; b++) put(t, ", v%d%s", b, j);
    put(t, ")");
}

static int grad_wanted(const brrr_chain_kernel *k, int b) { return k->backward && (k->grad_mask >> b & 1); }
static int is_vector(const brrr_chain_kernel *k, int b) { return k->vector_mask >> b & 1; }

/* A contiguous kernel's element [j] through the element function, each statement after `indent`:
 * y[j] the chain's value, or t[j] and the dense g0[j].. its derivatives times grad_out's gr[j]. */
static void put_element(text *t, const brrr_chain_kernel *k, int nops, const char *indent) {
    put(t, "%s%s", indent, k->backward ? "const Grads res = " : "y[j] = ");
    put_call(t, k, nops, "[j]");
    put(t, ";\n");
    if (!k->backward) return;
    put(t, "%st[j] = res.t * gr[j];\n", indent);
    for (int b = 0; b < nops; b++)
        if (grad_wanted(k, b) && !is_vector(k, b)) put(t, "%sg%d[j] = res.g%d * gr[j];\n", indent, b, b);
}

/* The variant kernel k of steps p is generated in when variant `wanted` is asked for: packwise
 * applies to contiguous kernels without the pack function (packed) only, the lean form to
 * contiguous kernels, exact bounds to the lean form; others are interleaved and wide whatever is
 * asked, so that every value finds the same program in the caches. */
static int applied_variant(const brrr_chain_kernel *k, const brrr_chain_steps *p, int wanted) {
    if (k->layout != BRRR_JIT_CONTIGUOUS) return 0;
    const int v = (wanted & ~ORDER_PACKWISE) | (packed(k, p) ? ORDER_INTERLEAVED : wanted & ORDER_PACKWISE);
    return v & FORM_LEAN ? v : v & ~BOUNDS_EXACT;
}

/* Dense tensors: each thread owns U 16-byte packs of every tensor (packs_per_thread), a block
 * apart (coalesced), all loaded before any is computed, as the precompiled contiguous kernels do
 * (the bytes in flight that keep HBM busy); block 0 takes the last numel % VEC elements one per
 * thread. v: applied_variant's.
 *
 * The wide form indexes in long long and loads a pack past the end as the last one again, each
 * pack at its own address. The lean form indexes in 32 bits where the kernel's index32 says they
 * fit (else in 64, unsigned: no signed division), and loads each pack predicated (ld_pack_if),
 * all of a thread's packs of a tensor at one address and its immediate offsets, as Triton's
 * kernels do; half types unpack their words with one instruction a value. With BOUNDS_EXACT (a
 * launch whose blocks are all full) every pack is in bounds: no predicate and no tail, as
 * Triton's kernels for a static size that their block divides. In the sm_90 SASS
 * (nvcc 13.0) of x * c once, a thread's instructions besides its multiplies: float32 20 for 8
 * values in the lean form against 48 wide, bfloat16 44 for 16 against 87 (the lean counts
 * include the unpacking and packing of the values). */
static void put_contiguous_kernel(text *t, const brrr_chain_kernel *k, const brrr_chain_steps *p, int v) {
    const int nops = p->n_operands, lean = v & FORM_LEAN, exact = v & BOUNDS_EXACT;
    const char *result = k->backward ? "t" : "y";
    /* Whether pack p is in bounds: always, for a launch that fills every block (exact). */
    const char *inside = exact ? "true" : "p < n_packs";
    /* Where pack u (index p) of a tensor starts, in elements; of a vector operand. */
    const char *at = lean ? "(unsigned long long)first * VEC + u * THREADS * VEC" : "p * VEC";
    const char *at_vector = lean ? "(p * VEC) % (I)a.row_length" : "(p * VEC) % a.row_length";
    if (lean) put(t, "typedef %s I; // index\n", k->index32 ? "unsigned" : "unsigned long long");
    /* The launch bounds' blocks are blocks of 256 threads' worth: 128-thread blocks ask for twice
     * as many, the same registers a thread. */
    const int threads = block_threads(v), blocks = (VARIANT_BLOCKS(v) ? VARIANT_BLOCKS(v) : auto_blocks(k)) * 256 / threads;
    put(t, "extern \"C\" __global__ void __launch_bounds__(%d, %d) %s(const __grid_constant__ brrr_chain_flat a) {\n"
           "    constexpr int U = %d, N = VEC * U, THREADS = %d;\n", threads, blocks, kernel_name(k),
        packs_per_thread(k, p, v), threads);
    if (lean) put(t, "%s    const I first = (I)blockIdx.x * (THREADS * U) + threadIdx.x;\n",
                  exact ? "" : "    const I n_packs = (I)a.numel / VEC;\n");
    else put(t, "    const long long n_packs = a.numel / VEC;\n"
                "    const long long first = (long long)blockIdx.x * (THREADS * U) + threadIdx.x;\n");
    put(t, "    A y[N]%s", k->backward ? ", gr[N], t[N]" : "");
    for (int b = 0; b < nops; b++) put(t, ", v%d[N]", b);
    for (int b = 0; b < nops; b++) /* the pack function sets them all; else only the gradients stored */
        if (packed(k, p) ? k->backward : grad_wanted(k, b) && !is_vector(k, b)) put(t, ", g%d[N]", b);
    if (lean) {
        /* Predicated, not branched around (below): a pack past the end is not loaded, its values
         * are computed and not stored. */
        put(t, ";\n    {\n#pragma unroll\n"
               "    for (int u = 0; u < U; ++u) {\n%s"
               "        ld_pack_if(static_cast<const T *>(a.x) + %s, y + u * VEC, %s);\n",
            exact && !k->vector_mask ? "" : "        const I p = first + (I)u * THREADS;\n", at, inside);
        if (k->backward) put(t, "        ld_pack_if(static_cast<const T *>(a.grad_out) + %s, gr + u * VEC, %s);\n", at, inside);
        for (int b = 0; b < nops; b++)
            put(t, "        ld_pack_if(static_cast<const T *>(a.operands[%d]) + %s, v%d + u * VEC, %s);\n", b,
                is_vector(k, b) ? at_vector : at, b, inside);
    } else {
        /* A pack past the end loads the last one again (its values are computed, not stored).
         * With a branch around each load, ptxas sank the first pack's steps into it and loaded
         * the second pack only after computing the first: half the bytes in flight (the likely
         * cause of float32 x * c 64 times running at 0.88 of torch.compile's speed). Unguarded,
         * the second load is issued first. */
        put(t, ";\n    if (n_packs > 0) {\n#pragma unroll\n"
               "    for (int u = 0; u < U; ++u) {\n"
               "        const long long q = first + (long long)u * THREADS, p = q < n_packs ? q : n_packs - 1;\n"
               "        ld_pack(static_cast<const T *>(a.x) + p * VEC, y + u * VEC);\n");
        if (k->backward) put(t, "        ld_pack(static_cast<const T *>(a.grad_out) + p * VEC, gr + u * VEC);\n");
        for (int b = 0; b < nops; b++)
            put(t, "        ld_pack(static_cast<const T *>(a.operands[%d]) + %s, v%d + u * VEC);\n", b,
                is_vector(k, b) ? at_vector : at, b);
    }
    put(t, "    }\n");
    const char *index = lean ? "I" : "long long";
    if (v & ORDER_PACKWISE) {
        /* Each pack computed and stored before the next, as Triton orders x * c repeated: the
         * branch keeps ptxas from interleaving the packs, so the first pack's store is issued
         * halfway through the thread's arithmetic and the stores spread over the kernel's time
         * (the knee of the repeat sweep, where memory and arithmetic take about as long). */
        put(t, "#pragma unroll\n    for (int u = 0; u < U; ++u) {\n");
        if (!exact) put(t, "        const %s p = first + (%s)u * THREADS;\n        if (p >= n_packs) break;\n", index, index);
        put(t, "#pragma unroll\n        for (int j = u * VEC; j < (u + 1) * VEC; ++j) {\n");
        put_element(t, k, nops, "            ");
        put(t, "        }\n        st_pack_if(static_cast<T *>(a.out) + %s, %s + u * VEC, true);\n", at, result);
        for (int b = 0; b < nops; b++)
            if (grad_wanted(k, b) && !is_vector(k, b))
                put(t, "        st_pack_if(static_cast<T *>(a.grad_operands[%d]) + %s, g%d + u * VEC, true);\n", b, at, b);
    } else {
        if (packed(k, p)) { /* the whole pack at once: y becomes the value, or t and g0.. the derivatives */
            put(t, "    chain_%s_n(y", direction(k));
            for (int b = 0; b < nops; b++) put(t, ", v%d", b);
            if (k->backward) put(t, ", t");
            for (int b = 0; k->backward && b < nops; b++) put(t, ", g%d", b);
            put(t, ");\n#pragma unroll\n    for (int j = 0; j < N; ++j) {\n");
            if (k->backward) {
                put(t, "        t[j] = t[j] * gr[j];\n");
                for (int b = 0; b < nops; b++)
                    if (grad_wanted(k, b) && !is_vector(k, b)) put(t, "        g%d[j] = g%d[j] * gr[j];\n", b, b);
            }
        } else {
            put(t, "#pragma unroll\n    for (int j = 0; j < N; ++j) {\n");
            put_element(t, k, nops, "        ");
        }
        /* Stores predicated, not branched around: with `if (p >= n_packs) continue;` the compiler
         * sank each pack's steps into its store's branch, so ptxas interleaved the 4 values of a
         * pack (float32) and not the 8 of a thread; predicated, one block holds all 8 chains of
         * steps (as Triton's kernels do), for latency hiding at the knee of the repeat sweep. */
        put(t, "    }\n#pragma unroll\n    for (int u = 0; u < U; ++u) {\n");
        if (!exact) put(t, "        const %s p = first + (%s)u * THREADS;\n", index, index);
        put(t, "        st_pack_if(static_cast<T *>(a.out) + %s, %s + u * VEC, %s);\n", at, result, inside);
        for (int b = 0; b < nops; b++)
            if (grad_wanted(k, b) && !is_vector(k, b))
                put(t, "        st_pack_if(static_cast<T *>(a.grad_operands[%d]) + %s, g%d + u * VEC, %s);\n", b, at, b, inside);
    }
    put(t, "    }\n    }\n");
    if (exact) { /* every block full: no pack past the end, no tail */
        put(t, "}\n");
        return;
    }
    if (lean) /* block 0 first: the other blocks leave on one uniform test */
        put(t, "    if (VEC == 1 || blockIdx.x != 0) return;\n"
               "    const I i = n_packs * VEC + threadIdx.x;\n"
               "    if (i >= (I)a.numel) return;\n");
    else
        put(t, "    const long long i = n_packs * VEC + threadIdx.x;\n"
               "    if (VEC == 1 || blockIdx.x != 0 || i >= a.numel) return;\n");
    put(t, "    const A y0 = ld(static_cast<const T *>(a.x)[i]);\n");
    for (int b = 0; b < nops; b++)
        put(t, "    const A v%d0 = ld(static_cast<const T *>(a.operands[%d])[%s]);\n", b, b,
            is_vector(k, b) ? "i % a.row_length" : "i");
    if (!k->backward) {
        put(t, "    static_cast<T *>(a.out)[i] = st(");
        put_call(t, k, nops, "0");
        put(t, ");\n}\n");
        return;
    }
    put(t, "    const A gr0 = ld(static_cast<const T *>(a.grad_out)[i]);\n    const Grads res = ");
    put_call(t, k, nops, "0");
    put(t, ";\n    static_cast<T *>(a.out)[i] = st(res.t * gr0);\n");
    for (int b = 0; b < nops; b++)
        if (grad_wanted(k, b) && !is_vector(k, b)) put(t, "    static_cast<T *>(a.grad_operands[%d])[i] = st(res.g%d * gr0);\n", b, b);
    put(t, "}\n");
}

/* The offsets of element (or row) r in every tensor the kernel touches, over dims [0, dims) of
 * L.shape, innermost last, each dim's index added in at its stride. */
static void put_offsets(text *t, const brrr_chain_kernel *k, int nops, int dims, const char *r) {
    const char *index = k->index32 ? "unsigned" : "long long";
    put(t, "        %s r = (%s)%s, c;\n        long long ox = 0, oo = 0%s", index, index, r, k->backward ? ", og = 0" : "");
    for (int b = 0; b < nops; b++)
        if (!(k->layout == BRRR_JIT_ROWS && is_vector(k, b))) put(t, ", o%d = 0", b);
    for (int b = 0; b < nops; b++)
        if (grad_wanted(k, b) && !is_vector(k, b)) put(t, ", q%d = 0", b);
    put(t, ";\n");
    for (int d = dims - 1; d >= 0; d--) {
        if (d > 0) put(t, "        c = r %% (%s)L.shape[%d];\n        r /= (%s)L.shape[%d];\n", index, d, index, d);
        else put(t, "        c = r;\n");
        put(t, "        ox += (long long)c * L.x.strides[%d];\n        oo += (long long)c * L.out.strides[%d];\n", d, d);
        if (k->backward) put(t, "        og += (long long)c * L.grad_out.strides[%d];\n", d);
        for (int b = 0; b < nops; b++)
            if (!(k->layout == BRRR_JIT_ROWS && is_vector(k, b)))
                put(t, "        o%d += (long long)c * L.operands[%d].strides[%d];\n", b, b, d);
        for (int b = 0; b < nops; b++)
            if (grad_wanted(k, b) && !is_vector(k, b))
                put(t, "        q%d += (long long)c * L.grad_operands[%d].strides[%d];\n", b, b, d);
    }
}

/* Any strides over the launch's ndim dims: one element per thread per grid-stride step. */
static void put_strided_kernel(text *t, const brrr_chain_kernel *k, int nops) {
    put(t, "extern \"C\" __global__ void __launch_bounds__(256) %s(const __grid_constant__ brrr_chain_launch L) {\n"
           "    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < L.numel; i += (long long)gridDim.x * 256) {\n",
        kernel_name(k));
    put_offsets(t, k, nops, k->ndim, "i");
    put(t, "        const A y = ld(static_cast<const T *>(L.x.data)[ox]);\n");
    for (int b = 0; b < nops; b++) put(t, "        const A v%d = ld(static_cast<const T *>(L.operands[%d].data)[o%d]);\n", b, b, b);
    if (!k->backward) {
        put(t, "        static_cast<T *>(L.out.data)[oo] = st(");
        put_call(t, k, nops, "");
        put(t, ");\n    }\n}\n");
        return;
    }
    put(t, "        const A gr = ld(static_cast<const T *>(L.grad_out.data)[og]);\n        const Grads res = ");
    put_call(t, k, nops, "");
    put(t, ";\n        static_cast<T *>(L.out.data)[oo] = st(res.t * gr);\n");
    for (int b = 0; b < nops; b++) /* a vector's gradient is a sum over rows: the rows layout's */
        if (grad_wanted(k, b) && !is_vector(k, b))
            put(t, "        static_cast<T *>(L.grad_operands[%d].data)[q%d] = st(res.g%d * gr);\n", b, b, b);
    put(t, "    }\n}\n");
}

/* Backward with a bias gradient: a (32, 8) block owns 32 columns and the slice of rows
 * blockIdx.y, its warps taking every 8th row; each thread sums its rows in order, the 8 lanes
 * are summed in order into partials[b][blockIdx.y][column], and brrr_cuda_chain_vector_grad
 * sums the slices in order: the precompiled row kernels' order, so the same sums. */
static void put_rows_kernel(text *t, const brrr_chain_kernel *k, int nops) {
    const int nd = k->ndim;
    put(t, "extern \"C\" __global__ void __launch_bounds__(256) %s(const __grid_constant__ brrr_chain_launch L) {\n"
           "    __shared__ A lanes[8][32];\n"
           "    const long long cols = L.row_length, rows = L.numel / cols;\n"
           "    const long long per_block = (rows + gridDim.y - 1) / gridDim.y;\n"
           "    const long long begin = blockIdx.y * per_block;\n"
           "    const long long end = begin + per_block < rows ? begin + per_block : rows;\n"
           "    const long long col = (long long)blockIdx.x * 32 + threadIdx.x;\n"
           "    const bool active = col < cols;\n",
        kernel_name(k));
    for (int b = 0; b < nops; b++) {
        if (!is_vector(k, b)) continue;
        put(t, "    const A v%d = active ? ld(static_cast<const T *>(L.operands[%d].data)[col * L.operands[%d].strides[%d]]) : (A)0;\n",
            b, b, b, nd - 1);
        if (grad_wanted(k, b)) put(t, "    A acc%d = (A)0;\n", b);
    }
    put(t, "    for (long long row = begin + threadIdx.y; active && row < end; row += 8) {\n");
    put_offsets(t, k, nops, nd - 1, "row");
    put(t, "        ox += col * L.x.strides[%d];\n        oo += col * L.out.strides[%d];\n        og += col * L.grad_out.strides[%d];\n",
        nd - 1, nd - 1, nd - 1);
    for (int b = 0; b < nops; b++) {
        if (is_vector(k, b)) continue;
        put(t, "        o%d += col * L.operands[%d].strides[%d];\n", b, b, nd - 1);
        if (grad_wanted(k, b)) put(t, "        q%d += col * L.grad_operands[%d].strides[%d];\n", b, b, nd - 1);
    }
    put(t, "        const A y = ld(static_cast<const T *>(L.x.data)[ox]);\n"
           "        const A gr = ld(static_cast<const T *>(L.grad_out.data)[og]);\n");
    for (int b = 0; b < nops; b++)
        if (!is_vector(k, b)) put(t, "        const A v%d = ld(static_cast<const T *>(L.operands[%d].data)[o%d]);\n", b, b, b);
    put(t, "        const Grads res = ");
    put_call(t, k, nops, "");
    put(t, ";\n        static_cast<T *>(L.out.data)[oo] = st(res.t * gr);\n");
    for (int b = 0; b < nops; b++) {
        if (!grad_wanted(k, b)) continue;
        if (is_vector(k, b)) put(t, "        acc%d += res.g%d * gr;\n", b, b);
        else put(t, "        static_cast<T *>(L.grad_operands[%d].data)[q%d] = st(res.g%d * gr);\n", b, b, b);
    }
    put(t, "    }\n");
    for (int b = 0; b < nops; b++) {
        if (!grad_wanted(k, b) || !is_vector(k, b)) continue;
        put(t, "    lanes[threadIdx.y][threadIdx.x] = acc%d;\n"
               "    __syncthreads();\n"
               "    if (threadIdx.y == 0 && active) {\n"
               "        A s = (A)0;\n"
               "#pragma unroll\n"
               "        for (int lane = 0; lane < 8; ++lane) s += lanes[lane][threadIdx.x];\n"
               "        static_cast<A *>(L.partials)[(%dLL * L.partial_rows + blockIdx.y) * cols + col] = s;\n"
               "    }\n"
               "    __syncthreads();\n", b, b);
    }
    put(t, "}\n");
}

/* The whole source of kernel k's program for steps p in variant `wanted` (applied_variant); NULL
 * when out of memory. */
static char *chain_source(const brrr_chain_kernel *k, const brrr_chain_steps *p, int wanted) {
    text t = {NULL, 0, 0, 0};
    const int v = applied_variant(k, p, wanted);
    /* The lean form's ld_pack_if: the values of a pack's 4 words w; bfloat16's with one
     * instruction each, where ld's conversion of each unsigned short took two or three. */
    const char *unpack = "    Pack k;\n    memcpy(&k, w, sizeof k);\n#pragma unroll\n    for (int j = 0; j < VEC; ++j) out[j] = ld(k.v[j]);";
    const char *storage, *compute, *math, *ld, *st;
    int math_id = 1; /* chain_math.cuh's BRRR_CHAIN_MATH for M */
    switch (k->dtype) {
    case BRRR_F16:
        storage = "unsigned short", compute = "float", math = "Fast32", math_id = 2;
        ld = "float f;\n    asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(v));\n    return f;";
        st = "unsigned short h;\n    asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(v));\n    return h;";
        break;
    case BRRR_BF16:
        storage = "unsigned short", compute = "float", math = "Fast32", math_id = 2;
        ld = "return __uint_as_float((unsigned)v << 16);";
        unpack = "#pragma unroll\n    for (int j = 0; j < 4; ++j) {\n        out[2 * j] = __uint_as_float(w[j] << 16);\n"
                 "        out[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);\n    }";
        st = "unsigned short h;\n    asm(\"cvt.rn.bf16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(v));\n    return h;";
        break;
    case BRRR_F64:
        storage = "double", compute = "double", math = "Precise64", math_id = 3, ld = "return v;", st = "return v;";
        break;
    default:
        storage = "float", compute = "float", math = "Precise32", ld = "return v;", st = "return v;";
        break;
    }
    static const char *const LAYOUT[] = {"contiguous", "strided", "rows"};
    put(&t, "// brrr chain, %s, %d steps: %s %s over %d dims.\n", brrr_dtype_name(k->dtype), (int)p->n_steps,
        k->backward ? "backward" : "forward", LAYOUT[k->layout], k->ndim);
    put(&t, "#define BRRR_LARGE_TRIG __noinline__\n#define BRRR_CHAIN_MATH %d\n#include \"chain_math.cuh\"\n\n"
            "typedef %s T; // storage\n"
            "typedef %s A; // compute\n"
            "typedef brrr::%s M;\n"
            "constexpr int VEC = 16 / (int)sizeof(T);\n"
            "struct alignas(16) Pack {\n    T v[VEC];\n};\n"
            "__device__ __forceinline__ A ld(const T v) {\n    %s\n}\n"
            "__device__ __forceinline__ T st(const A v) {\n    %s\n}\n",
        math_id, storage, compute, math, ld, st);
    if (!(v & FORM_LEAN))
        put(&t, "__device__ __forceinline__ void ld_pack(const T *p, A *out) {\n"
                "    const Pack k = *reinterpret_cast<const Pack *>(p);\n"
                "#pragma unroll\n    for (int j = 0; j < VEC; ++j) out[j] = ld(k.v[j]);\n}\n");
    put(&t, "// Stores the pack where ok: predicated, no branch, so the compiler cannot sink steps into one.\n"
            "__device__ __forceinline__ void st_pack_if(T *p, const A *in, bool ok) {\n"
            "    Pack k;\n"
            "#pragma unroll\n    for (int j = 0; j < VEC; ++j) k.v[j] = st(in[j]);\n"
            "    unsigned w[4];\n"
            "    memcpy(w, &k, sizeof w);\n"
            "    asm volatile(\"{\\n\\t.reg .pred p;\\n\\tsetp.ne.b32 p, %%5, 0;\\n\\t@p st.global.v4.b32 [%%0], {%%1, %%2, %%3, %%4};\\n\\t}\"\n"
            "                 :: \"l\"(p), \"r\"(w[0]), \"r\"(w[1]), \"r\"(w[2]), \"r\"(w[3]), \"r\"((int)ok) : \"memory\");\n}\n\n");
    /* A pack past the end (a launch that leaves a block part empty) is not loaded. Its values are
     * undefined, which only a pack function's range check (a trig step) reads: it then took the
     * fast or the full path for the thread's packs in bounds by a register's stale contents, so
     * that a float16 value of the last block came out 1 ulp apart from run to run. Zeros there
     * (in range) leave the choice to the values in bounds, as the precompiled kernels do. */
    const int zeros = (v & FORM_LEAN) && !(v & BOUNDS_EXACT) && checks_pack_range(k, p);
    if (v & FORM_LEAN)
        put(&t, "// Loads the pack where ok: predicated, no branch; elsewhere its values are %s.\n"
                "__device__ __forceinline__ void ld_pack_if(const T *p, A *out, bool ok) {\n"
                "    unsigned w[4]%s;\n"
                "    asm volatile(\"{\\n\\t.reg .pred p;\\n\\tsetp.ne.b32 p, %%5, 0;\\n\\t@p ld.global.v4.b32 {%%0, %%1, %%2, %%3}, [%%4];\\n\\t}\"\n"
                "                 : \"%sr\"(w[0]), \"%sr\"(w[1]), \"%sr\"(w[2]), \"%sr\"(w[3]) : \"l\"(p), \"r\"((int)ok));\n"
                "%s\n}\n\n", zeros ? "zeros (the range checks read them)" : "undefined (computed, never stored)",
            zeros ? " = {0u, 0u, 0u, 0u}" : "", zeros ? "+" : "=", zeros ? "+" : "=", zeros ? "+" : "=", zeros ? "+" : "=",
            unpack);
    put_element_functions(&t, k, p);
    if (k->layout == BRRR_JIT_CONTIGUOUS) put_contiguous_kernel(&t, k, p, v);
    else if (k->layout == BRRR_JIT_STRIDED) put_strided_kernel(&t, k, p->n_operands);
    else put_rows_kernel(&t, k, p->n_operands);
    return t.data;
}

/* ---- NVRTC ------------------------------------------------------------------------------------ */

typedef int (*nvrtc_create_fn)(void **, const char *, const char *, int, const char *const *, const char *const *);
typedef int (*nvrtc_compile_fn)(void *, int, const char *const *);
typedef int (*nvrtc_destroy_fn)(void **);
typedef int (*nvrtc_size_fn)(void *, size_t *);
typedef int (*nvrtc_get_fn)(void *, char *);
typedef int (*nvrtc_version_fn)(int *, int *);
typedef const char *(*nvrtc_error_fn)(int);

/* Loaded once, under nvrtc_lock (nvrtc_open); read-only from then on. */
static struct {
    int state; /* 0: not tried, 1: loaded, -1: not available */
    char path[PATH_MAX];
    char error[512];
    int major, minor;
    nvrtc_create_fn create;
    nvrtc_compile_fn compile;
    nvrtc_destroy_fn destroy;
    nvrtc_size_fn cubin_size, log_size;
    nvrtc_get_fn cubin, log;
    nvrtc_error_fn error_string;
} nvrtc;

/* NVRTC dlopens libnvrtc-builtins.so.<version> by name; when libnvrtc came from a folder that is
 * not on the loader's path (a pip wheel's), the builtins are loaded from that folder first, which
 * the loader then matches by name. */
static void preload_builtins(const char *dir) {
    DIR *d = opendir(dir);
    if (d == NULL) return;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strncmp(e->d_name, "libnvrtc-builtins.so.", 21) != 0) continue;
        char path[PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < (int)sizeof path) dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    }
    closedir(d);
}

static int nvrtc_bind(void *lib, const char *where) {
#define BIND(field, symbol)                                                                              \
    if ((*(void **)&nvrtc.field = dlsym(lib, symbol)) == NULL) {                                         \
        snprintf(nvrtc.error, sizeof nvrtc.error, "%s lacks %s", where, symbol);                          \
        return -1;                                                                                       \
    }
    BIND(create, "nvrtcCreateProgram")
    BIND(compile, "nvrtcCompileProgram")
    BIND(destroy, "nvrtcDestroyProgram")
    BIND(cubin_size, "nvrtcGetCUBINSize")
    BIND(cubin, "nvrtcGetCUBIN")
    BIND(log_size, "nvrtcGetProgramLogSize")
    BIND(log, "nvrtcGetProgramLog")
    BIND(error_string, "nvrtcGetErrorString")
#undef BIND
    nvrtc_version_fn version = (nvrtc_version_fn)dlsym(lib, "nvrtcVersion");
    if (version == NULL || version(&nvrtc.major, &nvrtc.minor) != 0) {
        snprintf(nvrtc.error, sizeof nvrtc.error, "%s: nvrtcVersion failed", where);
        return -1;
    }
    snprintf(nvrtc.path, sizeof nvrtc.path, "%s", where);
    return 0;
}

/* dlopen `file` (a path, or a name for the loader's search: one a library already loaded, such as
 * PyTorch's, answers) and bind it; its builtins are loaded from its folder before it needs them. */
static int nvrtc_try(const char *file) {
    void *lib = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return -1;
    Dl_info info;
    void *sym = dlsym(lib, "nvrtcVersion");
    const char *where = sym && dladdr(sym, &info) && info.dli_fname ? info.dli_fname : file;
    const char *slash = strrchr(where, '/');
    if (slash) {
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - where), where);
        preload_builtins(dir);
    }
    if (nvrtc_bind(lib, where) == 0) return 0;
    dlclose(lib);
    return -1;
}

static int nvrtc_try_dir(const char *dir) {
    static const char *const NAMES[] = {"libnvrtc.so.13", "libnvrtc.so.12"};
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++) {
        char path[PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", dir, NAMES[i]) < (int)sizeof path && access(path, R_OK) == 0 &&
            nvrtc_try(path) == 0)
            return 0;
    }
    return -1;
}

/* The folders of NVIDIA's pip wheels along sys.path, '\0'-separated, ending in an empty name:
 * gathered with the GIL (nvrtc_prepare), so that nvrtc_open can run without it. */
static char *wheel_dirs;

/* 0, or -1 with a Python exception. Needs the GIL. */
static int nvrtc_prepare(void) {
    if (wheel_dirs) return 0;
    text t = {NULL, 0, 0, 0};
    PyObject *path = PySys_GetObject("path"); /* borrowed */
    for (Py_ssize_t i = 0; path && PyList_Check(path) && i < PyList_GET_SIZE(path); i++) {
        PyObject *entry = PyList_GET_ITEM(path, i);
        const char *base = PyUnicode_Check(entry) ? PyUnicode_AsUTF8(entry) : NULL;
        if (base == NULL) {
            PyErr_Clear();
            continue;
        }
        put(&t, "%s/nvidia/cu13/lib%c%s/nvidia/cuda_nvrtc/lib%c", base, 0, base, 0);
    }
    put(&t, "%c", 0);
    if (t.failed) return PyErr_NoMemory(), -1;
    wheel_dirs = t.data;
    return 0;
}

static pthread_mutex_t nvrtc_lock = PTHREAD_MUTEX_INITIALIZER;

/* nvrtc_open's search, under nvrtc_lock. */
static int nvrtc_find(void) {
    nvrtc.state = -1;
    snprintf(nvrtc.error, sizeof nvrtc.error, "libnvrtc.so.13 or .12 not found");
    const char *forced = getenv("BRRR_NVRTC");
    if (forced && *forced) {
        if (strcmp(forced, "none") == 0) snprintf(nvrtc.error, sizeof nvrtc.error, "BRRR_NVRTC=none");
        else if (nvrtc_try(forced) == 0) nvrtc.state = 1;
        else snprintf(nvrtc.error, sizeof nvrtc.error, "BRRR_NVRTC=%s: %s", forced, dlerror());
        return nvrtc.state > 0 ? 0 : -1;
    }
    if (nvrtc_try("libnvrtc.so.13") == 0 || nvrtc_try("libnvrtc.so.12") == 0) return nvrtc.state = 1, 0;
    const char *homes[] = {getenv("CUDA_HOME"), getenv("CUDA_PATH"), "/usr/local/cuda"};
    for (size_t i = 0; i < sizeof homes / sizeof homes[0]; i++) {
        char dir[PATH_MAX];
        if (homes[i] && *homes[i] && snprintf(dir, sizeof dir, "%s/lib64", homes[i]) < (int)sizeof dir &&
            nvrtc_try_dir(dir) == 0)
            return nvrtc.state = 1, 0;
    }
    for (const char *dir = wheel_dirs; dir && *dir; dir += strlen(dir) + 1)
        if (nvrtc_try_dir(dir) == 0) return nvrtc.state = 1, 0;
    return -1;
}

/* 0 when NVRTC is loaded; -1 with the reason in nvrtc.error. Tried once; call after
 * nvrtc_prepare. The two threads that build a forward and its backward may both call it. */
static int nvrtc_open(void) {
    pthread_mutex_lock(&nvrtc_lock);
    const int rc = nvrtc.state ? (nvrtc.state > 0 ? 0 : -1) : nvrtc_find();
    pthread_mutex_unlock(&nvrtc_lock);
    return rc;
}

/* The bytes of stack frame and of spill stores that ptxas's report (-v) in log gives the entry
 * function `name`; -1 when the log does not say. */
static int frame_bytes(const char *log, const char *name) {
    char heading[64];
    snprintf(heading, sizeof heading, "Function properties for %s\n", name);
    const char *at = strstr(log, heading);
    int frame, spills;
    if (at == NULL || sscanf(at + strlen(heading), "ptxas . %d bytes stack frame, %d bytes spill stores", &frame, &spills) != 2)
        return -1;
    return frame + spills;
}

/* Compile source for sm_<arch> into a cubin (malloc'd). With `frame` non-NULL, *frame: the stack
 * frame and spill bytes of its kernel `name` (frame_bytes). On failure, -1 with the reason (and
 * the compiler's log) in a malloc'd *error. Thread-safe; call without the GIL. */
static int nvrtc_compile(const char *source, int arch, const char *name, int *frame, char **image, size_t *size,
                         char **error) {
    void *prog = NULL;
    *image = NULL;
    *error = NULL;
    int rc = nvrtc.create(&prog, source, "brrr_chain.cu", BRRR_JIT_HEADER_COUNT, BRRR_JIT_HEADER_TEXTS,
                          BRRR_JIT_HEADER_NAMES);
    if (rc != 0) {
        text t = {NULL, 0, 0, 0};
        put(&t, "nvrtcCreateProgram: %s", nvrtc.error_string(rc));
        *error = t.data;
        return -1;
    }
    char arch_option[32];
    snprintf(arch_option, sizeof arch_option, "-arch=sm_%d", arch);
    /* -default-device: brrr_cuda.h declares the host launchers, unannotated. --minimal (NVRTC
     * 12.4 and later) leaves out the runtime API's device-side declarations, which the kernels do
     * not use: about 5 ms of every compile. */
    const int minimal = nvrtc.major > 12 || (nvrtc.major == 12 && nvrtc.minor >= 4);
    const char *options[5] = {arch_option, "-std=c++17", "-default-device"};
    int n_options = 3;
    if (minimal) options[n_options++] = "--minimal";
    if (frame) options[n_options++] = "-Xptxas=-v"; /* the report frame_bytes reads */
    rc = nvrtc.compile(prog, n_options, options);
    size_t log_size = 0;
    char *log = NULL;
    if (nvrtc.log_size(prog, &log_size) == 0 && (log = malloc(log_size + 1)) != NULL && nvrtc.log(prog, log) == 0)
        log[log_size] = 0;
    else
        free(log), log = NULL;
    if (rc == 0 && nvrtc.cubin_size(prog, size) == 0 && (*image = malloc(*size)) != NULL &&
        nvrtc.cubin(prog, *image) == 0) {
        if (frame) *frame = log ? frame_bytes(log, name) : -1;
        free(log);
        nvrtc.destroy(&prog);
        return 0;
    }
    free(*image);
    *image = NULL;
    text t = {NULL, 0, 0, 0};
    put(&t, "NVRTC (%s) failed on a generated chain kernel for sm_%d: %s\n%s", nvrtc.path, arch,
        rc ? nvrtc.error_string(rc) : "no cubin", log ? log : "");
    free(log);
    nvrtc.destroy(&prog);
    *error = t.data;
    return -1;
}

/* ---- disk cache ------------------------------------------------------------------------------- */

/* The cache folder, or 0 when there is none ($HOME unset). */
static int cache_dir(char *dir, size_t size) {
    const char *env = getenv("BRRR_CACHE_DIR");
    if (env && *env) return snprintf(dir, size, "%s", env) < (int)size;
    env = getenv("XDG_CACHE_HOME");
    if (env && *env) return snprintf(dir, size, "%s/brrr", env) < (int)size;
    env = getenv("HOME");
    if (env && *env) return snprintf(dir, size, "%s/.cache/brrr", env) < (int)size;
    return 0;
}

static int make_dirs(const char *dir) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path) return -1;
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(path, 0777) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(path, 0777) != 0 && errno != EEXIST ? -1 : 0;
}

/* What a compiled kernel depends on besides its source: brrr, the architecture and the embedded
 * headers. Not NVRTC's version: a cached kernel loads without NVRTC (loading libnvrtc alone
 * takes tens of milliseconds), and one that the driver refuses is compiled again. */
static char *kernel_identity(const char *source, int arch) {
    uint64_t headers = FNV_OFFSET;
    for (int i = 0; i < BRRR_JIT_HEADER_COUNT; i++) {
        headers = fnv1a(headers, BRRR_JIT_HEADER_NAMES[i], strlen(BRRR_JIT_HEADER_NAMES[i]) + 1);
        headers = fnv1a(headers, BRRR_JIT_HEADER_TEXTS[i], strlen(BRRR_JIT_HEADER_TEXTS[i]) + 1);
    }
    text t = {NULL, 0, 0, 0};
    put(&t, "brrr %s sm_%d headers %016llx\n%s", BRRR_VERSION, arch, (unsigned long long)headers, source);
    return t.data;
}

static const char MAGIC[8] = {'B', 'R', 'R', 'R', 'J', 'I', 'T', '1'};

/* A file: MAGIC, the identity's and the cubin's lengths (uint64), the identity, the cubin, and
 * the FNV-1a hash of everything before it (uint64). */
static void cache_file_name(const char *dir, const char *identity, char *path, size_t size) {
    const size_t n = strlen(identity);
    snprintf(path, size, "%s/chain-%016llx%016llx.cubin", dir, (unsigned long long)fnv1a(FNV_OFFSET, identity, n),
             (unsigned long long)fnv1a(UINT64_C(0x84222325cbf29ce4), identity, n));
}

/* The cached cubin for identity (malloc'd), or NULL when there is none or it does not check. */
static char *cache_read(const char *path, const char *identity, size_t *image_size) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    char *data = NULL, *image = NULL;
    long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    const size_t id_len = strlen(identity), head = sizeof MAGIC + 2 * sizeof(uint64_t);
    if (size >= (long)(head + id_len + sizeof(uint64_t)) && size < (1L << 30) && fseek(f, 0, SEEK_SET) == 0 &&
        (data = malloc((size_t)size)) != NULL && fread(data, 1, (size_t)size, f) == (size_t)size) {
        uint64_t lengths[2], checksum;
        memcpy(lengths, data + sizeof MAGIC, sizeof lengths);
        memcpy(&checksum, data + size - sizeof checksum, sizeof checksum);
        if (memcmp(data, MAGIC, sizeof MAGIC) == 0 && lengths[0] == id_len &&
            lengths[1] == (uint64_t)size - head - id_len - sizeof checksum &&
            memcmp(data + head, identity, id_len) == 0 &&
            checksum == fnv1a(FNV_OFFSET, data, (size_t)size - sizeof checksum) && (image = malloc(lengths[1])) != NULL) {
            memcpy(image, data + head + id_len, lengths[1]);
            *image_size = lengths[1];
        }
    }
    free(data);
    fclose(f);
    return image;
}

/* Store a cubin; a cache that cannot be written is no error (the kernel runs all the same). */
static void cache_write(const char *dir, const char *path, const char *identity, const char *image, size_t image_size) {
    if (make_dirs(dir) != 0) return;
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.%ld.XXXXXX", path, (long)getpid()) >= (int)sizeof tmp) return;
    const int fd = mkstemp(tmp);
    if (fd < 0) return;
    FILE *f = fdopen(fd, "wb");
    if (f == NULL) {
        close(fd);
        unlink(tmp);
        return;
    }
    const uint64_t lengths[2] = {strlen(identity), image_size};
    uint64_t checksum = fnv1a(FNV_OFFSET, MAGIC, sizeof MAGIC);
    checksum = fnv1a(checksum, lengths, sizeof lengths);
    checksum = fnv1a(checksum, identity, lengths[0]);
    checksum = fnv1a(checksum, image, image_size);
    const int ok = fwrite(MAGIC, 1, sizeof MAGIC, f) == sizeof MAGIC && fwrite(lengths, 1, sizeof lengths, f) == sizeof lengths &&
                   fwrite(identity, 1, lengths[0], f) == lengths[0] && fwrite(image, 1, image_size, f) == image_size &&
                   fwrite(&checksum, 1, sizeof checksum, f) == sizeof checksum;
    if (fclose(f) != 0 || !ok || rename(tmp, path) != 0) unlink(tmp);
}

enum { ORIGIN_COMPILED, ORIGIN_DISK };

/* Counters for chain_jit_info(), updated under compile_lock. */
typedef struct {
    long long compiled, from_disk;
    double last_seconds; /* the last program's compile (or disk read) and load */
} jit_stats;
static jit_stats stats;
static pthread_mutex_t compile_lock = PTHREAD_MUTEX_INITIALIZER;

/* One kernel's program to build, in the variant `variant` asks for (chain_source): its cubin
 * (malloc'd; NULL on failure, with a malloc'd error and missing set when for want of NVRTC), where
 * it came from, and with want_source its source. */
typedef struct {
    brrr_chain_kernel k;
    const brrr_chain_steps *p;
    int arch, variant, skip_disk, want_source;
    char *image, *source, *error;
    size_t size;
    int origin, missing;
} build;

/* Kernel b's program is one of n sources, in order of preference: with two (auto_blocks's 8
 * blocks, then 2), the first is passed over where ptxas gives its kernel a stack frame
 * (frame_bytes). The disk cache holds the program taken under its own source's identity, so that
 * a later process finds the second at its second lookup, without NVRTC. Both begin with a line
 * that BRRR_CHAIN_JIT_BLOCKS's programs lack: an 8-block program compiled for the switch is
 * never found for the choice. */

/* The cached program of the first source on disk: 1 found (b->image), else 0. */
static int build_from_disk(build *b, char *const *sources, int n) {
    char dir[PATH_MAX], path[PATH_MAX + 64];
    for (int i = 0; i < n && !b->skip_disk && cache_dir(dir, sizeof dir); i++) {
        char *identity = kernel_identity(sources[i], b->arch);
        if (identity == NULL) return 0;
        cache_file_name(dir, identity, path, sizeof path);
        b->image = cache_read(path, identity, &b->size);
        free(identity);
        if (b->image) {
            b->origin = ORIGIN_DISK;
            if (b->want_source) b->source = strdup(sources[i]);
            return 1;
        }
    }
    return 0;
}

/* Compile the first source whose kernel has no stack frame (the last one whatever it has) and
 * cache it. */
static void build_compiled(build *b, char *const *sources, int n) {
    for (int i = 0; i < n; i++) {
        int frame = 0;
        free(b->error);
        b->error = NULL;
        if (nvrtc_compile(sources[i], b->arch, kernel_name(&b->k), i + 1 < n ? &frame : NULL, &b->image, &b->size,
                          &b->error) != 0)
            return;
        if (frame != 0 && i + 1 < n) {
            free(b->image);
            b->image = NULL;
            continue;
        }
        b->origin = ORIGIN_COMPILED;
        char dir[PATH_MAX], path[PATH_MAX + 64], *identity = kernel_identity(sources[i], b->arch);
        if (identity && cache_dir(dir, sizeof dir)) {
            cache_file_name(dir, identity, path, sizeof path);
            cache_write(dir, path, identity, b->image, b->size);
        }
        free(identity);
        if (b->want_source) b->source = strdup(sources[i]);
        return;
    }
}

/* Build b: the cubin of kernel b->k (chain_source) for steps b->p on sm_<arch>, from the disk
 * cache unless skip_disk, else compiled and stored. Thread-safe; call without the GIL, after
 * nvrtc_prepare. */
static void build_run(build *b) {
    b->image = b->source = b->error = NULL;
    b->missing = 0;
    const int automatic = VARIANT_BLOCKS(b->variant) == 0 && auto_blocks(&b->k) == 8, n = 1 + automatic;
    char *sources[2] = {chain_source(&b->k, b->p, b->variant),
                        automatic ? chain_source(&b->k, b->p, WITH_BLOCKS(b->variant, 2)) : NULL};
    for (int i = 0; automatic && i < 2; i++) { /* the choice's note, which the switch's programs lack */
        text t = {NULL, 0, 0, 0};
        if (sources[i]) put(&t, "// launch bounds: 8 blocks an SM where the kernel keeps no stack frame, else 2\n%s", sources[i]);
        free(sources[i]);
        sources[i] = t.data;
    }
    if (sources[0] == NULL || (automatic && sources[1] == NULL)) {
        b->error = strdup("out of memory generating a chain kernel");
    } else if (!build_from_disk(b, sources, n)) {
        if (nvrtc_open() != 0) {
            b->error = strdup(nvrtc.error);
            b->missing = 1;
        } else {
            build_compiled(b, sources, n);
        }
    }
    free(sources[0]);
    free(sources[1]);
}

static void *build_thread(void *b) {
    build_run(b);
    return NULL;
}

/* Build bs[0] and, when n is 2, bs[1] on a thread of its own meanwhile (a forward and its
 * backward: NVRTC compiles programs in parallel, so the pair takes the longer of the two, not the
 * sum); in turn when no thread can be started. */
static void build_all(build *bs, int n) {
    /* NVRTC's compiler recurses deeply on long unrolled chains: the thread gets a main thread's
     * usual 8 MiB of stack, whatever the default for new threads (2 MiB where RLIMIT_STACK is
     * unlimited). */
    pthread_attr_t attr;
    pthread_t thread;
    int threaded = 0;
    if (n == 2 && pthread_attr_init(&attr) == 0) {
        threaded = pthread_attr_setstacksize(&attr, (size_t)8 << 20) == 0 &&
                   pthread_create(&thread, &attr, build_thread, &bs[1]) == 0;
        pthread_attr_destroy(&attr);
    }
    build_run(&bs[0]);
    if (threaded) pthread_join(thread, NULL);
    else if (n == 2) build_run(&bs[1]);
}

/* ---- the kernels of this process -------------------------------------------------------------- */

/* The variant asked for (docs/kernel-switches.md), read at every launch so that one process can
 * time them all: BRRR_CHAIN_JIT_ORDER unset or `interleaved`, ORDER_INTERLEAVED; `packwise`,
 * ORDER_PACKWISE; BRRR_CHAIN_JIT_FORM unset or `lean`, FORM_LEAN; `wide`, the wide form; and
 * BRRR_CHAIN_JIT_BLOCKS unset or 2 to 8 (VARIANT_BLOCKS); BRRR_CHAIN_JIT_THREADS unset, 128 or 256
 * (BLOCK_256); BRRR_CHAIN_JIT_BOUNDS unset or `exact`, BOUNDS_EXACT (which the launch keeps only
 * where it fills every block); `checked`, the bounds tested everywhere. 0, or -1 with a Python exception for
 * any other value (a misspelt value would time the default). */
static int variant_wanted(int *variant) {
    const char *order = getenv("BRRR_CHAIN_JIT_ORDER"), *form = getenv("BRRR_CHAIN_JIT_FORM");
    *variant = (order && strcmp(order, "packwise") == 0 ? ORDER_PACKWISE : ORDER_INTERLEAVED) |
               (form && strcmp(form, "wide") == 0 ? 0 : FORM_LEAN);
    if (order && !(*variant & ORDER_PACKWISE) && strcmp(order, "interleaved") != 0) {
        PyErr_Format(PyExc_ValueError, "BRRR_CHAIN_JIT_ORDER: expected interleaved or packwise, got '%s'", order);
        return -1;
    }
    if (form && (*variant & FORM_LEAN) && strcmp(form, "lean") != 0) {
        PyErr_Format(PyExc_ValueError, "BRRR_CHAIN_JIT_FORM: expected wide or lean, got '%s'", form);
        return -1;
    }
    const char *threads = getenv("BRRR_CHAIN_JIT_THREADS");
    if (threads && strcmp(threads, "128") != 0 && strcmp(threads, "256") != 0) {
        PyErr_Format(PyExc_ValueError, "BRRR_CHAIN_JIT_THREADS: expected 128 or 256, got '%s'", threads);
        return -1;
    }
    if (threads && strcmp(threads, "256") == 0) *variant |= BLOCK_256;
    const char *bounds = getenv("BRRR_CHAIN_JIT_BOUNDS");
    if (bounds && strcmp(bounds, "checked") != 0 && strcmp(bounds, "exact") != 0) {
        PyErr_Format(PyExc_ValueError, "BRRR_CHAIN_JIT_BOUNDS: expected checked or exact, got '%s'", bounds);
        return -1;
    }
    if (!bounds || strcmp(bounds, "exact") == 0) *variant |= BOUNDS_EXACT;
    const char *blocks = getenv("BRRR_CHAIN_JIT_BLOCKS");
    if (blocks) {
        char *end;
        const long b = strtol(blocks, &end, 10);
        if (*blocks == 0 || *end != 0 || b < 2 || b > 8) {
            PyErr_Format(PyExc_ValueError, "BRRR_CHAIN_JIT_BLOCKS: expected 2 to 8, got '%s'", blocks);
            return -1;
        }
        *variant = WITH_BLOCKS(*variant, (int)b);
    }
    return 0;
}

static int jit_enabled = 1;

#if BRRR_WITH_CUDA
/* The table of loaded kernels: open addressing on an FNV-1a hash of the key (the kernel's
 * specification, the architecture, the variant it was generated in, the steps). kernel NULL: that kernel failed to build (the
 * interpreted kernels run it from then on). Guarded by table_lock, as is `with_backward`: the
 * chains whose backward is wanted (chain_jit_with_backward), keyed by their steps alone. */
typedef struct {
    uint64_t hash;
    size_t len;
    unsigned char *key;
    void *kernel;
    int missing; /* kernel NULL for want of NVRTC */
} kernel_entry;
typedef struct {
    kernel_entry *slots;
    size_t cap, count;
} kernel_table;
static kernel_table table, with_backward;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
    brrr_chain_kernel k;
    int32_t arch, variant, n_steps;
} key_head;

/* The key of kernel k for steps p on sm_<arch> when variant `wanted` is asked for: the variant it
 * is generated in (applied_variant), so that one variant's program never answers for another's. A
 * contiguous kernel's index32 only counts in the lean form, the wide one's source ignores it. */
static unsigned char *make_key(const brrr_chain_kernel *k, int arch, int wanted, const brrr_chain_steps *p, size_t *len) {
    key_head head = {*k, arch, applied_variant(k, p, wanted), p->n_steps};
    if (k->layout == BRRR_JIT_CONTIGUOUS && !(head.variant & FORM_LEAN)) head.k.index32 = 0;
    *len = sizeof head + (size_t)p->n_steps * sizeof(brrr_chain_step);
    unsigned char *key = malloc(*len);
    if (key == NULL) return NULL;
    memcpy(key, &head, sizeof head);
    if (p->n_steps) memcpy(key + sizeof head, p->steps, (size_t)p->n_steps * sizeof(brrr_chain_step));
    return key;
}

/* The entry for key, or NULL. Hold table_lock. */
static kernel_entry *table_find(const kernel_table *tb, const unsigned char *key, size_t len, uint64_t hash) {
    for (size_t i = hash & (tb->cap - 1); tb->cap && tb->slots[i].key; i = (i + 1) & (tb->cap - 1))
        if (tb->slots[i].hash == hash && tb->slots[i].len == len && memcmp(tb->slots[i].key, key, len) == 0)
            return &tb->slots[i];
    return NULL;
}

/* Add an entry (the table takes key). -1 when out of memory. Hold table_lock. */
static int table_add(kernel_table *tb, unsigned char *key, size_t len, uint64_t hash, void *kernel, int missing) {
    if (2 * (tb->count + 1) > tb->cap) {
        const size_t cap = tb->cap ? 2 * tb->cap : 64;
        kernel_entry *slots = calloc(cap, sizeof *slots);
        if (slots == NULL) return -1;
        for (size_t i = 0; i < tb->cap; i++) {
            if (!tb->slots[i].key) continue;
            size_t j = tb->slots[i].hash & (cap - 1);
            while (slots[j].key) j = (j + 1) & (cap - 1);
            slots[j] = tb->slots[i];
        }
        free(tb->slots);
        tb->slots = slots;
        tb->cap = cap;
    }
    size_t j = hash & (tb->cap - 1);
    while (tb->slots[j].key) j = (j + 1) & (tb->cap - 1);
    tb->slots[j] = (kernel_entry){hash, len, key, kernel, missing};
    tb->count++;
    return 0;
}

static int warn_once(int *warned, const char *fmt, ...) {
    if (*warned) return 0;
    *warned = 1;
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    return PyErr_WarnEx(PyExc_RuntimeWarning, message, 1);
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* The layout class of launch L (chain.c's choice of shape, strides and row layout). */
static brrr_chain_kernel kernel_for(const brrr_chain_launch *L, int n_operands, int backward) {
    brrr_chain_kernel k = {backward, L->dtype, BRRR_JIT_STRIDED, L->ndim, 0, 0, L->numel <= 0xFFFFFFFFLL};
    int aligned = aligned16(L->x.data) && aligned16(L->out.data) && (!backward || aligned16(L->grad_out.data));
    for (int b = 0; b < n_operands; b++) {
        k.vector_mask |= (L->operand_is_vector[b] ? 1 : 0) << b;
        if (backward && L->grad_operands[b].data) k.grad_mask |= 1 << b;
        aligned = aligned && aligned16(L->operands[b].data) &&
                  (!backward || !L->grad_operands[b].data || L->operand_is_vector[b] || aligned16(L->grad_operands[b].data));
    }
    const int64_t vec = 16 / (int64_t)brrr_dtype_size(L->dtype);
    if (L->partials) k.layout = BRRR_JIT_ROWS;
    else if (L->contiguous && aligned && (!k.vector_mask || L->row_length % vec == 0))
        k.layout = BRRR_JIT_CONTIGUOUS, k.ndim = 1, k.index32 = L->numel <= BRRR_JIT_CONTIGUOUS_INDEX32;
    return k;
}

static int warned_missing, warned_capture, warned_failed;

/* Whether a launch of n elements fills every block of contiguous kernel k in variant v (applied):
 * BOUNDS_EXACT's kernels take only such launches. */
static int fills_blocks(const brrr_chain_kernel *k, const brrr_chain_steps *p, int v, int64_t n) {
    const int64_t per_block = (int64_t)block_threads(v) * packs_per_thread(k, p, v) * (16 / (int64_t)brrr_dtype_size(k->dtype));
    return k->layout == BRRR_JIT_CONTIGUOUS && n > 0 && n % per_block == 0;
}

/* Whether chain p's backward is wanted (chain_jit_with_backward). Takes table_lock. */
static int backward_wanted(const brrr_chain_steps *p) {
    const brrr_chain_kernel none = {0, 0, 0, 0, 0, 0, 0};
    size_t len;
    unsigned char *key = make_key(&none, 0, ORDER_INTERLEAVED, p, &len);
    if (key == NULL) return 0;
    pthread_mutex_lock(&table_lock);
    const int wanted = table_find(&with_backward, key, len, fnv1a(FNV_OFFSET, key, len)) != NULL;
    pthread_mutex_unlock(&table_lock);
    free(key);
    return wanted;
}

/* Load b's cubin and free it: the kernel, or NULL with the reason in b->error. A cached cubin
 * that this driver refuses is compiled again. Counts the kernel in stats. Under compile_lock. */
static void *load(build *b) {
    const char *name = kernel_name(&b->k);
    void *kernel = NULL;
    int err = b->image ? brrr_cuda_library_load(b->image, 1, &name, &kernel) : 0;
    if (err && b->origin == ORIGIN_DISK) {
        free(b->image);
        b->skip_disk = 1;
        build_run(b);
        err = b->image ? brrr_cuda_library_load(b->image, 1, &name, &kernel) : 0;
    }
    if (err) {
        text t = {NULL, 0, 0, 0};
        put(&t, "loading a compiled chain kernel: CUDA error %d (%s)", err, brrr_cuda_error_string(err));
        free(b->error);
        b->error = t.data;
    }
    if (!b->image || err) kernel = NULL;
    if (kernel) ++*(b->origin == ORIGIN_DISK ? &stats.from_disk : &stats.compiled);
    free(b->image);
    b->image = NULL;
    return kernel;
}

/* The loaded kernel for (k, arch, p) in variant `wanted` (applied_variant), building it if need be: 1 found (*kernel NULL when it
 * failed to build, with the reason in *error the first time, *missing when for want of NVRTC),
 * 0 when it is not built and the stream is capturing, -1 with a Python exception. Builds without
 * the GIL. A contiguous forward of a chain whose backward is wanted is built at the same time as
 * that backward (of every operand's gradient), unless the backward is loaded already. */
static int find_kernel(const brrr_chain_kernel *k, int arch, int wanted, const brrr_chain_steps *p, void *stream,
                       void **kernel, char **error, int *missing) {
    *kernel = NULL;
    *error = NULL;
    *missing = 0;
    size_t len, pair_len = 0;
    unsigned char *key = make_key(k, arch, wanted, p, &len), *pair_key = NULL;
    if (key == NULL) return PyErr_NoMemory(), -1;
    const uint64_t hash = fnv1a(FNV_OFFSET, key, len);
    pthread_mutex_lock(&table_lock);
    const kernel_entry *e = table_find(&table, key, len, hash);
    if (e) *kernel = e->kernel, *missing = e->missing;
    pthread_mutex_unlock(&table_lock);
    if (e) {
        free(key);
        return 1;
    }
    int capturing = 0;
    if ((brrr_cuda_stream_capturing(stream, &capturing) == 0 && capturing) || nvrtc_prepare() < 0) {
        free(key);
        return capturing ? 0 : -1;
    }
    brrr_chain_kernel ks[2] = {*k, backward_of(k, p->n_operands)};
    if (pairs_with_backward(k) && backward_wanted(p)) pair_key = make_key(&ks[1], arch, wanted, p, &pair_len);
    const uint64_t pair_hash = pair_key ? fnv1a(FNV_OFFSET, pair_key, pair_len) : 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&compile_lock);
    pthread_mutex_lock(&table_lock);
    e = table_find(&table, key, len, hash); /* another thread may have built it meanwhile */
    if (e) *kernel = e->kernel, *missing = e->missing;
    const int n = 1 + (pair_key && !table_find(&table, pair_key, pair_len, pair_hash));
    pthread_mutex_unlock(&table_lock);
    if (e == NULL) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        build bs[2];
        void *kernels[2] = {NULL, NULL};
        for (int i = 0; i < n; i++) bs[i] = (build){.k = ks[i], .p = p, .arch = arch, .variant = wanted};
        build_all(bs, n);
        for (int i = 0; i < n; i++) kernels[i] = load(&bs[i]);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        stats.last_seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        *kernel = kernels[0], *error = bs[0].error, *missing = bs[0].missing;
        if (n == 2) free(bs[1].error);
        pthread_mutex_lock(&table_lock);
        if (table_add(&table, key, len, hash, *kernel, *missing) == 0) key = NULL;
        /* A backward that failed is left out: built alone when it is needed, it says why. */
        if (n == 2 && kernels[1] && table_add(&table, pair_key, pair_len, pair_hash, kernels[1], 0) == 0) pair_key = NULL;
        pthread_mutex_unlock(&table_lock);
    }
    pthread_mutex_unlock(&compile_lock);
    Py_END_ALLOW_THREADS
    free(key);
    free(pair_key);
    return 1;
}

int brrr_chain_jit_run(brrr_op_call *c, brrr_chain_launch *L, const brrr_chain_steps *prog, int backward) {
    const int interpretable = prog->n_steps <= BRRR_MAX_CHAIN_STEPS, device = c->t[0].device_id;
    static int archs[256];
    /* Rows of dense columns (a bias gradient, the halves of a GLU input) go to the precompiled row
     * kernels while they can take the chain: their loads are pipelined (cp.async), which the
     * compiled row kernel's are not. */
    if (!jit_enabled || device < 0 || device >= 256 || (interpretable && L->row_layout)) return 0;
    if (archs[device] == 0) {
        int arch = 0;
        const int err = brrr_cuda_device_arch(device, &arch);
        if (err) return brrr_cuda_result(err, c->spec->name) < 0 ? -1 : 0;
        archs[device] = arch;
    }
    const brrr_chain_kernel k = kernel_for(L, prog->n_operands, backward);
    void *stream = brrr_call_stream(&c->call), *kernel;
    char *error;
    int missing, variant;
    if (variant_wanted(&variant) < 0) return -1;
    if (!fills_blocks(&k, prog, applied_variant(&k, prog, variant), L->numel)) variant &= ~BOUNDS_EXACT;
    const int found = find_kernel(&k, archs[device], variant, prog, stream, &kernel, &error, &missing);
    if (found < 0) return -1;
    if (!found) {
        if (interpretable)
            return warn_once(&warned_capture, "brrr: a chain met first under CUDA-graph capture runs in the interpreted "
                                              "kernel; run it once before capture to capture its compiled kernel") < 0 ? -1 : 0;
        PyErr_Format(PyExc_RuntimeError, "brrr.%s: a chain of %d steps met first under CUDA-graph capture: run it once "
                     "before capture, which compiles its kernel", c->spec->name, (int)prog->n_steps);
        return -1;
    }
    if (kernel == NULL) { /* the interpreted kernels run it; chain.c refuses what they cannot */
        int rc = 0;
        if (missing)
            rc = warn_once(&warned_missing, "brrr: NVRTC was not found (%s): chains on CUDA run in the interpreted "
                                            "kernels, which take at most %d steps (docs/chains.md)", error, BRRR_MAX_CHAIN_STEPS);
        else if (!interpretable)
            PyErr_Format(PyExc_RuntimeError, "brrr.%s: %s", c->spec->name, error ? error : "the chain's kernel failed to build");
        else if (error)
            rc = warn_once(&warned_failed, "brrr: a chain runs in the interpreted kernels: %s", error);
        free(error);
        return rc < 0 || (!missing && !interpretable) ? -1 : 0;
    }
    unsigned grid[3] = {1, 1, 1}, block[3] = {256, 1, 1};
    brrr_chain_flat flat;
    const void *param = L;
    if (k.layout == BRRR_JIT_CONTIGUOUS) {
        memset(&flat, 0, sizeof flat);
        flat.x = L->x.data, flat.out = L->out.data, flat.grad_out = L->grad_out.data;
        for (int b = 0; b < prog->n_operands; b++) flat.operands[b] = L->operands[b].data, flat.grad_operands[b] = L->grad_operands[b].data;
        flat.numel = L->numel, flat.row_length = L->row_length;
        const int applied = applied_variant(&k, prog, variant);
        block[0] = (unsigned)block_threads(applied);
        const int64_t packs = L->numel / (16 / (int64_t)brrr_dtype_size(L->dtype)),
                      per_block = block_threads(applied) * packs_per_thread(&k, prog, applied);
        grid[0] = (unsigned)((packs + per_block - 1) / per_block);
        grid[0] = grid[0] ? grid[0] : 1;
        param = &flat;
    } else if (k.layout == BRRR_JIT_STRIDED) {
        int sms = 1;
        brrr_cuda_multiprocessors(device, &sms);
        const int64_t blocks = (L->numel + 255) / 256, cap = (int64_t)sms * 16;
        grid[0] = (unsigned)(blocks < cap ? blocks : cap);
    } else { /* rows: the precompiled row kernels' grid with a bias gradient */
        const int64_t rows = L->numel / L->row_length;
        int64_t slices = L->partial_rows < rows ? L->partial_rows : rows;
        slices = slices < 1 ? 1 : (slices > 65535 ? 65535 : slices);
        grid[0] = (unsigned)((L->row_length + 31) / 32);
        grid[1] = (unsigned)slices;
        block[0] = 32, block[1] = 8;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = brrr_cuda_kernel_launch(kernel, grid, block, param, device, stream);
    if (err == 0 && k.layout == BRRR_JIT_ROWS) err = brrr_cuda_chain_vector_grad(L, device, stream);
    Py_END_ALLOW_THREADS
    return brrr_cuda_result(err, c->spec->name) < 0 ? -1 : 1;
}
#endif

/* ---- Python ----------------------------------------------------------------------------------- */

static int parse_dtype(const char *name, int32_t *dtype) {
    static const struct {
        const char *name;
        int32_t dtype;
    } DTYPES[] = {{"float32", BRRR_F32}, {"float16", BRRR_F16}, {"bfloat16", BRRR_BF16}, {"float64", BRRR_F64}};
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (strcmp(name, DTYPES[i].name) == 0) return *dtype = DTYPES[i].dtype, 0;
    PyErr_Format(PyExc_ValueError, "argument dtype: expected float32, float16, bfloat16 or float64, got '%s'", name);
    return -1;
}

/* chain_jit_compile(steps, dtype, backward=False, layout="contiguous", ndim=1, vector_mask=0,
 * grad_mask=0, arch=90, index32=False, with_backward=False, full_blocks=False) -> (source, cubin, origin): what a
 * CUDA call would compile, through the disk cache (origin "disk" or "compiled"), without a GPU;
 * with_backward: the forward's backward (of every operand's gradient) built at the same time on a
 * second thread, as a chain whose backward is wanted gets it (the result is the forward's). In the
 * variant BRRR_CHAIN_JIT_ORDER and BRRR_CHAIN_JIT_FORM ask for, as a launch (index32: a contiguous
 * kernel's, in the lean form, is a launch's of at most 0xFFFF0000 elements; full_blocks: a launch
 * that fills every block, which BRRR_CHAIN_JIT_BOUNDS=exact needs). For tests and the
 * first-call benchmark. */
PyObject *brrr_py_chain_jit_compile(PyObject *module, PyObject *args, PyObject *kwargs) {
    (void)module;
    static char *keywords[] = {"steps", "dtype", "backward", "layout", "ndim", "vector_mask", "grad_mask", "arch", "index32",
                               "with_backward", "full_blocks", NULL};
    PyObject *steps;
    const char *dtype_name, *layout_name = "contiguous";
    int backward = 0, ndim = 1, vector_mask = 0, grad_mask = 0, arch = 90, index32 = 0, with_backward = 0,
        full_blocks = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Os|psiiiippp:chain_jit_compile", keywords, &steps, &dtype_name,
                                     &backward, &layout_name, &ndim, &vector_mask, &grad_mask, &arch, &index32,
                                     &with_backward, &full_blocks))
        return NULL;
    brrr_chain_kernel k = {backward, 0, -1, ndim, vector_mask, grad_mask, index32};
    static const char *const LAYOUTS[] = {"contiguous", "strided", "rows"};
    for (int i = 0; i < BRRR_JIT_LAYOUTS; i++)
        if (strcmp(layout_name, LAYOUTS[i]) == 0) k.layout = i;
    if (parse_dtype(dtype_name, &k.dtype) < 0) return NULL;
    if (k.layout < 0 || ndim < 1 || ndim > BRRR_MAX_DIMS || (k.layout == BRRR_JIT_ROWS && (!backward || ndim < 2)) ||
        (k.layout != BRRR_JIT_ROWS && (vector_mask & grad_mask))) {
        PyErr_SetString(PyExc_ValueError, "argument layout: contiguous, strided or rows (backward only, and the layout of "
                                          "every vector operand's gradient), with 1 <= ndim <= 16 (rows: >= 2)");
        return NULL;
    }
    PyObject *bytes = PyObject_CallMethod(module, "chain_program", "O", steps);
    brrr_chain_steps p;
    const int parsed = bytes ? brrr_chain_parse_program(bytes, &p) : -1;
    Py_XDECREF(bytes);
    if (parsed < 0) return NULL;
    if ((vector_mask | grad_mask) >> p.n_operands) {
        PyMem_Free(p.steps);
        PyErr_SetString(PyExc_ValueError, "argument vector_mask/grad_mask: a bit set past the chain's operands");
        return NULL;
    }
    if (with_backward && !pairs_with_backward(&k)) {
        PyMem_Free(p.steps);
        PyErr_SetString(PyExc_ValueError, "argument with_backward: only a contiguous forward without vector operands "
                                          "is built with its backward");
        return NULL;
    }
    int variant;
    if (variant_wanted(&variant) < 0 || nvrtc_prepare() < 0) {
        PyMem_Free(p.steps);
        return NULL;
    }
    if (!full_blocks) variant &= ~BOUNDS_EXACT;
    const int n = 1 + with_backward;
    build bs[2] = {{.k = k, .p = &p, .arch = arch, .variant = variant, .want_source = 1},
                   {.k = backward_of(&k, p.n_operands), .p = &p, .arch = arch, .variant = variant}};
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&compile_lock);
    build_all(bs, n);
    for (int i = 0; i < n; i++)
        if (bs[i].image) ++*(bs[i].origin == ORIGIN_DISK ? &stats.from_disk : &stats.compiled);
    pthread_mutex_unlock(&compile_lock);
    Py_END_ALLOW_THREADS
    PyMem_Free(p.steps);
    PyObject *result = NULL;
    const build *failed = !bs[0].image ? &bs[0] : n == 2 && !bs[1].image ? &bs[1] : NULL;
    if (failed)
        PyErr_Format(PyExc_RuntimeError, "%s%s", failed->missing ? "NVRTC not available: " : "",
                     failed->error ? failed->error : "out of memory");
    else
        result = Py_BuildValue("(sy#s)", bs[0].source, bs[0].image, (Py_ssize_t)bs[0].size,
                               bs[0].origin == ORIGIN_DISK ? "disk" : "compiled");
    for (int i = 0; i < n; i++) {
        free(bs[i].source);
        free(bs[i].image);
        free(bs[i].error);
    }
    return result;
}

/* chain_jit_with_backward(program): the chain's backward is wanted (autograd records it), so the
 * forward kernels it needs from now on are built at the same time as their backward, on two
 * threads: the first call waits for the longer compile, not for both in turn. */
PyObject *brrr_py_chain_jit_with_backward(PyObject *module, PyObject *program) {
    (void)module;
    brrr_chain_steps p;
    if (brrr_chain_parse_program(program, &p) < 0) return NULL;
#if BRRR_WITH_CUDA
    const brrr_chain_kernel none = {0, 0, 0, 0, 0, 0, 0};
    size_t len;
    unsigned char *key = make_key(&none, 0, ORDER_INTERLEAVED, &p, &len);
    int rc = key ? 0 : -1;
    if (key) {
        const uint64_t hash = fnv1a(FNV_OFFSET, key, len);
        pthread_mutex_lock(&table_lock);
        if (table_find(&with_backward, key, len, hash) == NULL) rc = table_add(&with_backward, key, len, hash, NULL, 0);
        else rc = 1;
        pthread_mutex_unlock(&table_lock);
        if (rc != 0) free(key);
    }
    PyMem_Free(p.steps);
    if (rc < 0) return PyErr_NoMemory();
#else
    PyMem_Free(p.steps);
#endif
    Py_RETURN_NONE;
}

/* chain_jit_info() -> dict: NVRTC's path and version (or why it is missing), the cache folder,
 * whether compiling is on, and the counts of kernels compiled and read from the disk cache. */
PyObject *brrr_py_chain_jit_info(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    if (nvrtc_prepare() < 0) return NULL;
    char dir[PATH_MAX], version[32];
    const int have_dir = cache_dir(dir, sizeof dir);
    int loaded;
    jit_stats counts;
    /* Without the GIL: another thread's compile holds compile_lock for seconds, and NVRTC's first
     * search reads the disk; every Python thread would stall behind them. */
    Py_BEGIN_ALLOW_THREADS
    loaded = nvrtc_open() == 0;
    pthread_mutex_lock(&compile_lock);
    counts = stats;
    pthread_mutex_unlock(&compile_lock);
    Py_END_ALLOW_THREADS
    snprintf(version, sizeof version, "%d.%d", nvrtc.major, nvrtc.minor);
    return Py_BuildValue("{s:z,s:z,s:z,s:z,s:O,s:L,s:L,s:d}", "nvrtc", loaded ? nvrtc.path : NULL, "nvrtc_version",
                         loaded ? version : NULL, "nvrtc_error", loaded ? NULL : nvrtc.error, "cache_dir",
                         have_dir ? dir : NULL, "enabled", jit_enabled ? Py_True : Py_False, "compiled", counts.compiled,
                         "from_disk", counts.from_disk, "last_seconds", counts.last_seconds);
}

/* chain_jit_enable(flag) -> previous: whether CUDA chains run compiled kernels (else the
 * interpreted ones, which take at most BRRR_MAX_CHAIN_STEPS steps). */
PyObject *brrr_py_chain_jit_enable(PyObject *module, PyObject *flag) {
    (void)module;
    int on;
    if (brrr_parse_bool(flag, "flag", &on) < 0) return NULL;
    const int previous = jit_enabled;
    jit_enabled = on;
    return PyBool_FromLong(previous);
}

/* ---- fork ------------------------------------------------------------------------------------ */

/* A fork child has only the thread that forked: a lock that another thread of the parent held at
 * that moment would stay locked in the child for ever. NVRTC's own locks are among them: a child
 * forked while another thread was inside nvrtcCompileProgram waited for ever in its own next compile
 * (2 children in 20 on a loaded 2-core machine). So a fork waits for a compile in progress to end
 * (every NVRTC call is made under compile_lock, which the compiling thread holds without the GIL;
 * seconds at most) and the child inherits NVRTC at rest. Of brrr's own locks the child starts
 * afresh: nvrtc_lock while NVRTC is looked for (the search is started again) and table_lock (the
 * tables of loaded kernels are dropped, unfreed: a table being rehashed may be torn; the CUDA kernels
 * in it cannot run in a fork child anyway). */
static void jit_fork_prepare(void) { pthread_mutex_lock(&compile_lock); }
static void jit_fork_parent(void) { pthread_mutex_unlock(&compile_lock); }

static void jit_fork_child(void) {
    const int searching = pthread_mutex_trylock(&nvrtc_lock) != 0;
    pthread_mutex_init(&nvrtc_lock, NULL);
    if (searching) nvrtc.state = 0;
    pthread_mutex_unlock(&compile_lock);  /* jit_fork_prepare's, in this same thread */
#if BRRR_WITH_CUDA
    pthread_mutex_init(&table_lock, NULL);
    memset(&table, 0, sizeof table);
    memset(&with_backward, 0, sizeof with_backward);
#endif
}

static pthread_once_t jit_atfork_once = PTHREAD_ONCE_INIT;
static void jit_register_atfork(void) { pthread_atfork(jit_fork_prepare, jit_fork_parent, jit_fork_child); }

void brrr_chain_jit_init(void) { pthread_once(&jit_atfork_once, jit_register_atfork); }
