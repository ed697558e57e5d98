/* The vocabulary head over a GGUF file's Q8_0 blocks, float32 in and out (station/kernels/cpu_kernels.py).

   y[m, n] = sum over groups g of d[n, g] * sum_{k in g} x[m, k] * q[n, k]

   q: int8 [N, K], d: float32 [N, K / 32] (the blocks' float16 scales, widened), x: float32
   [M, K], y: float32 [M, N]. The weights are the file's values exactly (d * q is exact in
   float32), the activations are not rounded, and each product is a float32 multiply-add:
   only the order of the sums differs from a float32 matrix product over the dequantized
   weights. It reads 1 + 4/32 bytes a weight instead of 4. Each row of x is computed
   alike whatever M is, so a row gives the same logits alone as in a batch.

   The functions and the struct they take are declared in cpu_abi.h. Rows of the weight
   are split over `threads` POSIX threads (the caller's own thread is
   one of them); a call is one head, a few milliseconds, so starting threads per call
   costs little beside it. */

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_abi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define GNOSIS_SIMD "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GNOSIS_SIMD "avx2"
#else
#define GNOSIS_SIMD "scalar"
#endif

#define GROUP GNOSIS_GROUP
#define TILE 4 /* rows of x per pass over a weight row */

const char *gnosis_simd(void) { return GNOSIS_SIMD; }

static void tile(const int8_t *q, const float *d, const float *x, float *y, int mt, int N, int K,
                 int n) {
    const int groups = K / GROUP;
    const int8_t *qr = q + (size_t)n * K;
    const float *dr = d + (size_t)n * groups;
#if defined(__AVX512F__)
    __m512 acc[TILE];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const int8_t *qg = qr + g * GROUP;
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qg)));
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qg + 16))));
        __m512 scale = _mm512_set1_ps(dr[g]);
        for (int m = 0; m < mt; m++) {
            const float *xg = x + (size_t)m * K + g * GROUP;
            __m512 part = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16),
                                          _mm512_mul_ps(w0, _mm512_loadu_ps(xg)));
            acc[m] = _mm512_fmadd_ps(part, scale, acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) y[(size_t)m * N + n] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[TILE];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const int8_t *qg = qr + g * GROUP;
        __m256 w[4];
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + 8 * i))));
        __m256 scale = _mm256_set1_ps(dr[g]);
        for (int m = 0; m < mt; m++) {
            const float *xg = x + (size_t)m * K + g * GROUP;
            __m256 part = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
            for (int i = 1; i < 4; i++) part = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xg + 8 * i), part);
            acc[m] = _mm256_fmadd_ps(part, scale, acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        y[(size_t)m * N + n] = _mm_cvtss_f32(s);
    }
#else
    for (int m = 0; m < mt; m++) {
        const float *xr = x + (size_t)m * K;
        float acc = 0.0f;
        for (int g = 0; g < groups; g++) {
            float part = 0.0f;
            for (int i = 0; i < GROUP; i++) part += (float)qr[g * GROUP + i] * xr[g * GROUP + i];
            acc += part * dr[g];
        }
        y[(size_t)m * N + n] = acc;
    }
#endif
}

void gnosis_q8_columns(const gnosis_q8_product_t *p, int32_t n0, int32_t n1) {
    const int M = p->rows, N = p->out_features, K = p->in_features;
    for (int m0 = 0; m0 < M; m0 += TILE) {
        int mt = M - m0 < TILE ? M - m0 : TILE;
        for (int n = n0; n < n1; n++) tile(p->q, p->d, p->x + (size_t)m0 * K, p->y + (size_t)m0 * N, mt, N, K, n);
    }
}

typedef struct {
    const gnosis_q8_product_t *product;
    int n0, n1;
} job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    gnosis_q8_columns(j->product, j->n0, j->n1);
    return NULL;
}

gnosis_status_t gnosis_q8_linear(const gnosis_q8_product_t *p, int32_t threads) {
    pthread_t tid[GNOSIS_MAX_THREADS];
    job_t jobs[GNOSIS_MAX_THREADS];
    int started[GNOSIS_MAX_THREADS] = {0};
    gnosis_status_t status = GNOSIS_OK;
    const int N = p->out_features;
    if (p->rows < 0 || N < 0 || p->in_features < 0 || p->in_features % GROUP) return GNOSIS_BAD_ARGUMENT;
    if (threads < 1) threads = 1;
    if (threads > GNOSIS_MAX_THREADS) threads = GNOSIS_MAX_THREADS;
    int per = (N + threads - 1) / threads;
    for (int i = 0; i < threads; i++) {
        int a = i * per < N ? i * per : N;
        int b = a + per < N ? a + per : N;
        jobs[i] = (job_t){p, a, b};
        if (i > 0 && a < b) {
            started[i] = pthread_create(&tid[i], NULL, run, &jobs[i]) == 0;
            if (!started[i]) status = GNOSIS_NO_THREAD; /* its rows run on this thread below */
        }
    }
    run(&jobs[0]);
    for (int i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else if (jobs[i].n0 < jobs[i].n1)
            run(&jobs[i]);
    }
    return status;
}
