/* bfloat16 <-> float32 for the C kernels that read or write bfloat16 (decode_gemm.c,
 * decode_attention.c): a bfloat16 travels as its 16-bit pattern, the upper half of a float32. */
#ifndef ORCA_BF16_H
#define ORCA_BF16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch rounds float32 to bfloat16 (NaN kept a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#endif
