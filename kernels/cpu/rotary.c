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
#include "kv_rows.h"

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

/* The rotary embedding of q and k, then k's and v's rows into the paged KV cache (see
 * kernels/rotary_write_kv.py): one call per layer instead of two. v's rows hold
 * num_k_heads heads like k's; strides are in elements. Positions and slots are checked
 * first: 1 (a position outside cos_sin's rows) or 2 (a slot at or past num_slots) means
 * nothing was written. */
#define DEFINE_ROTARY_WRITE_KV(NAME, ROTARY, T, CACHE_T, COPY_ROWS, ROW_UNIT)                                 \
    int NAME(const int64_t *positions, int rows, T *q, int64_t q_stride, int num_q_heads, T *k,              \
             int64_t k_stride, int num_k_heads, const float *cos_sin, int64_t cos_sin_stride,                \
             int64_t cos_sin_rows, int head_dim, int num_threads, const T *v, int64_t v_stride,              \
             CACHE_T *key_cache, CACHE_T *value_cache, const int64_t *slots, int64_t num_slots) {            \
        if (!kv_slots_in_range(slots, rows, num_slots)) return 2;                                            \
        if (ROTARY(positions, rows, q, q_stride, num_q_heads, k, k_stride, num_k_heads, cos_sin,             \
                   cos_sin_stride, cos_sin_rows, head_dim, num_threads))                                     \
            return 1;                                                                                        \
        COPY_ROWS((const char *)k, k_stride * (int64_t)sizeof(T), (const char *)v,                           \
                  v_stride * (int64_t)sizeof(T), key_cache, value_cache, slots, rows,                        \
                  (int64_t)num_k_heads * head_dim * (int64_t)(ROW_UNIT));                                    \
        return 0;                                                                                            \
    }

/* copy_kv_rows takes char caches and a row in bytes; copy_kv_rows_to_bf16 bf16 caches and a
 * row in values. */
#define COPY_BYTES(k, ks, v, vs, kc, vc, slots, rows, row) copy_kv_rows(k, ks, v, vs, (char *)(kc), (char *)(vc), slots, rows, row)
DEFINE_ROTARY_WRITE_KV(rotary_write_kv_f32, rotary_f32, float, float, COPY_BYTES, sizeof(float))
DEFINE_ROTARY_WRITE_KV(rotary_write_kv_bf16, rotary_bf16, uint16_t, uint16_t, COPY_BYTES, sizeof(uint16_t))
/* float32 q, k, v over bfloat16 caches (`--kv-cache-dtype bfloat16`). */
DEFINE_ROTARY_WRITE_KV(rotary_write_kv_f32_bf16kv, rotary_f32, float, uint16_t, copy_kv_rows_to_bf16, 1)
