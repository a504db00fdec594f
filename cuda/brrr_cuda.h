/* The interface between the C glue (csrc/) and the CUDA launchers (cuda/).
 *
 * Plain C, no Python and no CUDA headers: the glue compiles without a CUDA toolkit. Every
 * launcher runs on the stream it is given, on the device it is given (restoring the caller's
 * current device), allocates nothing, never synchronises, and returns a cudaError_t as an int
 * (0 on success). Validation happened before the call: launchers trust their arguments. */
#ifndef BRRR_CUDA_H
#define BRRR_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BRRR_MAX_DIMS 16
#define BRRR_MAX_CHAIN_STEPS 16
#define BRRR_MAX_CHAIN_OPERANDS 4

/* Float dtypes of every op's tensors; the index dtypes only for cross_entropy's class targets
 * (brrr_index_import). */
typedef enum {
    BRRR_F32 = 0, BRRR_F16 = 1, BRRR_BF16 = 2, BRRR_F64 = 3,
    BRRR_I64 = 4, BRRR_I32 = 5, BRRR_U8 = 6
} brrr_dtype;

/* Chain opcodes. Unary ops take the running value y; scalar ops use `scalar`; tensor ops combine
 * y with operand `operand` (a tensor of the input's shape, or a vector along the last dim). */
typedef enum {
    BRRR_OP_RELU = 0,
    BRRR_OP_GELU,       /* erf form */
    BRRR_OP_GELU_TANH,  /* tanh approximation */
    BRRR_OP_SILU,
    BRRR_OP_SIGMOID,
    BRRR_OP_TANH,
    BRRR_OP_EXP,
    BRRR_OP_COS,
    BRRR_OP_SIN,
    BRRR_OP_ADD_SCALAR,
    BRRR_OP_MUL_SCALAR,
    BRRR_OP_ADD_TENSOR,
    BRRR_OP_MUL_TENSOR,
    BRRR_OP_ABS,
    BRRR_OP_NEG,
    BRRR_OP_SQUARE,
    BRRR_OP_SQRT,
    BRRR_OP_RSQRT,
    BRRR_OP_LOG,
    BRRR_OP_LOG1P,
    BRRR_OP_EXPM1,
    BRRR_OP_RECIPROCAL,
    BRRR_OP_POW,        /* y ** scalar */
    BRRR_OP_CLAMP_MIN,  /* max(y, scalar), NaN propagating */
    BRRR_OP_CLAMP_MAX,  /* min(y, scalar), NaN propagating */
    BRRR_OP_SOFTPLUS,   /* beta 1, threshold 20, as torch's defaults */
    BRRR_OP_MISH,
    BRRR_OP_HARDSWISH,
    BRRR_OP_LEAKY_RELU, /* negative slope: scalar */
    BRRR_OP_COUNT
} brrr_op;

typedef struct {
    int32_t op;      /* brrr_op */
    int32_t operand; /* tensor ops: index into the operands; else unused */
    double scalar;   /* scalar ops: the constant; else unused */
} brrr_chain_step;

typedef struct {
    int32_t n_steps;
    int32_t n_operands; /* tensor steps, each with its own operand slot 0..n_operands-1 */
    brrr_chain_step steps[BRRR_MAX_CHAIN_STEPS];
} brrr_chain_program;

/* A tensor seen through the common (coalesced) iteration shape of an elementwise launch. */
typedef struct {
    void *data;                      /* element (0, ..., 0) */
    int64_t strides[BRRR_MAX_DIMS];  /* in elements, over the launch's shape; 0 = broadcast */
} brrr_view;

/* One elementwise chain launch. Forward writes out = chain(x, operands). Backward reads x and
 * grad_out, writes grad_x into `out`, and for every operand with a non-NULL grad_operands[k].data
 * its gradient: elementwise for x-shaped operands; for vector operands (a bias along the last
 * dim) a column sum over rows, taken in a fixed order through the `partials` scratch, with
 * grad_operands[k].strides[0] the stride of the [row_length] result. */
typedef struct {
    brrr_chain_program program;
    int32_t dtype;               /* brrr_dtype, shared by every tensor */
    int32_t ndim;                /* >= 1 after coalescing */
    int64_t numel;
    int64_t shape[BRRR_MAX_DIMS];
    int32_t contiguous;          /* every tensor dense row-major over `shape` (vectors: along the last dim) */
    int32_t row_layout;          /* the last dim is x's last dim (rows = the others), as bias gradients need */
    int64_t row_length;          /* shape[ndim - 1] */
    int32_t operand_is_vector[BRRR_MAX_CHAIN_OPERANDS];
    brrr_view x, out, grad_out;
    brrr_view operands[BRRR_MAX_CHAIN_OPERANDS];
    brrr_view grad_operands[BRRR_MAX_CHAIN_OPERANDS];
    void *partials;              /* [n_operands][partial_rows][row_length] of float (double for float64) */
    int64_t partial_rows;
} brrr_chain_launch;

int brrr_cuda_chain_fwd(const brrr_chain_launch *launch, int device, void *stream);
int brrr_cuda_chain_bwd(const brrr_chain_launch *launch, int device, void *stream);
/* The second pass of a bias gradient: grad_operands[b] = the launch's partials summed in a fixed
 * order, for every vector operand b with a gradient (the kernels compiled at run time write the
 * partials as the precompiled row kernels do). */
int brrr_cuda_chain_vector_grad(const brrr_chain_launch *launch, int device, void *stream);

/* The parameter of a chain kernel compiled at run time for dense tensors (csrc/chain_jit.c):
 * element i of every tensor at i, of a vector operand at i % row_length. */
typedef struct {
    void *x, *out, *grad_out;
    void *operands[BRRR_MAX_CHAIN_OPERANDS];
    void *grad_operands[BRRR_MAX_CHAIN_OPERANDS];
    int64_t numel, row_length;
} brrr_chain_flat;

/* Kernels compiled at run time (cuda/jit.cu): a cubin loaded with the runtime's library API (and
 * kept loaded), its n kernels found by name, each launched with one parameter, `param` pointing
 * at its value. */
int brrr_cuda_library_load(const void *image, int n, const char *const *kernel_names, void **kernels);
int brrr_cuda_kernel_launch(void *kernel, const unsigned grid[3], const unsigned block[3], const void *param,
                            int device, void *stream);
int brrr_cuda_device_arch(int device, int *arch);         /* 10 * major + minor */
int brrr_cuda_multiprocessors(int device, int *count);
int brrr_cuda_stream_capturing(void *stream, int *capturing);

/* ---- LayerNorm / RMSNorm (csrc/norm.c, cuda/norm*.cu) -------------------------------------
 * A tensor of the input's shape is seen as rows (its leading dims) by columns (the normalised
 * trailing dims). Row dims and column dims are coalesced separately by the glue, so a view keeps
 * two stride lists. Row-indexed tensors (mean, rstd) use only row_strides, column-indexed ones
 * (weight, bias and their gradients) only col_strides. */

typedef struct {
    void *data;                              /* element (0, ..., 0); NULL: absent */
    int64_t row_strides[BRRR_MAX_DIMS]; /* in elements, over row_shape */
    int64_t col_strides[BRRR_MAX_DIMS]; /* in elements, over col_shape */
} brrr_norm_view;

/* One norm launch. Forward: residual_out = x + residual (when residual is given), then
 * out = norm(residual_out or x), saving mean and rstd per row when their data is non-NULL.
 * Backward: x is the normalised input (the forward's residual_out for the fused forms);
 * grad_x = d/dx + grad_residual; grad_weight and grad_bias (each optional) are column sums over
 * rows, taken in a fixed order through `partials`.
 *
 * `mean` holds the row's mean minus its first element (x[row, 0, ..., 0]): a shift that keeps
 * x - mean exact for inputs with a large common offset, which the backward rematerialises from
 * x. Stats and partials have the accumulation dtype: float32, float64 for float64 inputs. */
typedef struct {
    int32_t dtype;           /* brrr_dtype of every row-by-column tensor */
    int32_t weight_dtype;    /* weight, bias, grad_weight, grad_bias: dtype, or float32 for half dtypes */
    int32_t rms;             /* 1: RMSNorm (no mean, no bias) */
    int32_t llama;           /* RMSNorm only: out = round(round(x * rstd) * weight), rounding to dtype */
    int32_t contiguous_cols; /* col_ndim == 1, column stride 1 in every row-by-column view, weight, bias */
    int32_t row_ndim, col_ndim; /* >= 1 after coalescing */
    int64_t rows, cols;
    int64_t row_shape[BRRR_MAX_DIMS];
    int64_t col_shape[BRRR_MAX_DIMS];
    double eps;
    double weight_offset;    /* added to the weight wherever it is read: (1 + weight) is Gemma's RMSNorm */
    brrr_norm_view x, residual, out, residual_out;       /* forward (x also in the backward) */
    brrr_norm_view grad_out, grad_residual, grad_x;       /* backward */
    brrr_norm_view weight, bias, grad_weight, grad_bias;  /* column-indexed */
    brrr_norm_view mean, rstd;                            /* row-indexed */
    void *partials;          /* backward with grad_weight/grad_bias: [n_grads][brrr_norm_partial_rows][cols] */
} brrr_norm_launch;

/* The order in which a CUDA backward sums the weight and bias gradients over rows: a function of
 * the shape alone, so that every kernel, block count and GPU gives the same bits. The rows are
 * cut into chunks of brrr_norm_chunk_rows(rows) consecutive rows (the last one shorter); row i
 * of a chunk belongs to lane i % brrr_norm_lanes(cols); each lane sums its rows in row order
 * (from 0: acc = fma(dy, xhat, acc) for the weight, acc + dy for the bias), the lanes of a chunk
 * are then added in lane order (from lane 0) into the chunk's partial row, and the partial rows
 * are summed by norm_finalize_kernel in its fixed order. The lanes let a block work on several
 * rows of a chunk at once: 8 for rows of up to 1024 columns, halving down to 1 for 8192. */
static inline int64_t brrr_norm_chunk_rows(int64_t rows) {
    int64_t r = (rows + 255) / 256; /* at most 256 chunks: 2 per SM of an H200 */
    return r < 8 ? 8 : r;
}
static inline int brrr_norm_lanes(int64_t cols) {
    int lanes = 8;
    while (lanes > 1 && lanes * cols > 8192) lanes /= 2;
    return lanes;
}
/* Rows of the partials scratch per weight/bias gradient: the number of chunks. */
static inline int64_t brrr_norm_partial_rows(int64_t rows, int64_t cols) {
    (void)cols;
    return (rows + brrr_norm_chunk_rows(rows) - 1) / brrr_norm_chunk_rows(rows);
}

int brrr_cuda_norm_fwd(const brrr_norm_launch *launch, int device, void *stream);
int brrr_cuda_norm_bwd(const brrr_norm_launch *launch, int device, void *stream);
/* ---- end LayerNorm / RMSNorm ---- */

/* ---- bias + dropout + residual add (csrc/dropout.c, cuda/dropout*.cu) ---------------------
 * out = residual + keep(i) * (x + bias) * scale, element i being the logical row-major index in
 * x's shape: the glue merges adjacent dims but never reorders them, so the row-major index over
 * `shape` is that index whatever the memory layout. keep(i): word i % 4 of
 * brrr_dropout_randoms(seed, offset, i / 4) (philox.h) is >= threshold. The backward is the
 * same launch with x = grad_out, out = grad_x and no residual or bias; with grad_bias it also
 * sums grad_x over rows (the last dim stays last: row_layout) through `partials`, in a fixed
 * order. Each element is multiplied by its mask value (scale or 0), as torch's dropout does: a
 * dropped inf or NaN gives NaN. */
typedef struct {
    int32_t dtype;             /* brrr_dtype of every tensor */
    int32_t ndim;              /* >= 1 after merging */
    int32_t contiguous;        /* ndim == 1 and x, residual, out have stride 1: memory order = logical order */
    int32_t row_layout;        /* shape[ndim - 1] is x's last dim (set when grad_bias is) */
    int64_t numel, cols;       /* cols: x's last dim (1 for a 0-d x) */
    int64_t shape[BRRR_MAX_DIMS];
    uint64_t seed, offset;
    uint64_t threshold;        /* floor(p * 2^32): 0 keeps every element, 2^32 (p == 1) none */
    double scale;              /* 1 / (1 - p); 0 when p == 1 */
    brrr_view x, residual, out; /* residual.data NULL: no residual */
    void *bias;                /* NULL: none; element c at c * bias_stride */
    int64_t bias_stride;
    void *grad_bias;           /* backward: NULL, or the [cols] result at grad_bias_stride */
    int64_t grad_bias_stride;
    void *partials;            /* [partial_rows][cols] of float (double for float64) */
    int64_t partial_rows;      /* 0 when there are no rows */
} brrr_dropout_launch;

int brrr_cuda_dropout(const brrr_dropout_launch *launch, int device, void *stream);
/* ---- end bias + dropout + residual add ---- */

/* ---- softmax cross-entropy (csrc/xent.c, cuda/xent*.cu) ----------------------------------
 * logits are rows (their leading dims, coalesced into row_shape) by `classes` (the last dim, at
 * class_stride), target holds one class index per row. The loss sees z = softcap * tanh(logits /
 * softcap) (Gemma 2's final-logit softcap) when softcap is not 0, else z = logits. Forward, per
 * row r with target t and shift s = z[r, t] where that is finite (else 0):
 *     lse[r]  = log(sum_c exp(z[r, c])) - s          (the row's nll where s = z[r, t])
 *     loss[r] = (1 - smoothing) * (lse[r] - (z[r, t] - s))
 *               + smoothing * (lse[r] - (mean_c z[r, c] - s))
 *               + z_loss * (lse[r] + s)^2              (PaLM's z-loss on the log-normaliser)
 * and 0 for both where t == ignore_index, NaN where t is outside [0, classes). lse is kept
 * relative to s so that the backward's z[r, c] - s - lse[r] rounds at the scale of the
 * softmax, not at the scale of a large offset common to the row. Then, when total
 * or count is given, one block sums loss over rows in a fixed order: *total = the sum (the sum /
 * count for mean), *count = the rows whose target is not ignore_index.
 * Backward, with p = exp(z[r, c] - s - lse[r]):
 *     grad_logits[r, c] = g_r * (p * (1 + 2 z_loss (lse[r] + s)) - smoothing / classes
 *                                - (1 - smoothing) * [c == t]) * dz/dlogits[r, c]
 * (dz/dlogits = 1 - (z / softcap)^2 with a softcap, else 1), g_r = grad_loss[r] (a 0-d grad_loss:
 * the same for every row; none, in the forward: 1), divided by *count when count is given
 * (mean); 0 for ignored rows.
 * lse and loss are contiguous over rows (logical row order) in the accumulation dtype (float32,
 * float64 for float64 logits); grad_loss (strided), total and count have that dtype too.
 * The backward's grad_logits never shares memory with logits (every element of a row needs the
 * row's target logit, which the row's threads read at different times). The forward writes the
 * gradient too when grad_logits is given (the fused forward and backward: lse may then be NULL);
 * it reads the target logit and the whole row before any thread of the row writes, so there
 * grad_logits may be logits itself (in place). */

typedef struct {
    int32_t dtype;        /* brrr_dtype of logits and grad_logits */
    int32_t target_dtype; /* BRRR_I64, BRRR_I32 or BRRR_U8 */
    int32_t mean;         /* forward: *total = sum / count */
    int32_t row_ndim;     /* >= 1 after coalescing */
    int64_t rows, classes;
    int64_t row_shape[BRRR_MAX_DIMS];
    int64_t ignore_index;
    double smoothing;
    double softcap;           /* 0: none */
    double z_loss;            /* 0: none */
    const void *logits, *target;
    int64_t logits_rows[BRRR_MAX_DIMS], target_rows[BRRR_MAX_DIMS];
    int64_t logits_class_stride;
    void *lse, *loss;         /* [rows]; forward with gradient: lse NULL or [rows] */
    void *total, *count_out;  /* forward: each NULL or 0-d */
    const void *grad_loss;    /* [rows] at grad_loss_rows strides (all 0 for a 0-d one); NULL in the forward: 1 */
    int64_t grad_loss_rows[BRRR_MAX_DIMS];
    const void *count;        /* backward, forward with gradient: NULL or the count to divide by */
    void *grad_logits;        /* forward: NULL, or the gradient to write in the same pass */
    int64_t grad_rows[BRRR_MAX_DIMS];
    int64_t grad_class_stride;
} brrr_xent_launch;

int brrr_cuda_xent_fwd(const brrr_xent_launch *launch, int device, void *stream);
int brrr_cuda_xent_bwd(const brrr_xent_launch *launch, int device, void *stream);

/* linear_cross_entropy's backward, which scales the gradients its forward computed:
 *     out[i] = acc[i] * factor       (factor NULL: 1)
 * the product in acc's compute dtype (float32, float64 for float64 acc; factor converted to it
 * exactly: a float64 factor only with a float64 acc) and rounded once, to nearest even, into out's
 * dtype (float64 into a half type through float32, as PyTorch converts): the bits of
 * torch.mul(acc, factor.reshape(1)).to(out's dtype). acc and out are contiguous, n elements each;
 * out has acc's dtype or a narrower one than a float32 or float64 acc. out may be acc itself (the
 * thread that writes an element has read it), and shares no other byte with it. */
typedef struct {
    int32_t dtype, out_dtype, factor_dtype; /* brrr_dtype of acc, out and factor */
    int64_t n;
    const void *acc, *factor;
    void *out;
} brrr_xent_scale_launch;

int brrr_cuda_xent_scale(const brrr_xent_scale_launch *launch, int device, void *stream);
/* ---- end softmax cross-entropy ---- */

/* ---- rotary position embedding (csrc/rotary.c, cuda/rotary.cu) -----------------------------
 * The first 2h features of x's last dim (rotary_dim; the rest are copied through) are rotated
 * in h pairs (e0, e1): (p, p + h), as Llama-style models pair them (rotate_half), or (2p, 2p + 1)
 * when interleaved (GPT-J, Cohere, GLM). With the angles' cos and sin (broadcast to x's shape)
 * read at (a0, a1) = (e0, e1), one per feature, or (p, p) when pair_angles (one per pair):
 *     out[e0] = x[e0] cos[a0] - x[e1] sin[a0]
 *     out[e1] = x[e1] cos[a1] + x[e0] sin[a1]
 * (x * cos + rotate_half(x) * sin for Llama's pairs) and the backward (transpose) with x = grad_out:
 *     out[e0] = x[e0] cos[a0] + x[e1] sin[a1]
 *     out[e1] = x[e1] cos[a1] - x[e0] sin[a0]
 * The leading dims are coalesced into row_shape (x, out, cos, sin each with its row strides, 0
 * where broadcast); math in float32 (float64 for float64), rounded once.
 * pair: a second tensor on the same angles and layout (k beside q, or dk beside dq), its rows2
 * rows over row_shape2 (coalesced as x's: x2, out2, cos2 and sin2 with their row strides and
 * col_stride2), rotated by the same launch where the kernel shares the angles between the two,
 * else as a launch of its own. */
typedef struct {
    int32_t dtype;    /* brrr_dtype of every tensor */
    int32_t backward;
    int32_t interleaved; /* pairs (2p, 2p + 1) rather than (p, p + half) */
    int32_t pair_angles; /* cos and sin hold one angle per pair (index p), not one per feature */
    int32_t row_ndim; /* >= 1 */
    int64_t rows, half;
    int64_t pass;     /* features after the 2 * half rotated ones that are copied from x to out (0 in place) */
    int64_t row_shape[BRRR_MAX_DIMS];
    brrr_view x, out, cos, sin;      /* strides over row_shape */
    int64_t col_stride[4];           /* x, out, cos, sin: the stride of the last dim */
    int32_t pair, row_ndim2;         /* pair 0: no second tensor (the fields below unused) */
    int64_t rows2;
    int64_t row_shape2[BRRR_MAX_DIMS];
    brrr_view x2, out2, cos2, sin2;  /* strides over row_shape2 */
    int64_t col_stride2[4];
} brrr_rotary_launch;

int brrr_cuda_rotary(const brrr_rotary_launch *launch, int device, void *stream);
/* ---- end rotary ---- */

int brrr_cuda_device_count(int *count);
int brrr_cuda_stream_synchronize(void *stream);
int brrr_cuda_runtime_version(int *version);
int brrr_cuda_driver_version(int *version);
const char *brrr_cuda_error_string(int error);

#ifdef __cplusplus
}
#endif
#endif
