/* The linear layer of a decode step over integer weights on CPU: y = x W^T (+ bias), W stored as 4- or
 * 8-bit unsigned integers with a float32 scale and zero point per group of input columns, x and y
 * float32.
 *
 * Layout (kernels/orca_kernels/cpu_int_gemm.py writes it at load): row n of W is K / 2 bytes (4 bits)
 * or K bytes (8 bits). At 4 bits each 32 columns are 16 bytes, byte j holding column j in its low
 * nibble and column j + 16 in its high one, so that one 16-byte load gives two runs of 16
 * consecutive columns with a mask and a shift (the checkpoints' nibble order would need a shuffle).
 * scales and zeros are [N, K / group], group a multiple of 16; weight (n, k) stands for
 * (q - zeros[n][g]) * scales[n][g], g = k / group: formed in float32 exactly as the torch reference
 * forms it (a subtraction of whole numbers, then one rounded product), then multiplied with x.
 *
 * Why: a decode step reads every weight once, so its time is the weights' bytes over the memory
 * bandwidth; at 4 bits that is an eighth of float32's. The unpacking costs a few instructions per
 * 16 weights, paid once per weight row whatever the number of tokens (up to T_MAX tokens share a
 * row's unpacked registers; more tokens take further passes over the row, which the caller avoids
 * by dequantizing for long steps).
 *
 * Order of the sums: each lane of a token's accumulator adds every 16th (AVX-512) or 8th (AVX2)
 * product in k order, then a fixed tree over the lanes and the bias: a token's result does not
 * depend on the other tokens of the batch, or on the threads (batch invariance by construction).
 * Rows are handed to the OpenMP threads (torch's libgomp) in dynamic chunks, as decode_gemm.c does.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

enum { ISA_AVX2 = 0, ISA_AVX512 = 1 };
#define T_MAX 4
#define CHUNK_ROWS 32

#define T_AVX2 __attribute__((target("avx2,fma")))
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define INLINE static inline __attribute__((always_inline))

/* ---- AVX-512: 16 columns a vector ---- */

T_AVX512 INLINE __m512 deq16(__m128i bytes, const float *s, const float *z, int64_t g) {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    return _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(z[g])), _mm512_set1_ps(s[g]));
}

/* One weight row against T tokens: acc[t] += w . x[t] over the row, 32 (4 bits) or 16 (8 bits)
 * columns a step. */
T_AVX512 INLINE void row_avx512(const float *x, int64_t xs, const uint8_t *w, const float *s, const float *z,
                                int64_t K, int64_t group, int bits, int T, float *out) {
    __m512 acc[T_MAX];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    if (bits == 4) {
        for (int64_t k = 0; k < K; k += 32) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(w + k / 2));
            const __m512 w0 = deq16(_mm_and_si128(v, low), s, z, k / group);
            const __m512 w1 = deq16(_mm_and_si128(_mm_srli_epi16(v, 4), low), s, z, (k + 16) / group);
            for (int t = 0; t < T; t++) {
                acc[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * xs + k), acc[t]);
                acc[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * xs + k + 16), acc[t]);
            }
        }
    } else {
        for (int64_t k = 0; k < K; k += 16) {
            const __m512 w0 = deq16(_mm_loadu_si128((const __m128i *)(w + k)), s, z, k / group);
            for (int t = 0; t < T; t++) acc[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * xs + k), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

/* ---- AVX2: 8 columns a vector ---- */

T_AVX2 INLINE __m256 deq8(__m128i bytes, const float *s, const float *z, int64_t g) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    return _mm256_mul_ps(_mm256_sub_ps(q, _mm256_set1_ps(z[g])), _mm256_set1_ps(s[g]));
}

T_AVX2 INLINE float hsum256(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

T_AVX2 INLINE void row_avx2(const float *x, int64_t xs, const uint8_t *w, const float *s, const float *z,
                            int64_t K, int64_t group, int bits, int T, float *out) {
    __m256 acc[T_MAX];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    if (bits == 4) {
        for (int64_t k = 0; k < K; k += 32) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(w + k / 2));
            const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
            const int64_t g0 = k / group, g1 = (k + 16) / group;
            const __m256 w0 = deq8(lo, s, z, g0), w1 = deq8(_mm_srli_si128(lo, 8), s, z, g0);
            const __m256 w2 = deq8(hi, s, z, g1), w3 = deq8(_mm_srli_si128(hi, 8), s, z, g1);
            for (int t = 0; t < T; t++) {
                const float *xt = x + t * xs + k;
                acc[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), acc[t]);
                acc[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), acc[t]);
                acc[t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xt + 16), acc[t]);
                acc[t] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xt + 24), acc[t]);
            }
        }
    } else {
        for (int64_t k = 0; k < K; k += 16) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(w + k));
            const int64_t g = k / group;
            const __m256 w0 = deq8(v, s, z, g), w1 = deq8(_mm_srli_si128(v, 8), s, z, g);
            for (int t = 0; t < T; t++) {
                acc[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * xs + k), acc[t]);
                acc[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * xs + k + 8), acc[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) out[t] = hsum256(acc[t]);
}

/* Each (instruction set, token count) its own function, so that the compiler unrolls the token
 * loops and keeps the accumulators in registers. */
#define ROWS(NAME, TARGET, ROW, T)                                                                        \
    TARGET static void NAME##_##T(const float *x, int64_t xs, const uint8_t *W, int64_t row_bytes,       \
                                  const float *S, const float *Z, int64_t groups, int64_t K,             \
                                  int64_t group, int bits, const float *bias, float *y, int64_t N,       \
                                  int64_t lo, int64_t hi) {                                              \
        float out[T_MAX];                                                                                \
        for (int64_t n = lo; n < hi; n++) {                                                              \
            ROW(x, xs, W + n * row_bytes, S + n * groups, Z + n * groups, K, group, bits, T, out);       \
            for (int t = 0; t < T; t++) y[t * N + n] = out[t] + (bias ? bias[n] : 0.0f);                 \
        }                                                                                                \
    }
ROWS(avx512, T_AVX512, row_avx512, 1)
ROWS(avx512, T_AVX512, row_avx512, 2)
ROWS(avx512, T_AVX512, row_avx512, 3)
ROWS(avx512, T_AVX512, row_avx512, 4)
ROWS(avx2, T_AVX2, row_avx2, 1)
ROWS(avx2, T_AVX2, row_avx2, 2)
ROWS(avx2, T_AVX2, row_avx2, 3)
ROWS(avx2, T_AVX2, row_avx2, 4)

typedef void (*rows_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *, const float *, int64_t,
                        int64_t, int64_t, int, const float *, float *, int64_t, int64_t, int64_t);
static const rows_fn AVX512_ROWS[T_MAX] = {avx512_1, avx512_2, avx512_3, avx512_4};
static const rows_fn AVX2_ROWS[T_MAX] = {avx2_1, avx2_2, avx2_3, avx2_4};

/* y [M, N] = x [M, K] (rows at x_stride floats) times W^T, plus bias [N] or NULL. K is a multiple of
 * 32 (4 bits) or 16 (8 bits), group of 16; `isa` one that decode_gemm.c's
 * orca_decode_gemm_isa_supported accepts (its AVX512-BF16 set runs the AVX-512 path here). */
void orca_int_linear_f32(const float *x, int64_t x_stride, int64_t M, const uint8_t *W, const float *scales,
                         const float *zeros, int64_t N, int64_t K, int64_t group, int bits, const float *bias,
                         float *y, int num_threads, int isa) {
    const rows_fn *fns = isa == ISA_AVX2 ? AVX2_ROWS : AVX512_ROWS;
    const int64_t row_bytes = bits == 4 ? K / 2 : K, groups = K / group;
    const int64_t chunks = (N + CHUNK_ROWS - 1) / CHUNK_ROWS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t lo = c * CHUNK_ROWS, hi = lo + CHUNK_ROWS < N ? lo + CHUNK_ROWS : N;
        for (int64_t m = 0; m < M; m += T_MAX) {
            const int t = M - m < T_MAX ? (int)(M - m) : T_MAX;
            fns[t - 1](x + m * x_stride, x_stride, W, row_bytes, scales, zeros, groups, K, group, bits,
                       bias, y + m * N, N, lo, hi);
        }
    }
}

/* The float32 weight [N, K] the layout stands for (long steps dequantize, then multiply with a GEMM
 * library): the same products as the kernel forms. */
void orca_int_dequantize_f32(const uint8_t *W, const float *scales, const float *zeros, int64_t N, int64_t K,
                             int64_t group, int bits, float *out, int num_threads) {
    const int64_t row_bytes = bits == 4 ? K / 2 : K, groups = K / group;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w = W + n * row_bytes;
        const float *s = scales + n * groups, *z = zeros + n * groups;
        float *o = out + n * K;
        for (int64_t k = 0; k < K; k++) {
            const int q = bits == 4 ? (w[(k / 32) * 16 + k % 16] >> (k % 32 < 16 ? 0 : 4)) & 15 : w[k];
            o[k] = ((float)q - z[k / group]) * s[k / group];
        }
    }
}
