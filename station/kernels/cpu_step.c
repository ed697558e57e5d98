/* The forward of up to max_rows token rows of a Llama-family model on 4-bit weights, in
   one call (station/kernels/cpu_step.py says when the station uses it and why; cpu_abi.h
   declares the interface and the structs it takes).

   A decode token of a small model is 30 layers x (2 norms, 4 matrix products, rotary,
   attention, SiLU): a few hundred torch calls, each a Python round trip and an OpenMP
   fork/join, more time than the arithmetic. Here the step is one C call: B token rows in
   (decode tokens, one per sequence, or a prompt's tokens in position order), the final
   norm's output out, K/V written into the paged pool and read back through each
   sequence's block table, the work split over a pool of threads that live as long as the
   step does.

   Weights: per output row, the row's 4-bit values as GGUF keeps them (32-value groups,
   byte j of a group holds values j and j + 16) and per group a float16 step and minimum,
   w = step * q + min, q in 0..15. Activations: each 32-value group of a row is scaled to
   int16 (its largest magnitude to 32767) for the integer multiply-add, and the minimum
   term uses the group's float32 sum: the only rounding added is the activations' to 15
   bits (torch's int4 kernels round them to bfloat16, 8 bits). Every output of a row is
   computed from that row's values alone, in the same order whatever B is: a sequence
   decodes alike alone or in a batch, and a token's K/V is the same bits from a prompt's
   row as from a decode row. */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu_parts.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define STEP_SIMD 1
#else
#define STEP_SIMD 0
#endif

#define G GNOSIS_GROUP
#define MAX_HEAD_DIM GNOSIS_STEP_MAX_HEAD_DIM
#define MAX_THREADS GNOSIS_MAX_THREADS
#define MAX_ROWS GNOSIS_STEP_MAX_ROWS
#define TILE_ROWS GNOSIS_Q4_TILE
#define SPIN_NS 300000 /* a worker spins this long for work, then sleeps */

typedef gnosis_q4_matrix_t mat_t;

typedef struct {
    gnosis_layer_weights_t w;
    gnosis_kv_layer_t kv; /* [slots, kv_heads, head_dim] each */
} layer_t;

/* How a matrix product writes its output. */
typedef enum {
    OUT_STORE,       /* out = x @ w.T */
    OUT_ADD,         /* out += x @ w.T (into the residual) */
    OUT_SILU_GATE_UP /* w is gate rows then up rows: out = SiLU(gate) * up, half w's rows wide */
} out_mode_t;

typedef gnosis_step_t step_t;
/* One chunk of a parallel region: chunk index, the running thread's index (its scratch). */
typedef void (*task_fn)(step_t *, int chunk, int tid);

struct gnosis_step {
    int layers, hidden, heads, kv_heads, head_dim, inter, block_size, max_pos, max_rows;
    float eps, scaling;
    const float *embed, *final_norm, *cos, *sin;
    layer_t *layer;
    /* scratch, sized for max_rows rows */
    float *h, *x, *qkv, *att, *act, *xs, *xr;
    int32_t *xsh;
    int16_t *xq;
    float *tile_out; /* per thread: a matrix tile's outputs (and its up rows') for every row */
    /* attention, per thread: cpu_attention.c's scratch where it takes the shape (vector),
       else the portable loops' scores and sums */
    int vector_attention, attention_bf16;
    float *scores, *acc, *qt, *part;
    int group_start[MAX_ROWS], group_len[MAX_ROWS]; /* this call's attention groups */
    int group_max, pairs; /* rows a group may hold; (row, head) pairs of a thread's scratch */
    /* this call */
    int b;
    const int64_t *pos, *slots;
    const int32_t *tables;
    int table_width;
    const mat_t *mat;
    const float *in, *norm;
    out_mode_t out_mode;
    float *out;
    layer_t *cur;
    task_fn row_fn; /* per_row's task, row_span rows a chunk */
    int row_span;
    gnosis_q8_product_t head;
    /* the pool */
    int nt, vocab, num_blocks;
    pthread_t tid[MAX_THREADS];
    struct worker_arg { step_t *s; int id; } args[MAX_THREADS];
    atomic_int gen, stop;
    /* the region being run, in one word (TICKET), and its chunks finished */
    _Atomic int64_t ticket;
    atomic_int finished;
    int sleepers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task_fn fn;
};

/* -- the thread pool */

static double now_ns(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec;
}

/* A region's ticket: its generation (low 24 bits), its number of chunks and the next chunk
   to claim (20 bits each), in one word, so that a claim checks all three at once. (A count
   kept beside the ticket let a thread read the next region's count with this region's
   ticket and claim one chunk too many, which hung or raced the caller.) */
#define CHUNK_BITS 20
#define MAX_CHUNKS ((1 << CHUNK_BITS) - 1)
#define GEN_MASK 0xffffff
#define TICKET(gen, chunks) (((int64_t)((gen) & GEN_MASK) << (2 * CHUNK_BITS)) | ((int64_t)(chunks) << CHUNK_BITS))

/* Claim and run the chunks of region `gen` until none is left. A thread that comes late
   (descheduled, or still waking) finds them all taken and does nothing: the caller never
   waits for a thread that has not started a chunk. */
static void run_chunks(step_t *s, int gen, int tid) {
    for (;;) {
        int64_t t = atomic_load_explicit(&s->ticket, memory_order_acquire);
        int next = (int)(t & MAX_CHUNKS), chunks = (int)((t >> CHUNK_BITS) & MAX_CHUNKS);
        if ((int)(t >> (2 * CHUNK_BITS)) != (gen & GEN_MASK) || next >= chunks) return;
        if (!atomic_compare_exchange_weak(&s->ticket, &t, t + 1)) continue;
        s->fn(s, next, tid);
        atomic_fetch_add_explicit(&s->finished, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    step_t *s = ((struct worker_arg *)arg)->s;
    int id = ((struct worker_arg *)arg)->id, seen = 0; /* gen starts at 0 */
    for (;;) {
        double start = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&s->gen, memory_order_acquire) == seen) {
#if STEP_SIMD
            _mm_pause();
#endif
            if (++spins % 256 == 0 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&s->mu);
                s->sleepers++;
                while (atomic_load(&s->gen) == seen) pthread_cond_wait(&s->cv, &s->mu);
                s->sleepers--;
                pthread_mutex_unlock(&s->mu);
            }
        }
        seen = atomic_load(&s->gen);
        if (atomic_load(&s->stop)) return NULL;
        run_chunks(s, seen, id);
    }
}

/* Run fn over chunks 0..chunks-1 on the pool's threads (the caller's is thread 0). */
static void parallel(step_t *s, task_fn fn, int chunks) {
    if (s->nt == 1 || chunks == 1 || chunks > MAX_CHUNKS) {
        for (int c = 0; c < chunks; c++) fn(s, c, 0);
        return;
    }
    int gen = (atomic_load(&s->gen) + 1) & GEN_MASK;  /* wraps: a long-lived station runs ~10^4 a second */
    s->fn = fn;
    atomic_store(&s->finished, 0);
    atomic_store_explicit(&s->ticket, TICKET(gen, chunks), memory_order_release);
    atomic_store_explicit(&s->gen, gen, memory_order_release);
    pthread_mutex_lock(&s->mu);
    if (s->sleepers) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    run_chunks(s, gen, 0);
    /* only chunks another thread has started remain */
    for (int spins = 1; atomic_load_explicit(&s->finished, memory_order_acquire) != chunks; spins++) {
#if STEP_SIMD
        _mm_pause();
#endif
        if (spins % 4096 == 0) sched_yield();
    }
}

/* -- arithmetic */

/* RMS norm of n values (n a multiple of 16: the step's widths are whole groups). The sum of
   squares is 16 partial sums (sum l takes fma(h_i, h_i, sum) for i = l mod 16, in order,
   from 0), then (l + l+8), (l + l+4), (l + l+2), (0 + 1): on every build the same bits, and
   16 short chains instead of one of n dependent additions (a row's norm was a third of
   the time a prompt spent outside its products and attention). */
static void rms_norm(const float *h, const float *w, float *out, int n, float eps) {
    float part[16];
#if STEP_SIMD
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __m256 x = _mm256_loadu_ps(h + i), y = _mm256_loadu_ps(h + i + 8);
        a = _mm256_fmadd_ps(x, x, a);
        b = _mm256_fmadd_ps(y, y, b);
    }
    _mm256_storeu_ps(part, a);
    _mm256_storeu_ps(part + 8, b);
#else
    for (int l = 0; l < 16; l++) part[l] = 0.0f;
    for (int i = 0; i < n; i++) part[i % 16] = fmaf(h[i], h[i], part[i % 16]);
#endif
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) part[l] += part[l + width];
    float r = 1.0f / sqrtf(part[0] / n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (h[i] * r);
}

#if STEP_SIMD
/* e^x for 8 floats (Cephes' expf: range reduction by ln 2 in two parts, a degree-6
   polynomial; within 2 ulp of expf over the range it does not clamp). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_shuffle_ps(r, r, 1));
    return _mm_cvtss_f32(r);
}
#endif

/* SiLU(gate) * up over n values, in place in gate. */
static void silu_mul(float *gate, const float *up, int n) {
    int i = 0;
#if STEP_SIMD
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                 _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* Output rows [16 chunk, +16) of the current matrix (one tile, cpu_q4.c) for every token
   row; gate rows then up rows, combined, in OUT_SILU_GATE_UP. */
static void matmul_task(step_t *s, int chunk, int tid) {
    const mat_t *w = s->mat;
    const int rows = s->out_mode == OUT_SILU_GATE_UP ? w->rows / 2 : w->rows;
    const int n0 = chunk * TILE_ROWS, n = rows - n0 < TILE_ROWS ? rows - n0 : TILE_ROWS;
    float *y = s->tile_out + (size_t)tid * 2 * s->max_rows * TILE_ROWS, *u = y + (size_t)s->max_rows * TILE_ROWS;
    gnosis_q4_tile(w, chunk, s->xq, s->xsh, s->xs, s->xr, s->b, y);
    if (s->out_mode == OUT_SILU_GATE_UP) {  /* the up rows' tile sits rows / 16 tiles on */
        gnosis_q4_tile(w, chunk + rows / TILE_ROWS, s->xq, s->xsh, s->xs, s->xr, s->b, u);
        for (int t = 0; t < s->b; t++) silu_mul(y + (size_t)t * TILE_ROWS, u + (size_t)t * TILE_ROWS, TILE_ROWS);
    }
    const int add = s->out_mode == OUT_ADD;
    for (int t = 0; t < s->b; t++) {
        float *out = s->out + (size_t)t * rows + n0;
        const float *yt = y + (size_t)t * TILE_ROWS;
#if STEP_SIMD
        if (n == TILE_ROWS) { /* a whole tile: two vectors, the same additions lane by lane (a
                                 memcpy call or a scalar loop per 16 outputs was 5-7% of the
                                 products' regions on a 2,000-token prompt) */
            for (int i = 0; i < TILE_ROWS; i += 8) {
                const __m256 v = _mm256_loadu_ps(yt + i);
                _mm256_storeu_ps(out + i, add ? _mm256_add_ps(_mm256_loadu_ps(out + i), v) : v);
            }
            continue;
        }
#endif
        if (add)
            for (int i = 0; i < n; i++) out[i] += yt[i];
        else
            memcpy(out, yt, sizeof(float) * n);
    }
}

/* Token row `chunk` of the current matrix's input, for its products (first its RMS norm
   from the residual, where the matrix reads the norm's output). */
static void quantize_task(step_t *s, int chunk, int tid) {
    (void)tid;
    const int k = s->mat->cols, groups = k / G;
    float *x = (float *)s->in + (size_t)chunk * k;
    if (s->norm) rms_norm(s->h + (size_t)chunk * k, s->norm, x, k, s->eps);
    gnosis_q4_quantize_row(x, k, s->xq + (size_t)chunk * k, s->xsh + (size_t)chunk * groups, s->xs + (size_t)chunk * groups,
                           s->xr + chunk);
}

#define ROWS_ALONE 8 /* rows the calling thread takes alone (a parallel region costs more) */

#define ROW_CHUNKS 4 /* chunks of rows a thread claims in a per-row region, about */

/* Rows [chunk * row_span, +row_span) of the current per-row task. A row's work is a
   microsecond or two, so with a chunk a row the threads spent the region claiming chunks
   (the region's counters bouncing between the cores): a 64-row quantize took 27 us where
   its arithmetic takes 6 on one thread; in spans of 8 rows the quantize regions of a
   2,000-token prompt took half the time, the rotary ones 10% less. */
static void row_span_task(step_t *s, int chunk, int tid) {
    const int t0 = chunk * s->row_span, t1 = t0 + s->row_span < s->b ? t0 + s->row_span : s->b;
    for (int t = t0; t < t1; t++) s->row_fn(s, t, tid);
}

static void per_row(step_t *s, task_fn fn) {
    if (s->b < ROWS_ALONE) {
        for (int t = 0; t < s->b; t++) fn(s, t, 0);
        return;
    }
    const int chunks = ROW_CHUNKS * s->nt;
    s->row_fn = fn;
    s->row_span = (s->b + chunks - 1) / chunks;
    parallel(s, row_span_task, (s->b + s->row_span - 1) / s->row_span);
}

/* out (mode) = x @ w.T; with `norm`, x is first written as the RMS norm of the residual. */
static void matmul(step_t *s, const mat_t *w, const float *norm, float *x, out_mode_t mode, float *out) {
    s->mat = w;
    s->in = x;
    s->norm = norm;
    per_row(s, quantize_task);
    s->out_mode = mode;
    s->out = out;
    const int rows = mode == OUT_SILU_GATE_UP ? w->rows / 2 : w->rows;
    parallel(s, matmul_task, (rows + TILE_ROWS - 1) / TILE_ROWS);
}

static inline float dot(const float *a, const float *b, int n) {
#if STEP_SIMD
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        return hsum8(acc);
    }
#endif
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if STEP_SIMD
/* dot(q, k + u * stride, n) for u < 4, each summed exactly as dot() sums it (n % 8 == 0). */
static inline void dot4(const float *q, const float *k, int stride, int n, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float *k1 = k + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    for (int i = 0; i < n; i += 8) {
        __m256 qi = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k3 + i), a3);
    }
    out[0] = hsum8(a0); out[1] = hsum8(a1); out[2] = hsum8(a2); out[3] = hsum8(a3);
}
#endif

/* The K (or V) row PREFETCH_AHEAD positions after position p, fetched ahead: a decode
   token reads its whole context's K/V once, from memory (not the caches) on a long one,
   and the dot products' dependent multiply-adds leave the core too few loads in flight to
   hide that on their own. */
#define PREFETCH_AHEAD 6
static inline void prefetch_ahead(const float *base, const int32_t *table, int p, int ctx, int bs,
                                  int block_stride, int hd) {
#if STEP_SIMD
    int q = p + PREFETCH_AHEAD;
    if (q >= ctx) return;
    const char *row = (const char *)(base + (size_t)table[q / bs] * block_stride + (size_t)(q % bs) * hd);
    for (int off = 0; off < hd * (int)sizeof(float); off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
#else
    (void)base; (void)table; (void)p; (void)ctx; (void)bs; (void)block_stride; (void)hd;
#endif
}

#if STEP_SIMD
/* Where prefetch_ahead looks: a K/V head's rows, a sequence's table, from position p0. */
typedef struct {
    const float *base;
    const int32_t *table;
    int p0, ctx, bs, block_stride, hd;
} ahead_t;

/* a[0 .. 8 * nv) += sc[j] * (v + j * stride)[0 .. 8 * nv) for j < end, position by
   position, the sums held in nv registers (nv a constant: the loops unroll); with `pf`,
   each position's row PREFETCH_AHEAD on is fetched as it goes. */
static inline __attribute__((always_inline)) void weighted_v(float *a, const float *v, const float *sc,
                                                             int end, int stride, const int nv,
                                                             const ahead_t *pf) {
    __m256 r[8];
    for (int u = 0; u < nv; u++) r[u] = _mm256_loadu_ps(a + 8 * u);
    for (int j = 0; j < end; j++, v += stride) {
        if (pf) prefetch_ahead(pf->base, pf->table, pf->p0 + j, pf->ctx, pf->bs, pf->block_stride, pf->hd);
        __m256 w8 = _mm256_set1_ps(sc[j]);
        for (int u = 0; u < nv; u++) r[u] = _mm256_fmadd_ps(w8, _mm256_loadu_ps(v + 8 * u), r[u]);
    }
    for (int u = 0; u < nv; u++) _mm256_storeu_ps(a + 8 * u, r[u]);
}
#endif

/* Attention of a group of token rows (one row, or a prompt's consecutive positions, which
   read the same K/V) for the query heads that share one K/V head (GQA), each row over its
   positions 0..pos. Each K and V vector is read from the pool once for all of them (a job
   per row and query head read it once each: on the default model at 2,024 positions,
   3 x 93 MB a decode token, and 8 rows of a prompt 8 times over). Each (row, head)'s
   arithmetic is the same whatever its group: its dot products, softmax and weighted sum
   of V in position order, so a row's output does not depend on the rows beside it. */
static void attention_task(step_t *s, int job, int tid) {
    const int hd = s->head_dim, kvh = s->kv_heads, rep = s->heads / kvh, bs = s->block_size;
    /* a K/V head's rows in a block: hd apart, from kv * bs * hd; blocks kvh * bs * hd apart */
    const int qkv_n = (s->heads + 2 * kvh) * hd, stride = hd, blk_stride = kvh * bs * hd, mp = s->max_pos;
    const int grp = job / kvh, kv = job % kvh, t0 = s->group_start[grp], g = s->group_len[grp];
    if (s->vector_attention) {
        const size_t kv_size = s->attention_bf16 ? 2 : 4; /* a pool value's bytes */
        const int npad = s->pairs < 16 ? 16 : (s->pairs + 15) / 16 * 16;
        const gnosis_attention_job_t j = {
            .q = s->qkv + (size_t)t0 * qkv_n + (size_t)kv * rep * hd,
            .k = (const char *)s->cur->kv.k + (size_t)kv * bs * hd * kv_size,
            .v = (const char *)s->cur->kv.v + (size_t)kv * bs * hd * kv_size, .table = s->tables + (size_t)t0 * s->table_width,
            .out = s->att + (size_t)t0 * s->heads * hd + (size_t)kv * rep * hd, .q_row = qkv_n,
            .out_row = s->heads * hd, .stride = stride, .block_stride = blk_stride, .block_size = bs, .head_dim = hd, .rows = g,
            .rep = rep, .first = (int)s->pos[t0], .scaling = s->scaling, .bf16 = s->attention_bf16};
        const gnosis_attention_scratch_t scratch = {
            .scores = s->scores + (size_t)tid * npad * (mp + 32), .qt = s->qt + (size_t)tid * hd * (npad < 32 ? 32 : npad),
            .part = s->part + (size_t)tid * 16 * npad, .acc = s->acc + (size_t)tid * hd * npad,
            .pairs = s->pairs, .max_pos = mp};
        gnosis_attention(&j, &scratch);
        return;
    }
    const int n = g * rep; /* (row i, head r) pairs, i * rep + r */
    float *scores = s->scores + (size_t)tid * s->pairs * mp; /* [n][max_pos] */
    float *acc = s->acc + (size_t)tid * s->pairs * hd;      /* [n][hd] */
    const int32_t *table = s->tables + (size_t)t0 * s->table_width;
    const int first = (int)s->pos[t0], ctx = first + g; /* row i sees positions 0..first + i */
    const float *kbase = (const float *)s->cur->kv.k + (size_t)kv * bs * hd;
    const float *vbase = (const float *)s->cur->kv.v + (size_t)kv * bs * hd;
    float best[n], total[n];
    for (int x = 0; x < n; x++) best[x] = -INFINITY;
    for (int p0 = 0, blk = 0; p0 < ctx; p0 += bs, blk++) {
        const float *k = kbase + (size_t)table[blk] * blk_stride;
        int end = ctx - p0 < bs ? ctx - p0 : bs, j = 0;
#if STEP_SIMD
        /* four positions at a time where every row of the group sees all four: four dot
           products in flight, each summed as dot() sums it */
        if (hd % 8 == 0)
            for (; j + 4 <= end && p0 + j + 3 <= first; j += 4) {
                for (int u = 0; u < 4; u++) prefetch_ahead(kbase, table, p0 + j + u, ctx, bs, blk_stride, hd);
                const float *k0 = k + (size_t)j * stride;
                for (int x = 0; x < n; x++) {
                    const float *q = s->qkv + (size_t)(t0 + x / rep) * qkv_n + (size_t)(kv * rep + x % rep) * hd;
                    float v[4];
                    dot4(q, k0, stride, hd, v);
                    float *sc = scores + (size_t)x * mp + p0 + j;
                    for (int u = 0; u < 4; u++) {
                        sc[u] = v[u] * s->scaling;
                        best[x] = sc[u] > best[x] ? sc[u] : best[x];
                    }
                }
            }
#endif
        for (k += (size_t)j * stride; j < end; j++, k += stride) {
            prefetch_ahead(kbase, table, p0 + j, ctx, bs, blk_stride, hd);
            for (int i = p0 + j > first ? p0 + j - first : 0; i < g; i++) {
                const float *q = s->qkv + (size_t)(t0 + i) * qkv_n + (size_t)kv * rep * hd;
                for (int r = 0; r < rep; r++) {
                    float v = dot(q + (size_t)r * hd, k, hd) * s->scaling;
                    int x = i * rep + r;
                    scores[(size_t)x * mp + p0 + j] = v;
                    best[x] = v > best[x] ? v : best[x];
                }
            }
        }
    }
    for (int x = 0; x < n; x++) {
        float *sc = scores + (size_t)x * mp;
        const int len = first + x / rep + 1;
        total[x] = 0.0f;
        int p = 0;
#if STEP_SIMD
        __m256 tot = _mm256_setzero_ps();
        for (; p + 8 <= len; p += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + p), _mm256_set1_ps(best[x])));
            _mm256_storeu_ps(sc + p, e);
            tot = _mm256_add_ps(tot, e);
        }
        total[x] = hsum8(tot);
#endif
        for (; p < len; p++) { sc[p] = expf(sc[p] - best[x]); total[x] += sc[p]; }
    }
    memset(acc, 0, sizeof(float) * n * hd);
    for (int p0 = 0, blk = 0; p0 < ctx; p0 += bs, blk++) {
        const float *v = vbase + (size_t)table[blk] * blk_stride;
        for (int x = 0; x < n; x++) {
            const int len = first + x / rep + 1;
            const int end = len - p0 < bs ? len - p0 : bs;
            if (end <= 0) continue;
            const float *sc = scores + (size_t)x * mp + p0;
            float *a = acc + (size_t)x * hd;
            int i = 0;
#if STEP_SIMD
            /* 64 lanes at a time, then 32, then 8: eight multiply-add chains in flight; the
               first pass over a block fetches the rows ahead */
            const ahead_t pf = {vbase, table, p0, ctx, bs, blk_stride, hd}, *first_pf = x == 0 ? &pf : NULL;
            for (; i + 64 <= hd; i += 64) weighted_v(a + i, v + i, sc, end, stride, 8, i == 0 ? first_pf : NULL);
            for (; i + 32 <= hd; i += 32) weighted_v(a + i, v + i, sc, end, stride, 4, i == 0 ? first_pf : NULL);
            for (; i + 8 <= hd; i += 8) weighted_v(a + i, v + i, sc, end, stride, 1, NULL);
#endif
            for (; i < hd; i++) {
                const float *vj = v + i;
                for (int j = 0; j < end; j++, vj += stride) a[i] += sc[j] * *vj;
            }
        }
    }
    for (int x = 0; x < n; x++) {
        float *o = s->att + (size_t)(t0 + x / rep) * s->heads * hd + (size_t)(kv * rep + x % rep) * hd;
        float inv = 1.0f / total[x];
        for (int i = 0; i < hd; i++) o[i] = acc[(size_t)x * hd + i] * inv;
    }
}

/* Rows that can share attention jobs: consecutive rows at consecutive positions whose
   block tables agree on every block the later row reads (a prompt's rows, in order): few
   enough a group that each thread has about two jobs in this call, and at most group_max
   (the scratch holds a group's scores). A row's bits do not depend on its group. */
static int group_rows(step_t *s, int b) {
    const int jobs_per_group = (2 * s->nt + s->kv_heads - 1) / s->kv_heads;
    int most = (b + jobs_per_group - 1) / jobs_per_group, ng = 0;
    most = most < 1 ? 1 : most > s->group_max ? s->group_max : most;
    for (int t = 0; t < b; t++) {
        if (ng > 0) {
            int t0 = s->group_start[ng - 1], g = s->group_len[ng - 1];
            if (t == t0 + g && g < most && s->pos[t] == s->pos[t0] + g &&
                memcmp(s->tables + (size_t)t * s->table_width, s->tables + (size_t)t0 * s->table_width,
                       sizeof(int32_t) * (size_t)(s->pos[t] / s->block_size + 1)) == 0) {
                s->group_len[ng - 1]++;
                continue;
            }
        }
        s->group_start[ng] = t;
        s->group_len[ng] = 1;
        ng++;
    }
    return ng;
}

/* Rotary embedding in place on `heads` vectors of head_dim at x (rotate-half form). */
static void rotate(float *x, int heads, int hd, const float *cos, const float *sin) {
    int half = hd / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + h * hd;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* Row `chunk`'s rotary embedding on its query and key heads, its K and V into the pool. */
static void rotary_task(step_t *s, int chunk, int tid) {
    (void)tid;
    const int hd = s->head_dim, kvh = s->kv_heads, qkv_n = (s->heads + 2 * kvh) * hd;
    float *q = s->qkv + (size_t)chunk * qkv_n, *k = q + s->heads * hd, *v = k + kvh * hd;
    const float *c = s->cos + (size_t)s->pos[chunk] * hd, *sn = s->sin + (size_t)s->pos[chunk] * hd;
    rotate(q, s->heads, hd, c, sn);
    rotate(k, kvh, hd, c, sn);
    const int bs = s->block_size;
    for (int h = 0; h < kvh; h++) { /* head h's row of the slot's block */
        const size_t at = (((size_t)(s->slots[chunk] / bs) * kvh + h) * bs + s->slots[chunk] % bs) * hd;
        if (s->attention_bf16) { /* the values the attention rounds them to, in half the bytes */
            gnosis_attention_store_bf16(k + h * hd, hd, (uint16_t *)s->cur->kv.k + at);
            gnosis_attention_store_bf16(v + h * hd, hd, (uint16_t *)s->cur->kv.v + at);
        } else {
            memcpy((float *)s->cur->kv.k + at, k + h * hd, sizeof(float) * hd);
            memcpy((float *)s->cur->kv.v + at, v + h * hd, sizeof(float) * hd);
        }
    }
}

/* -- the vocabulary head over Q8_0 blocks (cpu_kernels.c) on the step's threads */

#define HEAD_ROWS_PER_CHUNK 512

static void head_task(step_t *s, int chunk, int tid) {
    (void)tid;
    int n0 = chunk * HEAD_ROWS_PER_CHUNK;
    int n1 = n0 + HEAD_ROWS_PER_CHUNK < s->head.out_features ? n0 + HEAD_ROWS_PER_CHUNK : s->head.out_features;
    gnosis_q8_columns(&s->head, n0, n1);
}

gnosis_status_t gnosis_step_head(gnosis_step_t *s, const gnosis_q8_product_t *product) {
    const int n = product->out_features;
    if (product->rows < 1 || n < 1 || product->in_features < 1 || product->in_features % G)
        return GNOSIS_BAD_ARGUMENT;
    s->head = *product;
    parallel(s, head_task, (n + HEAD_ROWS_PER_CHUNK - 1) / HEAD_ROWS_PER_CHUNK);
    return GNOSIS_OK;
}

/* -- the interface (cpu_abi.h; called from cpu_step.py) */

/* A shape the step computes: widths its scratch and stack arrays hold, whole groups, GQA. */
static int takes_shape(const gnosis_model_shape_t *m, int max_rows) {
    const long att_n = (long)m->heads * m->head_dim;
    return m->layers >= 1 && m->hidden >= G && m->hidden % G == 0 && m->hidden <= GNOSIS_STEP_MAX_WIDTH &&
           m->intermediate >= G && m->intermediate % G == 0 && m->intermediate <= GNOSIS_STEP_MAX_WIDTH &&
           att_n % G == 0 && att_n <= GNOSIS_STEP_MAX_WIDTH && m->head_dim >= 2 && m->head_dim % 2 == 0 &&
           m->head_dim <= MAX_HEAD_DIM && m->kv_heads >= 1 && m->heads % m->kv_heads == 0 && m->vocab >= 1 &&
           max_rows >= 1 && max_rows <= MAX_ROWS;
}

/* Each matrix has the rows and columns the shape gives it. */
static int takes_layer(const gnosis_layer_weights_t *w, const gnosis_model_shape_t *m) {
    const int qkv_n = (m->heads + 2 * m->kv_heads) * m->head_dim, att_n = m->heads * m->head_dim;
    return w->qkv.rows == qkv_n && w->qkv.cols == m->hidden && w->o.rows == m->hidden && w->o.cols == att_n &&
           w->gate_up.rows == 2 * m->intermediate && w->gate_up.cols == m->hidden &&
           w->down.rows == m->hidden && w->down.cols == m->intermediate;
}

/* n bytes on whole cache lines: a row's outputs that two threads write (tiles of 16 floats,
   64 bytes) then never share a line, where malloc's 16-byte alignment split each across two. */
static void *lines(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

/* The step and what it allocated (free(NULL) is nothing). */
static void free_buffers(step_t *s) {
    free(s->layer); free(s->h); free(s->x); free(s->qkv); free(s->att); free(s->act);
    free(s->scores); free(s->acc); free(s->qt); free(s->part); free(s->xq); free(s->xsh); free(s->xs); free(s->xr);
    free(s->tile_out);
    free(s);
}

gnosis_status_t gnosis_step_create(const gnosis_step_config_t *config, gnosis_step_t **out) {
    const gnosis_model_shape_t *m = &config->shape;
    *out = NULL;
    if (!takes_shape(m, config->max_rows) || config->rotary.max_positions < 1 || config->kv.num_blocks < 1 ||
        config->kv.block_size < 1 || (config->attention_bf16 && gnosis_attention_takes(m->head_dim) != 2))
        return GNOSIS_BAD_ARGUMENT;
    for (int l = 0; l < m->layers; l++)
        if (!takes_layer(&config->weights.layers[l], m)) return GNOSIS_BAD_ARGUMENT;
    step_t *s = calloc(1, sizeof(step_t));
    if (!s) return GNOSIS_NO_MEMORY;
    s->layers = m->layers; s->hidden = m->hidden; s->heads = m->heads; s->kv_heads = m->kv_heads;
    s->head_dim = m->head_dim; s->inter = m->intermediate; s->vocab = m->vocab;
    s->eps = m->rms_eps; s->scaling = m->attention_scale;
    s->block_size = config->kv.block_size; s->num_blocks = config->kv.num_blocks;
    s->max_pos = config->rotary.max_positions; s->max_rows = config->max_rows;
    int nt = config->threads < 1 ? 1 : config->threads > MAX_THREADS ? MAX_THREADS : config->threads;
    s->embed = config->weights.embed; s->final_norm = config->weights.final_norm;
    s->cos = config->rotary.cos; s->sin = config->rotary.sin;
    s->layer = calloc(s->layers, sizeof(layer_t));
    if (s->layer)
        for (int l = 0; l < s->layers; l++) {
            s->layer[l].w = config->weights.layers[l];
            s->layer[l].kv = config->kv.layers[l];
        }
    int hd = s->head_dim, qkv_n = (s->heads + 2 * s->kv_heads) * hd, att_n = s->heads * hd;
    int B = s->max_rows, widest = s->inter > qkv_n ? s->inter : qkv_n;
    widest = widest > att_n ? widest : att_n;
    widest = widest > s->hidden ? widest : s->hidden;
    s->h = lines(sizeof(float) * B * s->hidden);
    s->x = lines(sizeof(float) * B * widest);
    s->qkv = lines(sizeof(float) * B * qkv_n);
    s->att = lines(sizeof(float) * B * att_n);
    s->act = lines(sizeof(float) * B * s->inter);
    /* A group of a prompt's rows reads each K/V row once for all of them; few enough rows
       a group that each thread has about two jobs of attention. */
    int rep = s->heads / s->kv_heads, jobs_per_group = (2 * nt + s->kv_heads - 1) / s->kv_heads;
    s->vector_attention = gnosis_attention_takes(hd) > 0;
    s->attention_bf16 = config->attention_bf16 != 0;
    s->group_max = B / jobs_per_group;
    if (s->vector_attention) {
        if (s->group_max < 1) s->group_max = 1;
        s->pairs = s->group_max * rep;
        const size_t npad = s->pairs < 16 ? 16 : (size_t)(s->pairs + 15) / 16 * 16;
        s->scores = lines(sizeof(float) * nt * npad * (s->max_pos + 32));
        s->qt = lines(sizeof(float) * nt * hd * (npad < 32 ? 32 : npad));
        s->part = lines(sizeof(float) * nt * 16 * npad);
        s->acc = lines(sizeof(float) * nt * hd * npad);
    } else { /* up to 32 (row, head) pairs a group (one row where a K/V head serves more) */
        s->pairs = rep > 32 ? rep : B * rep < 32 ? B * rep : 32;
        if (s->group_max > s->pairs / rep) s->group_max = s->pairs / rep;
        if (s->group_max < 1) s->group_max = 1;
        s->scores = lines(sizeof(float) * (size_t)nt * s->pairs * s->max_pos);
        s->acc = lines(sizeof(float) * (size_t)nt * s->pairs * hd);
        s->qt = lines(sizeof(float));
        s->part = lines(sizeof(float));
    }
    s->xq = lines(sizeof(int16_t) * B * widest);
    s->xsh = lines(sizeof(int32_t) * B * (widest / G + 1));
    s->xs = lines(sizeof(float) * B * (widest / G + 1));
    s->xr = lines(sizeof(float) * B);
    s->tile_out = lines(sizeof(float) * nt * 2 * B * TILE_ROWS);
    if (!s->layer || !s->h || !s->x || !s->qkv || !s->att || !s->act || !s->scores || !s->acc || !s->qt ||
        !s->part || !s->xq || !s->xsh || !s->xs || !s->xr || !s->tile_out) {
        free_buffers(s);
        return GNOSIS_NO_MEMORY;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->nt = 1;
    for (int i = 1; i < nt; i++) {
        s->args[i].s = s;
        s->args[i].id = i;
        if (pthread_create(&s->tid[i], NULL, worker, &s->args[i]) != 0) break;
        s->nt = i + 1;
    }
    *out = s;
    return GNOSIS_OK;
}

void gnosis_step_free(gnosis_step_t *s) {
    if (!s) return;
    atomic_store(&s->stop, 1);
    atomic_fetch_add(&s->gen, 1);
    pthread_mutex_lock(&s->mu);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    for (int i = 1; i < s->nt; i++) pthread_join(s->tid[i], NULL);
    free_buffers(s);
}

int32_t gnosis_step_threads(const gnosis_step_t *s) { return s->nt; }

/* Every row's token, position, slot and the blocks its table names within range. */
static int takes_rows(const step_t *s, const gnosis_step_rows_t *r) {
    if (r->rows < 1 || r->rows > s->max_rows || r->table_width < 1) return 0;
    for (int t = 0; t < r->rows; t++) {
        const int64_t pos = r->positions[t];
        if (r->tokens[t] < 0 || r->tokens[t] >= s->vocab || r->slots[t] < 0 ||
            r->slots[t] >= (int64_t)s->num_blocks * s->block_size || pos < 0 || pos >= s->max_pos ||
            (int64_t)r->table_width * s->block_size <= pos)
            return 0;
        const int32_t *table = r->block_tables + (size_t)t * r->table_width;
        for (int i = 0; i <= pos / s->block_size; i++)
            if (table[i] < 0 || table[i] >= s->num_blocks) return 0;
    }
    return 1;
}

gnosis_status_t gnosis_step_run(gnosis_step_t *s, const gnosis_step_rows_t *rows) {
    if (!takes_rows(s, rows)) return GNOSIS_BAD_ARGUMENT;
    const int b = rows->rows, H = s->hidden, kvh = s->kv_heads;
    const int64_t *tokens = rows->tokens;
    float *out = rows->hidden_out;
    s->b = b; s->pos = rows->positions; s->slots = rows->slots;
    s->tables = rows->block_tables; s->table_width = rows->table_width;
    const int groups = group_rows(s, b);
    for (int t = 0; t < b; t++) memcpy(s->h + (size_t)t * H, s->embed + (size_t)tokens[t] * H, sizeof(float) * H);
    for (int l = 0; l < s->layers; l++) {
        layer_t *L = &s->layer[l];
        s->cur = L;
        matmul(s, &L->w.qkv, L->w.input_norm, s->x, OUT_STORE, s->qkv);
        per_row(s, rotary_task);
        parallel(s, attention_task, groups * kvh);
        matmul(s, &L->w.o, NULL, s->att, OUT_ADD, s->h);
        matmul(s, &L->w.gate_up, L->w.post_attention_norm, s->x, OUT_SILU_GATE_UP, s->act);
        matmul(s, &L->w.down, NULL, s->act, OUT_ADD, s->h);
    }
    for (int t = 0; t < b; t++) rms_norm(s->h + (size_t)t * H, s->final_norm, out + (size_t)t * H, H, s->eps);
    return GNOSIS_OK;
}
