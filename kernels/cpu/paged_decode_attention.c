/* Decode attention over a paged KV cache, for the CPU (see kernels/cpu_paged_attention.py).
 *
 * One query token per request. Request i attends to its first seq_lens[i] cached tokens,
 * read in place through block_tables[i] from caches laid out
 * [num_blocks, block_size, num_kv_heads, head_dim]: no gathered copy of K/V. Work is split
 * over (request, KV head) pairs; a pair's query heads (the GQA group) share each K/V row
 * read. Arithmetic in float32 whatever the storage type (float32 or bfloat16). Threads
 * come from the OpenMP runtime PyTorch itself loaded (same soname), so no second thread
 * pool appears. Head dims 64 and 128 get code compiled for that size.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef struct {
    const void *query;
    int64_t query_row_stride; /* elements */
    const void *key_cache, *value_cache;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *seq_lens;
    int num_kv_heads, group, block_size;
    float scale;
    void *out;
    int64_t out_row_stride; /* elements */
} Args;

/* Row `index` (in elements) of a float32 or bfloat16 array, as float32. */
ALWAYS_INLINE void load_row(const void *base, int64_t index, float *dst, const int n, const int bf16) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + index;
#pragma omp simd
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)base + index, sizeof(float) * (size_t)n);
    }
}

/* exp(x) for x <= 0 (scores minus their max), in a form the compiler vectorizes:
 * x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial to degree 7
 * (relative error < 2e-8, below float's own rounding), 2^k through the exponent bits. */
ALWAYS_INLINE float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f; /* exp(-87) ~ 1.6e-38: still a normal float */
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
    int32_t e = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &e, sizeof two_k);
    return p * two_k;
}

/* Request i, KV head h: its group's output rows. `scores` holds group * seq_lens[i] floats. */
ALWAYS_INLINE void attend(const Args *a, int i, int h, float *scores, const int hd, const int bf16) {
    const int group = a->group, len = a->seq_lens[i], bs = a->block_size;
    const int32_t *blocks = a->block_tables + (int64_t)i * a->block_table_stride;
    const int64_t token_stride = (int64_t)a->num_kv_heads * hd;
    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];
    for (int g = 0; g < group; g++) {
        load_row(a->query, (int64_t)i * a->query_row_stride + (int64_t)(h * group + g) * hd, q[g], hd, bf16);
        for (int d = 0; d < hd; d++) q[g][d] *= a->scale;
        memset(acc[g], 0, sizeof(float) * (size_t)hd);
    }
    /* Scores, token by token through the blocks. */
    for (int start = 0; start < len; start += bs) {
        const int64_t first = (int64_t)blocks[start / bs] * bs;
        const int count = len - start < bs ? len - start : bs;
        for (int j = 0; j < count; j++) {
            load_row(a->key_cache, (first + j) * token_stride + (int64_t)h * hd, row, hd, bf16);
            for (int g = 0; g < group; g++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < hd; d++) s += q[g][d] * row[d];
                scores[(int64_t)g * len + start + j] = s;
            }
        }
    }
    /* Softmax numerators and denominators. */
    float inv_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *sg = scores + (int64_t)g * len, m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : total)
        for (int t = 0; t < len; t++) {
            sg[t] = exp_nonpositive(sg[t] - m);
            total += sg[t];
        }
        inv_sum[g] = len > 0 ? 1.0f / total : 0.0f;
    }
    /* Weighted values. */
    for (int start = 0; start < len; start += bs) {
        const int64_t first = (int64_t)blocks[start / bs] * bs;
        const int count = len - start < bs ? len - start : bs;
        for (int j = 0; j < count; j++) {
            load_row(a->value_cache, (first + j) * token_stride + (int64_t)h * hd, row, hd, bf16);
            for (int g = 0; g < group; g++) {
                const float p = scores[(int64_t)g * len + start + j];
#pragma omp simd
                for (int d = 0; d < hd; d++) acc[g][d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const int64_t dst = (int64_t)i * a->out_row_stride + (int64_t)(h * group + g) * hd;
        if (bf16) {
            for (int d = 0; d < hd; d++) ((uint16_t *)a->out)[dst + d] = f32_to_bf16(acc[g][d] * inv_sum[g]);
        } else {
            for (int d = 0; d < hd; d++) ((float *)a->out)[dst + d] = acc[g][d] * inv_sum[g];
        }
    }
}

static void attend_hd64_f32(const Args *a, int i, int h, float *s) { attend(a, i, h, s, 64, 0); }
static void attend_hd64_bf16(const Args *a, int i, int h, float *s) { attend(a, i, h, s, 64, 1); }
static void attend_hd128_f32(const Args *a, int i, int h, float *s) { attend(a, i, h, s, 128, 0); }
static void attend_hd128_bf16(const Args *a, int i, int h, float *s) { attend(a, i, h, s, 128, 1); }
static void attend_any_f32(const Args *a, int i, int h, float *s, int hd) { attend(a, i, h, s, hd, 0); }
static void attend_any_bf16(const Args *a, int i, int h, float *s, int hd) { attend(a, i, h, s, hd, 1); }

/* Returns 0 on success, 1 for shapes the fixed buffers cannot take (nothing written),
 * 2 when a thread could not allocate its score buffer. */
static int decode_attention(const void *query, int64_t query_row_stride, const void *key_cache,
                            const void *value_cache, const int32_t *block_tables,
                            int64_t block_table_stride, const int32_t *seq_lens, int num_requests,
                            int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            void *out, int64_t out_row_stride, int num_threads, int bf16) {
    if (head_dim > MAX_HEAD_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > MAX_GROUP || block_size <= 0)
        return 1;
    const Args a = {query, query_row_stride, key_cache, value_cache, block_tables, block_table_stride,
                    seq_lens, num_kv_heads, num_heads / num_kv_heads, block_size, scale, out, out_row_stride};
    int max_len = 1;
    for (int i = 0; i < num_requests; i++)
        if (seq_lens[i] > max_len) max_len = seq_lens[i];
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)a.group * (size_t)max_len);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_requests * num_kv_heads; item++) {
            if (!scores) continue;
            const int i = item / num_kv_heads, h = item % num_kv_heads;
            if (head_dim == 64) bf16 ? attend_hd64_bf16(&a, i, h, scores) : attend_hd64_f32(&a, i, h, scores);
            else if (head_dim == 128) bf16 ? attend_hd128_bf16(&a, i, h, scores) : attend_hd128_f32(&a, i, h, scores);
            else bf16 ? attend_any_bf16(&a, i, h, scores, head_dim) : attend_any_f32(&a, i, h, scores, head_dim);
        }
        free(scores);
    }
    return failed ? 2 : 0;
}

int decode_attention_f32(const float *query, int64_t query_row_stride, const float *key_cache,
                         const float *value_cache, const int32_t *block_tables, int64_t block_table_stride,
                         const int32_t *seq_lens, int num_requests, int num_heads, int num_kv_heads,
                         int head_dim, int block_size, float scale, float *out, int64_t out_row_stride,
                         int num_threads) {
    return decode_attention(query, query_row_stride, key_cache, value_cache, block_tables, block_table_stride,
                            seq_lens, num_requests, num_heads, num_kv_heads, head_dim, block_size, scale, out,
                            out_row_stride, num_threads, 0);
}

int decode_attention_bf16(const uint16_t *query, int64_t query_row_stride, const uint16_t *key_cache,
                          const uint16_t *value_cache, const int32_t *block_tables, int64_t block_table_stride,
                          const int32_t *seq_lens, int num_requests, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, uint16_t *out, int64_t out_row_stride,
                          int num_threads) {
    return decode_attention(query, query_row_stride, key_cache, value_cache, block_tables, block_table_stride,
                            seq_lens, num_requests, num_heads, num_kv_heads, head_dim, block_size, scale, out,
                            out_row_stride, num_threads, 1);
}
