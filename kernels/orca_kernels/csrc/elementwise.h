/* What the element-wise libraries (llama_ops.c, gpt2_ops.c) share: how they round, when they use
 * threads, and their norms' fused residual add. Include it before any function.
 *
 * Rounding: floating-point contraction is off, so that each operation rounds as written; with
 * -march=native the compiler would otherwise fuse `a * b - c * d` into one fma, rounded unlike
 * torch's separate mul and sub. The fmaf calls in these files are explicit. no-trapping-math
 * changes no value (only whether FP exceptions may trap); without it GCC will not turn the selects
 * of the SiLU's exp and the GeLU's tanh into blends, and those loops stay scalar.
 *
 * Threads: rows (tokens) go to OpenMP threads (torch's own libgomp) only when a call touches at
 * least PARALLEL_MIN_ELEMENTS floats (~10 us of work): at one decode token a parallel region would
 * cost more than the op. */
#ifndef ORCA_ELEMENTWISE_H
#define ORCA_ELEMENTWISE_H

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

#define PARALLEL_MIN_ELEMENTS (1 << 15)

#include <stdint.h>

/* The residual add the norm kernels fuse, for row r: with a residual, writes s + residual's row r
 * into summed's row r (contiguous [rows, hidden]) and returns it; without one, returns s. */
static inline const float *add_residual_row(const float *s, const float *residual, int64_t res_stride, float *summed,
                                            int64_t r, int64_t hidden) {
    if (!residual) return s;
    const float *res = residual + r * res_stride;
    float *sum = summed + r * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) sum[i] = s[i] + res[i];
    return sum;
}

#include "bf16.h" /* after the pragma above: it must cover these helpers for them to inline and vectorise */

/* The bfloat16 norms' residual add for row r, widened: with a residual, writes bf16(x + residual)
 * (torch's bfloat16 add) into summed's row r and its float32 values into s; without one, x's row
 * widened into s. */
static inline void add_residual_row_bf16(const uint16_t *x, const uint16_t *residual, int64_t res_stride,
                                         uint16_t *summed, int64_t r, int64_t hidden, float *s) {
    if (!residual) {
        for (int64_t i = 0; i < hidden; i++) s[i] = bf16_to_f32(x[i]);
        return;
    }
    const uint16_t *res = residual + r * res_stride;
    uint16_t *sum = summed + r * hidden;
    for (int64_t i = 0; i < hidden; i++) {
        sum[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i]));
        s[i] = bf16_to_f32(sum[i]);
    }
}

#endif
