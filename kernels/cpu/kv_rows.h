/* Copying token rows into the paged KV cache, for write_kv.c and rotary.c's fused
 * rotary_write_kv (see kernels/write_kv.py). Token t's key and value rows (row_bytes each)
 * go to slot slots[t] of the caches, seen as [num_slots, row] arrays; negative slots
 * (padding tokens) are skipped. Rows are copied as bytes: one function for every dtype
 * the cache shares with the rows; copy_kv_rows_to_bf16 narrows float32 rows. */
#ifndef NATSLLM_KV_ROWS_H
#define NATSLLM_KV_ROWS_H
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Whether every slot is below num_slots (then copy_kv_rows may run). */
static inline int kv_slots_in_range(const int64_t *slots, int num_tokens, int64_t num_slots) {
    for (int t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return 0;
    return 1;
}

/* Strides in bytes. */
static inline void copy_kv_rows(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                                char *key_cache, char *value_cache, const int64_t *slots, int num_tokens,
                                int64_t row_bytes) {
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(key_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
}

/* The same for float32 rows into bfloat16 caches (`--kv-cache-dtype bfloat16` under a
 * float32 model): each value rounded to nearest even, as PyTorch's conversion does. Strides
 * in bytes; row_elements values a row. */
static inline void copy_kv_rows_to_bf16(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                                        uint16_t *key_cache, uint16_t *value_cache, const int64_t *slots,
                                        int num_tokens, int64_t row_elements) {
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const float *k = (const float *)(key + t * key_stride), *v = (const float *)(value + t * value_stride);
        uint16_t *kc = key_cache + slot * row_elements, *vc = value_cache + slot * row_elements;
#pragma omp simd
        for (int64_t d = 0; d < row_elements; d++) {
            kc[d] = f32_to_bf16(k[d]);
            vc[d] = f32_to_bf16(v[d]);
        }
    }
}
#endif
