/* bfloat16 <-> float32 for the CPU kernels: bf16 is the top half of a float32. */
#ifndef NATSLLM_BF16_H
#define NATSLLM_BF16_H
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as PyTorch's float -> bfloat16 conversion does. */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}
#endif
