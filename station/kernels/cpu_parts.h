/* What the library's C files call in one another, never from Python (cpu_abi.h is the
   interface Python calls): the 4-bit products (cpu_q4.c) and the attention of a group of
   token rows (cpu_attention.c), both called by the step (cpu_step.c) on its threads. */

#ifndef GNOSIS_CPU_PARTS_H
#define GNOSIS_CPU_PARTS_H

#include <stdint.h>

#include "cpu_abi.h"

/* -- the 4-bit products (cpu_q4.c) */

/* One row of activations for the products: int16 values xq; per 32-value group g the left
   shift xsh[g] (0..7) that brings its integer sums to steps of the row's *xr (its largest
   magnitude / 32767 / 128), and the group's float32 sum xs[g]. */
void gnosis_q4_quantize_row(const float *x, int32_t k, int16_t *xq, int32_t *xsh, float *xs, float *xr);
/* y[r][i] = row 16 tile + i of w times token row r (r < rows; rows of xq are w->cols apart,
   of xsh and xs w->cols / GNOSIS_GROUP, of xr 1), bias included: [rows, GNOSIS_Q4_TILE]. */
void gnosis_q4_tile(const gnosis_q4_matrix_t *w, int32_t tile, const int16_t *xq, const int32_t *xsh,
                    const float *xs, const float *xr, int32_t rows, float *y);

/* -- attention (cpu_attention.c) */

/* One job: the rows of a group (consecutive positions of one sequence, row i at position
   first + i, seeing positions 0..first + i) and one K/V head with the rep query heads it
   serves. Position p's K and V rows are at table[p / block_size] * block_stride + (p %
   block_size) * stride values into k and v: float32, or bfloat16 where bf16. */
typedef struct {
    const float *q;     /* row i's query head r at q + i * q_row + r * head_dim */
    const void *k, *v;
    const int32_t *table;
    float *out;         /* row i's head r at out + i * out_row + r * head_dim */
    int32_t q_row, out_row, stride, block_stride, block_size, head_dim, rows, rep, first;
    float scaling;      /* multiplies q . k */
    int32_t bf16;       /* 1: the products on bfloat16 pairs, K and V bfloat16 (only where
                           gnosis_attention_takes says 2) */
} gnosis_attention_job_t;

/* A thread's scratch for jobs of up to `pairs` (row, head) pairs and `max_pos` positions. */
typedef struct {
    float *scores; /* [max(pairs, 16) rounded up to 16, max_pos + 32] */
    float *qt;     /* [head_dim, max(32, pairs rounded up to 16)] */
    float *part;   /* [16, pairs rounded up to 16] */
    float *acc;    /* [head_dim, pairs rounded up to 16] */
    int32_t pairs, max_pos;
} gnosis_attention_scratch_t;

/* n float32 values (n a multiple of 16) as the bfloat16 values the attention's products
   take (nearest even): a K or V row into a bfloat16 pool. Only where gnosis_attention_takes
   says 2. */
void gnosis_attention_store_bf16(const float *x, int32_t n, uint16_t *out);

/* The job's attention, into out (its scratch the calling thread's). */
void gnosis_attention(const gnosis_attention_job_t *job, const gnosis_attention_scratch_t *scratch);

#endif
