/* The attention of a group of token rows for one K/V head, on AVX-512 (cpu_step.c calls it
   on its threads; cpu_parts.h declares the job and the scratch).

   A group is one row (a decode token) or a prompt's consecutive rows, which read the same
   K/V: each K and V row is read from the pool once for all of the group's (row, query
   head) pairs. The arithmetic of one pair over its positions 0..len-1, whatever else is in
   the job:
     - score_p = (q[0] k_p[0] + ... + q[hd-1] k_p[hd-1], one multiply-add at a time in
       that order, from 0) * scaling;
     - best = the largest score; e_p = exp16(score_p - best);
     - total = 16 partial sums (sum l takes e_p for p = l mod 16, in order, from 0), then
       (l + l+8), (l + l+4), (l + l+2), (0 + 1), as sum16 adds them;
     - out[d] = (e_0 v_0[d] + ... , one multiply-add at a time in position order, from 0)
       * (1 / total).
   Two layouts compute it, chosen by the number of pairs: with few (a decode row's heads)
   positions go in the 16 lanes, K rows transposed 16 x 16 into scratch; with many (a
   prompt's rows) pairs go in the lanes, the queries transposed once and each K value
   broadcast. Both do the same operations on the same values, so a row gets the same bits
   alone as in a prompt's group, and its K/V are read at the vector units' rate instead of
   one dot product (and one horizontal sum) at a time.

   That is the float32 arithmetic (the job's bf16 0). An AVX512_BF16 build also has a
   second one (bf16 1, the step's attention_bf16; the "bfloat16 dot products" part below
   states it): the same two layouts with the two dot products on bfloat16 pairs, twice
   the float32 multiply-add's rate. A step uses one of the two for every row, decode and
   prompt alike. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_parts.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define MANY_PAIRS 16 /* pairs from which the pairs take the lanes */
#define SPAN 32       /* positions a K transpose covers (two vectors) */
#define PAIR_BLOCK 6  /* pairs whose output sums are held in registers at once */

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
#define ATT_BF16 1 /* the products in bfloat16 pairs (below); else in float32 */
#endif

int32_t gnosis_attention_takes(int32_t head_dim) {
#if defined(ATT_BF16)
    return head_dim % 16 == 0 ? 2 : 0;
#else
    return head_dim % 16 == 0;
#endif
}

/* Position p's K or V row in a float32 pool. */
static inline const float *row_at(const gnosis_attention_job_t *j, const void *base, int p) {
    return (const float *)base + (size_t)j->table[p / j->block_size] * j->block_stride +
           (size_t)(p % j->block_size) * j->stride;
}

/* e^x for 16 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-6
   polynomial), the step's exp8 on 16 lanes. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n); /* y * 2^n: n >= -126 here, the bits of the product by 2^n */
}

/* The 16 lanes' sum as the header says: (l + l+8), then (l + l+4), (l + l+2), (0 + 1). */
static inline float sum16(__m512 a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

/* 16 rows of 16 floats (src[i]) into 16 columns: dst[j * ld + i] = src[i][j]. */
static inline void transpose16(const float *const src[16], float *dst, int ld) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src[i]);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        _mm512_storeu_ps(dst + (size_t)i * ld, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
        _mm512_storeu_ps(dst + (size_t)(i + 8) * ld, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
    }
}

static inline const float *query(const gnosis_attention_job_t *j, int x) {
    return j->q + (size_t)(x / j->rep) * j->q_row + (size_t)(x % j->rep) * j->head_dim;
}

/* Few pairs: scores[x][p] (rows max_pos + 32 apart), positions in the lanes. */
static void scores_by_position(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s,
                               int n, int ctx) {
    const int hd = j->head_dim, ss = s->max_pos + SPAN;
    float *kt = s->qt; /* [hd][SPAN] */
    const __m512 scale = _mm512_set1_ps(j->scaling);
    for (int p0 = 0; p0 < ctx; p0 += SPAN) {
        for (int h = 0; h < SPAN / 16; h++) {
            const float *rows[16];
            for (int i = 0; i < 16; i++) {
                const int p = p0 + 16 * h + i;
                rows[i] = row_at(j, j->k, p < ctx ? p : ctx - 1);
                if (p + SPAN < ctx) /* the next span's row, on its way while this one computes */
                    for (int off = 0; off < hd; off += 16)
                        _mm_prefetch((const char *)(row_at(j, j->k, p + SPAN) + off),
                                     _MM_HINT_T0);
            }
            for (int d0 = 0; d0 < hd; d0 += 16) {
                const float *src[16];
                for (int i = 0; i < 16; i++) src[i] = rows[i] + d0;
                transpose16(src, kt + (size_t)d0 * SPAN + 16 * h, SPAN);
            }
        }
        for (int x0 = 0; x0 < n; x0 += 4) {
            const float *q[4];
            for (int u = 0; u < 4; u++) q[u] = query(j, x0 + u < n ? x0 + u : x0);
            __m512 a[4][2];
            for (int u = 0; u < 4; u++) a[u][0] = a[u][1] = _mm512_setzero_ps();
            for (int d = 0; d < hd; d++) {
                const __m512 k0 = _mm512_loadu_ps(kt + (size_t)d * SPAN), k1 = _mm512_loadu_ps(kt + (size_t)d * SPAN + 16);
                for (int u = 0; u < 4; u++) {
                    const __m512 qd = _mm512_set1_ps(q[u][d]);
                    a[u][0] = _mm512_fmadd_ps(qd, k0, a[u][0]);
                    a[u][1] = _mm512_fmadd_ps(qd, k1, a[u][1]);
                }
            }
            for (int u = 0; u < 4 && x0 + u < n; u++) {
                _mm512_storeu_ps(s->scores + (size_t)(x0 + u) * ss + p0, _mm512_mul_ps(a[u][0], scale));
                _mm512_storeu_ps(s->scores + (size_t)(x0 + u) * ss + p0 + 16, _mm512_mul_ps(a[u][1], scale));
            }
        }
    }
}

/* Few pairs: each pair's scores into e_p in place; -> 1 / total in inv[x]. */
static void softmax_by_position(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s,
                                int n, float *inv) {
    const int ss = s->max_pos + SPAN;
    for (int x = 0; x < n; x++) {
        float *sc = s->scores + (size_t)x * ss;
        const int len = j->first + x / j->rep + 1;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int p = 0; p < len; p += 16) {
            const __mmask16 valid = len - p >= 16 ? 0xffff : (__mmask16)((1u << (len - p)) - 1);
            m = _mm512_mask_max_ps(m, valid, m, _mm512_maskz_loadu_ps(valid, sc + p));
        }
        const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 total = _mm512_setzero_ps();
        for (int p = 0; p < len; p += 16) {
            const __mmask16 valid = len - p >= 16 ? 0xffff : (__mmask16)((1u << (len - p)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sc + p), best));
            _mm512_mask_storeu_ps(sc + p, valid, e);
            total = _mm512_mask_add_ps(total, valid, total, e);
        }
        inv[x] = 1.0f / sum16(total);
    }
}

/* Few pairs, a block of PAIR_BLOCK from x0: each pair's positions (0 past n) in len; -> the longest. */
static inline int block_lengths(const gnosis_attention_job_t *j, int x0, int n, int *len) {
    int longest = 0;
    for (int u = 0; u < PAIR_BLOCK; u++) {
        len[u] = x0 + u < n ? j->first + (x0 + u) / j->rep + 1 : 0;
        longest = len[u] > longest ? len[u] : longest;
    }
    return longest;
}

/* Few pairs: the block's output sums r (head dims d0 .. d0 + 16 nd) times each pair's inv. */
static inline void store_block(const gnosis_attention_job_t *j, int x0, int n, int d0, int nd,
                               __m512 r[PAIR_BLOCK][4], const float *inv) {
    for (int u = 0; u < PAIR_BLOCK && x0 + u < n; u++) {
        const int x = x0 + u;
        float *o = j->out + (size_t)(x / j->rep) * j->out_row + (size_t)(x % j->rep) * j->head_dim + d0;
        const __m512 scale = _mm512_set1_ps(inv[x]);
        for (int i = 0; i < nd; i++) _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(r[u][i], scale));
    }
}

static inline __mmask16 pairs_seeing(__m512i len, int p) {
    return _mm512_cmpgt_epi32_mask(len, _mm512_set1_epi32(p));
}

/* How many vectors of 16 pairs a block of the score and weighing passes holds: three
   where three or more are left (but two and two of four), else what is left. The sums of a
   block sit in registers: QK_POS(nv) positions x nv vectors of scores, WEIGH_DIMS(nv) head
   dims x nv vectors of output, about 16 to 24 of the 32 registers, so that every load of a
   query vector, a K value, an e vector or a V value feeds as many multiply-adds as a
   register file allows whatever the group's size (a 10-row group of a short turn has two
   vectors; a 32-row group of a long prompt six). Blocks only reorder which sums are
   computed together: each (pair, position) or (pair, dim) sum is the same sequence of
   operations in any block. */
#define MAX_VEC 3
static inline int vectors_in_block(int left) { return left == 4 ? 2 : left < MAX_VEC ? left : MAX_VEC; }
#define QK_POS(nv) ((nv) == 1 ? 16 : (nv) == 2 ? 12 : 8)
#define QK_POS_MAX 16
#define WEIGH_DIMS(nv) ((nv) == 1 ? 16 : 8)
#define WEIGH_DIMS_MAX 16

/* A score block's sums a[u][v] (positions p + u, pair vectors v0 + v) times scaling into
   scores[p][x], and into each pair vector's largest m[v] where its pairs see the position:
   without masks before see_all, which every pair of the job sees (the masks were 6% of a
   long prompt's attention). */
static inline __attribute__((always_inline)) void store_scores(
        const gnosis_attention_scratch_t *s, int npad, int ctx, int see_all, int p, int np, int v0,
        const int nv, __m512 a[QK_POS_MAX][MAX_VEC], __m512 scale, const __m512i *len, __m512 *m) {
    const int every = p + np <= see_all; /* the same for the whole block: the loop splits on it */
    for (int u = 0; u < np && p + u < ctx; u++)
        for (int v = 0; v < nv; v++) {
            const __m512 sc = _mm512_mul_ps(a[u][v], scale);
            _mm512_storeu_ps(s->scores + (size_t)(p + u) * npad + (v0 + v) * 16, sc);
            m[v] = every ? _mm512_max_ps(m[v], sc)
                         : _mm512_mask_max_ps(m[v], pairs_seeing(len[v0 + v], p + u), m[v], sc);
        }
}

/* Scores of pair vectors v0..v0 + nv (a constant: the loops unroll, the sums stay in
   registers), QK_POS(nv) positions at a time, and their largest. */
static inline __attribute__((always_inline)) void score_block(
        const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s, int npad, int ctx, int v0,
        const int nv, const __m512i *len, float *best) {
    const int hd = j->head_dim, np = QK_POS(nv);
    const __m512 scale = _mm512_set1_ps(j->scaling);
    __m512 m[MAX_VEC];
    for (int v = 0; v < nv; v++) m[v] = _mm512_set1_ps(-INFINITY);
    for (int p = 0; p < ctx; p += np) {
        const float *k[QK_POS_MAX];
        for (int u = 0; u < np; u++)
            k[u] = row_at(j, j->k, p + u < ctx ? p + u : ctx - 1);
        __m512 a[QK_POS_MAX][MAX_VEC];
        for (int u = 0; u < np; u++)
            for (int v = 0; v < nv; v++) a[u][v] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d++) {
            __m512 qv[MAX_VEC];
            for (int v = 0; v < nv; v++) qv[v] = _mm512_loadu_ps(s->qt + (size_t)d * npad + (v0 + v) * 16);
            for (int u = 0; u < np; u++) {
                const __m512 kd = _mm512_set1_ps(k[u][d]);
                for (int v = 0; v < nv; v++) a[u][v] = _mm512_fmadd_ps(qv[v], kd, a[u][v]);
            }
        }
        store_scores(s, npad, ctx, j->first + 1, p, np, v0, nv, a, scale, len, m);
    }
    for (int v = 0; v < nv; v++) _mm512_storeu_ps(best + (v0 + v) * 16, m[v]);
}

/* Many pairs: queries transposed (qt[d][x]), scores[p][x] (rows npad apart), and each
   pair's largest score in best[x]. */
static void scores_by_pair(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s,
                           int n, int npad, int ctx, const __m512i *len, float *best) {
    const int hd = j->head_dim;
    for (int x = 0; x < npad; x++) {
        const float *q = query(j, x < n ? x : 0);
        for (int d = 0; d < hd; d++) s->qt[(size_t)d * npad + x] = x < n ? q[d] : 0.0f;
    }
    for (int v0 = 0, nv; v0 < npad / 16; v0 += nv) {
        nv = vectors_in_block(npad / 16 - v0);
        switch (nv) {
        case 1: score_block(j, s, npad, ctx, v0, 1, len, best); break;
        case 2: score_block(j, s, npad, ctx, v0, 2, len, best); break;
        default: score_block(j, s, npad, ctx, v0, 3, len, best); break;
        }
    }
}

#define P_TILE 64 /* positions whose e_p are computed, then weighed, while in L1 */

/* Many pairs, a tile of positions [p0, p1): e_p into place (zero where a pair does not see
   p), each added to its pair's partial sum p mod 16; before see_all, which every pair sees,
   without masks. */
static inline __attribute__((always_inline)) void exp_tile(
        const gnosis_attention_scratch_t *s, int npad, int see_all, int p0, int p1, const __m512i *len,
        const float *best) {
    for (int v = 0; v < npad / 16; v++) {
        const __m512 b = _mm512_loadu_ps(best + 16 * v);
        int p = p0;
        for (; p < p1 && p < see_all; p++) {
            float *sc = s->scores + (size_t)p * npad + 16 * v, *pl = s->part + 16 * (16 * v + p % 16);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc), b));
            _mm512_storeu_ps(sc, e);
            _mm512_storeu_ps(pl, _mm512_add_ps(_mm512_loadu_ps(pl), e));
        }
        for (; p < p1; p++) {
            const __mmask16 valid = pairs_seeing(len[v], p);
            float *sc = s->scores + (size_t)p * npad + 16 * v, *pl = s->part + 16 * (16 * v + p % 16);
            const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc), b)));
            _mm512_storeu_ps(sc, e);
            _mm512_storeu_ps(pl, _mm512_mask_add_ps(_mm512_loadu_ps(pl), valid, _mm512_loadu_ps(pl), e));
        }
    }
}

/* acc[d][v0 + v] for d in [d0, d0 + WEIGH_DIMS(nv)), v < nv (a constant: the loops
   unroll, the sums stay in registers), over the tile's positions: those every pair sees,
   then the rest, masked. */
static inline __attribute__((always_inline)) void weigh_block(
        const float *const *vrow, const float *e, int npad, int p0, int p1, int all_see, int d0,
        int v0, const int nv, const __m512i *len, float *acc) {
    const int nd = WEIGH_DIMS(nv);
    __m512 r[WEIGH_DIMS_MAX][MAX_VEC];
    for (int dd = 0; dd < nd; dd++)
        for (int v = 0; v < nv; v++) r[dd][v] = _mm512_loadu_ps(acc + (size_t)(d0 + dd) * npad + (v0 + v) * 16);
    int p = p0;
    for (; p < all_see; p++) {
        const float *vp = vrow[p - p0] + d0, *ep = e + (size_t)p * npad + v0 * 16;
        __m512 ev[MAX_VEC];
        for (int v = 0; v < nv; v++) ev[v] = _mm512_loadu_ps(ep + 16 * v);
        for (int dd = 0; dd < nd; dd++) {
            const __m512 w = _mm512_set1_ps(vp[dd]);
            for (int v = 0; v < nv; v++) r[dd][v] = _mm512_fmadd_ps(ev[v], w, r[dd][v]);
        }
    }
    for (; p < p1; p++) {
        const float *vp = vrow[p - p0] + d0, *ep = e + (size_t)p * npad + v0 * 16;
        for (int v = 0; v < nv; v++) {
            const __mmask16 valid = pairs_seeing(len[v0 + v], p);
            const __m512 ev = _mm512_loadu_ps(ep + 16 * v);
            for (int dd = 0; dd < nd; dd++)
                r[dd][v] = _mm512_mask3_fmadd_ps(ev, _mm512_set1_ps(vp[dd]), r[dd][v], valid);
        }
    }
    for (int dd = 0; dd < nd; dd++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(acc + (size_t)(d0 + dd) * npad + (v0 + v) * 16, r[dd][v]);
}

/* Many pairs, a tile of positions [p0, p1): e_p into place (zero where a pair does not
   see p), added to the partial sums, and acc[d][x] += e(x, p) v_p[d] in position order. */
static void weigh_tile(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s, int npad,
                       int p0, int p1, const __m512i *len, const float *best, float *acc) {
    const int hd = j->head_dim, nv_all = npad / 16;
    exp_tile(s, npad, j->first + 1, p0, p1, len, best);
    const float *vrow[P_TILE];
    for (int p = p0; p < p1; p++) vrow[p - p0] = row_at(j, j->v, p);
    const int all_see = j->first + 1 < p1 ? (j->first + 1 > p0 ? j->first + 1 : p0) : p1;
    for (int v0 = 0, nv; v0 < nv_all; v0 += nv) {
        nv = vectors_in_block(nv_all - v0);
        for (int d0 = 0; d0 < hd; d0 += WEIGH_DIMS(nv)) {
            switch (nv) {
            case 1: weigh_block(vrow, s->scores, npad, p0, p1, all_see, d0, v0, 1, len, acc); break;
            case 2: weigh_block(vrow, s->scores, npad, p0, p1, all_see, d0, v0, 2, len, acc); break;
            default: weigh_block(vrow, s->scores, npad, p0, p1, all_see, d0, v0, 3, len, acc); break;
            }
        }
    }
}

#if defined(ATT_BF16)
/* -- bfloat16 dot products (AVX512_BF16: vdpbf16ps, two products a lane an instruction,
   twice the float32 multiply-add's rate). The arithmetic of a pair, in every layout:
     - score_p = (dp over i = 0 .. hd/2 - 1 in order, from 0, of the bfloat16 pairs
       (q[2i], q[2i+1]) and (k_p[2i], k_p[2i+1])) * scaling, where one dp step is
       acc + q[2i+1] k[2i+1], rounded, then + q[2i] k[2i], rounded (the instruction's
       order; each product of two bfloat16 values is exact in float32);
     - best, e_p and total as the float32 build computes them (from the float32 e_p);
     - out[d] = (dp over position pairs (2m, 2m+1) in order, from 0, of
       (bf16(e_2m), bf16(e_2m+1)) and (bf16(v_2m[d]), bf16(v_2m+1[d]))) * (1 / total),
       with e = 0 past the pair's own positions and v = 0 past the job's (0 x a finite V
       value adds an exact zero, so a row's sums are the same in a group that reads
       further as alone).
   Rounding to bfloat16 is the instruction's (nearest even; a denormal is zero). K and V
   are rounded once, as the step writes them (gnosis_attention_store_bf16): the pool holds
   bfloat16, half float32's bytes to read, and a K row is already its pairs. */

typedef uint32_t pair_t; /* two bfloat16 values, the lower-indexed one in the low half */

/* Position p's K or V row in a bfloat16 pool; a K row is its own pairs (k[2i], k[2i+1]). */
static inline const uint16_t *bf16_row_at(const gnosis_attention_job_t *j, const void *base, int p) {
    return (const uint16_t *)base + (size_t)j->table[p / j->block_size] * j->block_stride +
           (size_t)(p % j->block_size) * j->stride;
}

/* A bfloat16 row's cache lines from p on, on their way (hd values: hd / 32 lines). */
static inline void fetch_row(const gnosis_attention_job_t *j, const void *base, int p) {
    const uint16_t *r = bf16_row_at(j, base, p);
    for (int off = 0; off < j->head_dim; off += 32) _mm_prefetch((const char *)(r + off), _MM_HINT_T0);
}

/* n floats (n a multiple of 16) as n / 2 pairs (x[2i], x[2i+1]): 32 values an instruction. */
static inline void to_pairs(const float *x, int n, pair_t *out) {
    int i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512((void *)((uint16_t *)out + i),
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
    if (i < n)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

/* Lane l's pair (a[l], b[l]), from one register holding a[0..15] in its low 16 16-bit
   values and b[0..15] in its high 16: one vpermw. */
static inline __m512i interleave16(__m512i ab) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, ab);
}

/* 16 lanes of pairs (a[l], b[l]) of float32 vectors, each rounded to bfloat16. */
static inline __m512i zip_pairs(__m512 a, __m512 b) {
    return interleave16((__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* 16 lanes of pairs (a[l], b[l]) of 16 bfloat16 values each (b NULL: zeros). */
static inline __m512i zip_rows(const uint16_t *a, const uint16_t *b) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)a);
    const __m256i hi = b ? _mm256_loadu_si256((const __m256i *)b) : _mm256_setzero_si256();
    return interleave16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

void gnosis_attention_store_bf16(const float *x, int32_t n, uint16_t *out) { to_pairs(x, n, (pair_t *)out); }

static inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Few pairs: scores[x][p] (rows max_pos + 32 apart), positions in the lanes: K rows as
   pairs, transposed 16 x 16 (kt[i][p]), each query pair broadcast. */
static void scores_by_position_bf16(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s,
                                    int n, int ctx) {
    const int hd = j->head_dim, half = hd / 2, ss = s->max_pos + SPAN;
    pair_t *kt = (pair_t *)s->qt; /* [half][SPAN] */
    pair_t qp[4][GNOSIS_STEP_MAX_HEAD_DIM / 2];
    const __m512 scale = _mm512_set1_ps(j->scaling);
    for (int p0 = 0; p0 < ctx; p0 += SPAN) {
        for (int h = 0; h < SPAN / 16; h++) {
            const pair_t *kp[16];
            for (int i = 0; i < 16; i++) {
                const int p = p0 + 16 * h + i;
                kp[i] = (const pair_t *)bf16_row_at(j, j->k, p < ctx ? p : ctx - 1);
                if (p + SPAN < ctx) fetch_row(j, j->k, p + SPAN);
            }
            for (int i0 = 0; i0 < half; i0 += 16) {
                const float *src[16];
                for (int i = 0; i < 16; i++) src[i] = (const float *)(kp[i] + i0);
                transpose16(src, (float *)(kt + (size_t)i0 * SPAN + 16 * h), SPAN);
            }
        }
        for (int x0 = 0; x0 < n; x0 += 4) {
            for (int u = 0; u < 4; u++) to_pairs(query(j, x0 + u < n ? x0 + u : x0), hd, qp[u]);
            __m512 a[4][2];
            for (int u = 0; u < 4; u++) a[u][0] = a[u][1] = _mm512_setzero_ps();
            for (int i = 0; i < half; i++) {
                const __m512i k0 = _mm512_loadu_si512((const void *)(kt + (size_t)i * SPAN));
                const __m512i k1 = _mm512_loadu_si512((const void *)(kt + (size_t)i * SPAN + 16));
                for (int u = 0; u < 4; u++) {
                    const __m512i qi = _mm512_set1_epi32((int)qp[u][i]);
                    a[u][0] = dp(a[u][0], qi, k0);
                    a[u][1] = dp(a[u][1], qi, k1);
                }
            }
            for (int u = 0; u < 4 && x0 + u < n; u++) {
                _mm512_storeu_ps(s->scores + (size_t)(x0 + u) * ss + p0, _mm512_mul_ps(a[u][0], scale));
                _mm512_storeu_ps(s->scores + (size_t)(x0 + u) * ss + p0 + 16, _mm512_mul_ps(a[u][1], scale));
            }
        }
    }
}

/* One pair's e at positions (p, p + 1) as a bfloat16 pair, zero past its len. */
static inline pair_t e_pair(const float *e, int p, int len) {
    const __m128 two = _mm_setr_ps(p < len ? e[p] : 0.0f, p + 1 < len ? e[p + 1] : 0.0f, 0.0f, 0.0f);
    return (pair_t)_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(two));
}

/* Few pairs: out = dp over position pairs of e(x, .) and V, times inv[x]; e(x, p) at
   e[x * ex + p]. PAIR_BLOCK pairs and up to 64 of head_dim at a time in registers. */
static void weighted_values_bf16(const gnosis_attention_job_t *j, const float *e, int ex, int n,
                                 const float *inv) {
    const int hd = j->head_dim;
    const __m512 zero = _mm512_setzero_ps();
    for (int x0 = 0; x0 < n; x0 += PAIR_BLOCK) {
        int len[PAIR_BLOCK];
        const int longest = block_lengths(j, x0, n, len);
        for (int d0 = 0; d0 < hd; d0 += 64) {
            const int nd = (hd - d0) / 16 < 4 ? (hd - d0) / 16 : 4;
            __m512 r[PAIR_BLOCK][4];
            for (int u = 0; u < PAIR_BLOCK; u++)
                for (int i = 0; i < 4; i++) r[u][i] = zero;
            for (int p = 0; p < longest; p += 2) {
                const uint16_t *va = bf16_row_at(j, j->v, p) + d0;
                const uint16_t *vb = p + 1 < longest ? bf16_row_at(j, j->v, p + 1) + d0 : NULL;
                if (p + 8 < longest) /* the pair 8 on's first row (its second: measured slower, 2026-12-07) */
                    _mm_prefetch((const char *)(bf16_row_at(j, j->v, p + 8) + d0), _MM_HINT_T0);
                __m512i vv[4];
                for (int i = 0; i < 4; i++)
                    vv[i] = i < nd ? zip_rows(va + 16 * i, vb ? vb + 16 * i : NULL) : _mm512_setzero_si512();
                for (int u = 0; u < PAIR_BLOCK; u++)
                    if (p < len[u]) {
                        const __m512i w = _mm512_set1_epi32((int)e_pair(e + (size_t)(x0 + u) * ex, p, len[u]));
                        for (int i = 0; i < 4; i++)
                            if (i < nd) r[u][i] = dp(r[u][i], w, vv[i]);
                    }
            }
            store_block(j, x0, n, d0, nd, r, inv);
        }
    }
}

/* Scores of pair vectors v0..v0 + nv as score_block, from query pairs (qt[i][x]) and K
   rows as pairs, a position's pair broadcast. */
static inline __attribute__((always_inline)) void score_block_bf16(
        const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s, int npad, int ctx, int v0,
        const int nv, const __m512i *len, float *best) {
    const int half = j->head_dim / 2, np = QK_POS(nv);
    const pair_t *qt = (const pair_t *)s->qt;
    const __m512 scale = _mm512_set1_ps(j->scaling);
    __m512 m[MAX_VEC];
    for (int v = 0; v < nv; v++) m[v] = _mm512_set1_ps(-INFINITY);
    for (int p = 0; p < ctx; p += np) {
        const pair_t *kp[QK_POS_MAX];
        for (int u = 0; u < np; u++) { /* the rows two blocks on fetched as these are read */
            kp[u] = (const pair_t *)bf16_row_at(j, j->k, p + u < ctx ? p + u : ctx - 1);
            if (p + u + 2 * np < ctx) fetch_row(j, j->k, p + u + 2 * np);
        }
        __m512 a[QK_POS_MAX][MAX_VEC];
        for (int u = 0; u < np; u++)
            for (int v = 0; v < nv; v++) a[u][v] = _mm512_setzero_ps();
        for (int i = 0; i < half; i++) {
            __m512i qv[MAX_VEC];
            for (int v = 0; v < nv; v++) qv[v] = _mm512_loadu_si512((const void *)(qt + (size_t)i * npad + (v0 + v) * 16));
            for (int u = 0; u < np; u++) {
                const __m512i kd = _mm512_set1_epi32((int)kp[u][i]);
                for (int v = 0; v < nv; v++) a[u][v] = dp(a[u][v], qv[v], kd);
            }
        }
        store_scores(s, npad, ctx, j->first + 1, p, np, v0, nv, a, scale, len, m);
    }
    for (int v = 0; v < nv; v++) _mm512_storeu_ps(best + (v0 + v) * 16, m[v]);
}

/* Many pairs: query pairs transposed (qt[i][x]), scores[p][x], each pair's largest. */
static void scores_by_pair_bf16(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s,
                                int n, int npad, int ctx, const __m512i *len, float *best) {
    const int half = j->head_dim / 2;
    pair_t *qt = (pair_t *)s->qt, row[GNOSIS_STEP_MAX_HEAD_DIM / 2];
    for (int x = 0; x < npad; x++) {
        if (x < n) to_pairs(query(j, x), 2 * half, row);
        for (int i = 0; i < half; i++) qt[(size_t)i * npad + x] = x < n ? row[i] : 0;
    }
    for (int v0 = 0, nv; v0 < npad / 16; v0 += nv) {
        nv = vectors_in_block(npad / 16 - v0);
        switch (nv) {
        case 1: score_block_bf16(j, s, npad, ctx, v0, 1, len, best); break;
        case 2: score_block_bf16(j, s, npad, ctx, v0, 2, len, best); break;
        default: score_block_bf16(j, s, npad, ctx, v0, 3, len, best); break;
        }
    }
}

/* acc[d][v0 + v] += dp of e pairs (ep[m][x]) and V pairs (vt[m][d]) over the tile's
   position pairs, d in [d0, d0 + WEIGH_DIMS(nv)). A pair's e is zero where it does not
   see a position, so every lane takes every step. */
static inline __attribute__((always_inline)) void weigh_block_bf16(
        const pair_t *vt, const pair_t *ep, int hd, int npad, int m1, int d0, int v0, const int nv, float *acc) {
    const int nd = WEIGH_DIMS(nv);
    __m512 r[WEIGH_DIMS_MAX][MAX_VEC];
    for (int dd = 0; dd < nd; dd++)
        for (int v = 0; v < nv; v++) r[dd][v] = _mm512_loadu_ps(acc + (size_t)(d0 + dd) * npad + (v0 + v) * 16);
    for (int m = 0; m < m1; m++) {
        const pair_t *vm = vt + (size_t)m * hd + d0, *em = ep + (size_t)m * npad + v0 * 16;
        __m512i ev[MAX_VEC];
        for (int v = 0; v < nv; v++) ev[v] = _mm512_loadu_si512((const void *)(em + 16 * v));
        for (int dd = 0; dd < nd; dd++) {
            const __m512i w = _mm512_set1_epi32((int)vm[dd]);
            for (int v = 0; v < nv; v++) r[dd][v] = dp(r[dd][v], ev[v], w);
        }
    }
    for (int dd = 0; dd < nd; dd++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(acc + (size_t)(d0 + dd) * npad + (v0 + v) * 16, r[dd][v]);
}

/* Many pairs, a tile of positions [p0, p1) (p0 even): e_p into place and the partial
   sums as weigh_tile, then the tile's e as pairs (over its own rows: pair m of the tile
   into row p0 + m, after rows p0 + 2m and p0 + 2m + 1 are read) and its V rows as pairs
   (V past the job's positions zero), and acc += their dp, position pair by pair. */
static void weigh_tile_bf16(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s, int npad,
                            int p0, int p1, const __m512i *len, const float *best, float *acc) {
    const int hd = j->head_dim, nv_all = npad / 16, m1 = (p1 - p0 + 1) / 2;
    const __m512 zero = _mm512_setzero_ps();
    exp_tile(s, npad, j->first + 1, p0, p1, len, best);
    pair_t *ep = (pair_t *)(s->scores + (size_t)p0 * npad); /* [m1][npad], over the tile's rows */
    for (int m = 0; m < m1; m++) {
        const float *ea = s->scores + (size_t)(p0 + 2 * m) * npad, *eb = ea + npad;
        const int has_b = p0 + 2 * m + 1 < p1;
        for (int v = 0; v < nv_all; v++) {
            const __m512i z = zip_pairs(_mm512_loadu_ps(ea + 16 * v), has_b ? _mm512_loadu_ps(eb + 16 * v) : zero);
            _mm512_storeu_si512((void *)(ep + (size_t)m * npad + 16 * v), z);
        }
    }
    pair_t vt[(P_TILE / 2) * GNOSIS_STEP_MAX_HEAD_DIM];
    for (int p = p1; p < p1 + P_TILE && p < j->first + j->rows; p++) fetch_row(j, j->v, p); /* the next tile's V */
    for (int m = 0; m < m1; m++) {
        const uint16_t *va = bf16_row_at(j, j->v, p0 + 2 * m);
        const uint16_t *vb = p0 + 2 * m + 1 < p1 ? bf16_row_at(j, j->v, p0 + 2 * m + 1) : NULL;
        for (int d = 0; d < hd; d += 16)
            _mm512_storeu_si512((void *)(vt + (size_t)m * hd + d), zip_rows(va + d, vb ? vb + d : NULL));
    }
    for (int v0 = 0, nv; v0 < nv_all; v0 += nv) {
        nv = vectors_in_block(nv_all - v0);
        for (int d0 = 0; d0 < hd; d0 += WEIGH_DIMS(nv)) {
            switch (nv) {
            case 1: weigh_block_bf16(vt, ep, hd, npad, m1, d0, v0, 1, acc); break;
            case 2: weigh_block_bf16(vt, ep, hd, npad, m1, d0, v0, 2, acc); break;
            default: weigh_block_bf16(vt, ep, hd, npad, m1, d0, v0, 3, acc); break;
            }
        }
    }
}
#endif

/* Many pairs, the last part: each pair's total from its 16 partial sums (s->part) and its
   output, acc[d][x] (s->acc) * (1 / total). */
static void finish_by_pair(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s, int n, int npad) {
    const int hd = j->head_dim;
    for (int v = 0; v < npad / 16; v++) {
        const float *part = s->part + 16 * 16 * v; /* [16 partial sums][16 pairs] */
        __m512 t[8];
        for (int l = 0; l < 8; l++) t[l] = _mm512_add_ps(_mm512_loadu_ps(part + 16 * l), _mm512_loadu_ps(part + 16 * (l + 8)));
        for (int l = 0; l < 4; l++) t[l] = _mm512_add_ps(t[l], t[l + 4]);
        for (int l = 0; l < 2; l++) t[l] = _mm512_add_ps(t[l], t[l + 2]);
        float total[16];
        _mm512_storeu_ps(total, _mm512_add_ps(t[0], t[1]));
        for (int l = 0; l < 16 && 16 * v + l < n; l++) {
            const int x = 16 * v + l;
            const float inv = 1.0f / total[l];
            float *o = j->out + (size_t)(x / j->rep) * j->out_row + (size_t)(x % j->rep) * hd;
            for (int d = 0; d < hd; d++) o[d] = s->acc[(size_t)d * npad + x] * inv;
        }
    }
}

/* Many pairs: scores, then tiles of positions weighed into acc[d][x], then each pair's
   total from its 16 partial sums and its output, acc * (1 / total). */
static void attend_by_pair(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s, int n, int ctx) {
    const int hd = j->head_dim, npad = (n + 15) / 16 * 16, nv = npad / 16;
    __m512i len[nv];
    for (int v = 0; v < nv; v++) {
        int32_t lens[16];
        for (int l = 0; l < 16; l++) {
            const int x = 16 * v + l;
            lens[l] = x < n ? j->first + x / j->rep + 1 : 0;
        }
        len[v] = _mm512_loadu_si512((const void *)lens);
    }
    float best[npad];
    float *acc = s->acc; /* [hd][npad] */
    memset(acc, 0, sizeof(float) * hd * npad);
    memset(s->part, 0, sizeof(float) * 16 * npad);
#if defined(ATT_BF16)
    if (j->bf16) {
        scores_by_pair_bf16(j, s, n, npad, ctx, len, best);
        for (int p0 = 0; p0 < ctx; p0 += P_TILE) weigh_tile_bf16(j, s, npad, p0, p0 + P_TILE < ctx ? p0 + P_TILE : ctx, len, best, acc);
    } else
#endif
    {
        scores_by_pair(j, s, n, npad, ctx, len, best);
        for (int p0 = 0; p0 < ctx; p0 += P_TILE) weigh_tile(j, s, npad, p0, p0 + P_TILE < ctx ? p0 + P_TILE : ctx, len, best, acc);
    }
    finish_by_pair(j, s, n, npad);
}

/* out = sum over p of e(x, p) v_p, in position order, times inv[x]; e(x, p) at
   e[x * ex + p * ep]. PAIR_BLOCK pairs and up to 64 of head_dim at a time in registers. */
static void weighted_values(const gnosis_attention_job_t *j, const float *e, int ex, int ep, int n,
                            const float *inv) {
    const int hd = j->head_dim;
    for (int x0 = 0; x0 < n; x0 += PAIR_BLOCK) {
        int len[PAIR_BLOCK];
        const int longest = block_lengths(j, x0, n, len);
        for (int d0 = 0; d0 < hd; d0 += 64) {
            const int nd = (hd - d0) / 16 < 4 ? (hd - d0) / 16 : 4;
            __m512 r[PAIR_BLOCK][4];
            for (int u = 0; u < PAIR_BLOCK; u++)
                for (int i = 0; i < 4; i++) r[u][i] = _mm512_setzero_ps();
            for (int p = 0; p < longest; p++) {
                const float *vp = row_at(j, j->v, p) + d0;
                if (p + 8 < longest)
                    _mm_prefetch((const char *)(row_at(j, j->v, p + 8) + d0), _MM_HINT_T0);
                __m512 vv[4];
                for (int i = 0; i < 4; i++) vv[i] = i < nd ? _mm512_loadu_ps(vp + 16 * i) : _mm512_setzero_ps();
                for (int u = 0; u < PAIR_BLOCK; u++)
                    if (p < len[u]) {
                        const __m512 w = _mm512_set1_ps(e[(size_t)(x0 + u) * ex + (size_t)p * ep]);
                        for (int i = 0; i < 4; i++)
                            if (i < nd) r[u][i] = _mm512_fmadd_ps(w, vv[i], r[u][i]);
                    }
            }
            store_block(j, x0, n, d0, nd, r, inv);
        }
    }
}

void gnosis_attention(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s) {
    const int n = j->rows * j->rep, ctx = j->first + j->rows;
    if (n < MANY_PAIRS) {
        float inv[MANY_PAIRS];
#if defined(ATT_BF16)
        if (j->bf16) {
            scores_by_position_bf16(j, s, n, ctx);
            softmax_by_position(j, s, n, inv);
            weighted_values_bf16(j, s->scores, s->max_pos + SPAN, n, inv);
            return;
        }
#endif
        scores_by_position(j, s, n, ctx);
        softmax_by_position(j, s, n, inv);
        weighted_values(j, s->scores, s->max_pos + SPAN, 1, n, inv);
    } else {
        attend_by_pair(j, s, n, ctx);
    }
}

#else

int32_t gnosis_attention_takes(int32_t head_dim) { (void)head_dim; return 0; }

void gnosis_attention(const gnosis_attention_job_t *j, const gnosis_attention_scratch_t *s) {
    (void)j; (void)s; /* never called: the step attends with its own loops */
}

#endif

#if !defined(ATT_BF16)
/* Never called: a step takes attention_bf16 only where gnosis_attention_takes says 2. */
void gnosis_attention_store_bf16(const float *x, int32_t n, uint16_t *out) { (void)x; (void)n; (void)out; }
#endif
