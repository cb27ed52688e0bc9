/* Writing new keys and values into the paged KV cache (see kernels/write_kv.py).
 *
 * Token t's key and value rows (each num_kv_heads * head_dim values, packed) go to slot
 * slots[t] of the caches, seen as [num_slots, row] arrays; negative slots (padding
 * tokens) are skipped. Rows are copied as bytes, so one function serves every dtype.
 * Slots are checked first: one at or past num_slots writes nothing and returns 1.
 */
#include <stdint.h>
#include <string.h>

#include "isa.h"

int write_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *key_cache,
             char *value_cache, const int64_t *slots, int num_tokens, int64_t num_slots, int64_t row_bytes) {
    for (int t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return 1;
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(key_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
