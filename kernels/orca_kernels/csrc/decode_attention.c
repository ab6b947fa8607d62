/* Decode attention on CPU for selective batching, float32 or bfloat16 (over a pool of that dtype or
 * of FP8), with grouped-query attention (GQA).
 *
 * For every request whose step has at most max_short queries (a decode, a one-token prompt, a
 * speculative verify of 1 + k tokens, a short prompt chunk), attends each query over the request's
 * context up to its own position in the paged K/V pool: query t of n sits at position
 * ctx - n + t, so it is a decode of context ctx - n + t + 1 (causal within the step). Requests with
 * more queries (long prefills) are skipped: the caller handles them. Semantics equal
 * attention_torch in attention.py: out = softmax(scale * q.K^T) V per head, fp32 throughout; a
 * query computes the same whether it came alone or with others of its request.
 *
 * Sliding window and soft-capping (per layer; 0: none). With window > 0 the query, at position
 * ctx - 1, sees only keys [start, ctx) with start = max(ctx - window, 0), and the walk begins at
 * block start / block_size, offset start % block_size: table entries (and K/V) before it are
 * never read, since the scheduler may have freed those blocks and left -1 in their entries. With
 * softcap > 0 each score s = scale * q.k becomes softcap * tanhf(s / softcap) before the softmax
 * (Gemma 2). With both 0 the arithmetic, and its order, is exactly that of the plain kernel.
 *
 * Paged K/V: the pool is cut into blocks of block_size consecutive slots, and row r of
 * block_tables (block_table_stride int32 per row) lists request r's blocks in context order, so
 * context token j is slot block_tables[r][j / block_size] * block_size + j % block_size. Only the
 * first ceil(ctx / block_size) entries of a row are read (the rest is padding), and of the last
 * block only its first ctx % block_size slots when that is not 0; with a window, neither are the
 * entries before the window's block nor the slots before its start.
 *
 * GQA: q has q_heads heads and the K/V pool kv_heads heads (q_heads % kv_heads == 0, checked by
 * the caller); query head h reads KV head h / group with group = q_heads / kv_heads. kv_heads ==
 * q_heads is plain multi-head attention, kv_heads == 1 multi-query attention. K/V is never
 * repeated: each KV head's row is streamed from memory once per request and used, while it sits
 * in L1, by all `group` query heads that share it. Decode is memory-bound on the K/V stream, so
 * this is what makes GQA's smaller cache a speed-up and not only a memory saving.
 *
 * Why C: in torch this is a Python loop of ~6 small ops per request and layer (~0.15 ms each, a
 * third of it dispatch, plus a gather of the context out of its blocks); here it is one call per
 * layer that streams each K/V row once, in place, with requests spread over the OpenMP threads of
 * the caller (torch's own libgomp: same soname, so the process has one OpenMP runtime). A block's
 * tokens are consecutive rows, so the walk goes block by block and, inside a block, straight
 * through memory: one table lookup per block, and the prefetcher sees block_size-row runs.
 *
 * Layouts: q rows at q_row_stride elements, heads at q_head_stride; caches are contiguous
 * [slots, kv_heads, head_dim] (slots = num_blocks * block_size); block_tables is [requests,
 * block_table_stride] int32; out is contiguous [tokens, q_heads, head_dim]; scratch is per thread
 * (see the entry points; a window only shortens the rows used).
 *
 * FP8 pools (kv_cache_dtype fp8): one byte per element, read back through a per-head table of the
 * 256 codes' values (fp8_row), so both FP8 formats and any scale take the same code.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "expf_sleef.h"

/* Asks for the `bytes` at p ahead of their use: each token of a block fetches its row of the next
 * block (a block's rows are contiguous, but the next block can sit anywhere in the pool, where the
 * hardware prefetcher does not follow). */
static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* A K or V row (of K/V head g) as float32: a float32 pool's own row; a bfloat16 one's widened into
 * `buf` (exact); an FP8 one's read back into `buf` through its head's table: lut[g * 256 + code] is
 * what the byte `code` stands for under head g's scale, rounded to the model's dtype (KVScales.tables
 * in attention.py), so one lookup replaces the conversion, the multiply and the rounding. */
#define F32_ROW(row, buf, n, lut, g) (row)
static inline const float *bf16_row(const uint16_t *row, float *buf, int64_t n, const float *lut, int64_t g) {
    (void)lut, (void)g;
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(row[i]);
    return buf;
}
static inline const float *fp8_row(const uint8_t *row, float *buf, int64_t n, const float *lut, int64_t g) {
    const float *table = lut + g * 256;
    for (int64_t i = 0; i < n; i++) buf[i] = table[row[i]];
    return buf;
}

/* One query token (q_heads heads, float32) at position ctx - 1 over its visible keys [start, ctx) of
 * K/V (kv_heads heads each, elements of KV_T, each row as float32 through ROW) held in the blocks
 * listed by `blocks`, into out (q_heads * head_dim floats); start is 0, or the sliding window's
 * first key. scores holds q_heads rows of ctx - start floats; row_buf head_dim floats (bfloat16).
 *
 * Both passes walk the keys in token order, block by block; a block's tokens are consecutive
 * kv_heads * head_dim rows of the pool, so within a block the walk is in memory order. Within a
 * token it goes KV head by KV head; each KV head's head_dim elements are then reused for the `group`
 * consecutive query heads g * group .. g * group + group - 1. Per (query head, token) the
 * arithmetic, and the order in which a head's output sums over tokens, depend neither on group nor
 * on the block layout, so kv_heads == q_heads computes exactly what the multi-head kernel did.
 * A bfloat16 pool's rows are widened to float32 as they are read (exact), and an FP8 pool's are
 * looked up, so their arithmetic is the float32 kernel's, operation for operation. */
#define DEFINE_ATTEND_ONE(NAME, KV_T, ROW)                                                                   \
    static void NAME(const float *q, int64_t q_head_stride, const KV_T *k_cache, const KV_T *v_cache,         \
                     const int32_t *blocks, int64_t block_size, float *out, int64_t ctx, int64_t start,       \
                     int64_t q_heads, int64_t kv_heads, int64_t head_dim, float scale, float softcap,         \
                     const float *k_lut, const float *v_lut, float *scores, float *row_buf) {                \
        const int64_t group = q_heads / kv_heads;                                                            \
        const int64_t kv_row = kv_heads * head_dim; /* elements per token in the K/V pool */                 \
        const int64_t block_elems = block_size * kv_row;                                                     \
        const int64_t keys = ctx - start; /* the length of each query head's row of scores */                \
        for (int64_t i = 0; i < q_heads * head_dim; i++) out[i] = 0.0f;                                      \
        /* nothing to attend to: a padded row of a CUDA-graph bucket gets zeros (s[0] is never read) */     \
        if (keys < 1) return;                                                                                \
        /* Block b holds keys t0 = b * block_size onwards; the walk starts at start's block, which it        \
         * enters at row start - t0 (0 without a window). Key t0 + t's score is entry t0 + t - start of      \
         * its head's row. */                                                                                \
        const int64_t first = start / block_size;                                                            \
        for (int64_t t0 = first * block_size, b = first; t0 < ctx; t0 += block_size, b++) {                 \
            const KV_T *kb = k_cache + blocks[b] * block_elems; /* int64: the offset can pass 2**31 */       \
            const int64_t len = ctx - t0 < block_size ? ctx - t0 : block_size;                               \
            const KV_T *next = t0 + block_size < ctx ? k_cache + blocks[b + 1] * block_elems : NULL;          \
            for (int64_t t = t0 < start ? start - t0 : 0; t < len; t++) {                                   \
                if (next) prefetch(next + t * kv_row, kv_row * (int64_t)sizeof(KV_T));                       \
                for (int64_t g = 0; g < kv_heads; g++) {                                                     \
                    /* read from memory once for the group */                                                \
                    const float *kt = ROW(kb + t * kv_row + g * head_dim, row_buf, head_dim, k_lut, g);            \
                    for (int64_t h = g * group; h < (g + 1) * group; h++) {                                  \
                        float s = scale * dot(q + h * q_head_stride, kt, head_dim);                          \
                        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);                                \
                        scores[h * keys + t0 + t - start] = s;                                               \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int64_t h = 0; h < q_heads; h++) { /* softmax of each query head's row, max-subtracted */       \
            float *s = scores + h * keys, max = s[0], sum = 0.0f;                                            \
            for (int64_t t = 1; t < keys; t++) max = s[t] > max ? s[t] : max;                                \
            /* a vectorised exp (SLEEF's, 1 ulp): libm's expf, one call a key, cost as much as the rest */   \
            _Pragma("omp simd reduction(+ : sum)")                                                           \
            for (int64_t t = 0; t < keys; t++) {                                                             \
                s[t] = expf_sleef_u10(s[t] - max);                                                           \
                sum += s[t];                                                                                 \
            }                                                                                                \
            const float inv = 1.0f / sum; /* sum >= 1: the max term is exp(0) */                             \
            for (int64_t t = 0; t < keys; t++) s[t] *= inv;                                                  \
        }                                                                                                    \
        for (int64_t t0 = first * block_size, b = first; t0 < ctx; t0 += block_size, b++) {                 \
            const KV_T *vb = v_cache + blocks[b] * block_elems;                                              \
            const int64_t len = ctx - t0 < block_size ? ctx - t0 : block_size;                               \
            const KV_T *next = t0 + block_size < ctx ? v_cache + blocks[b + 1] * block_elems : NULL;          \
            for (int64_t t = t0 < start ? start - t0 : 0; t < len; t++) {                                   \
                if (next) prefetch(next + t * kv_row, kv_row * (int64_t)sizeof(KV_T));                       \
                for (int64_t g = 0; g < kv_heads; g++) {                                                     \
                    const float *vt = ROW(vb + t * kv_row + g * head_dim, row_buf, head_dim, v_lut, g);            \
                    for (int64_t h = g * group; h < (g + 1) * group; h++) {                                  \
                        const float p = scores[h * keys + t0 + t - start];                                   \
                        float *o = out + h * head_dim;                                                       \
                        _Pragma("omp simd")                                                                  \
                        for (int64_t d = 0; d < head_dim; d++) o[d] += p * vt[d];                            \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
DEFINE_ATTEND_ONE(attend_one, float, F32_ROW)
DEFINE_ATTEND_ONE(attend_one_bf16, uint16_t, bf16_row)
DEFINE_ATTEND_ONE(attend_one_fp8, uint8_t, fp8_row)

/* The query token t of a step: its request r (bisecting query_start), and whether it is attended
 * here (its request has at most max_short queries); then its context and window start. */
static inline int locate(const int32_t *query_start, const int32_t *context_lens, int64_t num_requests,
                         int64_t t, int64_t max_short, int64_t window, int64_t *r_out, int64_t *ctx_out,
                         int64_t *start_out) {
    int64_t lo = 0, hi = num_requests; /* the r with query_start[r] <= t < query_start[r + 1] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (query_start[mid] <= t) lo = mid; else hi = mid;
    }
    const int64_t r = lo, n = query_start[r + 1] - query_start[r];
    if (n > max_short) return 0;
    const int64_t ctx = context_lens[r] - n + (t - query_start[r]) + 1; /* this query's own context */
    *r_out = r;
    *ctx_out = ctx;
    *start_out = window > 0 && ctx > window ? ctx - window : 0; /* the window's first key */
    return 1;
}

/* The entry points, one per (query dtype, pool dtype): float32 queries over a float32 or FP8 pool,
 * bfloat16 ones over a bfloat16 or FP8 pool. The caller guarantees (attention_cpu checks) q_heads %
 * kv_heads == 0, kv_heads >= 1, block_size >= 1, window >= 0, softcap >= 0, rows of at least
 * ceil(max_context / block_size) blocks, and for an FP8 pool the tables k_lut and v_lut ([kv_heads,
 * 256] floats each; NULL otherwise); the block ids the walk reads are trusted to lie in the pool, as
 * slot_mapping's slots are by write_kv. One task per query token (a verify step at batch 1 still
 * fills every thread). */
#define ENTRY_ARGS(Q_T, KV_T)                                                                                \
    const Q_T *q, int64_t q_row_stride, int64_t q_head_stride, const KV_T *k_cache, const KV_T *v_cache,      \
        Q_T *out, const int32_t *query_start, const int32_t *context_lens, const int32_t *block_tables,       \
        int64_t block_table_stride, int64_t block_size, int64_t num_requests, int64_t q_heads,                \
        int64_t kv_heads, int64_t head_dim, int64_t max_context, float scale, int64_t window, float softcap,   \
        const float *k_lut, const float *v_lut, float *scratch, int num_threads, int64_t max_short

/* float32 queries: scratch is [num_threads, q_heads * max_context + head_dim] floats, the scores
 * and one read-back K/V row. */
#define DEFINE_F32_ENTRY(NAME, KV_T, ATTEND)                                                                 \
    void NAME(ENTRY_ARGS(float, KV_T)) {                                                                      \
        const int64_t out_row = q_heads * head_dim, tokens = query_start[num_requests];                      \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                            \
        for (int64_t t = 0; t < tokens; t++) {                                                               \
            int64_t r, ctx, start;                                                                           \
            if (!locate(query_start, context_lens, num_requests, t, max_short, window, &r, &ctx, &start))    \
                continue;                                                                                    \
            float *scores = scratch + (int64_t)omp_get_thread_num() * (q_heads * max_context + head_dim);    \
            ATTEND(q + t * q_row_stride, q_head_stride, k_cache, v_cache, block_tables + r * block_table_stride, \
                   block_size, out + t * out_row, ctx, start, q_heads, kv_heads, head_dim, scale, softcap,   \
                   k_lut, v_lut, scores, scores + q_heads * max_context);                                   \
        }                                                                                                    \
    }

/* bfloat16 queries and output (their 16-bit patterns): each query is widened to float32, attended
 * in float32 as above, and its output rounded to bfloat16 once. scratch is [num_threads, q_heads *
 * (max_context + 2 * head_dim) + head_dim] floats: the scores, the widened query, the output and
 * one read-back K/V row. */
#define DEFINE_BF16_ENTRY(NAME, KV_T, ATTEND)                                                                \
    void NAME(ENTRY_ARGS(uint16_t, KV_T)) {                                                                   \
        const int64_t out_row = q_heads * head_dim, tokens = query_start[num_requests];                      \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                            \
        for (int64_t t = 0; t < tokens; t++) {                                                               \
            int64_t r, ctx, start;                                                                           \
            if (!locate(query_start, context_lens, num_requests, t, max_short, window, &r, &ctx, &start))    \
                continue;                                                                                    \
            float *scores = scratch + (int64_t)omp_get_thread_num() *                                        \
                                          (q_heads * (max_context + 2 * head_dim) + head_dim);               \
            float *q32 = scores + q_heads * max_context, *o32 = q32 + out_row, *row_buf = o32 + out_row;     \
            for (int64_t h = 0; h < q_heads; h++)                                                            \
                for (int64_t d = 0; d < head_dim; d++)                                                       \
                    q32[h * head_dim + d] = bf16_to_f32(q[t * q_row_stride + h * q_head_stride + d]);        \
            ATTEND(q32, head_dim, k_cache, v_cache, block_tables + r * block_table_stride, block_size, o32,  \
                   ctx, start, q_heads, kv_heads, head_dim, scale, softcap, k_lut, v_lut, scores, row_buf);  \
            for (int64_t i = 0; i < out_row; i++) out[t * out_row + i] = f32_to_bf16(o32[i]);              \
        }                                                                                                    \
    }

DEFINE_F32_ENTRY(orca_decode_attention_f32, float, attend_one)
DEFINE_F32_ENTRY(orca_decode_attention_fp8_f32, uint8_t, attend_one_fp8)
DEFINE_BF16_ENTRY(orca_decode_attention_bf16, uint16_t, attend_one_bf16)
DEFINE_BF16_ENTRY(orca_decode_attention_fp8_bf16, uint8_t, attend_one_fp8)

/* Writes each new token's K and V row (row_bytes each: kv_heads * head_dim elements of any dtype,
 * contiguous within the token) into its pool slot. A negative slot is a padded row of a CUDA-graph
 * bucket (worker/cuda_graphs.py) and writes nothing, so a padded batch keeps the shape of a live
 * one and leaves the pool as the live rows alone would. Slots are trusted to lie in the pool. */
void orca_write_kv(const char *k, int64_t k_row_stride, const char *v, int64_t v_row_stride, char *k_cache,
                   char *v_cache, const int64_t *slots, int64_t tokens, int64_t row_bytes) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, k + t * k_row_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, v + t * v_row_stride, (size_t)row_bytes);
    }
}
