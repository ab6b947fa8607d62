/* The machine's multiply-add peak, measured: every thread runs independent chains of vector
 * multiply-adds on registers only (no memory traffic), enough of them to cover the instruction's
 * latency on every pipe. benchmarks/offline.py's gemm suite reports each GEMM against it (GFLOP/s
 * of the measured peak rather than of a datasheet figure this VM's clocks may not reach).
 *
 * Returns GFLOP/s over all threads, counting a multiply-add as 2 flops (VDPBF16PS: 2 multiply-adds
 * per float32 lane). isa: 0 AVX2 (float32 FMA), 1 AVX-512 (float32 FMA), 2 AVX512-BF16 (VDPBF16PS);
 * the caller checks the CPU runs it (decode_gemm.c's orca_decode_gemm_isa_supported). */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#define CHAINS 12

__attribute__((target("avx2,fma"))) static float chains_avx2(int64_t iters) {
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm256_set1_ps((float)j);
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
    float sum = 0.0f;
    for (int j = 0; j < CHAINS; j++) sum += _mm256_cvtss_f32(acc[j]);
    return sum;
}

__attribute__((target("avx512f,fma"))) static float chains_avx512(int64_t iters) {
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_set1_ps((float)j);
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
    float sum = 0.0f;
    for (int j = 0; j < CHAINS; j++) sum += _mm512_reduce_add_ps(acc[j]);
    return sum;
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) static float chains_dpbf16(int64_t iters) {
    __m512 acc[CHAINS];
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380); /* 1, ~6e-8 */
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_set1_ps((float)j);
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    float sum = 0.0f;
    for (int j = 0; j < CHAINS; j++) sum += _mm512_reduce_add_ps(acc[j]);
    return sum;
}

double orca_flops_peak(int isa, int64_t iters, int num_threads) {
    const double lanes_flops[] = {8 * 2, 16 * 2, 16 * 4}; /* flops per instruction */
    volatile float sink = 0.0f;
    double start = omp_get_wtime();
#pragma omp parallel num_threads(num_threads)
    {
        const float r = isa == 0 ? chains_avx2(iters) : isa == 1 ? chains_avx512(iters) : chains_dpbf16(iters);
#pragma omp atomic
        sink += r;
    }
    const double seconds = omp_get_wtime() - start;
    return (double)num_threads * (double)iters * CHAINS * lanes_flops[isa] / seconds / 1e9;
}
