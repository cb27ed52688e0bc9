/* SiLU-and-mul of bfloat16 rows (see kernels/silu_and_mul.py): row t of x is
 * [gate | up], each `inter` values; out = bf16(silu(gate) * up) computed in float32 and
 * rounded once, as silu_and_mul_ref does.
 */
#include <stdint.h>

#include "bf16.h"
#include "isa.h"
#include "fast_exp.h"

void silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride, int rows, int inter,
                       int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= 16384) schedule(static)
    for (int t = 0; t < rows; t++) {
        const uint16_t *gate = x + t * x_stride, *up = gate + inter;
        uint16_t *o = out + t * out_stride;
#pragma omp simd
        for (int d = 0; d < inter; d++) {
            const float g = bf16_to_f32(gate[d]);
            o[d] = f32_to_bf16(g / (1.0f + fast_expf(-g)) * bf16_to_f32(up[d]));
        }
    }
}

/* The same for float32 rows; fast_expf in place of PyTorch's exp, so some outputs differ
 * from the reference in the last bit. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int rows, int inter,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= 16384) schedule(static)
    for (int t = 0; t < rows; t++) {
        const float *gate = x + t * x_stride, *up = gate + inter;
        float *o = out + t * out_stride;
#pragma omp simd
        for (int d = 0; d < inter; d++) o[d] = gate[d] / (1.0f + fast_expf(-gate[d])) * up[d];
    }
}
