/* The linear layer of a decode step on CPU, float32: y = x W^T (+ bias) for a handful of tokens.
 *
 * x is [M, K] (rows at x_stride floats), W is torch.nn.Linear's [N, K], contiguous; y is [M, N]
 * contiguous; bias is [N] or NULL. Meant for M <= 32 (orca_backend/model/gemm.py picks it there),
 * where the step is bound by reading W: every weight is read from memory once, whatever M is.
 *
 * Why C: at a few tokens a GEMM library's blocking is built for reuse that is not there (MKL costs
 * 3x at 4 tokens what it costs at 1, oneDNN 1.2-1.6x this kernel); this walks W once, straight
 * through memory, with the output rows split over the OpenMP threads of the caller (torch's
 * libgomp, as in decode_attention.c).
 *
 * Order of the sums: y[m][n] is always the same sequence of operations (eight lanes each summing
 * every eighth product in k order, a fixed tree over the lanes, the K % 8 tail, then the bias),
 * whatever M is, which rows share a block, or how many threads run. A token's result therefore
 * does not depend on the other tokens of the batch: batch invariance by construction.
 *
 * Blocking: a tile of R rows of W against T tokens keeps R * T accumulators, R weight vectors and
 * one token vector in the 16 AVX registers. Under 4 tokens the tile is 4 rows x 2 tokens: four
 * sequential weight streams per thread keep the prefetchers busy, and the step is bound by memory.
 * From 4 tokens on it is 3 rows x 4 tokens (12 FMAs per 7 loads): the step turns compute-bound
 * there, and this tile measured 8-12% faster at 16-32 tokens. The rows of a tile (<= 48 KB at
 * K = 3072) stay in L1/L2 while the next tokens reuse them, so memory sees each weight once.
 * Rows are handed to the threads in small dynamic chunks: on a shared host a descheduled thread
 * then holds up one chunk, not half of the matrix.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);                      /* lanes i + i+4 */
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));   /* + lanes 2,3 */
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* The scalar tail past the last multiple of 8, then the bias: the same for every caller. */
static inline float finish(float acc, const float *x, const float *w, int64_t k8, int64_t K, float b) {
    for (int64_t k = k8; k < K; k++) acc = fmaf(x[k], w[k], acc);
    return acc + b;
}

/* Rows n..n+R-1 of W against tokens m..m+T-1 (R in 1..4, T in 1..2), fully unrolled by the compiler. */
#define BLOCK(R, T)                                                                                        \
    static void block_##R##_##T(const float *x, int64_t x_stride, const float *W, int64_t K,              \
                                const float *bias, float *y, int64_t N, int64_t m, int64_t n) {            \
        __m256 acc[R][T];                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();                                   \
        const int64_t k8 = K & ~(int64_t)7;                                                                \
        for (int64_t k = 0; k < k8; k += 8) {                                                              \
            __m256 w[R];                                                                                   \
            for (int r = 0; r < R; r++) w[r] = _mm256_loadu_ps(W + (n + r) * K + k);                       \
            for (int t = 0; t < T; t++) {                                                                  \
                __m256 xv = _mm256_loadu_ps(x + (m + t) * x_stride + k);                                   \
                for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(w[r], xv, acc[r][t]);              \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int t = 0; t < T; t++)                                                                    \
                y[(m + t) * N + n + r] = finish(hsum(acc[r][t]), x + (m + t) * x_stride, W + (n + r) * K,  \
                                                k8, K, bias ? bias[n + r] : 0.0f);                         \
    }
BLOCK(4, 2)
BLOCK(4, 1)
BLOCK(3, 4)
BLOCK(3, 1)
BLOCK(1, 4)
BLOCK(1, 2)
BLOCK(1, 1)

void orca_decode_linear_f32(const float *x, int64_t x_stride, int64_t M, const float *W, int64_t N, int64_t K,
                            const float *bias, float *y, int num_threads) {
    if (M < 4) {
        const int64_t n_blocks = (N + 3) / 4;
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
        for (int64_t nb = 0; nb < n_blocks; nb++) {
            const int64_t n = nb * 4;
            if (n + 4 <= N) {
                int64_t m = 0;
                for (; m + 2 <= M; m += 2) block_4_2(x, x_stride, W, K, bias, y, N, m, n);
                if (m < M) block_4_1(x, x_stride, W, K, bias, y, N, m, n);
            } else {
                for (int64_t r = n; r < N; r++) {
                    int64_t m = 0;
                    for (; m + 2 <= M; m += 2) block_1_2(x, x_stride, W, K, bias, y, N, m, r);
                    if (m < M) block_1_1(x, x_stride, W, K, bias, y, N, m, r);
                }
            }
        }
        return;
    }
    const int64_t n_blocks = (N + 2) / 3;
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        const int64_t n = nb * 3;
        if (n + 3 <= N) {
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) block_3_4(x, x_stride, W, K, bias, y, N, m, n);
            for (; m < M; m++) block_3_1(x, x_stride, W, K, bias, y, N, m, n);
        } else {
            for (int64_t r = n; r < N; r++) {
                int64_t m = 0;
                for (; m + 4 <= M; m += 4) block_1_4(x, x_stride, W, K, bias, y, N, m, r);
                for (; m < M; m++) block_1_1(x, x_stride, W, K, bias, y, N, m, r);
            }
        }
    }
}
