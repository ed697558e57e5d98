/* The ABI of the station's C library: every function it exports and the structs they take.

   cpu_kernels.c (the Q8_0 product) and cpu_step.c (the decode step) both include this
   header, and station/kernels/cpu_kernels.py builds them into one shared object on the
   machine it runs on. Python mirrors each struct as a ctypes.Structure with the same field
   names in the same order, beside the code that calls the function taking it
   (cpu_kernels.py: gnosis_q8_product_t and gnosis_status_t; cpu_step.py: the step's), and
   tests/station/kernels/test_cpu_abi.py compiles a probe against this header to check
   each struct's size, each field's name and offset, and the constants below.

   Fields are int32_t, float, pointers or structs of these, so the layout is the
   platform's plain C one. Widths and counts come first in a struct where they size the
   arrays after them; a NULL pointer means "none" only where its comment says so. */

#ifndef GNOSIS_CPU_ABI_H
#define GNOSIS_CPU_ABI_H

#include <stdint.h>

#define GNOSIS_GROUP 32               /* values a group holds: Q8_0 blocks, the 4-bit groups, activations */
#define GNOSIS_STEP_MAX_WIDTH 32768   /* inputs of any of the step's matrices */
#define GNOSIS_STEP_MAX_HEAD_DIM 512
#define GNOSIS_STEP_MAX_ROWS 64       /* token rows one step call may take */
#define GNOSIS_MAX_THREADS 64
#define GNOSIS_Q4_TILE 16            /* output rows of a 4-bit matrix's tile */

/* What every call that can fail returns. */
typedef enum {
    GNOSIS_OK = 0,
    GNOSIS_BAD_ARGUMENT = -1, /* a shape, token, position, slot or block id out of range; nothing written */
    GNOSIS_NO_MEMORY = -2,    /* a buffer could not be allocated */
    GNOSIS_NO_THREAD = -3,    /* a thread could not start; the caller's thread did its share: the result is complete */
} gnosis_status_t;

/* -- the Q8_0 product (cpu_kernels.c) */

/* y = x @ (q * d).T over a GGUF file's Q8_0 blocks, float32 in and out. */
typedef struct {
    const int8_t *q;  /* [out_features, in_features] */
    const float *d;   /* [out_features, in_features / GNOSIS_GROUP]: the blocks' float16 scales, widened */
    const float *x;   /* [rows, in_features] */
    float *y;         /* [rows, out_features] */
    int32_t rows, out_features, in_features; /* in_features a multiple of GNOSIS_GROUP */
} gnosis_q8_product_t;

/* "avx512", "avx2" or "scalar": the instructions this build's kernels use. */
const char *gnosis_simd(void);
/* The product, output columns split over `threads` threads (the caller's one of them). */
gnosis_status_t gnosis_q8_linear(const gnosis_q8_product_t *product, int32_t threads);
/* Output columns [n0, n1) of the product on the calling thread (cpu_step.c's head, on the
   step's threads; not called from Python). */
void gnosis_q8_columns(const gnosis_q8_product_t *product, int32_t n0, int32_t n1);

/* -- the decode step (cpu_step.c) */

/* A Llama-family model's shape. */
typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    float rms_eps;         /* the RMS norms' epsilon */
    float attention_scale; /* multiplies q . k */
} gnosis_model_shape_t;

/* A matrix of 4-bit groups, w = step * q + min with q in 0..15 and a float16 step and
   minimum per 32-value group (a GGUF file's Q4_0 / Q4_1 groups), in tiles of
   GNOSIS_Q4_TILE output rows (the last one padded with zero rows): tile t holds rows
   16t..16t+15, and for each of its groups g, in order:
     q:    8 slabs of 32 bytes; in slab c, byte 2i + j holds value 2c + j of row 16t + i's
           group g in its low nibble and value 2c + 16 + j in its high nibble;
     step, min: 16 float16 each, row 16t + i's at [t][g][i].
   So one 32-byte load is 16 rows' 4 values, and the products of a tile are 16 lanes
   (cpu_q4.c). cpu_step.py writes this layout from the file's groups. */
typedef struct {
    const uint8_t *q;     /* [tiles, cols / GNOSIS_GROUP, 8, 32] */
    const uint16_t *step; /* [tiles, cols / GNOSIS_GROUP, GNOSIS_Q4_TILE] float16 */
    const uint16_t *min;  /* [tiles, cols / GNOSIS_GROUP, GNOSIS_Q4_TILE] float16 */
    const float *bias;    /* [tiles * GNOSIS_Q4_TILE] (zero past rows), or NULL: none */
    int32_t rows, cols;
} gnosis_q4_matrix_t;

/* One layer's weights; the projections that read the same input stacked into one matrix. */
typedef struct {
    gnosis_q4_matrix_t qkv;     /* q, k, v: [(heads + 2 kv_heads) head_dim, hidden] */
    gnosis_q4_matrix_t o;       /* [hidden, heads head_dim] */
    gnosis_q4_matrix_t gate_up; /* gate rows, then up rows: [2 intermediate, hidden] */
    gnosis_q4_matrix_t down;    /* [hidden, intermediate] */
    const float *input_norm;    /* [hidden] */
    const float *post_attention_norm; /* [hidden] */
} gnosis_layer_weights_t;

typedef struct {
    const float *embed;      /* [vocab, hidden] */
    const float *final_norm; /* [hidden] */
    const gnosis_layer_weights_t *layers; /* [shape.layers], copied by gnosis_step_create */
} gnosis_model_weights_t;

/* The rotary tables, rotate-half form: [max_positions, head_dim] each. */
typedef struct {
    const float *cos, *sin;
    int32_t max_positions;
} gnosis_rotary_t;

/* One layer's K and V in the paged pool: [num_blocks, kv_heads, block_size, head_dim]
   each (a block's rows head by head, so a K/V head's rows of a block are one run of
   memory), float32, or bfloat16 where the step's attention_bf16 (the values its attention
   would round them to); slot = block id * block_size + offset in the block. */
typedef struct {
    void *k, *v;
} gnosis_kv_layer_t;

typedef struct {
    const gnosis_kv_layer_t *layers; /* [shape.layers], copied by gnosis_step_create */
    int32_t num_blocks, block_size;
} gnosis_kv_pool_t;

/* Everything a step holds for its life: the tensors pointed to must outlive it. */
typedef struct {
    gnosis_model_shape_t shape;
    gnosis_model_weights_t weights;
    gnosis_rotary_t rotary;
    gnosis_kv_pool_t kv;
    int32_t max_rows; /* token rows a call may take, 1..GNOSIS_STEP_MAX_ROWS */
    int32_t threads;  /* the step's pool, the caller's thread included (fewer where some cannot start) */
    int32_t attention_bf16; /* 1: attention's products on bfloat16 pairs, where gnosis_attention_takes
                               says 2 (else GNOSIS_BAD_ARGUMENT), over a bfloat16 pool; 0: in
                               float32, over a float32 pool */
} gnosis_step_config_t;

/* One call's token rows: decode tokens (one per sequence), or a prompt's in position order. */
typedef struct {
    const int64_t *tokens;       /* [rows] */
    const int64_t *positions;    /* [rows] */
    const int64_t *slots;        /* [rows]: where each row's K/V is written */
    const int32_t *block_tables; /* [rows, table_width]: each row's sequence's block ids */
    float *hidden_out;           /* [rows, hidden]: the final norm's output */
    int32_t rows, table_width;
} gnosis_step_rows_t;

typedef struct gnosis_step gnosis_step_t; /* opaque: the step's buffers and threads */

/* A step for `config`, in *step (NULL unless GNOSIS_OK): GNOSIS_BAD_ARGUMENT for a shape
   the step does not take, GNOSIS_NO_MEMORY. A thread that cannot start leaves fewer. */
gnosis_status_t gnosis_step_create(const gnosis_step_config_t *config, gnosis_step_t **step);
void gnosis_step_free(gnosis_step_t *step); /* stops its threads; NULL is nothing */
int32_t gnosis_step_threads(const gnosis_step_t *step);
/* The forward of the rows: their K/V into the pool, the final norm's output into
   hidden_out; GNOSIS_BAD_ARGUMENT (checked before anything is written). */
gnosis_status_t gnosis_step_run(gnosis_step_t *step, const gnosis_step_rows_t *rows);
/* Tiles [first, first + tiles) of w times each of `rows` float32 rows of x ([rows, w->cols]),
   into y [rows, 16 tiles]: a linear layer's outputs, computed as the step computes them
   (cpu_q4.c), tiles split over `threads` threads (the caller's one of them). GNOSIS_NO_THREAD:
   the caller's thread did the rest; the result is complete. */
gnosis_status_t gnosis_q4_linear(const gnosis_q4_matrix_t *w, int32_t first, int32_t tiles, const float *x, int32_t rows, float *y, int32_t threads);
/* What this build computes the step with: "avx512-vnni", "avx2" or "scalar" for the
   4-bit products (cpu_q4.c; each gives the same bits), and for head_dim: 0 where the step
   attends with its portable loops, 1 where its vector attention (cpu_attention.c: an
   AVX-512 build, head_dim a multiple of 16) takes it in float32, 2 where it can also take
   it on bfloat16 pairs (an AVX512_BF16 build: gnosis_step_config_t's attention_bf16). */
const char *gnosis_q4_simd(void);
int32_t gnosis_attention_takes(int32_t head_dim);
/* The Q8_0 product as gnosis_q8_linear computes it, on the step's threads. */
gnosis_status_t gnosis_step_head(gnosis_step_t *step, const gnosis_q8_product_t *product);

#endif
