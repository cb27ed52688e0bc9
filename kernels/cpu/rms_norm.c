/* RMSNorm of bfloat16 rows, optionally after adding the residual (see kernels/rms_norm.py).
 *
 * With a residual: residual <- bf16(x + residual) in place, then that sum is normalised.
 * out = bf16(weight * (s * 1 / sqrt(mean(s^2) + eps))), all arithmetic in float32, in
 * the order of rms_norm_ref (and Hugging Face's LlamaRMSNorm).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "isa.h"

#define MAX_HIDDEN 16384

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual, int64_t residual_stride,
                   const uint16_t *weight, uint16_t *out, int64_t out_stride, int rows, int hidden,
                   float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * hidden >= 262144) schedule(static)
    for (int t = 0; t < rows; t++) {
        float s[MAX_HIDDEN];
        const uint16_t *xr = x + t * x_stride;
        float sum_sq = 0.0f;
        if (residual) {
            uint16_t *rr = residual + t * residual_stride;
#pragma omp simd reduction(+ : sum_sq)
            for (int d = 0; d < hidden; d++) {
                const uint16_t b = f32_to_bf16(bf16_to_f32(xr[d]) + bf16_to_f32(rr[d]));
                rr[d] = b;
                s[d] = bf16_to_f32(b);
                sum_sq += s[d] * s[d];
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int d = 0; d < hidden; d++) {
                s[d] = bf16_to_f32(xr[d]);
                sum_sq += s[d] * s[d];
            }
        }
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        uint16_t *o = out + t * out_stride;
#pragma omp simd
        for (int d = 0; d < hidden; d++) o[d] = f32_to_bf16(bf16_to_f32(weight[d]) * (s[d] * inv_rms));
    }
}

/* The same for float32 rows: residual <- x + residual in place (PyTorch's add, bit for bit),
 * then out = weight * (s * 1 / sqrt(mean(s^2) + eps)). The sum of squares is vectorized, so
 * its order (and the last bit of some outputs) differs from PyTorch's reduction. */
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t residual_stride, const float *weight,
                  float *out, int64_t out_stride, int rows, int hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * hidden >= 262144) schedule(static)
    for (int t = 0; t < rows; t++) {
        const float *s = x + t * x_stride;
        float sum_sq = 0.0f;
        if (residual) {
            float *rr = residual + t * residual_stride;
#pragma omp simd reduction(+ : sum_sq)
            for (int d = 0; d < hidden; d++) {
                rr[d] = s[d] + rr[d];
                sum_sq += rr[d] * rr[d];
            }
            s = rr;
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int d = 0; d < hidden; d++) sum_sq += s[d] * s[d];
        }
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        float *o = out + t * out_stride;
#pragma omp simd
        for (int d = 0; d < hidden; d++) o[d] = weight[d] * (s[d] * inv_rms);
    }
}
