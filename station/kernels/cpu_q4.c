/* The step's matrix products over 4-bit weights, one tile of 16 output rows at a time, for
   any number of token rows (cpu_step.c calls these on its threads; cpu_abi.h declares them
   and the tiled layout they read, which cpu_step.py writes from a GGUF file's groups).

   The arithmetic of one output of one token row, whatever the rows beside it:
     - the row's activations: A = the row's largest magnitude, d = A / 32767; per 32-value
       group g a shift s_g, the largest of 0..7 with max|x of g| * 2^s_g <= A, so a group
       far below the row's largest keeps up to 7 more bits; q = round(x * 2^s_g * 32767 / A)
       (int16), and the group's float32 sum in index order;
     - per group g: an exact integer sum over the group of w_q * x_q (4-bit weights 0..15
       times int16 activations, below 2^24 in magnitude), shifted left by 7 - s_g (below
       2^31, and exact as a float32), so every group's sum counts steps of d / 128;
     - acc = fma((float)shifted_g, step_g, acc), then tail = fma(min_g, sum_g, tail), both
       over the groups in order, from 0; the output is fma(acc, d / 128, tail) (+ bias).
   One scale per row, not per group, leaves a group's sum one multiply-add and an integer
   shift where a per-group scale took a multiply more (measured 6% of the products, AMD
   Zen 4, 2026-12-08). The float operations of an output are the same sequence in a decode
   row and in a prompt's row, in a batch of 1 or of 64, and on every instruction set below:
   the AVX-512 VNNI build (vpdpwssd, 32 products an instruction into 16 outputs' sums), the
   AVX2 build (vpmaddwd) and the plain C one give the same bits. Beside the float32 forward
   on the same 4-bit values, the only added rounding is the activations' to 15 bits of their
   row's largest, or of their group's own where that is up to 128 times smaller (torch's
   int4 kernels round them to bfloat16, 8 bits; int8 activations, tried, were 4x further
   from the float forward than bfloat16 on the test models). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_parts.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define Q4_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q4_AVX2 1
#endif

#define G GNOSIS_GROUP
#define T GNOSIS_Q4_TILE
#define ROW_BLOCK 8 /* token rows whose sums are held in registers at once */

static inline float half_to_float(uint16_t v) {
#if defined(Q4_VNNI) || defined(Q4_AVX2)
    return _cvtsh_ss(v);
#else
    uint32_t sign = (uint32_t)(v & 0x8000) << 16, exp = (v >> 10) & 0x1f, man = v & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; } else {
            exp = 113;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

/* A group's sum in the order every build adds it: lane l (l < 8) adds values l, l + 8,
   l + 16, l + 24; then (l + l+4), (l + l+2), (0 + 1). */
static inline float group_sum(const float *v) {
#if defined(Q4_VNNI) || defined(Q4_AVX2)
    __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                                           _mm256_loadu_ps(v + 16)), _mm256_loadu_ps(v + 24));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
#else
    float lane[8], half[4];
    for (int l = 0; l < 8; l++) lane[l] = ((v[l] + v[l + 8]) + v[l + 16]) + v[l + 24];
    for (int l = 0; l < 4; l++) half[l] = lane[l] + lane[l + 4];
    return (half[0] + half[2]) + (half[1] + half[3]);
#endif
}

/* A group's largest magnitude (a max is exact in any order). */
static inline float group_amax(const float *v) {
#if defined(Q4_VNNI) || defined(Q4_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v)), _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8))),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + 16)), _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 24))));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#else
    float amax = 0.0f;
    for (int i = 0; i < G; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
#endif
}

void gnosis_q4_quantize_row(const float *x, int32_t k, int16_t *xq, int32_t *xsh, float *xs, float *xr) {
    const int groups = k / G;
    float top = 0.0f;
    for (int g = 0; g < groups; g++) { /* xs holds each group's largest until its sum */
        xs[g] = group_amax(x + g * G);
        top = xs[g] > top ? xs[g] : top;
    }
    const float inv = top > 0.0f ? 32767.0f / top : 0.0f;
    *xr = top / 32767.0f / 128.0f;
    for (int g = 0; g < groups; g++) {
        const float *v = x + g * G;
        int shift = 0; /* amax * 2^(shift + 1) <= top, both sides exact */
        while (shift < 7 && xs[g] * (float)(2 << shift) <= top) shift++;
        const float scale = inv * (float)(1 << shift);
#if defined(Q4_VNNI) || defined(Q4_AVX2)
        const __m256 sc = _mm256_set1_ps(scale);
        for (int i = 0; i < G; i += 16) { /* round to nearest even, as lrintf */
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), sc));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8), sc));
            _mm256_storeu_si256((__m256i *)(xq + g * G + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8));
        }
#else
        for (int i = 0; i < G; i++) xq[g * G + i] = (int16_t)lrintf(v[i] * scale);
#endif
        xsh[g] = 7 - shift;
        xs[g] = group_sum(v);
    }
}

#if defined(Q4_VNNI)
/* bt token rows (a constant: the loops unroll, every sum in a register) of one tile. */
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *q, const uint16_t *sp,
                                                            const uint16_t *mp, int groups, int k,
                                                            const int16_t *xq, const int32_t *xsh,
                                                            const float *xs, const float *xr, const int bt,
                                                            float *y) {
    __m512 acc[ROW_BLOCK], tail[ROW_BLOCK];
    for (int t = 0; t < bt; t++) acc[t] = tail[t] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f);
    for (int g = 0; g < groups; g++) {
        __m512i sum[ROW_BLOCK];
        for (int t = 0; t < bt; t++) sum[t] = _mm512_setzero_si512();
        const uint8_t *qg = q + (size_t)g * (T * G / 2);
        for (int c = 0; c < 8; c++) {
            /* lane i: row i's values 2c, 2c+1 (low nibbles) and 2c+16, 2c+17 (high) */
            const __m512i slab = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qg + 32 * c)));
            const __m512i a = _mm512_and_si512(slab, low), b = _mm512_srli_epi16(slab, 4);
            for (int t = 0; t < bt; t++) {
                const int16_t *xg = xq + (size_t)t * k + g * G + 2 * c;
                int32_t xa, xb;
                memcpy(&xa, xg, 4);
                memcpy(&xb, xg + 16, 4);
                sum[t] = _mm512_dpwssd_epi32(sum[t], a, _mm512_set1_epi32(xa));
                sum[t] = _mm512_dpwssd_epi32(sum[t], b, _mm512_set1_epi32(xb));
            }
        }
        const __m512 st = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + (size_t)g * T)));
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mp + (size_t)g * T)));
        for (int t = 0; t < bt; t++) {
            const __m512i shifted = _mm512_sllv_epi32(sum[t], _mm512_set1_epi32(xsh[t * groups + g]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(shifted), st, acc[t]);
            tail[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[t * groups + g]), tail[t]);
        }
    }
    for (int t = 0; t < bt; t++)
        _mm512_storeu_ps(y + (size_t)t * T, _mm512_fmadd_ps(acc[t], _mm512_set1_ps(xr[t]), tail[t]));
}
#elif defined(Q4_AVX2)
/* As the AVX-512 build, eight of the tile's rows at a time (h: which eight). */
static inline __attribute__((always_inline)) void tile_half(const uint8_t *q, const uint16_t *sp,
                                                            const uint16_t *mp, int groups, int k,
                                                            const int16_t *xq, const int32_t *xsh,
                                                            const float *xs, const float *xr, const int bt,
                                                            int h, float *y) {
    __m256 acc[4], tail[4];
    for (int t = 0; t < bt; t++) acc[t] = tail[t] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi16(0x0f);
    for (int g = 0; g < groups; g++) {
        __m256i sum[4];
        for (int t = 0; t < bt; t++) sum[t] = _mm256_setzero_si256();
        const uint8_t *qg = q + (size_t)g * (T * G / 2) + 16 * h;
        for (int c = 0; c < 8; c++) {
            const __m256i slab = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qg + 32 * c)));
            const __m256i a = _mm256_and_si256(slab, low), b = _mm256_srli_epi16(slab, 4);
            for (int t = 0; t < bt; t++) {
                const int16_t *xg = xq + (size_t)t * k + g * G + 2 * c;
                int32_t xa, xb;
                memcpy(&xa, xg, 4);
                memcpy(&xb, xg + 16, 4);
                sum[t] = _mm256_add_epi32(sum[t], _mm256_add_epi32(_mm256_madd_epi16(a, _mm256_set1_epi32(xa)),
                                                                   _mm256_madd_epi16(b, _mm256_set1_epi32(xb))));
            }
        }
        const __m256 st = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + (size_t)g * T + 8 * h)));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mp + (size_t)g * T + 8 * h)));
        for (int t = 0; t < bt; t++) {
            const __m256i shifted = _mm256_sllv_epi32(sum[t], _mm256_set1_epi32(xsh[t * groups + g]));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(shifted), st, acc[t]);
            tail[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[t * groups + g]), tail[t]);
        }
    }
    for (int t = 0; t < bt; t++)
        _mm256_storeu_ps(y + (size_t)t * T + 8 * h, _mm256_fmadd_ps(acc[t], _mm256_set1_ps(xr[t]), tail[t]));
}

static inline __attribute__((always_inline)) void tile_rows(const uint8_t *q, const uint16_t *sp,
                                                            const uint16_t *mp, int groups, int k,
                                                            const int16_t *xq, const int32_t *xsh,
                                                            const float *xs, const float *xr, const int bt,
                                                            float *y) {
    for (int t0 = 0; t0 < bt; t0 += 4) {
        const int n = bt - t0 < 4 ? bt - t0 : 4;
        const int16_t *x = xq + (size_t)t0 * k;
        const int32_t *e = xsh + t0 * groups;
        const float *s = xs + t0 * groups, *r = xr + t0;
        for (int h = 0; h < 2; h++) {
            switch (n) {
            case 1: tile_half(q, sp, mp, groups, k, x, e, s, r, 1, h, y + t0 * T); break;
            case 2: tile_half(q, sp, mp, groups, k, x, e, s, r, 2, h, y + t0 * T); break;
            case 3: tile_half(q, sp, mp, groups, k, x, e, s, r, 3, h, y + t0 * T); break;
            default: tile_half(q, sp, mp, groups, k, x, e, s, r, 4, h, y + t0 * T); break;
            }
        }
    }
}
#else
static void tile_rows(const uint8_t *q, const uint16_t *sp, const uint16_t *mp, int groups, int k,
                      const int16_t *xq, const int32_t *xsh, const float *xs, const float *xr, const int bt,
                      float *y) {
    for (int t = 0; t < bt; t++)
        for (int i = 0; i < T; i++) {
            float acc = 0.0f, tail = 0.0f;
            for (int g = 0; g < groups; g++) {
                const uint8_t *qg = q + (size_t)g * (T * G / 2) + 2 * i;
                const int16_t *xg = xq + (size_t)t * k + g * G;
                int32_t sum = 0;
                for (int c = 0; c < 8; c++)
                    for (int j = 0; j < 2; j++) {
                        const uint8_t byte = qg[32 * c + j];
                        sum += (byte & 15) * xg[2 * c + j] + (byte >> 4) * xg[2 * c + 16 + j];
                    }
                const int32_t shifted = sum * (1 << xsh[t * groups + g]); /* |sum| < 2^24: no overflow */
                acc = fmaf((float)shifted, half_to_float(sp[(size_t)g * T + i]), acc);
                tail = fmaf(half_to_float(mp[(size_t)g * T + i]), xs[t * groups + g], tail);
            }
            y[(size_t)t * T + i] = fmaf(acc, xr[t], tail);
        }
}
#endif

void gnosis_q4_tile(const gnosis_q4_matrix_t *w, int32_t tile, const int16_t *xq, const int32_t *xsh,
                    const float *xs, const float *xr, int32_t rows, float *y) {
    const int k = w->cols, groups = k / G;
    const uint8_t *q = w->q + (size_t)tile * groups * (T * G / 2);
    const uint16_t *sp = w->step + (size_t)tile * groups * T, *mp = w->min + (size_t)tile * groups * T;
    for (int t0 = 0; t0 < rows; t0 += ROW_BLOCK) {
        const int bt = rows - t0 < ROW_BLOCK ? rows - t0 : ROW_BLOCK;
        const int16_t *x = xq + (size_t)t0 * k;
        const int32_t *e = xsh + (size_t)t0 * groups;
        const float *s = xs + (size_t)t0 * groups, *r = xr + t0;
        float *out = y + (size_t)t0 * T;
        switch (bt) {
        case 1: tile_rows(q, sp, mp, groups, k, x, e, s, r, 1, out); break;
        case 2: tile_rows(q, sp, mp, groups, k, x, e, s, r, 2, out); break;
        case 3: tile_rows(q, sp, mp, groups, k, x, e, s, r, 3, out); break;
        case 4: tile_rows(q, sp, mp, groups, k, x, e, s, r, 4, out); break;
        case 5: tile_rows(q, sp, mp, groups, k, x, e, s, r, 5, out); break;
        case 6: tile_rows(q, sp, mp, groups, k, x, e, s, r, 6, out); break;
        case 7: tile_rows(q, sp, mp, groups, k, x, e, s, r, 7, out); break;
        default: tile_rows(q, sp, mp, groups, k, x, e, s, r, 8, out); break;
        }
    }
    if (w->bias)
        for (int t = 0; t < rows; t++)
            for (int i = 0; i < T; i++) y[(size_t)t * T + i] += w->bias[(size_t)tile * T + i];
}

const char *gnosis_q4_simd(void) {
#if defined(Q4_VNNI)
    return "avx512-vnni";
#elif defined(Q4_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

/* -- the same products as one linear layer's, called from Python (q4_tiles.TiledLinear) */

#include <pthread.h>
#include <stdlib.h>

typedef struct {
    const gnosis_q4_matrix_t *w;
    const int16_t *xq;
    const int32_t *xsh;
    const float *xs, *xr;
    float *y, *scratch; /* y: [rows, ld]; scratch: [rows, T] */
    int32_t t0, t1, first, rows, ld;
} q4_job_t;

static void *q4_job(void *arg) {
    const q4_job_t *j = (const q4_job_t *)arg;
    for (int t = j->t0; t < j->t1; t++) {
        gnosis_q4_tile(j->w, j->first + t, j->xq, j->xsh, j->xs, j->xr, j->rows, j->scratch);
        for (int r = 0; r < j->rows; r++)
            memcpy(j->y + (size_t)r * j->ld + (size_t)t * T, j->scratch + (size_t)r * T, sizeof(float) * T);
    }
    return NULL;
}

gnosis_status_t gnosis_q4_linear(const gnosis_q4_matrix_t *w, int32_t first, int32_t tiles, const float *x,
                                 int32_t rows, float *y, int32_t threads) {
    const int k = w->cols, groups = k / G;
    if (rows < 0 || first < 0 || tiles < 0 || k % G || first + tiles > (w->rows + T - 1) / T) return GNOSIS_BAD_ARGUMENT;
    if (threads < 1) threads = 1;
    if (threads > GNOSIS_MAX_THREADS) threads = GNOSIS_MAX_THREADS;
    if (threads > tiles) threads = tiles > 0 ? tiles : 1;
    int16_t *xq = malloc(sizeof(int16_t) * ((size_t)rows * k + 1));
    int32_t *xsh = malloc(sizeof(int32_t) * ((size_t)rows * groups + 1));
    float *xs = malloc(sizeof(float) * ((size_t)rows * groups + 1)), *xr = malloc(sizeof(float) * ((size_t)rows + 1));
    float *scratch = malloc(sizeof(float) * ((size_t)threads * rows * T + 1));
    gnosis_status_t status = GNOSIS_OK;
    if (!xq || !xsh || !xs || !xr || !scratch) {
        status = GNOSIS_NO_MEMORY;
        goto done;
    }
    for (int r = 0; r < rows; r++)
        gnosis_q4_quantize_row(x + (size_t)r * k, k, xq + (size_t)r * k, xsh + (size_t)r * groups, xs + (size_t)r * groups, xr + r);
    pthread_t tid[GNOSIS_MAX_THREADS];
    q4_job_t jobs[GNOSIS_MAX_THREADS];
    int started[GNOSIS_MAX_THREADS] = {0};
    const int per = (tiles + threads - 1) / threads;
    for (int i = 0; i < threads; i++) {
        const int a = i * per < tiles ? i * per : tiles, b = a + per < tiles ? a + per : tiles;
        jobs[i] = (q4_job_t){w, xq, xsh, xs, xr, y, scratch + (size_t)i * rows * T, a, b, first, rows, tiles * T};
        if (i > 0 && a < b) {
            started[i] = pthread_create(&tid[i], NULL, q4_job, &jobs[i]) == 0;
            if (!started[i]) status = GNOSIS_NO_THREAD; /* its tiles run on this thread below */
        }
    }
    q4_job(&jobs[0]);
    for (int i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else if (jobs[i].t0 < jobs[i].t1)
            q4_job(&jobs[i]);
    }
done:
    free(xq), free(xsh), free(xs), free(xr), free(scratch);
    return status;
}
