/* Rotary position embedding of q and k in place, rotate-half (Llama) style (see
 * kernels/rotary.py). Row t of q holds num_q_heads heads of head_dim values (row stride
 * given, heads packed); the first half of a head pairs with the second half. cos_sin
 * rows are [cos(half) | sin(half)] in float32 for each position.
 *
 * Built with -ffp-contract=off: x1*cos - x2*sin rounds each product as PyTorch's
 * separate multiply and subtract do, so float32 results equal rotary_embedding_ref's
 * bit for bit.
 */
#include <stdint.h>

#include "bf16.h"
#include "isa.h"

#define ROTATE(T, LOAD, STORE)                                                          \
    for (int h = 0; h < num_heads; h++) {                                               \
        T *x1 = row + (int64_t)h * head_dim, *x2 = x1 + half;                           \
        _Pragma("omp simd") for (int i = 0; i < half; i++) {                            \
            const float a = LOAD(x1[i]), b = LOAD(x2[i]);                               \
            x1[i] = STORE(a * cos[i] - b * sin[i]);                                     \
            x2[i] = STORE(b * cos[i] + a * sin[i]);                                     \
        }                                                                               \
    }

static inline float f32_id(float v) { return v; }

/* Returns 0, or 1 (nothing written) when a position is outside cos_sin's rows. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                                            \
    int NAME(const int64_t *positions, int rows, T *q, int64_t q_stride, int num_q_heads, T *k,          \
             int64_t k_stride, int num_k_heads, const float *cos_sin, int64_t cos_sin_stride,            \
             int64_t cos_sin_rows, int head_dim, int num_threads) {                                      \
        for (int t = 0; t < rows; t++)                                                                   \
            if (positions[t] < 0 || positions[t] >= cos_sin_rows) return 1;                              \
        const int half = head_dim / 2;                                                                   \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= 256) schedule(static)")           \
        for (int t = 0; t < rows; t++) {                                                                 \
            const float *cos = cos_sin + positions[t] * cos_sin_stride, *sin = cos + half;               \
            {                                                                                            \
                T *row = q + t * q_stride;                                                               \
                const int num_heads = num_q_heads;                                                       \
                ROTATE(T, LOAD, STORE)                                                                   \
            }                                                                                            \
            {                                                                                            \
                T *row = k + t * k_stride;                                                               \
                const int num_heads = num_k_heads;                                                       \
                ROTATE(T, LOAD, STORE)                                                                   \
            }                                                                                            \
        }                                                                                                \
        return 0;                                                                                        \
    }

DEFINE_ROTARY(rotary_f32, float, f32_id, f32_id)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
