/* Attention on CPU for selective batching, float32 or bfloat16 (over a pool of that dtype or of
 * FP8), with grouped-query attention (GQA): the decode entry points and the prefill ones.
 *
 * The decode entries take every request whose step has at most max_short queries (a decode, a
 * one-token prompt, a speculative verify of 1 + k tokens, a short prompt chunk) and attend each
 * query over the request's context up to its own position in the paged K/V pool: query t of n sits
 * at position ctx - n + t, so it is a decode of context ctx - n + t + 1 (causal within the step).
 * The prefill entries (below) take the requests with more queries, in tiles. Semantics equal
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
 * Vectors: GCC's generic vectors of LANES floats (below), so one source builds for AVX-512 or AVX2.
 *
 * FP8 pools (kv_cache_dtype fp8): one byte per element, read back through a per-head table of the
 * 256 codes' values (fp8_lanes), so both FP8 formats and any scale take the same code.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#include "bf16.h"
#include "expf_sleef.h"

/* Asks for the `bytes` at p ahead of their use: each tile of a block fetches its rows of the next
 * block (a block's rows are contiguous, but the next block can sit anywhere in the pool, where the
 * hardware prefetcher does not follow). Into L2, not L1 (locality 2: prefetcht1): a block of K or V
 * is as large as L1 (48 KB for GPT-2-small's 16 rows), and one thread streaming 64 decodes' K/V read
 * 18 GB/s against 10.5 with the rows fetched into L1 (2 threads: 28 against 21). */
static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 2);
}

/* A vector of float32 lanes in GCC's generic vectors, so one source builds for any x86-64: 16 lanes
 * (one zmm register) where -march=native has AVX-512, else 8 (one ymm; 16 would spill the
 * accumulators and split every shuffle in two: 2-3x slower on AVX2). The _u types load and store at
 * any element alignment. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float lanes_t __attribute__((vector_size(LANES * 4)));
typedef float lanes_u __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t halves_u __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t words_t __attribute__((vector_size(LANES * 4)));

/* acc + a * b in each lane with one rounding, whatever the code around it: left to the compiler, the
 * scores' `acc += q * (key or zero)` became a multiply-add for some keys of a tile and a multiply and
 * an add for others, so a score depended on where its key sat in the tile (on the block size). */
static inline lanes_t fma_lanes(lanes_t a, lanes_t b, lanes_t acc) {
#if defined(__AVX512F__)
    return (lanes_t)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
    return (lanes_t)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b; /* no multiply-add instruction: two roundings, for every key alike */
#endif
}

/* Elements [0, n) of a K/V row (n <= LANES) as float32 lanes, the lanes past n zero: a float32
 * pool's own; a bfloat16 one's widened (exact: a bfloat16 is a float32's upper half); an FP8 one's
 * read back through its head's table: lut[code] is what the byte `code` stands for under that
 * head's scale, rounded to the model's dtype (KVScales.tables in attention.py), so one lookup
 * replaces the conversion, the multiply and the rounding. */
static inline lanes_t f32_lanes(const float *row, int64_t n, const float *lut) {
    (void)lut;
    if (n == LANES) return *(const lanes_u *)row;
    float buf[LANES] = {0};
    memcpy(buf, row, (size_t)n * sizeof *row);
    return *(const lanes_u *)buf;
}
/* The other way: lanes [0, n) of x into row[0, n) (n <= LANES), nothing past them. */
static inline void store_f32_lanes(float *row, lanes_t x, int64_t n) {
    if (n == LANES) *(lanes_u *)row = x;
    else memcpy(row, &x, (size_t)n * sizeof *row);
}
static inline lanes_t bf16_lanes(const uint16_t *row, int64_t n, const float *lut) {
    (void)lut;
    halves_u h;
    if (n == LANES) {
        h = *(const halves_u *)row;
    } else {
        uint16_t buf[LANES] = {0};
        memcpy(buf, row, (size_t)n * sizeof *row);
        h = *(const halves_u *)buf;
    }
#ifdef __AVX512F__
    /* One widening instruction: GCC lowered the generic conversion below to 256-bit halves (5
     * instructions a row, the value pass's largest cost). */
    return (lanes_t)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
#else
    return (lanes_t)(__builtin_convertvector(h, words_t) << 16);
#endif
}
static inline lanes_t fp8_lanes(const uint8_t *row, int64_t n, const float *lut) {
    float buf[LANES] = {0};
    for (int64_t i = 0; i < n; i++) buf[i] = lut[row[i]];
    return *(const lanes_u *)buf;
}

/* Lane j of the result: the sum of acc[j]'s lanes. A transposing tree (each level adds the two
 * halves of every lane group, two vectors at a time), so each acc[j]'s lanes are added in the same
 * order whatever j is: a score does not depend on where its key sits in a tile. */
#define HALVES(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
static inline lanes_t sum_each(const lanes_t acc[LANES]) {
#if LANES == 16
    lanes_t a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = HALVES(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               HALVES(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = HALVES(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               HALVES(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = HALVES(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               HALVES(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return HALVES(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           HALVES(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    lanes_t b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = HALVES(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               HALVES(acc[2 * i], acc[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        c[i] = HALVES(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) + HALVES(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return HALVES(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) + HALVES(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* The largest of s[0, n) (n >= 1), LANES lanes at a time: the one-lane loop was a chain of
 * dependent compares, one a key. The same value whatever the order (no score is NaN). */
static inline float row_max(const float *s, int64_t n) {
    float max = s[0];
    int64_t t = 0;
    if (n >= LANES) {
        lanes_t m = *(const lanes_u *)s;
        for (t = LANES; t + LANES <= n; t += LANES) {
            const lanes_t x = *(const lanes_u *)(s + t);
#ifdef __AVX512F__
            m = (lanes_t)_mm512_max_ps((__m512)x, (__m512)m);
#else
            m = (lanes_t)_mm256_max_ps((__m256)x, (__m256)m);
#endif
        }
        float lanes[LANES];
        *(lanes_u *)lanes = m;
        for (int j = 0; j < LANES; j++) max = lanes[j] > max ? lanes[j] : max;
    }
    for (; t < n; t++) max = s[t] > max ? s[t] : max;
    return max;
}

/* The value pass over one block's keys [lo, len) for the `heads` query heads of one K/V head: out[i]
 * (head i's head_dim floats, heads head_dim apart) += sum over t of p[i][t] * v[t] (p's rows p_stride
 * apart; v's rows kv_row elements apart), each output lane summing its products in token order onto
 * what it held. One accumulator chain per output vector, as a plain loop has, waits on the
 * multiply-add's latency at every key (it measured 0.065 us a key for a batch-1 decode of 12 heads
 * of 64); here a key's row is read (and widened) once for up to VALUE_HEADS heads, and their
 * VALUE_CHUNKS vectors each are summed side by side. Each lane's order of additions is unchanged, so
 * are its roundings. The heads go VALUE_HEADS, then 2, then 1 at a time (a group of 3: 2, then 1),
 * each count a constant of an always-inlined call, so that the accumulators stay in registers. */
#ifdef __AVX512F__
#define VALUE_HEADS 4 /* 16 accumulators + 4 value vectors of the 32 registers */
#else
#define VALUE_HEADS 2 /* 8 + 4 of 16 */
#endif
#define VALUE_CHUNKS 4
#define DEFINE_WEIGH_VALUES(NAME, KV_T, LOAD)                                                                \
    static inline __attribute__((always_inline)) void NAME##_chunks(                                         \
        const int nh, const int nc, float *out, const float *p, int64_t p_stride, const KV_T *v,             \
        int64_t kv_row, int64_t lo, int64_t len, int64_t head_dim, int64_t w, const float *lut) {             \
        lanes_t acc[VALUE_HEADS][VALUE_CHUNKS];                                                              \
        _Pragma("GCC unroll 4") for (int i = 0; i < nh; i++)                                                 \
            _Pragma("GCC unroll 4") for (int c = 0; c < nc; c++)                                             \
                acc[i][c] = f32_lanes(out + i * head_dim + c * LANES, w, NULL);                              \
        for (int64_t t = lo; t < len; t++) {                                                                 \
            lanes_t x[VALUE_CHUNKS];                                                                         \
            _Pragma("GCC unroll 4") for (int c = 0; c < nc; c++) x[c] = LOAD(v + t * kv_row + c * LANES, w, lut); \
            _Pragma("GCC unroll 4") for (int i = 0; i < nh; i++) {                                           \
                const float pt = p[i * p_stride + t];                                                        \
                _Pragma("GCC unroll 4") for (int c = 0; c < nc; c++) acc[i][c] += pt * x[c];                 \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 4") for (int i = 0; i < nh; i++)                                                 \
            _Pragma("GCC unroll 4") for (int c = 0; c < nc; c++)                                             \
                store_f32_lanes(out + i * head_dim + c * LANES, acc[i][c], w);                               \
    }                                                                                                        \
    static inline __attribute__((always_inline)) void NAME##_heads(                                          \
        const int nh, float *out, const float *p, int64_t p_stride, const KV_T *v, int64_t kv_row, int64_t lo, \
        int64_t len, int64_t head_dim, const float *lut) {                                                   \
        int64_t c = 0;                                                                                       \
        for (; c + VALUE_CHUNKS * LANES <= head_dim; c += VALUE_CHUNKS * LANES)                              \
            NAME##_chunks(nh, VALUE_CHUNKS, out + c, p, p_stride, v + c, kv_row, lo, len, head_dim, LANES, lut); \
        for (; c < head_dim; c += LANES)                                                                     \
            NAME##_chunks(nh, 1, out + c, p, p_stride, v + c, kv_row, lo, len, head_dim,                    \
                          head_dim - c < LANES ? head_dim - c : LANES, lut);                                 \
    }                                                                                                        \
    static inline void NAME(int64_t heads, float *out, const float *p, int64_t p_stride, const KV_T *v,      \
                            int64_t kv_row, int64_t lo, int64_t len, int64_t head_dim, const float *lut) {   \
        int64_t h = 0;                                                                                       \
        for (; h + VALUE_HEADS <= heads; h += VALUE_HEADS)                                                   \
            NAME##_heads(VALUE_HEADS, out + h * head_dim, p + h * p_stride, p_stride, v, kv_row, lo, len,    \
                         head_dim, lut);                                                                     \
        for (; h + 2 <= heads; h += 2)                                                                       \
            NAME##_heads(2, out + h * head_dim, p + h * p_stride, p_stride, v, kv_row, lo, len, head_dim, lut); \
        for (; h < heads; h++)                                                                               \
            NAME##_heads(1, out + h * head_dim, p + h * p_stride, p_stride, v, kv_row, lo, len, head_dim, lut); \
    }
DEFINE_WEIGH_VALUES(weigh_values, float, f32_lanes)
DEFINE_WEIGH_VALUES(weigh_values_bf16, uint16_t, bf16_lanes)
DEFINE_WEIGH_VALUES(weigh_values_fp8, uint8_t, fp8_lanes)

/* One query token (q_heads heads, float32) at position ctx - 1 over its visible keys [start, ctx) of
 * K/V (kv_heads heads each, elements of KV_T, read as float32 lanes through LOAD) held in the
 * blocks listed by `blocks`, into out (q_heads * head_dim floats); start is 0, or the sliding
 * window's first key. scores holds q_heads rows of ctx - start floats.
 *
 * Both passes walk the keys in token order, block by block, and cut each block into tiles of up to
 * LANES keys. Scores: per KV head, each of its `group` query heads takes the dot products with a
 * tile's keys in LANES independent accumulators (a lone dot product is a chain of dependent
 * multiply-adds ending in a horizontal sum, which left the kernel waiting on arithmetic at half the
 * read bandwidth), summed by `sum_each`. Values: each query head's output takes the tile's tokens
 * in order, head_dim lanes at a time. The KV head's rows of a tile, read from memory once, stay in
 * L1 for the group. Per (query head, key) the arithmetic depends neither on the group, nor on the
 * tile, nor on the block layout, so kv_heads == q_heads computes exactly what multi-head attention
 * over repeated K/V would; and since every dtype reads into the same float32 lanes, a bfloat16 or
 * FP8 pool's arithmetic is the float32 kernel's, operation for operation. */
#define DEFINE_ATTEND_ONE(NAME, KV_T, LOAD, WEIGH)                                                           \
    static void NAME(const float *q, int64_t q_head_stride, const KV_T *k_cache, const KV_T *v_cache,         \
                     const int32_t *blocks, int64_t block_size, float *out, int64_t ctx, int64_t start,       \
                     int64_t q_heads, int64_t kv_heads, int64_t head_dim, float scale, float softcap,         \
                     const float *k_lut, const float *v_lut, float *scores, int64_t g_lo, int64_t g_hi) {    \
        const int64_t group = q_heads / kv_heads;                                                            \
        const int64_t kv_row = kv_heads * head_dim; /* elements per token in the K/V pool */                 \
        const int64_t block_elems = block_size * kv_row;                                                     \
        const int64_t keys = ctx - start; /* the length of each query head's row of scores */                \
        for (int64_t i = g_lo * group * head_dim; i < g_hi * group * head_dim; i++) out[i] = 0.0f;           \
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
            for (int64_t tile = t0 < start ? start - t0 : 0; tile < len; tile += LANES) {                   \
                const int64_t n = len - tile < LANES ? len - tile : LANES;                                   \
                for (int64_t g = g_lo; g < g_hi; g++) {                                                      \
                    const KV_T *kt = kb + tile * kv_row + g * head_dim;                                      \
                    const float *lut = k_lut ? k_lut + g * 256 : NULL;                                       \
                    if (next)                                                                                \
                        for (int64_t j = 0; j < n; j++) prefetch(next + (tile + j) * kv_row + g * head_dim,  \
                                                                 head_dim * (int64_t)sizeof(KV_T));          \
                    for (int64_t h = g * group; h < (g + 1) * group; h++) {                                  \
                        lanes_t acc[LANES];                                                                  \
                        for (int j = 0; j < LANES; j++) acc[j] = (lanes_t){0};                               \
                        for (int64_t c = 0; c < head_dim; c += LANES) {                                      \
                            const int64_t w = head_dim - c < LANES ? head_dim - c : LANES;                   \
                            const lanes_t qc = f32_lanes(q + h * q_head_stride + c, w, NULL);                \
                            /* constant bounds (keys past n add zeros), so acc stays in registers */        \
                            _Pragma("GCC unroll 16") for (int64_t j = 0; j < LANES; j++)                     \
                                acc[j] = fma_lanes(qc, j < n ? LOAD(kt + j * kv_row + c, w, lut) : (lanes_t){0}, acc[j]); \
                        }                                                                                    \
                        float s[LANES];                                                                      \
                        *(lanes_u *)s = scale * sum_each(acc);                                               \
                        float *row = scores + h * keys + t0 + tile - start;                                  \
                        if (n == LANES && softcap == 0.0f) /* (a short copy loop became a slow rep movs) */  \
                            *(lanes_u *)row = *(lanes_u *)s;                                                 \
                        else                                                                                 \
                            for (int64_t j = 0; j < n; j++)                                                  \
                                row[j] = softcap > 0.0f ? softcap * tanhf(s[j] / softcap) : s[j];            \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int64_t h = g_lo * group; h < g_hi * group; h++) { /* softmax of each row, max-subtracted */   \
            float *s = scores + h * keys, sum = 0.0f;                                                        \
            const float max = row_max(s, keys);                                                              \
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
            const int64_t lo = t0 < start ? start - t0 : 0;                                                  \
            for (int64_t g = g_lo; g < g_hi; g++) {                                                          \
                const KV_T *vt = vb + g * head_dim;                                                          \
                const float *lut = v_lut ? v_lut + g * 256 : NULL;                                           \
                if (next)                                                                                    \
                    for (int64_t t = lo; t < len; t++)                                                       \
                        prefetch(next + t * kv_row + g * head_dim, head_dim * (int64_t)sizeof(KV_T));        \
                WEIGH(group, out + g * group * head_dim, scores + g * group * keys + t0 - start, keys, vt,   \
                      kv_row, lo, len, head_dim, lut);                                                       \
            }                                                                                                \
        }                                                                                                    \
    }
DEFINE_ATTEND_ONE(attend_one, float, f32_lanes, weigh_values)
DEFINE_ATTEND_ONE(attend_one_bf16, uint16_t, bf16_lanes, weigh_values_bf16)
DEFINE_ATTEND_ONE(attend_one_fp8, uint8_t, fp8_lanes, weigh_values_fp8)

/* The first key a query at `position` sees: 0, or with a sliding window the window's start (the
 * C twin of first_visible_key in attention.py). */
static inline int64_t first_visible(int64_t position, int64_t window) {
    return window > 0 && position >= window ? position - window + 1 : 0;
}

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
    *start_out = first_visible(ctx - 1, window);
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

/* The tasks of a step: one per query token, each over every head; with fewer than 4 tokens a thread
 * (a batch-1 decode), one per (token, K/V head), so that every thread has work. Task i is token
 * i / splits over K/V heads [g_lo, g_hi). */
#define TASKS(tokens, kv_heads, num_threads) ((tokens) < 4 * (num_threads) ? (kv_heads) : 1)
#define TASK_HEADS(task, splits, kv_heads, g_lo, g_hi)                                                       \
    const int64_t g_lo = (task) % (splits) * (kv_heads) / (splits), g_hi = ((task) % (splits) + 1) * (kv_heads) / (splits)

/* float32 queries: scratch is [num_threads, q_heads * max_context] floats, the scores. */
#define DEFINE_F32_ENTRY(NAME, KV_T, ATTEND)                                                                 \
    void NAME(ENTRY_ARGS(float, KV_T)) {                                                                      \
        const int64_t out_row = q_heads * head_dim, tokens = query_start[num_requests];                      \
        const int64_t splits = TASKS(tokens, kv_heads, num_threads);                                         \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                            \
        for (int64_t task = 0; task < tokens * splits; task++) {                                             \
            const int64_t t = task / splits;                                                                 \
            TASK_HEADS(task, splits, kv_heads, g_lo, g_hi);                                                  \
            int64_t r, ctx, start;                                                                           \
            if (!locate(query_start, context_lens, num_requests, t, max_short, window, &r, &ctx, &start))    \
                continue;                                                                                    \
            float *scores = scratch + (int64_t)omp_get_thread_num() * q_heads * max_context;                 \
            ATTEND(q + t * q_row_stride, q_head_stride, k_cache, v_cache, block_tables + r * block_table_stride, \
                   block_size, out + t * out_row, ctx, start, q_heads, kv_heads, head_dim, scale, softcap,   \
                   k_lut, v_lut, scores, g_lo, g_hi);                                                        \
        }                                                                                                    \
    }

/* bfloat16 queries and output (their 16-bit patterns): each query is widened to float32, attended
 * in float32 as above, and its output rounded to bfloat16 once. scratch is [num_threads, q_heads *
 * (max_context + 2 * head_dim)] floats: the scores, the widened query and the output. */
#define DEFINE_BF16_ENTRY(NAME, KV_T, ATTEND)                                                                \
    void NAME(ENTRY_ARGS(uint16_t, KV_T)) {                                                                   \
        const int64_t out_row = q_heads * head_dim, tokens = query_start[num_requests];                      \
        const int64_t splits = TASKS(tokens, kv_heads, num_threads), group = q_heads / kv_heads;             \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                            \
        for (int64_t task = 0; task < tokens * splits; task++) {                                             \
            const int64_t t = task / splits;                                                                 \
            TASK_HEADS(task, splits, kv_heads, g_lo, g_hi);                                                  \
            int64_t r, ctx, start;                                                                           \
            if (!locate(query_start, context_lens, num_requests, t, max_short, window, &r, &ctx, &start))    \
                continue;                                                                                    \
            float *scores = scratch + (int64_t)omp_get_thread_num() *                                        \
                                          q_heads * (max_context + 2 * head_dim);                            \
            float *q32 = scores + q_heads * max_context, *o32 = q32 + out_row;                               \
            for (int64_t h = g_lo * group; h < g_hi * group; h++)                                            \
                for (int64_t d = 0; d < head_dim; d++)                                                       \
                    q32[h * head_dim + d] = bf16_to_f32(q[t * q_row_stride + h * q_head_stride + d]);        \
            ATTEND(q32, head_dim, k_cache, v_cache, block_tables + r * block_table_stride, block_size, o32,  \
                   ctx, start, q_heads, kv_heads, head_dim, scale, softcap, k_lut, v_lut, scores, g_lo, g_hi); \
            for (int64_t i = g_lo * group * head_dim; i < g_hi * group * head_dim; i++)                      \
                out[t * out_row + i] = f32_to_bf16(o32[i]);                                                  \
        }                                                                                                    \
    }

DEFINE_F32_ENTRY(orca_decode_attention_f32, float, attend_one)
DEFINE_F32_ENTRY(orca_decode_attention_fp8_f32, uint8_t, attend_one_fp8)
DEFINE_BF16_ENTRY(orca_decode_attention_bf16, uint16_t, attend_one_bf16)
DEFINE_BF16_ENTRY(orca_decode_attention_fp8_bf16, uint8_t, attend_one_fp8)

/* ---------------------------------------------------------------------------------------------
 * Prefills: requests of more than max_short queries, a tile of TILE queries at a time.
 *
 * Query-by-query, a long prompt would stream its whole context once per query at two flops per
 * element read, and torch's SDPA runs MKL's AVX2 GEMMs on AMD CPUs (~60-70 GFLOP/s on a 512-token
 * prompt of GPT-2-small, against ~500 for the linear layers). Here each task is one query head over
 * a tile of TILE consecutive queries of one request, with the queries in the vector lanes: scores
 * are outer products (a query-lanes column of the transposed tile times one key element,
 * broadcast), so every multiply-add does LANES useful products and the key is read once per tile;
 * the scores are kept key-major ([key][query]), so the max, the exp and the sum of the softmax are
 * lane-wise too; and the output is the same outer product over the value rows. K/V are read in
 * place from the paged pool (no gathered copy), through the row converters below for a bfloat16 or
 * FP8 pool.
 *
 * Semantics as the decode kernel's: query i of n sits at position ctx - n + i and sees keys
 * [start, position] (start: 0, or the sliding window's first key for that query); scores scale *
 * q.k, soft-capped when softcap > 0; softmax max-subtracted in float32; out = P V. */

/* A K/V row of head_dim elements as float32: a float32 pool's own row; another's converted into buf. */
static inline const float *f32_row(const float *row, float *buf, int64_t n, const float *lut) {
    (void)buf, (void)n, (void)lut;
    return row;
}
#define CONVERTED_ROW(NAME, KV_T, LOAD)                                                                      \
    static inline const float *NAME(const KV_T *row, float *buf, int64_t n, const float *lut) {              \
        for (int64_t c = 0; c < n; c += LANES) {                                                             \
            const int64_t w = n - c < LANES ? n - c : LANES;                                                 \
            store_f32_lanes(buf + c, LOAD(row + c, w, lut), w);                                              \
        }                                                                                                    \
        return buf;                                                                                          \
    }
CONVERTED_ROW(bf16_row, uint16_t, bf16_lanes)
CONVERTED_ROW(fp8_row, uint8_t, fp8_lanes)

/* A tile is TILE_VECTORS vectors of queries, and a pass accumulates KEYS_PER_PASS keys' scores or
 * DIMS_PER_PASS output dimensions for all of them at once: with AVX-512 3 x 8 accumulators of 32
 * registers (48 queries), with AVX2 2 x 6 of 16 (16 queries); each broadcast key or value element
 * then feeds TILE_VECTORS multiply-adds. */
#if LANES == 16
#define TILE_VECTORS 3
#define KEYS_PER_PASS 8
#else
#define TILE_VECTORS 2
#define KEYS_PER_PASS 6
#endif
#define DIMS_PER_PASS KEYS_PER_PASS
#define TILE (TILE_VECTORS * LANES) /* queries a task takes */
#define VALUES_PER_PASS 64          /* value rows looked up (converted, for non-float32 pools) per pass */

/* Floats of a thread's work area: the transposed query tile and output ([head_dim][TILE] each),
 * the scores ([max_context][TILE]) and converted K/V rows ([VALUES_PER_PASS][head_dim]). */
static inline int64_t prefill_work_floats(int64_t head_dim, int64_t max_context) {
    return (2 * head_dim + max_context) * TILE + VALUES_PER_PASS * head_dim;
}

/* Pointers to the float32 rows of keys first .. first + n - 1 (each head_dim elements at g_off in
 * its token's kv_row) of a request's blocks, converted into rows[i * head_dim] for a non-float32
 * pool; one division for the run, then the block walk. */
#define DEFINE_ROWS(NAME, KV_T, ROW)                                                                         \
    static inline void NAME(const float **out, const KV_T *cache, const int32_t *blocks, int64_t block_size, \
                            int64_t kv_row, int64_t g_off, int64_t first, int64_t n, int64_t head_dim,        \
                            const float *lut, float *rows) {                                                 \
        int64_t b = first / block_size, off = first % block_size;                                           \
        for (int64_t i = 0; i < n; i++) {                                                                    \
            out[i] = ROW(cache + (blocks[b] * block_size + off) * kv_row + g_off, rows + i * head_dim, head_dim, lut); \
            if (++off == block_size) off = 0, b++;                                                           \
        }                                                                                                    \
    }
DEFINE_ROWS(f32_rows, float, f32_row)
DEFINE_ROWS(bf16_rows, uint16_t, bf16_row)
DEFINE_ROWS(fp8_rows, uint8_t, fp8_row)

/* One task: query head h of the nq (<= TILE) queries of one request at positions pos0.. (q: the
 * first query's head h, rows q_row_stride elements apart, read as float32 through TO_F32), over
 * the request's blocks; K/V head rows at g_off within a token's kv_row elements; writes the nq
 * outputs (out: the first query's head h, rows out_row_stride apart, through FROM_F32). */
#define DEFINE_PREFILL_TILE(NAME, Q_T, KV_T, ROWS, TO_F32, FROM_F32)                                         \
    static void NAME(const Q_T *q, int64_t q_row_stride, int64_t nq, int64_t pos0, const KV_T *k_cache,       \
                     const KV_T *v_cache, const int32_t *blocks, int64_t block_size, int64_t kv_row,          \
                     int64_t g_off, int64_t head_dim, float scale, int64_t window, float softcap,             \
                     const float *k_lut, const float *v_lut, Q_T *out, int64_t out_row_stride, float *work) { \
        float *qt = work, *o = qt + head_dim * TILE, *s = o + head_dim * TILE;                               \
        const int64_t last = pos0 + nq - 1; /* lanes past nq repeat the last query (never written) */        \
        const int64_t first = first_visible(pos0, window); /* no query of the tile sees a key before it */   \
        const int64_t keys = last + 1 - first;                                                               \
        float *rows = s + keys * TILE;                                                                       \
        int64_t pos[TILE];                                                                                   \
        for (int l = 0; l < TILE; l++) pos[l] = pos0 + (l < nq ? l : nq - 1);                                \
        /* the rows' loads all in flight at once: a row's load waited behind the previous row's       \
         * transposed stores, and each cold row (the qkv output of a whole prompt step) took a trip to   \
         * memory of its own */                                                                          \
        for (int64_t l = 0; l < nq; l++) prefetch(q + l * q_row_stride, head_dim * (int64_t)sizeof(Q_T));  \
        for (int l = 0; l < TILE; l++) { /* each query's row read in order, written transposed */           \
            const Q_T *row = q + (l < nq ? l : nq - 1) * q_row_stride;                                       \
            for (int64_t d = 0; d < head_dim; d++) qt[d * TILE + l] = TO_F32(row[d]);                        \
        }                                                                                                    \
        memset(o, 0, (size_t)(head_dim * TILE) * sizeof *o);                                                 \
        for (int64_t j0 = first; j0 <= last; j0 += KEYS_PER_PASS) {                                          \
            const int64_t nk = last + 1 - j0 < KEYS_PER_PASS ? last + 1 - j0 : KEYS_PER_PASS;                \
            const float *kr[KEYS_PER_PASS];                                                                  \
            ROWS(kr, k_cache, blocks, block_size, kv_row, g_off, j0, nk, head_dim, k_lut, rows);             \
            for (int64_t k = nk; k < KEYS_PER_PASS; k++) kr[k] = kr[nk - 1]; /* scores never kept */         \
            lanes_t acc[KEYS_PER_PASS][TILE_VECTORS];                                                        \
            for (int k = 0; k < KEYS_PER_PASS; k++)                                                          \
                for (int v = 0; v < TILE_VECTORS; v++) acc[k][v] = (lanes_t){0};                             \
            for (int64_t d = 0; d < head_dim; d++) {                                                         \
                lanes_t qd[TILE_VECTORS];                                                                    \
                for (int v = 0; v < TILE_VECTORS; v++) qd[v] = *(const lanes_t *)(qt + d * TILE + v * LANES); \
                for (int k = 0; k < KEYS_PER_PASS; k++) {                                                    \
                    const float kd = kr[k][d];                                                               \
                    for (int v = 0; v < TILE_VECTORS; v++) acc[k][v] += qd[v] * kd;                          \
                }                                                                                            \
            }                                                                                                \
            for (int64_t k = 0; k < nk; k++) {                                                               \
                const int64_t j = j0 + k;                                                                    \
                float *row = s + (j - first) * TILE;                                                         \
                for (int v = 0; v < TILE_VECTORS; v++) *(lanes_t *)(row + v * LANES) = scale * acc[k][v];    \
                if (softcap > 0.0f)                                                                          \
                    for (int l = 0; l < TILE; l++) row[l] = softcap * tanhf(row[l] / softcap);               \
                /* hidden from some queries: keys after the tile's first query, or (window) at or before   \
                 * its last query's window */                                                                \
                if (j > pos0 || (window > 0 && j <= last - window))                                          \
                    for (int l = 0; l < TILE; l++)                                                           \
                        if (j > pos[l] || (window > 0 && j <= pos[l] - window)) row[l] = -INFINITY;          \
            }                                                                                                \
        }                                                                                                    \
        /* softmax over each query's keys: every query sees at least its own position */                     \
        float max[TILE], sum[TILE];                                                                          \
        for (int l = 0; l < TILE; l++) max[l] = -INFINITY, sum[l] = 0.0f;                                    \
        for (int64_t j = 0; j < keys; j++)                                                                   \
            for (int l = 0; l < TILE; l++) max[l] = s[j * TILE + l] > max[l] ? s[j * TILE + l] : max[l];     \
        for (int64_t j = 0; j < keys; j++) {                                                                 \
            _Pragma("omp simd")                                                                              \
            for (int l = 0; l < TILE; l++) {                                                                 \
                /* a hidden key's -inf clamped to where the exp is exactly 0, inside its valid range */     \
                const float x = s[j * TILE + l] - max[l];                                                    \
                s[j * TILE + l] = expf_sleef_u10(x > -127.0f ? x : -127.0f);                                 \
                sum[l] += s[j * TILE + l];                                                                   \
            }                                                                                                \
        }                                                                                                    \
        for (int l = 0; l < TILE; l++) sum[l] = 1.0f / sum[l];                                               \
        for (int64_t j = 0; j < keys; j++)                                                                   \
            for (int l = 0; l < TILE; l++) s[j * TILE + l] *= sum[l];                                        \
        for (int64_t v0 = first; v0 <= last; v0 += VALUES_PER_PASS) {                                        \
            const int64_t nv = last + 1 - v0 < VALUES_PER_PASS ? last + 1 - v0 : VALUES_PER_PASS;            \
            const float *vr[VALUES_PER_PASS];                                                                \
            ROWS(vr, v_cache, blocks, block_size, kv_row, g_off, v0, nv, head_dim, v_lut, rows);             \
            const float *p = s + (v0 - first) * TILE;                                                        \
            int64_t d0 = 0;                                                                                  \
            for (; d0 + DIMS_PER_PASS <= head_dim; d0 += DIMS_PER_PASS) {                                    \
                lanes_t acc[DIMS_PER_PASS][TILE_VECTORS];                                                    \
                for (int x = 0; x < DIMS_PER_PASS; x++)                                                      \
                    for (int v = 0; v < TILE_VECTORS; v++)                                                   \
                        acc[x][v] = *(const lanes_t *)(o + (d0 + x) * TILE + v * LANES);                     \
                for (int64_t k = 0; k < nv; k++) {                                                           \
                    lanes_t pk[TILE_VECTORS];                                                                \
                    for (int v = 0; v < TILE_VECTORS; v++) pk[v] = *(const lanes_t *)(p + k * TILE + v * LANES); \
                    for (int x = 0; x < DIMS_PER_PASS; x++) {                                                \
                        const float vd = vr[k][d0 + x];                                                      \
                        for (int v = 0; v < TILE_VECTORS; v++) acc[x][v] += pk[v] * vd;                      \
                    }                                                                                        \
                }                                                                                            \
                for (int x = 0; x < DIMS_PER_PASS; x++)                                                      \
                    for (int v = 0; v < TILE_VECTORS; v++)                                                   \
                        *(lanes_t *)(o + (d0 + x) * TILE + v * LANES) = acc[x][v];                           \
            }                                                                                                \
            for (; d0 < head_dim; d0++)                                                                      \
                for (int64_t k = 0; k < nv; k++)                                                             \
                    for (int l = 0; l < TILE; l++) o[d0 * TILE + l] += p[k * TILE + l] * vr[k][d0];          \
        }                                                                                                    \
        for (int64_t i = 0; i < nq; i++)                                                                     \
            for (int64_t d = 0; d < head_dim; d++) out[i * out_row_stride + d] = FROM_F32(o[d * TILE + i]);  \
    }
#define SAME(x) (x)
DEFINE_PREFILL_TILE(prefill_tile_f32, float, float, f32_rows, SAME, SAME)
DEFINE_PREFILL_TILE(prefill_tile_fp8_f32, float, uint8_t, fp8_rows, SAME, SAME)
DEFINE_PREFILL_TILE(prefill_tile_bf16, uint16_t, uint16_t, bf16_rows, bf16_to_f32, f32_to_bf16)
DEFINE_PREFILL_TILE(prefill_tile_fp8_bf16, uint16_t, uint8_t, fp8_rows, bf16_to_f32, f32_to_bf16)

/* The entry points: every request of more than max_short queries (the rest are the decode entry's),
 * tasks of one query head and one tile of LANES queries spread over the threads. A request without
 * context (a CUDA-graph bucket's padding request) gets zeros. The arguments are the decode entry's
 * without scratch: each thread allocates its own work area. Returns 0, or -1 if an allocation failed
 * (out is then incomplete). */
#define DEFINE_PREFILL_ENTRY(NAME, Q_T, KV_T, TILE_FN)                                                          \
    int NAME(const Q_T *q, int64_t q_row_stride, int64_t q_head_stride, const KV_T *k_cache,                   \
             const KV_T *v_cache, Q_T *out, const int32_t *query_start, const int32_t *context_lens,          \
             const int32_t *block_tables, int64_t block_table_stride, int64_t block_size, int64_t num_requests, \
             int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t max_context, float scale,            \
             int64_t window, float softcap, const float *k_lut, const float *v_lut, int num_threads,          \
             int64_t max_short) {                                                                            \
        const int64_t group = q_heads / kv_heads, kv_row = kv_heads * head_dim, out_row = q_heads * head_dim; \
        int64_t *first_task = malloc((size_t)(num_requests + 1) * sizeof *first_task);                      \
        if (!first_task) return -1;                                                                          \
        int64_t tasks = 0;                                                                                   \
        for (int64_t r = 0; r < num_requests; r++) {                                                         \
            const int64_t n = query_start[r + 1] - query_start[r];                                           \
            first_task[r] = tasks;                                                                           \
            if (n > max_short) tasks += (n + TILE - 1) / TILE * q_heads;                                   \
        }                                                                                                    \
        first_task[num_requests] = tasks;                                                                    \
        const size_t work_bytes = ((size_t)prefill_work_floats(head_dim, max_context) * sizeof(float) + 63) / 64 * 64; \
        int failed = 0;                                                                                      \
        _Pragma("omp parallel num_threads(num_threads)")                                                     \
        {                                                                                                    \
            float *work = aligned_alloc(64, work_bytes);                                                     \
            if (!work) {                                                                                     \
                _Pragma("omp atomic write")                                                                  \
                failed = 1;                                                                                  \
            }                                                                                                \
            _Pragma("omp for schedule(dynamic, 1)")                                                          \
            for (int64_t task = 0; task < tasks; task++) {                                                   \
                if (!work) continue;                                                                         \
                int64_t lo = 0, hi = num_requests; /* the r with first_task[r] <= task < first_task[r + 1] */ \
                while (hi - lo > 1) {                                                                        \
                    const int64_t mid = (lo + hi) / 2;                                                       \
                    if (first_task[mid] <= task) lo = mid; else hi = mid;                                    \
                }                                                                                            \
                const int64_t r = lo, local = task - first_task[r], h = local % q_heads;                     \
                const int64_t q0 = query_start[r] + local / q_heads * TILE, n = query_start[r + 1] - query_start[r]; \
                const int64_t nq = query_start[r + 1] - q0 < TILE ? query_start[r + 1] - q0 : TILE;        \
                Q_T *o = out + q0 * out_row + h * head_dim;                                                  \
                if (context_lens[r] < n) { /* no context for these queries: zeros */                         \
                    for (int64_t i = 0; i < nq; i++) memset(o + i * out_row, 0, (size_t)head_dim * sizeof *o); \
                    continue;                                                                                \
                }                                                                                            \
                const int64_t g = h / group;                                                                 \
                TILE_FN(q + q0 * q_row_stride + h * q_head_stride, q_row_stride, nq, context_lens[r] - n + (q0 - query_start[r]), \
                     k_cache, v_cache, block_tables + r * block_table_stride, block_size, kv_row, g * head_dim, head_dim, \
                     scale, window, softcap, k_lut ? k_lut + g * 256 : NULL, v_lut ? v_lut + g * 256 : NULL, o,  \
                     out_row, work);                                                                         \
            }                                                                                                \
            free(work);                                                                                      \
        }                                                                                                    \
        free(first_task);                                                                                    \
        return failed ? -1 : 0;                                                                              \
    }
DEFINE_PREFILL_ENTRY(orca_prefill_attention_f32, float, float, prefill_tile_f32)
DEFINE_PREFILL_ENTRY(orca_prefill_attention_fp8_f32, float, uint8_t, prefill_tile_fp8_f32)
DEFINE_PREFILL_ENTRY(orca_prefill_attention_bf16, uint16_t, uint16_t, prefill_tile_bf16)
DEFINE_PREFILL_ENTRY(orca_prefill_attention_fp8_bf16, uint16_t, uint8_t, prefill_tile_fp8_bf16)

/* The float32 lanes of this build's vectors: 16 with AVX-512, 8 with AVX2 (attention_cpu sends
 * prompts to the prefill entries only with 16; cpu_attention.prefill_in_c says why). */
int orca_attention_lanes(void) { return LANES; }

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
