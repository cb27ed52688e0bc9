/* exp(x) in float32 in a form the compiler vectorizes, for the CPU kernels. */
#ifndef NATSLLM_FAST_EXP_H
#define NATSLLM_FAST_EXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* x = k ln2 + r, |r| <= ln2 / 2; exp(r) by its Taylor polynomial to degree 7 (relative
 * error < 2e-8, below float's own rounding); 2^k through the exponent bits, as two
 * factors so that k = 128 stays representable. Above ln(FLT_MAX) the result is +inf, as
 * expf's; below -87 it is exp(-87) ~ 1.6e-38 (no denormals): negligible next to the 1
 * (SiLU) or the softmax sum (attention) the callers add it to. */
static inline __attribute__((always_inline)) float fast_expf(float x) {
    if (x > 88.72283935546875f) return INFINITY;
    if (x < -87.0f) x = -87.0f;
    float k = nearbyintf(x * 1.44269504088896341f);
    float r = x - k * 0.693145751953125f - k * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t k1 = (int32_t)k / 2, e1 = (k1 + 127) << 23, e2 = ((int32_t)k - k1 + 127) << 23;
    float f1, f2;
    memcpy(&f1, &e1, sizeof f1);
    memcpy(&f2, &e2, sizeof f2);
    return p * f1 * f2;
}
#endif
