/* Decode attention on CPU for selective batching, float32.
 *
 * For every request whose step has exactly one query (a decode, or a one-token prompt), attends
 * that query over the request's whole context in its own contiguous K/V region. Requests with
 * more queries (prefills) are skipped: the caller handles them. Semantics equal attention_torch in
 * attention.py: out = softmax(scale * q.K^T) V per head, fp32 throughout.
 *
 * Why C: in torch this is a Python loop of ~6 small ops per request and layer (~0.15 ms each, a
 * third of it dispatch); here it is one call per layer that streams each K/V row once, in memory
 * order, with requests spread over the OpenMP threads of the caller (torch's own libgomp: same
 * soname, so the process has one OpenMP runtime).
 *
 * Layouts: q rows at q_row_stride floats, heads at q_head_stride; caches and out are contiguous
 * [slots or tokens, heads, head_dim]; scratch is [num_threads, heads, max_context].
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static void attend_one(const float *q, int64_t q_head_stride, const float *k, const float *v, float *out,
                       int64_t ctx, int64_t heads, int64_t head_dim, float scale, float *scores) {
    const int64_t row = heads * head_dim;
    for (int64_t t = 0; t < ctx; t++) /* K rows in memory order: all heads of a token at once */
        for (int64_t h = 0; h < heads; h++)
            scores[h * ctx + t] = scale * dot(q + h * q_head_stride, k + t * row + h * head_dim, head_dim);
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * ctx, max = s[0], sum = 0.0f;
        for (int64_t t = 1; t < ctx; t++) max = s[t] > max ? s[t] : max;
        for (int64_t t = 0; t < ctx; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
    }
    for (int64_t i = 0; i < row; i++) out[i] = 0.0f;
    for (int64_t t = 0; t < ctx; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float p = scores[h * ctx + t], *vt = v + t * row + h * head_dim;
            float *o = out + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] += p * vt[d];
        }
}

void orca_decode_attention_f32(const float *q, int64_t q_row_stride, int64_t q_head_stride, const float *k_cache,
                               const float *v_cache, float *out, const int32_t *query_start,
                               const int32_t *context_lens, const int32_t *kv_starts, int64_t num_requests,
                               int64_t heads, int64_t head_dim, int64_t max_context, float scale, float *scratch,
                               int num_threads) {
    const int64_t row = heads * head_dim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t r = 0; r < num_requests; r++) {
        const int64_t first = query_start[r];
        if (query_start[r + 1] - first != 1) continue;
        const int64_t region = (int64_t)kv_starts[r] * row;
        attend_one(q + first * q_row_stride, q_head_stride, k_cache + region, v_cache + region, out + first * row,
                   context_lens[r], heads, head_dim, scale, scratch + omp_get_thread_num() * heads * max_context);
    }
}
