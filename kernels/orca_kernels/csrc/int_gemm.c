/* The linear layer of a decode step over integer weights on CPU: y = x W^T (+ bias), W stored as 4- or
 * 8-bit unsigned integers with a float32 scale and zero point per group of input columns, x and y
 * float32.
 *
 * Layout (kernels/orca_kernels/cpu_int_gemm.py writes it at load): row n of W is K / 2 bytes (4 bits)
 * or K bytes (8 bits). At 4 bits each 32 columns are 16 bytes, four 32-bit words d0..d3: column
 * 16 h + i is nibble 4 h + i / 4 of word i % 4. A 16-byte load broadcast over a vector and shifted
 * lane by lane then puts 16 consecutive columns in the low 4 bits of 16 lanes (8 on AVX2), with no
 * byte shuffle (the checkpoints' nibble orders would need one).
 * scales and zeros are [N, K / group], K and group multiples of 32; weight (n, k) stands for
 * (q - zeros[n][g]) * scales[n][g], g = k / group: formed in float32 exactly as the torch reference
 * forms it (a subtraction of whole numbers, then one rounded product), then multiplied with x.
 *
 * Why: a decode step reads every weight once, so its time is the weights' bytes over the memory
 * bandwidth; at 4 bits that is an eighth of float32's, and the unpacking, not memory, becomes the
 * cost. On AVX-512 a 4-bit weight is looked up, not converted: each group's 16 possible values
 * (q - z) * s are formed once (the reference's products exactly) and VPERMPS picks a lane's from
 * its low 4 bits, three instructions per 16 weights with the shift and the FMA. The unpacking is
 * paid once per weight row whatever the number of tokens (up to T_MAX tokens share a
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
#define R_MAX 4
#define CHUNK_ROWS 32

#define T_AVX2 __attribute__((target("avx2,fma")))
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define INLINE static inline __attribute__((always_inline))

/* ---- AVX-512: 16 columns a vector ---- */

T_AVX512 INLINE __m512 deq16(__m128i bytes, __m512 s, __m512 z) {
    return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), z), s);
}

/* (q - z) * s for q = 0..15, lane q. */
T_AVX512 INLINE __m512 deq16_iota(__m512 s, __m512 z) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_mul_ps(_mm512_sub_ps(iota, z), s);
}

/* R weight rows against T tokens: out[r][t] = w_r . x[t], a group at a time (its scale and zero point
 * broadcast once), 32 columns a step. Each (row, token) sums into two accumulators (the halves of
 * a step), so that R * 2 independent
 * FMA chains hide the FMA's latency at one token. */
T_AVX512 INLINE void rows_avx512(const float *x, int64_t xs, const uint8_t *W, int64_t row_bytes, const float *S,
                                 const float *Z, int64_t groups, int64_t K, int64_t group, int bits, int R, int T,
                                 float out[R_MAX][T_MAX]) {
    __m512 acc[R_MAX][T_MAX][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
    const __m512i lo = _mm512_set_epi32(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(16));
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
        __m512 sv[R_MAX], zv[R_MAX], table[R_MAX];
        for (int r = 0; r < R; r++) {
            sv[r] = _mm512_set1_ps(S[r * groups + g]), zv[r] = _mm512_set1_ps(Z[r * groups + g]);
            table[r] = deq16_iota(sv[r], zv[r]); /* the group's 16 values (4 bits) */
        }
        if (bits == 4) {
            for (int64_t k = k0; k < k0 + group; k += 32) {
                for (int r = 0; r < R; r++) {
                    const __m512i v =
                        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(W + r * row_bytes + k / 2)));
                    const __m512 w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, lo), table[r]);
                    const __m512 w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, hi), table[r]);
                    for (int t = 0; t < T; t++) {
                        acc[r][t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * xs + k), acc[r][t][0]);
                        acc[r][t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * xs + k + 16), acc[r][t][1]);
                    }
                }
            }
        } else {
            for (int64_t k = k0; k < k0 + group; k += 32) {
                for (int r = 0; r < R; r++) {
                    const uint8_t *w = W + r * row_bytes + k;
                    const __m512 w0 = deq16(_mm_loadu_si128((const __m128i *)w), sv[r], zv[r]);
                    const __m512 w1 = deq16(_mm_loadu_si128((const __m128i *)(w + 16)), sv[r], zv[r]);
                    for (int t = 0; t < T; t++) {
                        acc[r][t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * xs + k), acc[r][t][0]);
                        acc[r][t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * xs + k + 16), acc[r][t][1]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) out[r][t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1]));
}

/* ---- AVX2: 8 columns a vector ---- */

T_AVX2 INLINE __m256 deq8(__m128i bytes, __m256 s, __m256 z) {
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), z), s);
}

T_AVX2 INLINE __m256 deq8_shifted(__m256i words, __m256i shifts, __m256 s, __m256 z) {
    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(words, shifts), _mm256_set1_epi32(15));
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), z), s);
}

T_AVX2 INLINE float hsum256(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

T_AVX2 INLINE void rows_avx2(const float *x, int64_t xs, const uint8_t *W, int64_t row_bytes, const float *S,
                             const float *Z, int64_t groups, int64_t K, int64_t group, int bits, int R, int T,
                             float out[R_MAX][T_MAX]) {
    __m256 acc[R_MAX][T_MAX][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    /* lane shifts bringing columns 0-7, 8-15, 16-23, 24-31 of a 4-bit block down to the low 4 bits */
    const __m256i s0 = _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0), eight = _mm256_set1_epi32(8);
    const __m256i s1 = _mm256_add_epi32(s0, eight), s2 = _mm256_add_epi32(s1, eight);
    const __m256i s3 = _mm256_add_epi32(s2, eight);
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
        for (int r = 0; r < R; r++) {
            const __m256 sv = _mm256_set1_ps(S[r * groups + g]), zv = _mm256_set1_ps(Z[r * groups + g]);
            const uint8_t *w = W + r * row_bytes;
            if (bits == 4) {
                for (int64_t k = k0; k < k0 + group; k += 32) {
                    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(w + k / 2)));
                    const __m256 w0 = deq8_shifted(v, s0, sv, zv), w1 = deq8_shifted(v, s1, sv, zv);
                    const __m256 w2 = deq8_shifted(v, s2, sv, zv), w3 = deq8_shifted(v, s3, sv, zv);
                    for (int t = 0; t < T; t++) {
                        const float *xt = x + t * xs + k;
                        acc[r][t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), acc[r][t][0]);
                        acc[r][t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), acc[r][t][1]);
                        acc[r][t][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xt + 16), acc[r][t][0]);
                        acc[r][t][1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xt + 24), acc[r][t][1]);
                    }
                }
            } else {
                for (int64_t k = k0; k < k0 + group; k += 16) {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(w + k));
                    const __m256 w0 = deq8(v, sv, zv), w1 = deq8(_mm_srli_si128(v, 8), sv, zv);
                    for (int t = 0; t < T; t++) {
                        acc[r][t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * xs + k), acc[r][t][0]);
                        acc[r][t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * xs + k + 8), acc[r][t][1]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) out[r][t] = hsum256(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));
}

/* Each (instruction set, token count) its own function, with the rows it takes at a time, so that
 * the compiler unrolls the row and token loops and keeps the accumulators in registers: a tile of R
 * rows, then single rows for the last N % R. A row's sums do not depend on R. */
#define ROWS(NAME, TARGET, ROWS_FN, R, T)                                                                 \
    TARGET static void NAME##_##T(const float *x, int64_t xs, const uint8_t *W, int64_t row_bytes,       \
                                  const float *S, const float *Z, int64_t groups, int64_t K,             \
                                  int64_t group, int bits, const float *bias, float *y, int64_t N,       \
                                  int64_t lo, int64_t hi) {                                              \
        float out[R_MAX][T_MAX];                                                                         \
        int64_t n = lo;                                                                                  \
        for (; n + R <= hi; n += R) {                                                                    \
            ROWS_FN(x, xs, W + n * row_bytes, row_bytes, S + n * groups, Z + n * groups, groups, K, group, \
                    bits, R, T, out);                                                                    \
            for (int r = 0; r < R; r++)                                                                  \
                for (int t = 0; t < T; t++) y[t * N + n + r] = out[r][t] + (bias ? bias[n + r] : 0.0f);  \
        }                                                                                                \
        for (; n < hi; n++) {                                                                            \
            ROWS_FN(x, xs, W + n * row_bytes, row_bytes, S + n * groups, Z + n * groups, groups, K, group, \
                    bits, 1, T, out);                                                                    \
            for (int t = 0; t < T; t++) y[t * N + n] = out[0][t] + (bias ? bias[n] : 0.0f);              \
        }                                                                                                \
    }
/* 32 vector registers on AVX-512: 4 rows up to 2 tokens (16 accumulators), then 2; 16 on AVX2. */
ROWS(avx512, T_AVX512, rows_avx512, 4, 1)
ROWS(avx512, T_AVX512, rows_avx512, 4, 2)
ROWS(avx512, T_AVX512, rows_avx512, 2, 3)
ROWS(avx512, T_AVX512, rows_avx512, 2, 4)
ROWS(avx2, T_AVX2, rows_avx2, 2, 1)
ROWS(avx2, T_AVX2, rows_avx2, 2, 2)
ROWS(avx2, T_AVX2, rows_avx2, 1, 3)
ROWS(avx2, T_AVX2, rows_avx2, 1, 4)
typedef void (*rows_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *, const float *, int64_t,
                        int64_t, int64_t, int, const float *, float *, int64_t, int64_t, int64_t);
static const rows_fn AVX512_ROWS[T_MAX] = {avx512_1, avx512_2, avx512_3, avx512_4};
static const rows_fn AVX2_ROWS[T_MAX] = {avx2_1, avx2_2, avx2_3, avx2_4};

/* y [M, N] = x [M, K] (rows at x_stride floats) times W^T, plus bias [N] or NULL. K and group are
 * multiples of 32; `isa` one that decode_gemm.c's
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
            /* column c = 16 h + i of a block: nibble 4 h + i / 4 of word i % 4 */
            const int64_t c = k % 32, h = c / 16, i = c % 16, nibble = 4 * h + i / 4;
            const int q = bits == 4 ? (w[(k / 32) * 16 + 4 * (i % 4) + nibble / 2] >> (4 * (nibble % 2))) & 15 : w[k];
            o[k] = ((float)q - z[k / group]) * s[k / group];
        }
    }
}
