/* The linear layer of a decode step on CPU: y = x W^T (+ bias) for a handful of tokens, float32 or
 * bfloat16 weights.
 *
 * x is [M, K] (rows at x_stride elements), W is torch.nn.Linear's [N, K], contiguous; y is [M, N]
 * contiguous; bias is [N] or NULL; x, W, bias and y share one dtype. Meant for M <= 32
 * (kernels/orca_kernels/cpu_gemm.py picks it there), where the step is bound by reading W: every
 * weight is read from memory once, whatever M is.
 *
 * Why C: at a few tokens a GEMM library's blocking is built for reuse that is not there (MKL costs
 * 3x at 4 tokens what it costs at 1, oneDNN 1.2-1.6x this kernel); this walks W once, straight
 * through memory, with the output rows split over the OpenMP threads of the caller (torch's
 * libgomp, as in decode_attention.c).
 *
 * Instruction sets, chosen at run time (the caller passes one orca_decode_gemm_isa_supported
 * accepts; the library itself is built for any x86-64 machine's compiler, each path with its own
 * target attribute):
 *   ISA_AVX2         8-float FMAs;
 *   ISA_AVX512       16-float FMAs over 32 registers: bigger tiles, one masked step for the K tail;
 *   ISA_AVX512_BF16  bfloat16 weights through VDPBF16PS (32 products an instruction, fp32 sums).
 * bfloat16 weights run on every set: without AVX512-BF16 the weights and tokens are widened to
 * float32 in registers (interleaved with zero halves: exact) and multiplied by FMAs, so memory still
 * sees two bytes a weight.
 *
 * Order of the sums: y[m][n] is always the same sequence of operations for a given instruction set
 * (each lane sums every L-th product in k order, a fixed tree over the lanes, the tail, then the
 * bias), whatever M is, which rows share a tile, or how many threads run. A token's result
 * therefore does not depend on the other tokens of the batch: batch invariance by construction.
 * Different instruction sets add in different orders (float32 results differ in the last bits).
 *
 * Blocking: a tile of R rows of W against T tokens keeps R * T accumulators, R weight vectors and
 * one token vector in registers (16 on AVX2, 32 on AVX-512). Under 4 tokens the step is bound by
 * memory, and what decides its speed is how the reads look to the CPU's stream prefetcher: a tile
 * reading R rows side by side is R short streams interleaved within a few pages, which the
 * prefetcher follows badly (on a Zen 5 EPYC 8 x 1 tiles read 18-22 GB/s where torch.sum reads
 * 40-50). So the AVX-512 tiles read one row at a time (1 x 1, 1 x 2), one ascending stream per
 * thread, and its single chain of FMAs keeps up with memory. On AVX2, where a bfloat16 row's chain
 * (two 8-float FMAs per 16 weights) cannot, the tiles keep 4 rows (4 x 1, 4 x 2). Every tile but a
 * chunk's last also prefetches the next tile's rows into L2 as it goes (`pf`), which the 4-row
 * tiles need and the 1-row ones do not mind. From 4 tokens on the step turns compute-bound and the
 * tiles trade rows for tokens (AVX2 3 x 4, AVX-512 4 x 6: more FMAs per load); the AVX-512 ones
 * still gain from the prefetch (1.4-1.6x at 8 tokens), the AVX2 ones lose (below) and do not. The
 * rows of a tile stay in L1/L2 while the next tokens reuse them, so memory sees each weight once.
 * Rows are handed to the threads in small dynamic chunks: on a shared host a descheduled thread
 * then holds up one chunk, not half of the matrix. docs/cpu-gemm.md has the measurements.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "bf16.h"

enum { ISA_AVX2 = 0, ISA_AVX512 = 1, ISA_AVX512_BF16 = 2 };

/* Whether this CPU (and its OS, which must save the wide registers) runs the given path. */
int orca_decode_gemm_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    case ISA_AVX512_BF16:
        return orca_decode_gemm_isa_supported(ISA_AVX512) && __builtin_cpu_supports("avx512bf16");
    }
    return 0;
}

#define T_AVX2 __attribute__((target("avx2,fma")))
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define T_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

/* What a tile writes for an output: its float32 sum plus the bias, as float32 or rounded once to
 * bfloat16. */
#define OUT_F32(s, bias, i) ((s) + ((bias) ? (bias)[i] : 0.0f))
#define OUT_BF16(s, bias, i) f32_to_bf16((s) + ((bias) ? bf16_to_f32((bias)[i]) : 0.0f))
#define AS_F32(v) (v)

/* The tiles each instruction set instantiates: rows x tokens (the drivers below say which runs when). */
#define AVX2_TILES(TILE) TILE(4, 1) TILE(4, 2) TILE(3, 1) TILE(3, 2) TILE(3, 3) TILE(3, 4) \
                         TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4)
#define AVX512_TILES(TILE) TILE(4, 1) TILE(4, 2) TILE(4, 3) TILE(4, 4) TILE(4, 5) TILE(4, 6) TILE(1, 1) \
                           TILE(1, 2) TILE(1, 3) TILE(1, 4) TILE(1, 5) TILE(1, 6)

/* The R rows of the next tile, at the column a step reads (`pf`: NULL for none), into L2. */
#define PREFETCH_ROWS(R, k0)                                                                               \
    if (pf)                                                                                                \
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)(pf + r * K + (k0)), _MM_HINT_T1);

/* ------------------------------------------------------------------------------------ AVX2 */
T_AVX2 static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);                      /* lanes i + i+4 */
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));   /* + lanes 2,3 */
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* 16 bfloat16s widened to float32 by interleaving them with zero halves (a bfloat16 is a float32's
 * upper half, so this is exact): `lo` gets elements 0-3 and 8-11, `hi` 4-7 and 12-15. Weights and
 * tokens are widened alike, so the products pair up as they should. */
T_AVX2 static inline void widen16_bf16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

/* One step of an AVX2 tile at column k0, WIDTH elements of every row and token into acc. Only the
 * tiles of up to 2 tokens prefetch: a 3 x 4 tile's operands take all 16 registers, and the
 * prefetches' addressing made 32-token steps 1.2x slower. */
#define AVX2_F32_STEP(R, T, k0)                                                                            \
    {                                                                                                      \
        __m256 w[R];                                                                                       \
        if (T <= 2) PREFETCH_ROWS(R, k0)                                                                   \
        for (int r = 0; r < R; r++) w[r] = _mm256_loadu_ps(W + (n + r) * K + k0);                          \
        for (int t = 0; t < T; t++) {                                                                      \
            __m256 xv = _mm256_loadu_ps(x + (m + t) * xs + k0);                                            \
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(w[r], xv, acc[r][t]);                  \
        }                                                                                                  \
    }
#define AVX2_BF16_STEP(R, T, k0)                                                                           \
    {                                                                                                      \
        __m256 wlo[R], whi[R];                                                                             \
        if (T <= 2) PREFETCH_ROWS(R, k0)                                                                   \
        for (int r = 0; r < R; r++) widen16_bf16(W + (n + r) * K + k0, &wlo[r], &whi[r]);                  \
        for (int t = 0; t < T; t++) {                                                                      \
            __m256 xlo, xhi;                                                                               \
            widen16_bf16(x + (m + t) * xs + k0, &xlo, &xhi);                                               \
            for (int r = 0; r < R; r++) {                                                                  \
                acc[r][t] = _mm256_fmadd_ps(wlo[r], xlo, acc[r][t]);                                       \
                acc[r][t] = _mm256_fmadd_ps(whi[r], xhi, acc[r][t]);                                       \
            }                                                                                              \
        }                                                                                                  \
    }

/* Rows n..n+R-1 of W against tokens m..m+T-1, fully unrolled by the compiler: STEP over the
 * multiples of WIDTH, then per output the horizontal sum, the scalar tail (TO_F32 reads an element
 * as float32) and OUT. */
#define AVX2_TILE(NAME, TYPE, WIDTH, STEP, TO_F32, OUT, R, T)                                              \
    T_AVX2 static void NAME##_##R##_##T(const TYPE *x, int64_t xs, const TYPE *W, int64_t K,              \
                                        const TYPE *bias, TYPE *y, int64_t N, int64_t m, int64_t n,        \
                                        const TYPE *pf) {                                                  \
        __m256 acc[R][T];                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();                                   \
        const int64_t kw = K & ~(int64_t)(WIDTH - 1);                                                      \
        for (int64_t k = 0; k < kw; k += WIDTH) STEP(R, T, k)                                              \
        for (int r = 0; r < R; r++)                                                                        \
            for (int t = 0; t < T; t++) {                                                                  \
                float s = hsum8(acc[r][t]);                                                                \
                for (int64_t k = kw; k < K; k++)                                                           \
                    s = fmaf(TO_F32(x[(m + t) * xs + k]), TO_F32(W[(n + r) * K + k]), s);                  \
                y[(m + t) * N + n + r] = OUT(s, bias, n + r);                                              \
            }                                                                                              \
    }
#define AVX2_F32(R, T) AVX2_TILE(avx2_f32, float, 8, AVX2_F32_STEP, AS_F32, OUT_F32, R, T)
#define AVX2_BF16(R, T) AVX2_TILE(avx2_bf16, uint16_t, 16, AVX2_BF16_STEP, bf16_to_f32, OUT_BF16, R, T)
AVX2_TILES(AVX2_F32)
AVX2_TILES(AVX2_BF16)

/* ---------------------------------------------------------------------------------- AVX-512 */
/* 32 bfloat16s (those `mask` keeps, zeros elsewhere) widened to float32 as widen16_bf16 does. */
T_AVX512 static inline void widen32_bf16(const uint16_t *p, __mmask32 mask, __m512 *lo, __m512 *hi) {
    const __m512i v = _mm512_maskz_loadu_epi16(mask, p), zero = _mm512_setzero_si512();
    *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
    *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
}

/* One step of an AVX-512 tile at column k0. WHICH is FULL (every element of the step: plain loads)
 * or TAIL (the K tail: masked loads of the elements `tail` keeps, zeros past the end adding
 * nothing). The main loops of float32 and VDPBF16PS keep plain loads: a constant all-ones mask there
 * gives the same values, but GCC then kept the accumulators in memory (1.5x slower). */
#define F32_LOAD_FULL(p) _mm512_loadu_ps(p)
#define F32_LOAD_TAIL(p) _mm512_maskz_loadu_ps(tail, p)
#define BH_LOAD_FULL(p) ((__m512bh)_mm512_loadu_si512(p))
#define BH_LOAD_TAIL(p) ((__m512bh)_mm512_maskz_loadu_epi16(tail, p))
#define WIDEN_FULL(p, lo, hi) widen32_bf16(p, (__mmask32)0xffffffffu, lo, hi)
#define WIDEN_TAIL(p, lo, hi) widen32_bf16(p, tail, lo, hi)
#define PREFETCH_FULL(R, k0) PREFETCH_ROWS(R, k0)
#define PREFETCH_TAIL(R, k0)

#define AVX512_F32_STEP(R, T, k0, WHICH)                                                                   \
    {                                                                                                      \
        __m512 w[R];                                                                                       \
        PREFETCH_##WHICH(R, k0)                                                                            \
        for (int r = 0; r < R; r++) w[r] = F32_LOAD_##WHICH(W + (n + r) * K + k0);                         \
        for (int t = 0; t < T; t++) {                                                                      \
            __m512 xv = F32_LOAD_##WHICH(x + (m + t) * xs + k0);                                           \
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], xv, acc[r][t]);                  \
        }                                                                                                  \
    }
/* bfloat16 on AVX-512 without its dot-product instruction: widened in registers, float32 FMAs. */
#define AVX512_BF16_STEP(R, T, k0, WHICH)                                                                  \
    {                                                                                                      \
        __m512 wlo[R], whi[R];                                                                             \
        PREFETCH_##WHICH(R, k0)                                                                            \
        for (int r = 0; r < R; r++) WIDEN_##WHICH(W + (n + r) * K + k0, &wlo[r], &whi[r]);                 \
        for (int t = 0; t < T; t++) {                                                                      \
            __m512 xlo, xhi;                                                                               \
            WIDEN_##WHICH(x + (m + t) * xs + k0, &xlo, &xhi);                                              \
            for (int r = 0; r < R; r++) {                                                                  \
                acc[r][t] = _mm512_fmadd_ps(wlo[r], xlo, acc[r][t]);                                       \
                acc[r][t] = _mm512_fmadd_ps(whi[r], xhi, acc[r][t]);                                       \
            }                                                                                              \
        }                                                                                                  \
    }
/* VDPBF16PS: each float32 lane adds the products of one pair of bfloat16s (exact in float32). */
#define DPBF16_STEP(R, T, k0, WHICH)                                                                       \
    {                                                                                                      \
        __m512bh w[R];                                                                                     \
        PREFETCH_##WHICH(R, k0)                                                                            \
        for (int r = 0; r < R; r++) w[r] = BH_LOAD_##WHICH(W + (n + r) * K + k0);                          \
        for (int t = 0; t < T; t++) {                                                                      \
            __m512bh xv = BH_LOAD_##WHICH(x + (m + t) * xs + k0);                                          \
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w[r], xv);                \
        }                                                                                                  \
    }

/* Rows n..n+R-1 of W against tokens m..m+T-1: STEP over the multiples of WIDTH, one masked STEP
 * for the K tail, then per output the horizontal sum and OUT. */
#define AVX512_TILE(NAME, TARGET, TYPE, WIDTH, MASK_T, STEP, OUT, R, T)                                    \
    TARGET static void NAME##_##R##_##T(const TYPE *x, int64_t xs, const TYPE *W, int64_t K,              \
                                        const TYPE *bias, TYPE *y, int64_t N, int64_t m, int64_t n,        \
                                        const TYPE *pf) {                                                  \
        __m512 acc[R][T];                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();                                   \
        const int64_t kw = K & ~(int64_t)(WIDTH - 1);                                                      \
        for (int64_t k = 0; k < kw; k += WIDTH) STEP(R, T, k, FULL)                                        \
        if (kw < K) {                                                                                      \
            const MASK_T tail = (MASK_T)((1u << (K - kw)) - 1);                                            \
            STEP(R, T, kw, TAIL)                                                                           \
        }                                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int t = 0; t < T; t++) y[(m + t) * N + n + r] = OUT(_mm512_reduce_add_ps(acc[r][t]), bias, n + r); \
    }
#define AVX512_F32(R, T) AVX512_TILE(avx512_f32, T_AVX512, float, 16, __mmask16, AVX512_F32_STEP, OUT_F32, R, T)
#define AVX512_BF16(R, T)                                                                                  \
    AVX512_TILE(avx512_bf16, T_AVX512, uint16_t, 32, __mmask32, AVX512_BF16_STEP, OUT_BF16, R, T)
#define DPBF16(R, T) AVX512_TILE(dpbf16, T_BF16, uint16_t, 32, __mmask32, DPBF16_STEP, OUT_BF16, R, T)
AVX512_TILES(AVX512_F32)
AVX512_TILES(AVX512_BF16)
AVX512_TILES(DPBF16)

/* ----------------------------------------------------------------------------------- drivers */
/* One instruction set's tiles for one dtype: R_MEM rows against 1..T_MEM tokens (the memory-bound
 * shape, under 4 tokens) and R_CMP rows against 1..T_CMP tokens (from 4 on), each with its
 * single-row versions for the last N % R rows. A tile row takes the tokens T_MAX at a time and the
 * remainder in one narrower tile (7 tokens: 6 + 1; 8: 6 + 2), so no weight row is streamed once per
 * token. Every y element is one tile call's, and a tile's accumulators are independent, so its
 * order of sums does not depend on the tiling. A chunk's tiles but its last prefetch the next one's
 * rows (on their first pass over the tokens: later passes find the rows in cache); the next chunk
 * may go to another thread, so a chunk's last tile prefetches nothing. */
/* Rows a thread takes at a time (64 rows measured 5-10% faster than 32 at one token on AVX-512). */
#define CHUNK_ROWS 64
#define TILE_SET(TYPE)                                                                                     \
    typedef void (*TYPE##_tile)(const TYPE *, int64_t, const TYPE *, int64_t, const TYPE *, TYPE *, int64_t, \
                                int64_t, int64_t, const TYPE *);                                           \
    typedef struct {                                                                                       \
        int64_t rows_mem, rows_cmp;                                                                        \
        int tokens_mem, tokens_cmp;                                                                        \
        const TYPE##_tile *mem, *mem_row, *cmp, *cmp_row; /* indexed by tokens - 1 */                      \
    } TYPE##_tiles;                                                                                        \
    static void drive_##TYPE(const TYPE##_tiles *set, const TYPE *x, int64_t xs, int64_t M, const TYPE *W,  \
                             int64_t N, int64_t K, const TYPE *bias, TYPE *y, int num_threads) {           \
        const int mem = M < 4;                                                                             \
        const int64_t R = mem ? set->rows_mem : set->rows_cmp;                                             \
        const int T = mem ? set->tokens_mem : set->tokens_cmp;                                             \
        const TYPE##_tile *tiles = mem ? set->mem : set->cmp, *row_tiles = mem ? set->mem_row : set->cmp_row; \
        const int64_t n_blocks = (N + R - 1) / R;                                                          \
        const int64_t chunk = CHUNK_ROWS / R, n_chunks = (n_blocks + chunk - 1) / chunk;                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                          \
        for (int64_t c = 0; c < n_chunks; c++) {                                                           \
            const int64_t nb_end = (c + 1) * chunk < n_blocks ? (c + 1) * chunk : n_blocks;                \
            for (int64_t nb = c * chunk; nb < nb_end; nb++) {                                              \
                const int64_t n = nb * R;                                                                  \
                const TYPE *pf = nb + 1 < nb_end && n + 2 * R <= N ? W + (n + R) * K : NULL;               \
                for (int64_t m = 0; m < M;) {                                                              \
                    const int t = M - m < T ? (int)(M - m) : T;                                            \
                    if (n + R <= N)                                                                        \
                        tiles[t - 1](x, xs, W, K, bias, y, N, m, n, m ? NULL : pf);                        \
                    else                                                                                   \
                        for (int64_t r = n; r < N; r++)                                                    \
                            row_tiles[t - 1](x, xs, W, K, bias, y, N, m, r, NULL);                         \
                    m += t;                                                                                \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }
typedef uint16_t bf16;
TILE_SET(float)
TILE_SET(bf16)

#define AVX2_SET(TYPE, P)                                                                                  \
    static const TYPE##_tile P##_mem[] = {P##_4_1, P##_4_2}, P##_mem_row[] = {P##_1_1, P##_1_2};            \
    static const TYPE##_tile P##_cmp[] = {P##_3_1, P##_3_2, P##_3_3, P##_3_4};                             \
    static const TYPE##_tile P##_cmp_row[] = {P##_1_1, P##_1_2, P##_1_3, P##_1_4};                         \
    static const TYPE##_tiles P##_set = {4, 3, 2, 4, P##_mem, P##_mem_row, P##_cmp, P##_cmp_row};
#define AVX512_SET(TYPE, P)                                                                                \
    static const TYPE##_tile P##_mem[] = {P##_1_1, P##_1_2}, P##_mem_row[] = {P##_1_1, P##_1_2};            \
    static const TYPE##_tile P##_cmp[] = {P##_4_1, P##_4_2, P##_4_3, P##_4_4, P##_4_5, P##_4_6};           \
    static const TYPE##_tile P##_cmp_row[] = {P##_1_1, P##_1_2, P##_1_3, P##_1_4, P##_1_5, P##_1_6};       \
    static const TYPE##_tiles P##_set = {1, 4, 2, 6, P##_mem, P##_mem_row, P##_cmp, P##_cmp_row};
AVX2_SET(float, avx2_f32)
AVX2_SET(bf16, avx2_bf16)
AVX512_SET(float, avx512_f32)
AVX512_SET(bf16, avx512_bf16)
AVX512_SET(bf16, dpbf16)

/* The entry points. `isa` must be one orca_decode_gemm_isa_supported(isa) accepts (cpu_gemm.py
 * checks once); bfloat16 tensors travel as their 16-bit patterns. */
void orca_decode_linear_f32(const float *x, int64_t x_stride, int64_t M, const float *W, int64_t N, int64_t K,
                            const float *bias, float *y, int num_threads, int isa) {
    /* both AVX-512 sets run the same float32 tiles: float32 has no use for VDPBF16PS */
    drive_float(isa == ISA_AVX2 ? &avx2_f32_set : &avx512_f32_set, x, x_stride, M, W, N, K, bias, y, num_threads);
}

void orca_decode_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *W, int64_t N,
                             int64_t K, const uint16_t *bias, uint16_t *y, int num_threads, int isa) {
    const bf16_tiles *set = isa == ISA_AVX2 ? &avx2_bf16_set : isa == ISA_AVX512 ? &avx512_bf16_set : &dpbf16_set;
    drive_bf16(set, x, x_stride, M, W, N, K, bias, y, num_threads);
}

/* ------------------------------------------------------------- weights in oneDNN's blocked layout */
/* The same product over a weight oneDNN reordered for its own GEMMs (cpu_gemm.pack_weight, on
 * AVX-512 machines), read in place: at a few tokens oneDNN reads it at 0.6-0.75x the bandwidth this
 * reaches (docs/cpu-gemm.md), and holding a plain copy beside it would double the weights' memory.
 *
 * The layout, as torch's oneDNN lays out a linear weight [N, K] on AVX-512 (cpu_gemm.py checks it
 * on every weight it packs, and only a weight that matches comes here): panels of 64 output rows,
 * N padded to a multiple of 64, K to Kp, padding zero;
 *   float32   [N / 64][Kp][64]        (a panel row holds one k of 64 outputs),
 *   bfloat16  [N / 64][Kp / 2][64][2] (pairs of k side by side, as VDPBF16PS takes them).
 * A panel is one contiguous stream, so a thread reading it gives the prefetcher one ascending
 * stream; each k of a panel is one broadcast token element against 4 vectors of 16 outputs (outer
 * products), so no horizontal sums. Sums: each output adds its products in k order in one float32
 * lane (bfloat16: a pair of k at a time), whatever M is or how the tokens are tiled: batch
 * invariant, like the kernel above (whose order it does not share). */
#define PANEL 64
#define PANEL_TOKENS 6 /* tokens one pass over a panel takes: 4 x 6 accumulators */

#define PANEL_F32_TILE(T)                                                                                  \
    T_AVX512 static void panel_f32_##T(const float *x, int64_t xs, const float *P, int64_t K,             \
                                       float out[][PANEL]) {                                               \
        __m512 acc[T][4];                                                                                  \
        for (int t = 0; t < T; t++)                                                                        \
            for (int j = 0; j < 4; j++) acc[t][j] = _mm512_setzero_ps();                                   \
        for (int64_t k = 0; k < K; k++) {                                                                  \
            __m512 w[4];                                                                                   \
            for (int j = 0; j < 4; j++) w[j] = _mm512_loadu_ps(P + k * PANEL + 16 * j);                    \
            for (int t = 0; t < T; t++) {                                                                  \
                const __m512 xv = _mm512_set1_ps(x[t * xs + k]);                                           \
                for (int j = 0; j < 4; j++) acc[t][j] = _mm512_fmadd_ps(w[j], xv, acc[t][j]);              \
            }                                                                                              \
        }                                                                                                  \
        for (int t = 0; t < T; t++)                                                                        \
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(out[t] + 16 * j, acc[t][j]);                      \
    }

/* The pair of token elements k, k + 1 as one 32-bit lane (the second zero past the end of the row:
 * the weight's padding there is zero too). */
static inline int32_t token_pair(const uint16_t *x, int64_t k, int64_t K) {
    return (int32_t)((uint32_t)x[k] | (k + 1 < K ? (uint32_t)x[k + 1] << 16 : 0u));
}

/* bfloat16 pairs through VDPBF16PS, or (AVX-512 without it) each half widened to float32 exactly
 * (the low half shifted up, the high half masked) and two FMAs. */
#define PANEL_BF16_TILE(NAME, TARGET, PAIR_STEP, T)                                                        \
    TARGET static void NAME##_##T(const uint16_t *x, int64_t xs, const uint16_t *P, int64_t K,            \
                                  float out[][PANEL]) {                                                    \
        __m512 acc[T][4];                                                                                  \
        for (int t = 0; t < T; t++)                                                                        \
            for (int j = 0; j < 4; j++) acc[t][j] = _mm512_setzero_ps();                                   \
        for (int64_t k = 0; k < K; k += 2) {                                                               \
            __m512i w[4];                                                                                  \
            for (int j = 0; j < 4; j++) w[j] = _mm512_loadu_si512(P + k * PANEL + 32 * j);                 \
            for (int t = 0; t < T; t++) {                                                                  \
                const int32_t pair = token_pair(x + t * xs, k, K);                                         \
                PAIR_STEP(acc[t], w, pair)                                                                 \
            }                                                                                              \
        }                                                                                                  \
        for (int t = 0; t < T; t++)                                                                        \
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(out[t] + 16 * j, acc[t][j]);                      \
    }
#define DPBF16_PAIR_STEP(a, w, pair)                                                                       \
    {                                                                                                      \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                             \
        for (int j = 0; j < 4; j++) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)w[j], xv);                     \
    }
#define WIDEN_PAIR_STEP(a, w, pair)                                                                        \
    {                                                                                                      \
        const __m512 x_lo = _mm512_set1_ps(bf16_to_f32((uint16_t)pair));                                   \
        const __m512 x_hi = _mm512_set1_ps(bf16_to_f32((uint16_t)((uint32_t)pair >> 16)));                 \
        const __m512i high = _mm512_set1_epi32((int32_t)0xffff0000u);                                      \
        for (int j = 0; j < 4; j++) {                                                                      \
            a[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w[j], 16)), x_lo, a[j]);         \
            a[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w[j], high)), x_hi, a[j]);        \
        }                                                                                                  \
    }
#define PANEL_TILES(TILE) TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#define PANEL_DPBF16(T) PANEL_BF16_TILE(panel_dpbf16, T_BF16, DPBF16_PAIR_STEP, T)
#define PANEL_WIDEN(T) PANEL_BF16_TILE(panel_widen, T_AVX512, WIDEN_PAIR_STEP, T)
PANEL_TILES(PANEL_F32_TILE)
PANEL_TILES(PANEL_DPBF16)
PANEL_TILES(PANEL_WIDEN)

/* Panels go to the threads one at a time (a panel is 64 x Kp weights: 192 KB of float32 at K = 768);
 * a panel's tokens PANEL_TOKENS at a time, the later passes reading it from L2. */
#define PANEL_DRIVER(TILES, PANEL_ROWS, OUT)                                                         \
    {                                                                                                      \
        const int64_t panels = (N + PANEL - 1) / PANEL;                                                    \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                          \
        for (int64_t p = 0; p < panels; p++) {                                                             \
            const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;                         \
            float out[PANEL_TOKENS][PANEL];                                                                \
            for (int64_t m = 0; m < M; m += PANEL_TOKENS) {                                                \
                const int t_count = M - m < PANEL_TOKENS ? (int)(M - m) : PANEL_TOKENS;                    \
                TILES[t_count - 1](x + m * xs, xs, P + p * PANEL_ROWS, K, out);                            \
                for (int t = 0; t < t_count; t++)                                                          \
                    for (int64_t j = 0; j < width; j++)                                                    \
                        y[(m + t) * N + n0 + j] = OUT(out[t][j], bias, n0 + j);                            \
            }                                                                                              \
        }                                                                                                  \
    }
typedef void (*panel_f32_tile)(const float *, int64_t, const float *, int64_t, float[][PANEL]);
typedef void (*panel_bf16_tile)(const uint16_t *, int64_t, const uint16_t *, int64_t, float[][PANEL]);
static const panel_f32_tile panel_f32_tiles[] = {panel_f32_1, panel_f32_2, panel_f32_3,
                                                 panel_f32_4, panel_f32_5, panel_f32_6};
static const panel_bf16_tile panel_dpbf16_tiles[] = {panel_dpbf16_1, panel_dpbf16_2, panel_dpbf16_3,
                                                     panel_dpbf16_4, panel_dpbf16_5, panel_dpbf16_6};
static const panel_bf16_tile panel_widen_tiles[] = {panel_widen_1, panel_widen_2, panel_widen_3, panel_widen_4,
                                                    panel_widen_5, panel_widen_6};

/* y [M, N] = x [M, K] (rows at x_stride) times the packed weight P (K padded to Kp) + bias. `isa`
 * is ISA_AVX512 or ISA_AVX512_BF16 (float32 runs the same tiles on both). */
void orca_packed_linear_f32(const float *x, int64_t xs, int64_t M, const float *P, int64_t N, int64_t K,
                            int64_t Kp, const float *bias, float *y, int num_threads, int isa) {
    (void)isa;
    PANEL_DRIVER(panel_f32_tiles, Kp * PANEL, OUT_F32)
}

void orca_packed_linear_bf16(const uint16_t *x, int64_t xs, int64_t M, const uint16_t *P, int64_t N, int64_t K,
                             int64_t Kp, const uint16_t *bias, uint16_t *y, int num_threads, int isa) {
    const panel_bf16_tile *tiles = isa == ISA_AVX512_BF16 ? panel_dpbf16_tiles : panel_widen_tiles;
    PANEL_DRIVER(tiles, Kp * PANEL, OUT_BF16)
}
