/* Writing new keys and values into the paged KV cache (see kernels/write_kv.py and
 * kv_rows.h). Slots are checked first: one at or past num_slots writes nothing and
 * returns 1.
 */
#include <stdint.h>

#include "isa.h"
#include "kv_rows.h"

int write_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *key_cache,
             char *value_cache, const int64_t *slots, int num_tokens, int64_t num_slots, int64_t row_bytes) {
    if (!kv_slots_in_range(slots, num_tokens, num_slots)) return 1;
    copy_kv_rows(key, key_stride, value, value_stride, key_cache, value_cache, slots, num_tokens, row_bytes);
    return 0;
}
