/* Causal attention of requests' prompt chunks over their paged K/V, bfloat16, with
 * AVX512_BF16 (see kernels/paged_attention_torch.py, `_prefill_plan`).
 *
 * A request's q_len queries sit at positions prefix .. prefix + q_len - 1 of its seq_len
 * keys (prefix = seq_len - q_len: a cached prefix or earlier chunks); query i sees keys
 * 0 .. prefix + i. Flash attention's online softmax, so no [queries, keys] matrix is ever
 * held:
 *
 *   1. each request's K and V, per KV head, are copied once from the cache's blocks into
 *      the layouts vdpbf16ps reads (products of bf16 pairs summed in float32): K as, per 16
 *      keys and per pair of dims, one vector of the 16 keys' pairs; V as, per pair of keys
 *      and per 16 dims, one vector of the 16 dims' key pairs;
 *   2. a work item is one request, one KV head and BQ query positions, for all the query
 *      heads of that KV head (GQA: its K/V are read once for the group); per BK keys, only
 *      up to the last position the item sees (above the diagonal nothing is computed): the
 *      scores of 4 rows x 64 keys held in registers over the head dim, the causal mask on
 *      the diagonal block, the softmax update in float32 (running max and sum, the output
 *      rescaled), and the weights rounded to bf16 times V, again 4 rows x 64 dims in
 *      registers.
 *
 * Work items of all the requests are spread over the OpenMP threads, largest first (the
 * last positions see the most keys). Returns 1 where this build or the shapes cannot (no
 * AVX512_BF16, head_dim not a multiple of 32 up to 256), -1 without memory for the K/V
 * copies.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "isa.h"

#define BQ 16 /* query positions per work item */
#define BK 64 /* keys per online-softmax step */
#define MAX_HD 256

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

typedef struct {
    const uint16_t *key_cache, *value_cache;
    const int32_t *block_table;
    int block_size, num_kv_heads, head_dim;
} paged_kv_t;

static inline const uint16_t *kv_row(const paged_kv_t *kv, const uint16_t *cache, int position, int head) {
    const int64_t block = kv->block_table[position / kv->block_size];
    return cache + ((block * kv->block_size + position % kv->block_size) * kv->num_kv_heads + head) * kv->head_dim;
}

/* K of head h, keys [16 kb, 16 kb + 16): per pair of dims d2, the 16 keys' (d, d + 1) pairs. */
static void pack_keys(const paged_kv_t *kv, int head, int kb, int seq_len, uint32_t *out) {
    const int pairs = kv->head_dim / 2;
    for (int j = 0; j < 16; j++) {
        const int position = 16 * kb + j;
        if (position < seq_len) {
            const uint32_t *row = (const uint32_t *)kv_row(kv, kv->key_cache, position, head);
            for (int d2 = 0; d2 < pairs; d2++) out[d2 * 16 + j] = row[d2];
        } else {
            for (int d2 = 0; d2 < pairs; d2++) out[d2 * 16 + j] = 0;
        }
    }
}

/* V of head h, keys 2 jp and 2 jp + 1: per 16 dims, the 16 dims' (key 2 jp, key 2 jp + 1) pairs. */
static void pack_values(const paged_kv_t *kv, int head, int jp, int seq_len, uint32_t *out) {
    const uint16_t *a = 2 * jp < seq_len ? kv_row(kv, kv->value_cache, 2 * jp, head) : NULL;
    const uint16_t *b = 2 * jp + 1 < seq_len ? kv_row(kv, kv->value_cache, 2 * jp + 1, head) : NULL;
    for (int d = 0; d < kv->head_dim; d++) out[d] = (uint32_t)(a ? a[d] : 0) | (uint32_t)(b ? b[d] : 0) << 16;
}

/* Per thread: one work item's rows (group x BQ) of scores, bf16 weights, output and softmax state. */
typedef struct {
    float *scores;     /* [rows][BK] */
    uint16_t *weights; /* [rows][BK] bf16 */
    float *acc;        /* [rows][hd] */
    float *row_max, *row_sum, *rescale;
} item_scratch_t;

/* scores[r][0..64) = scale * q_r . K[key block], 4 rows at a time, 64 keys in 16 registers. */
static void block_scores(const uint32_t *const *q_words, int rows, const uint32_t *packed_k, int pairs, float scale,
                         float *scores) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r += 4) {
        __m512 acc[4][4];
        for (int a = 0; a < 4; a++)
            for (int v = 0; v < 4; v++) acc[a][v] = _mm512_setzero_ps();
        for (int d2 = 0; d2 < pairs; d2++) {
            __m512bh k[4];
            for (int v = 0; v < 4; v++) k[v] = (__m512bh)_mm512_loadu_si512(packed_k + ((int64_t)v * pairs + d2) * 16);
            for (int a = 0; a < 4; a++) {
                const __m512bh q = (__m512bh)_mm512_set1_epi32((int)q_words[r + a][d2]);
                for (int v = 0; v < 4; v++) acc[a][v] = _mm512_dpbf16_ps(acc[a][v], q, k[v]);
            }
        }
        for (int a = 0; a < 4; a++)
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(scores + (r + a) * BK + 16 * v, _mm512_mul_ps(acc[a][v], vscale));
    }
}

/* acc[r] = acc[r] * rescale[r] + weights[r] . V[key block], 4 rows x 64 dims at a time. */
static void block_values(const uint16_t *weights, const float *rescale, int rows, const uint32_t *packed_v, int hd,
                         float *acc_io) {
    const int dim_vectors = hd / 16;
    for (int r = 0; r < rows; r += 4) {
        for (int dv = 0; dv < dim_vectors; dv += 4) {
            const int nv = dim_vectors - dv < 4 ? dim_vectors - dv : 4;
            __m512 acc[4][4];
            for (int a = 0; a < 4; a++) {
                const __m512 s = _mm512_set1_ps(rescale[r + a]);
                for (int v = 0; v < nv; v++)
                    acc[a][v] = _mm512_mul_ps(_mm512_loadu_ps(acc_io + (int64_t)(r + a) * hd + 16 * (dv + v)), s);
            }
            for (int jp = 0; jp < BK / 2; jp++) {
                __m512bh vals[4];
                for (int v = 0; v < nv; v++)
                    vals[v] = (__m512bh)_mm512_loadu_si512(packed_v + ((int64_t)jp * dim_vectors + dv + v) * 16);
                for (int a = 0; a < 4; a++) {
                    uint32_t w;
                    memcpy(&w, weights + (r + a) * BK + 2 * jp, sizeof w);
                    const __m512bh p = (__m512bh)_mm512_set1_epi32((int)w);
                    for (int v = 0; v < nv; v++) acc[a][v] = _mm512_dpbf16_ps(acc[a][v], p, vals[v]);
                }
            }
            for (int a = 0; a < 4; a++)
                for (int v = 0; v < nv; v++) _mm512_storeu_ps(acc_io + (int64_t)(r + a) * hd + 16 * (dv + v), acc[a][v]);
        }
    }
}

/* The online softmax over one key block for every row: masks keys past each row's last
 * visible position, updates the running max and sum, leaves the bf16 weights and each
 * row's rescale of its output so far. */
static void softmax_block(item_scratch_t *s, int rows, const int *last_visible, int key0) {
    for (int r = 0; r < rows; r++) {
        float *sc = s->scores + r * BK;
        const int visible = last_visible[r] - key0 + 1; /* keys of this block the row sees */
        if (visible < BK)
            for (int j = visible < 0 ? 0 : visible; j < BK; j++) sc[j] = -INFINITY;
        float block_max = -INFINITY;
        for (int j = 0; j < BK; j++) block_max = sc[j] > block_max ? sc[j] : block_max;
        const float old_max = s->row_max[r];
        const float new_max = block_max > old_max ? block_max : old_max;
        if (new_max == -INFINITY) { /* nothing seen yet (never so: key 0 is in the first block) */
            s->rescale[r] = 1.0f;
            memset(s->weights + r * BK, 0, BK * sizeof *s->weights);
            continue;
        }
        float sum = 0.0f;
        float p[BK];
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < BK; j++) {
            p[j] = sc[j] == -INFINITY ? 0.0f : fast_expf(sc[j] - new_max);
            sum += p[j];
        }
        for (int j = 0; j < BK; j += 32) {
            const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + j + 16), _mm512_loadu_ps(p + j));
            _mm512_storeu_si512(s->weights + r * BK + j, (__m512i)pair);
        }
        const float rescale = old_max == -INFINITY ? 0.0f : fast_expf(old_max - new_max);
        s->rescale[r] = rescale;
        s->row_sum[r] = s->row_sum[r] * rescale + sum;
        s->row_max[r] = new_max;
    }
}

typedef struct {
    int request, head, query_block;
    int64_t cost; /* keys seen by the block's last query */
} work_item_t;

static int by_cost_desc(const void *a, const void *b) {
    const work_item_t *x = a, *y = b;
    return (x->cost < y->cost) - (x->cost > y->cost);
}

int prefill_attention_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *q_starts, const int32_t *q_lens, const int32_t *seq_lens, int num_requests,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, uint16_t *out,
                           int64_t out_stride, int num_threads) {
    if (head_dim % 32 || head_dim > MAX_HD || num_heads % num_kv_heads) return 1;
    for (int r = 0; r < num_requests; r++)
        if (q_lens[r] < 1 || q_lens[r] > seq_lens[r]) return 1;
    const int group = num_heads / num_kv_heads, rows = group * BQ, pairs = head_dim / 2;
    /* Per request: where its packed K/V start (in 64-key blocks) and its work items. */
    int64_t *first_block = malloc((size_t)(num_requests + 1) * sizeof *first_block);
    int num_items = 0;
    if (!first_block) return -1;
    first_block[0] = 0;
    for (int r = 0; r < num_requests; r++) {
        first_block[r + 1] = first_block[r] + (seq_lens[r] + BK - 1) / BK;
        num_items += num_kv_heads * ((q_lens[r] + BQ - 1) / BQ);
    }
    const int64_t total_blocks = first_block[num_requests];
    /* Packed K/V per (request, head): 64-key blocks of BK/16 x pairs x 16 and BK/2 x hd words. */
    const int64_t k_block = (int64_t)(BK / 16) * pairs * 16, v_block = (int64_t)(BK / 2) * head_dim;
    uint32_t *packed_k = malloc((size_t)(total_blocks * num_kv_heads * k_block) * sizeof *packed_k);
    uint32_t *packed_v = malloc((size_t)(total_blocks * num_kv_heads * v_block) * sizeof *packed_v);
    work_item_t *work = malloc((size_t)num_items * sizeof *work);
    static const uint32_t zero_words[MAX_HD / 2];
    int failed = !packed_k || !packed_v || !work;
    if (!failed) {
        int n = 0;
        for (int r = 0; r < num_requests; r++)
            for (int qb = 0; qb < (q_lens[r] + BQ - 1) / BQ; qb++)
                for (int h = 0; h < num_kv_heads; h++) {
                    const int last = qb * BQ + BQ < q_lens[r] ? qb * BQ + BQ : q_lens[r];
                    work[n++] = (work_item_t){r, h, qb, seq_lens[r] - q_lens[r] + last};
                }
        qsort(work, (size_t)num_items, sizeof *work, by_cost_desc); /* largest first */
    }
    /* K/V of (request r, head h) start at block (first_block[r] * num_kv_heads + h * blocks of r). */
#define KV_BLOCK_AT(r, h) (first_block[r] * num_kv_heads + (int64_t)(h) * (first_block[(r) + 1] - first_block[r]))
#pragma omp parallel num_threads(num_threads) if (!failed)
    {
        for (int r = 0; r < num_requests; r++) {
            const paged_kv_t kv = {key_cache, value_cache, block_tables + r * table_stride, block_size, num_kv_heads,
                                   head_dim};
            const int blocks = (int)(first_block[r + 1] - first_block[r]);
#pragma omp for schedule(static) nowait
            for (int i = 0; i < num_kv_heads * blocks * (BK / 16); i++) {
                const int head = i / (blocks * (BK / 16)), kb = i % (blocks * (BK / 16));
                pack_keys(&kv, head, kb, seq_lens[r], packed_k + KV_BLOCK_AT(r, head) * k_block + (int64_t)kb * pairs * 16);
            }
#pragma omp for schedule(static) nowait
            for (int i = 0; i < num_kv_heads * blocks * (BK / 2); i++) {
                const int head = i / (blocks * (BK / 2)), jp = i % (blocks * (BK / 2));
                pack_values(&kv, head, jp, seq_lens[r], packed_v + KV_BLOCK_AT(r, head) * v_block + (int64_t)jp * head_dim);
            }
        }
#pragma omp barrier
        item_scratch_t s;
        s.scores = malloc((size_t)rows * BK * sizeof *s.scores);
        s.weights = malloc((size_t)rows * BK * sizeof *s.weights);
        s.acc = malloc((size_t)rows * head_dim * sizeof *s.acc);
        s.row_max = malloc((size_t)rows * 3 * sizeof *s.row_max);
        const uint32_t **q_words = malloc((size_t)rows * sizeof *q_words);
        int *last_visible = malloc((size_t)rows * sizeof *last_visible);
        const int ok = s.scores && s.weights && s.acc && s.row_max && q_words && last_visible;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        s.row_sum = ok ? s.row_max + rows : NULL;
        s.rescale = ok ? s.row_max + 2 * rows : NULL;
        /* Every thread takes part in the loop (an OpenMP rule); one without scratch skips its items. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_items; item++) {
            if (!ok) continue;
            const int r = work[item].request, head = work[item].head;
            const int q_len = q_lens[r], prefix = seq_lens[r] - q_len;
            const int i0 = work[item].query_block * BQ, nq = q_len - i0 < BQ ? q_len - i0 : BQ;
            const uint16_t *q_rows = query + (int64_t)q_starts[r] * q_stride;
            for (int g = 0; g < group; g++)
                for (int i = 0; i < BQ; i++) {
                    const int row = g * BQ + i;
                    q_words[row] = i < nq ? (const uint32_t *)(q_rows + (i0 + i) * q_stride + (head * group + g) * head_dim)
                                          : zero_words;
                    last_visible[row] = prefix + i0 + (i < nq ? i : nq - 1);
                    s.row_max[row] = -INFINITY;
                    s.row_sum[row] = 0.0f;
                }
            memset(s.acc, 0, (size_t)rows * head_dim * sizeof *s.acc);
            const uint32_t *k_head = packed_k + KV_BLOCK_AT(r, head) * k_block;
            const uint32_t *v_head = packed_v + KV_BLOCK_AT(r, head) * v_block;
            const int last_block = (prefix + i0 + nq - 1) / BK;
            for (int kb = 0; kb <= last_block; kb++) {
                block_scores(q_words, rows, k_head + kb * k_block, pairs, scale, s.scores);
                softmax_block(&s, rows, last_visible, kb * BK);
                block_values(s.weights, s.rescale, rows, v_head + kb * v_block, head_dim, s.acc);
            }
            uint16_t *o_rows = out + (int64_t)q_starts[r] * out_stride;
            for (int g = 0; g < group; g++)
                for (int i = 0; i < nq; i++) {
                    const int row = g * BQ + i;
                    const float inv = 1.0f / s.row_sum[row];
                    uint16_t *o = o_rows + (i0 + i) * out_stride + (head * group + g) * head_dim;
                    for (int d = 0; d < head_dim; d++) o[d] = f32_to_bf16(s.acc[(int64_t)row * head_dim + d] * inv);
                }
        }
        free(s.scores);
        free(s.weights);
        free(s.acc);
        free(s.row_max);
        free(q_words);
        free(last_visible);
    }
#undef KV_BLOCK_AT
    free(first_block);
    free(packed_k);
    free(packed_v);
    free(work);
    return failed ? -1 : 0;
}

#else
int prefill_attention_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *q_starts, const int32_t *q_lens, const int32_t *seq_lens, int num_requests,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, uint16_t *out,
                           int64_t out_stride, int num_threads) {
    (void)query, (void)q_stride, (void)key_cache, (void)value_cache, (void)block_tables, (void)table_stride;
    (void)q_starts, (void)q_lens, (void)seq_lens, (void)num_requests, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)block_size, (void)scale, (void)out, (void)out_stride, (void)num_threads;
    return 1;
}
#endif
