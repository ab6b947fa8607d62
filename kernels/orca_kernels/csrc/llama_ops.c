/* The Llama family's element-wise ops on CPU, float32 and bfloat16: residual-add + RMSNorm, neox
 * rotary embedding, and SiLU-and-multiply. Semantics equal the torch references in rmsnorm.py, rotary.py
 * and silu.py (see there); the Python side is cpu_llama_ops.py.
 *
 * Why C: at a handful of tokens each of these is a chain of small aten ops (add, pow, mean, rsqrt,
 * mul; index, split, cat, _to_copy; slice, silu, mul) whose cost is dispatch and temporaries, not
 * arithmetic. Here each op is one call that reads its inputs once and writes its outputs once.
 *
 * Rounding follows the references operation by operation, down to the order in which torch's CPU
 * kernels add the RMSNorm's squares and the exp SiLU uses, so that outputs equal torch's (and so
 * transformers') bit for bit on x86 builds of torch: a last-bit difference can flip a greedy
 * token. That is also why floating-point contraction is off (elementwise.h): with -march=native the
 * compiler would otherwise fuse `a * b - c * d` into one fma, rounded differently from torch's
 * separate mul and sub (the fmaf calls in expf_sleef_u10 are SLEEF's own).
 *
 * Threads: rows (tokens) are spread over num_threads OpenMP threads (torch's own libgomp, as in
 * decode_attention.c), but only when there is enough work: at one decode token a parallel region
 * would cost more than the op.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "elementwise.h" /* contraction off, no-trapping-math, PARALLEL_MIN_ELEMENTS, the norms' residual adds, bf16.h */

/* bfloat16 (their 16-bit patterns): torch computes each of these ops' bfloat16 forms in float32 and
 * rounds (to nearest even) where the reference's tensors are bfloat16: the residual sum, the
 * normalised row before the weight, the product with the weight; the rotated q and k; the SiLU
 * before the multiply, and the product. The bfloat16 entry points below round at exactly those
 * points, with the float32 kernels' arithmetic in between. */

/* The sum of the fp32 squares of s[0..n) added in exactly the order of torch's CPU sum kernel
 * (cascade_sum in aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum ->
 * multi_row_sum), which `h.pow(2).mean(-1)` runs, with `lanes` = Vectorized<float>::size() of
 * torch's CPU capability (8 for AVX2 and the default build, 16 for AVX512). Any other order
 * would be as accurate but differ from torch in the last bit of about half the rows, and the
 * references follow transformers' RMSNorm so that greedy tokens match it exactly.
 *
 * torch sees the row as vectors of `lanes` floats in rows of ILP = 4 vectors: it adds those
 * rows in chunks of 2**power, carried up LEVELS levels of partial sums; then the leftover
 * vectors into the first vector, the other three vectors into it, and finally the scalar tail
 * followed by each lane in turn. */
#define ILP 4
#define LEVELS 4
#define MAX_LANES 16

static float sum_squares_torch_order(const float *s, int64_t n, int64_t lanes) {
    if (n < lanes) lanes = 1; /* torch's scalar path (scalar_inner_sum) adds like one-float vectors */
    const int64_t vecs = n / lanes, rows = vecs / ILP, width = ILP * lanes;
    const int64_t ceil_log2 = rows <= 2 ? 1 : 64 - __builtin_clzll((unsigned long long)(rows - 1));
    const int64_t power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][ILP * MAX_LANES] = {{0.0f}};
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t k = 0; k < width; k++) acc[0][k] += s[i * width + k] * s[i * width + k];
        for (int64_t j = 1; j < LEVELS; j++) {
            for (int64_t k = 0; k < width; k++) {
                acc[j][k] += acc[j - 1][k];
                acc[j - 1][k] = 0.0f;
            }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < rows; i++)
        for (int64_t k = 0; k < width; k++) acc[0][k] += s[i * width + k] * s[i * width + k];
    for (int64_t j = 1; j < LEVELS; j++)
        for (int64_t k = 0; k < width; k++) acc[0][k] += acc[j][k];
    for (int64_t v = rows * ILP; v < vecs; v++) /* whole vectors left over: into the first */
        for (int64_t l = 0; l < lanes; l++) acc[0][l] += s[v * lanes + l] * s[v * lanes + l];
    for (int64_t v = 1; v < ILP; v++)
        for (int64_t l = 0; l < lanes; l++) acc[0][l] += acc[0][v * lanes + l];
    float total = 0.0f;
    for (int64_t k = vecs * lanes; k < n; k++) total += s[k] * s[k];
    for (int64_t l = 0; l < lanes; l++) total += acc[0][l];
    return total;
}

/* out[r] = weight * (s * rsqrt(mean(s^2) + eps)) with s = x[r] + residual[r] (written to summed[r])
 * or s = x[r] when residual is NULL. x and residual rows are at x_stride / res_stride floats with
 * unit column stride; out and summed are contiguous [rows, hidden]. The mean is torch's sum
 * (above) / hidden, the rsqrt 1 / sqrtf as torch's vectorised rsqrt computes it, and each
 * product rounded in the reference's order: weight * (s * rstd). lanes <= MAX_LANES. */
void orca_add_rmsnorm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                          const float *weight, float *out, float *summed, int64_t rows, int64_t hidden, float eps,
                          int64_t lanes, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 && rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *s = add_residual_row(x + r * x_stride, residual, res_stride, summed, r, hidden);
        const float var = sum_squares_torch_order(s, hidden, lanes) / (float)hidden;
        const float rstd = 1.0f / sqrtf(var + eps);
        float *o = out + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (s[i] * rstd);
    }
}

/* RMSNorm of bfloat16 rows: summed[r] = bf16(x + residual) (or x itself: `summed` is then unused),
 * out[r] = bf16(weight * bf16(s * rstd)) with rstd from s widened to float32 (into scratch: one row
 * of hidden floats per thread) and its squares added in torch's order, as the float32 kernel. */
void orca_add_rmsnorm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t res_stride,
                           const uint16_t *weight, uint16_t *out, uint16_t *summed, int64_t rows, int64_t hidden,
                           float eps, int64_t lanes, int num_threads, float *scratch) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 && rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *s = scratch + (int64_t)omp_get_thread_num() * hidden;
        add_residual_row_bf16(x + r * x_stride, residual, res_stride, summed, r, hidden, s);
        const float var = sum_squares_torch_order(s, hidden, lanes) / (float)hidden;
        const float rstd = 1.0f / sqrtf(var + eps);
        uint16_t *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++)
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(s[i] * rstd)));
    }
}

/* One head: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], each product rounded before the sum. */
static inline void rotate_head(const float *x, float *o, const float *cos, const float *sin, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        o[i] = x1 * cos[i] - x2 * sin[i];
        o[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* One bfloat16 head, rotated in float32 as rotate_head, each output rounded to bfloat16. */
static inline void rotate_head_bf16(const uint16_t *x, uint16_t *o, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
        o[i] = f32_to_bf16(x1 * cos[i] - x2 * sin[i]);
        o[i + half] = f32_to_bf16(x2 * cos[i] + x1 * sin[i]);
    }
}

/* Rotates q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] (float32 or bfloat16 T;
 * token and head strides in elements, unit stride within a head) into contiguous q_out and k_out,
 * token t by the angles in row positions[t] of cos_sin (float32 [max_positions, head_dim] at
 * cs_stride floats per row: cos in the first half, sin in the second).
 *
 * Returns -1, or the first token whose position is outside [0, max_positions): then nothing is
 * written. Checking costs one pass over `tokens` int64s and keeps a bad position from reading
 * outside the table (torch's index would raise). */
#define DEFINE_ROTARY(NAME, T, ROTATE)                                                                       \
    int64_t NAME(const T *q, int64_t q_tok_stride, int64_t q_head_stride, const T *k, int64_t k_tok_stride,     \
                 int64_t k_head_stride, const int64_t *positions, const float *cos_sin, int64_t cs_stride,      \
                 int64_t max_positions, T *q_out, T *k_out, int64_t tokens, int64_t q_heads, int64_t k_heads,   \
                 int64_t head_dim, int num_threads) {                                                          \
        for (int64_t t = 0; t < tokens; t++)                                                                 \
            if (positions[t] < 0 || positions[t] >= max_positions) return t;                                 \
        const int64_t half = head_dim / 2;                                                                   \
        _Pragma("omp parallel for num_threads(num_threads) \
                 if (tokens > 1 && tokens * (q_heads + k_heads) * head_dim >= PARALLEL_MIN_ELEMENTS)")        \
        for (int64_t t = 0; t < tokens; t++) {                                                               \
            const float *cos = cos_sin + positions[t] * cs_stride, *sin = cos + half;                        \
            for (int64_t h = 0; h < q_heads; h++)                                                            \
                ROTATE(q + t * q_tok_stride + h * q_head_stride, q_out + (t * q_heads + h) * head_dim, cos, sin, \
                       half);                                                                                \
            for (int64_t h = 0; h < k_heads; h++)                                                            \
                ROTATE(k + t * k_tok_stride + h * k_head_stride, k_out + (t * k_heads + h) * head_dim, cos, sin, \
                       half);                                                                                \
        }                                                                                                    \
        return -1;                                                                                           \
    }
DEFINE_ROTARY(orca_rotary_f32, float, rotate_head)
DEFINE_ROTARY(orca_rotary_bf16, uint16_t, rotate_head_bf16)

#include "expf_sleef.h"

/* out[r] = silu(gate) * up for x[r] = [gate, up] (2 * inner elements of T at x_stride, unit column
 * stride) into contiguous out [rows, inner]. silu(g) = g / (1 + exp(-g)) as torch writes it,
 * rounded (KEEP: to T's precision) before the multiply like F.silu(gate) * up.
 *
 * torch's element-wise loop (aten/src/ATen/native/cpu/Loops.h, vectorized_loop) runs each row
 * in steps of two of its vectors with SLEEF's exp and the rest of the row with the scalar
 * std::exp: the same split here gives the same bits. A step is STEP * lanes elements, lanes being
 * float32's vector width: 2 for float32 rows, 4 for bfloat16 ones (whose vectors are twice as wide). */
#define F32_LOAD(v) (v)
#define F32_KEEP(v) (v)
#define BF16_KEEP(v) bf16_to_f32(f32_to_bf16(v))
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, KEEP, STORE, STEP)                                                \
    void NAME(const T *x, int64_t x_stride, T *out, int64_t rows, int64_t inner, int64_t lanes, int num_threads) { \
        const int64_t vectorised = inner - inner % (STEP * lanes);                                           \
        _Pragma("omp parallel for num_threads(num_threads) if (rows > 1 && rows * inner >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++) {                                                                 \
            const T *gate = x + r * x_stride, *up = gate + inner;                                            \
            T *o = out + r * inner;                                                                          \
            _Pragma("omp simd")                                                                              \
            for (int64_t i = 0; i < vectorised; i++) {                                                       \
                const float g = LOAD(gate[i]);                                                               \
                const float silu = KEEP(g / (1.0f + expf_sleef_u10(-g)));                                    \
                o[i] = STORE(silu * LOAD(up[i]));                                                            \
            }                                                                                                \
            for (int64_t i = vectorised; i < inner; i++) {                                                   \
                const float g = LOAD(gate[i]);                                                               \
                const float silu = KEEP(g / (1.0f + expf(-g)));                                              \
                o[i] = STORE(silu * LOAD(up[i]));                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
DEFINE_SILU_AND_MUL(orca_silu_and_mul_f32, float, F32_LOAD, F32_KEEP, F32_LOAD, 2)
DEFINE_SILU_AND_MUL(orca_silu_and_mul_bf16, uint16_t, bf16_to_f32, BF16_KEEP, f32_to_bf16, 4)
