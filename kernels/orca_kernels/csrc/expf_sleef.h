/* exp for the element-wise kernels (llama_ops.c, gpt2_ops.c), computed as torch's vectorised CPU
 * kernels compute it, and for decode_attention.c's softmax (where it vectorises and libm's expf does
 * not). Each including file compiles its own static copy; the element-wise ones include it after
 * turning floating-point contraction off, so it rounds as written (its fused multiply-adds are
 * explicit fmaf calls; it has no other multiply-add a compiler could fuse). kernels/orca_kernels/native.py rebuilds a kernel when this header changes. */
#ifndef ORCA_EXPF_SLEEF_H
#define ORCA_EXPF_SLEEF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* 2**q for q in [-126, 127], by building the exponent field. */
static inline float pow2i(int32_t q) {
    const int32_t bits = (q + 0x7f) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* exp(d) computed as torch's vectorised CPU kernels compute it, SLEEF's expf_u10 (1 ulp) with
 * fused multiply-adds, so that SiLU below rounds like F.silu; a plain loop of it also vectorises,
 * where calls to libm's expf would not. The final scaling by 2**q is split in two so that
 * results near the limits neither overflow nor flush early. */
static inline float expf_sleef_u10(float d) {
    const float q = rintf(d * 1.442695040888963407359924681001892137f);
    float s = fmaf(q, -0.693145751953125f, d); /* d - q ln 2 in two parts, ln 2's high bits exact */
    s = fmaf(q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = fmaf(u, s * s, s) + 1.0f;
    const int32_t qi = (int32_t)q;
    u = u * pow2i(qi >> 1) * pow2i(qi - (qi >> 1));
    u = d < -104.0f ? 0.0f : u;
    return d > 104.0f ? INFINITY : u;
}

#endif
