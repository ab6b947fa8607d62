/* GPT-2's element-wise ops on CPU: residual-add + LayerNorm and bias + GeLU (tanh approximation),
 * float32 and bfloat16. Semantics equal the torch references in layernorm.py and gelu.py (see there);
 * the Python side is cpu_gpt2_ops.py.
 *
 * Why C: at a handful of tokens each reference is 2-3 small aten ops (add, layer_norm; add, gelu)
 * whose cost is dispatch and temporaries, and at prefill each is an extra pass over a large
 * activation. Here each op is one call that reads its inputs once and writes its outputs once.
 *
 * Rounding: the LayerNorm's mean and variance are computed as torch's CPU kernel computes them
 * (RowwiseMoments in aten/src/ATen/native/cpu/moments_utils.h: Welford updates per vector lane in
 * chunks of 16 vectors, combined in a cascade, then the scalar tail and the lanes), so that the
 * statistics are as accurate as torch's: the mean equals torch's, the variance usually does (see
 * row_moments). The output is fma((s - mean) * rstd, weight, bias), as torch rounds it. The GeLU's tanh is computed
 * here (a vectorisable exp-based form, a few ulp), not by SLEEF as torch does, so GeLU outputs may
 * differ from torch's in the last bits; see bias_gelu below. Floating-point contraction is off
 * (elementwise.h) so that each operation rounds as written; the fmaf calls are explicit.
 *
 * Threads: rows (tokens) are spread over num_threads OpenMP threads (torch's own libgomp), but
 * only when there is enough work: at one decode token a parallel region would cost more than the
 * op.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "elementwise.h" /* contraction off, no-trapping-math, PARALLEL_MIN_ELEMENTS, the norms' residual adds, bf16.h */

#define MAX_LANES 16
#define CHUNK 16     /* kChunkSize in torch's moments_utils.h: vectors per Welford chunk */
#define MAX_DEPTH 64 /* cascade levels: ceil(log2(chunks)) <= 64 */

static int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll((unsigned long long)(x - 1)); }

/* Merges the moments (m0_add, m1_add[l], m2_add[l]) into (*m0, m1[l], m2[l]) lane by lane, as
 * torch's AddMomentsVec: c = m0_add / n in float, m2 += m2_add + delta * delta * c * m0. */
static inline void add_moments_vec(int64_t m0_add, const float *m1_add, const float *m2_add, int64_t *m0, float *m1,
                                   float *m2, int64_t lanes) {
    const int64_t n = *m0 + m0_add;
    const float c = n == 0 ? 0.0f : (float)m0_add / (float)n;
    const float old = (float)*m0;
    for (int64_t l = 0; l < lanes; l++) {
        const float delta = m1_add[l] - m1[l];
        m1[l] += c * delta;
        m2[l] += m2_add[l] + delta * delta * c * old;
    }
    *m0 = n;
}

/* Mean and (biased) variance of s[0..n) in float, in the order of torch's RowwiseMoments with
 * `lanes` = Vectorized<float>::size() of torch's CPU capability (8 for AVX2 and the default build,
 * 16 for AVX512). lanes <= MAX_LANES. The fmaf calls are where torch's x86 build fuses (found by
 * comparing with torch.native_layer_norm's mean): with them the mean equals torch's bit for bit;
 * the variance, and so rstd, still differs from torch's in the last bit for some rows (where
 * torch rounds differently is not known), which moves outputs by an ulp or two. */
static void row_moments(const float *s, int64_t n, int64_t lanes, float *mean, float *var) {
    const int64_t vecs = n / lanes, chunks = (vecs + CHUNK - 1) / CHUNK, depth = ceil_log2(chunks);
    int64_t m0_stk[MAX_DEPTH] = {0};
    float m1_stk[MAX_DEPTH][MAX_LANES] = {{0.0f}}, m2_stk[MAX_DEPTH][MAX_LANES] = {{0.0f}};
    float inv[CHUNK];
    for (int j = 0; j < CHUNK; j++) inv[j] = 1.0f / (float)(j + 1);
    for (int64_t i = 0; i < chunks; i++) {
        const float *p = s + i * CHUNK * lanes;
        const int64_t m0 = vecs - i * CHUNK < CHUNK ? vecs - i * CHUNK : CHUNK;
        float m1[MAX_LANES] = {0.0f}, m2[MAX_LANES] = {0.0f};
        for (int64_t j = 0; j < m0; j++)
            for (int64_t l = 0; l < lanes; l++) {
                const float x = p[j * lanes + l], delta = x - m1[l];
                m1[l] = fmaf(delta, inv[j], m1[l]);
                m2[l] = fmaf(delta, x - m1[l], m2[l]);
            }
        add_moments_vec(m0, m1, m2, &m0_stk[0], m1_stk[0], m2_stk[0], lanes);
        int64_t mask = i + 1;
        for (int64_t j = 1; j < depth && (mask & 1) == 0; j++) {
            add_moments_vec(m0_stk[j - 1], m1_stk[j - 1], m2_stk[j - 1], &m0_stk[j], m1_stk[j], m2_stk[j], lanes);
            m0_stk[j - 1] = 0;
            memset(m1_stk[j - 1], 0, sizeof m1_stk[j - 1]);
            memset(m2_stk[j - 1], 0, sizeof m2_stk[j - 1]);
            mask >>= 1;
        }
    }
    for (int64_t j = 1; j < depth; j++)
        add_moments_vec(m0_stk[j], m1_stk[j], m2_stk[j], &m0_stk[0], m1_stk[0], m2_stk[0], lanes);
    /* the scalar tail by Welford, then each lane merged into it */
    int64_t m0 = 0;
    float m1 = 0.0f, m2 = 0.0f;
    for (int64_t i = vecs * lanes; i < n; i++) {
        const float x = s[i], delta = x - m1;
        m0++;
        m1 += delta / (float)m0;
        m2 += delta * (x - m1);
    }
    for (int64_t l = 0; l < lanes; l++) {
        const int64_t total = m0 + vecs;
        const float c = total == 0 ? 0.0f : (float)vecs / (float)total;
        const float delta = m1_stk[0][l] - m1;
        m1 = fmaf(c, delta, m1);
        m2 += fmaf(delta * delta * c, (float)m0, m2_stk[0][l]);
        m0 = total;
    }
    *mean = m1;
    *var = m2 / (float)n;
}

/* out[r] = fma((s - mean) * rstd, weight, bias) (torch's kernel ends in one fused multiply-add) with s = x[r] + residual[r] (written to summed[r]) or
 * s = x[r] when residual is NULL; rstd = 1 / sqrtf(var + eps). x and residual rows are at
 * x_stride / res_stride floats with unit column stride; out and summed are contiguous
 * [rows, hidden]. */
void orca_add_layernorm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                            const float *weight, const float *bias, float *out, float *summed, int64_t rows,
                            int64_t hidden, float eps, int64_t lanes, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 && rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *s = add_residual_row(x + r * x_stride, residual, res_stride, summed, r, hidden);
        float mean, var;
        row_moments(s, hidden, lanes, &mean, &var);
        const float rstd = 1.0f / sqrtf((var > 0.0f ? var : 0.0f) + eps);
        float *o = out + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = fmaf((s[i] - mean) * rstd, weight[i], bias[i]);
    }
}

/* LayerNorm of bfloat16 rows: summed[r] = bf16(x + residual) (or x itself: `summed` is then unused),
 * widened to float32 (into scratch: one row of hidden floats per thread), its moments as the float32
 * kernel's, and out[r] = bf16(fma(fma(s, rstd, -mean * rstd), weight, bias)) with weight and bias
 * widened: the order torch's bfloat16 kernel computes its output in (LayerNormSecondPass), measured
 * bit for bit against it given the same moments. torch adds a bfloat16 row's moments in vectors of
 * 32 split into two float vectors, merged in another order than the float32 kernel's, so rstd may
 * differ in its last float32 bit, and an output by one bfloat16 ulp where that lands on a rounding
 * boundary (about one element in 10^4; cpu_gpt2_ops.add_layernorm_bf16_order measures it). */
void orca_add_layernorm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t res_stride,
                             const uint16_t *weight, const uint16_t *bias, uint16_t *out, uint16_t *summed,
                             int64_t rows, int64_t hidden, float eps, int64_t lanes, int num_threads, float *scratch) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 && rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *s = scratch + (int64_t)omp_get_thread_num() * hidden;
        add_residual_row_bf16(x + r * x_stride, residual, res_stride, summed, r, hidden, s);
        float mean, var;
        row_moments(s, hidden, lanes, &mean, &var);
        const float rstd = 1.0f / sqrtf((var > 0.0f ? var : 0.0f) + eps), shift = -mean * rstd;
        uint16_t *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++)
            o[i] = f32_to_bf16(fmaf(fmaf(s[i], rstd, shift), bf16_to_f32(weight[i]), bf16_to_f32(bias[i])));
    }
}

#include "expf_sleef.h" /* SLEEF's expf_u10 (1 ulp), as torch's SiLU and llama_ops.c use */

/* tanh(u) within a few ulp, vectorisable: for |u| < 0.5 its Taylor series to u**19 (truncation
 * below 1e-10 relative), beyond 1 - 2 / (exp(2|u|) + 1) with u's sign (which saturates to +-1
 * once exp overflows). */
static inline float tanhf_approx(float u) {
    const float a = fabsf(u), z = u * u;
    float p = -2.3912911424355248e-04f;
    p = p * z + 5.9002744094558600e-04f;
    p = p * z + -1.4558343870513183e-03f;
    p = p * z + 3.5921280365724810e-03f;
    p = p * z + -8.8632355299021970e-03f;
    p = p * z + 2.1869488536155203e-02f;
    p = p * z + -5.3968253968253970e-02f;
    p = p * z + 1.3333333333333333e-01f;
    p = p * z + -3.3333333333333333e-01f;
    const float small = u + u * (z * p);
    const float big = copysignf(1.0f - 2.0f / (expf_sleef_u10(2.0f * a) + 1.0f), u);
    return a < 0.5f ? small : big;
}

/* out[r] = gelu_tanh(x[r] + bias) for x rows at x_stride elements (unit column stride) into
 * contiguous out [rows, inner], rounded operation by operation as torch's GeluKernel writes it:
 * v = x + bias; inner = kBeta * (v + kKappa * (v * v * v)); 0.5 * v * (1 + tanh(inner)).
 * bfloat16 rows: v is the sum rounded to bfloat16 (torch's add rounds to the tensors' dtype), the
 * GeLU of v runs in float32 and rounds once to bfloat16, as torch's kernel widens bfloat16 to float;
 * with this file's tanh an output can differ from torch's by one bfloat16 ulp where the float32
 * result lies within a few float32 ulps of a rounding boundary. */
#define DEFINE_BIAS_GELU(NAME, T, LOAD, KEEP, STORE)                                                          \
    void NAME(const T *x, int64_t x_stride, const T *bias, T *out, int64_t rows, int64_t inner, int num_threads) { \
        const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;                           \
        _Pragma("omp parallel for num_threads(num_threads) if (rows > 1 && rows * inner >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++) {                                                                 \
            const T *xr = x + r * x_stride;                                                                  \
            T *o = out + r * inner;                                                                          \
            _Pragma("omp simd")                                                                              \
            for (int64_t i = 0; i < inner; i++) {                                                            \
                const float v = KEEP(LOAD(xr[i]) + LOAD(bias[i]));                                           \
                const float cube = v * v * v;                                                                \
                const float t = tanhf_approx(beta * (v + kappa * cube));                                     \
                o[i] = STORE(0.5f * v * (1.0f + t));                                                         \
            }                                                                                                \
        }                                                                                                    \
    }
#define F32_SAME(v) (v)
#define BF16_KEEP(v) bf16_to_f32(f32_to_bf16(v))
DEFINE_BIAS_GELU(orca_bias_gelu_f32, float, F32_SAME, F32_SAME, F32_SAME)
DEFINE_BIAS_GELU(orca_bias_gelu_bf16, uint16_t, bf16_to_f32, BF16_KEEP, f32_to_bf16)
