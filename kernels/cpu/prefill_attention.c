/* Causal attention of requests' prompt chunks over their paged K/V, bfloat16, with
 * AVX512_BF16 (see kernels/paged_attention_torch.py, `_prefill_plan`).
 *
 * A request's q_len queries sit at positions prefix .. prefix + q_len - 1 of its seq_len
 * keys (prefix = seq_len - q_len: a cached prefix or earlier chunks); query i sees keys
 * 0 .. prefix + i. Flash attention's online softmax, so no [queries, keys] matrix is ever
 * held:
 *
 *   1. a work item is one request, one KV head and BQ query positions (all of them when
 *      fewer), for all the query heads of that KV head (GQA: its K/V are read once for the
 *      group); it copies the head's keys up to its last visible one from the cache's blocks
 *      into the layouts vdpbf16ps reads (products of bf16 pairs summed in float32), kept for
 *      the thread's next item of the same head: K as, per 16 keys and per pair of dims, one
 *      vector of the 16 keys' pairs (a 16 x 16 transpose of 32-bit words); V as, per pair
 *      of keys and per 16 dims, one vector of the 16 dims' key pairs;
 *   2. per BK keys, only up to the last position the item sees (above the diagonal nothing
 *      is computed): the scores of 4 rows x 64 keys held in registers over the head dim,
 *      the causal mask on the diagonal block, the softmax update in float32 (running max and
 *      sum, the output rescaled), and the weights rounded to bf16 times V, again 4 rows x
 *      64 dims in registers.
 *
 * A row's arithmetic depends only on its query and its context's K/V (blocks of keys at
 * fixed positions from 0, in order; blocks past a row's last key change nothing), so a
 * token gets the same bits however its prompt is chunked and whatever else the call
 * holds. It is not the decode kernel's arithmetic (kernels/cpu/paged_decode_attention.c):
 * the same token attended as a decode differs in the last bits. Work items of all the
 * requests are spread over the OpenMP threads, a head's last query block first. Returns 1
 * where this build or the shapes cannot (no AVX512_BF16, head_dim not a multiple of 32 up
 * to 256), -1 without memory for a thread's scratch.
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

/* A 16 x 16 transpose of 32-bit words: out[d] lane j = in[j] lane d. */
static inline void transpose_16x16(const __m512i in[16], __m512i out[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* per 128-bit lane L, u[4 i + m] holds rows 4i..4i+3 of word 4L + m */
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) { /* word 4L + m of all 16 rows: lane L of u[m], u[4 + m], u[8 + m], u[12 + m] */
        const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), x1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
        const __m512i y1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
        out[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        out[8 + m] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        out[4 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        out[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
}

/* K of head h, keys [16 g, 16 g + 16): per pair of dims d2, the 16 keys' (d, d + 1) pairs
 * (zeros past seq_len). */
static void pack_keys(const paged_kv_t *kv, int head, int g, int seq_len, uint32_t *out) {
    const int pairs = kv->head_dim / 2;
    const uint16_t *rows[16];
    for (int j = 0; j < 16; j++) rows[j] = 16 * g + j < seq_len ? kv_row(kv, kv->key_cache, 16 * g + j, head) : NULL;
    for (int c = 0; c < pairs; c += 16) { /* 16 pairs of dims at a time */
        __m512i in[16], t[16];
        for (int j = 0; j < 16; j++) in[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 2 * c) : _mm512_setzero_si512();
        transpose_16x16(in, t);
        for (int d = 0; d < 16; d++) _mm512_storeu_si512(out + (int64_t)(c + d) * 16, t[d]);
    }
}

/* V of head h, keys 2 jp and 2 jp + 1: per 16 dims, the 16 dims' (key 2 jp, key 2 jp + 1)
 * pairs (zeros past seq_len). */
static void pack_values(const paged_kv_t *kv, int head, int jp, int seq_len, uint32_t *out) {
    const uint16_t *a = 2 * jp < seq_len ? kv_row(kv, kv->value_cache, 2 * jp, head) : NULL;
    const uint16_t *b = 2 * jp + 1 < seq_len ? kv_row(kv, kv->value_cache, 2 * jp + 1, head) : NULL;
    for (int d = 0; d < kv->head_dim; d += 16) {
        const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + d))) : _mm512_setzero_si512();
        const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + d))) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
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
} work_item_t;

/* Query positions per work item of a request with q_len queries: BQ, or all of them when
 * fewer (a decode is one). */
static inline int item_positions(int q_len) { return q_len < BQ ? q_len : BQ; }

/* Rows of a work item: its positions for each query head of the group, a multiple of 4. */
static inline int item_rows(int group, int positions) { return (group * positions + 3) / 4 * 4; }

/* One thread's scratch, kept between calls (grown as needed). */
typedef struct {
    uint32_t *packed_k, *packed_v; /* one KV head's keys up to an item's last, packed */
    item_scratch_t item;
    const uint32_t **q_words;
    int *last_visible;
    int64_t key_capacity, row_capacity, dim_capacity;
    /* What packed_k / packed_v hold: keys 0 .. packed_keys - 1 of (call, request, head). */
    int64_t packed_call;
    int packed_request, packed_head, packed_keys;
} thread_scratch_t;

static thread_scratch_t *thread_scratch(int64_t keys, int rows, int head_dim) {
    static __thread thread_scratch_t t;
    if (t.key_capacity >= keys && t.row_capacity >= rows && t.dim_capacity >= head_dim) return &t;
    free(t.packed_k), free(t.packed_v), free(t.item.scores), free(t.item.weights), free(t.item.acc);
    free(t.item.row_max), free(t.q_words), free(t.last_visible);
    if (keys < t.key_capacity) keys = t.key_capacity;
    if (rows < t.row_capacity) rows = (int)t.row_capacity;
    if (head_dim < t.dim_capacity) head_dim = (int)t.dim_capacity;
    t.packed_k = malloc((size_t)keys * head_dim / 2 * sizeof *t.packed_k);
    t.packed_v = malloc((size_t)keys * head_dim / 2 * sizeof *t.packed_v);
    t.item.scores = malloc((size_t)rows * BK * sizeof *t.item.scores);
    t.item.weights = malloc((size_t)rows * BK * sizeof *t.item.weights);
    t.item.acc = malloc((size_t)rows * head_dim * sizeof *t.item.acc);
    t.item.row_max = malloc((size_t)rows * 3 * sizeof *t.item.row_max);
    t.q_words = malloc((size_t)rows * sizeof *t.q_words);
    t.last_visible = malloc((size_t)rows * sizeof *t.last_visible);
    const int ok = t.packed_k && t.packed_v && t.item.scores && t.item.weights && t.item.acc && t.item.row_max &&
                   t.q_words && t.last_visible;
    t.packed_call = -1;
    t.key_capacity = ok ? keys : 0;
    t.row_capacity = ok ? rows : 0;
    t.dim_capacity = ok ? head_dim : 0;
    if (!ok) return NULL;
    t.item.row_sum = t.item.row_max + rows;
    t.item.rescale = t.item.row_max + 2 * rows;
    return &t;
}

/* One work item: positions i0 .. i0 + nq - 1 of request `request`'s queries, KV head `head`. */
static void attend_item(const uint16_t *query, int64_t q_stride, const paged_kv_t *kv, int64_t call, int request,
                        int q_start, int q_len, int seq_len, int head, int group, int i0, int positions, float scale,
                        uint16_t *out, int64_t out_stride, thread_scratch_t *t) {
    static const uint32_t zero_words[MAX_HD / 2];
    const int hd = kv->head_dim, pairs = hd / 2, prefix = seq_len - q_len;
    const int nq = q_len - i0 < positions ? q_len - i0 : positions, rows = item_rows(group, positions);
    const int last_block = (prefix + i0 + nq - 1) / BK, keys = (last_block + 1) * BK;
    /* This head's keys up to the item's last visible one, packed (zeros past seq_len); what
     * this thread packed for the same head's previous item is kept. */
    int from = 0;
    if (t->packed_call == call && t->packed_request == request && t->packed_head == head) from = t->packed_keys;
    for (int g16 = from / 16; g16 < keys / 16; g16++)
        pack_keys(kv, head, g16, seq_len, t->packed_k + (int64_t)g16 * pairs * 16);
    for (int jp = from / 2; jp < keys / 2; jp++)
        pack_values(kv, head, jp, seq_len, t->packed_v + (int64_t)jp * hd);
    if (keys > from || t->packed_call != call || t->packed_request != request || t->packed_head != head) {
        t->packed_call = call, t->packed_request = request, t->packed_head = head;
        t->packed_keys = keys > from ? keys : from;
    }
    item_scratch_t *s = &t->item;
    const uint16_t *q_rows = query + (int64_t)q_start * q_stride;
    for (int r = 0; r < rows; r++) {
        const int g = r / positions, i = r % positions, real = g < group && i < nq;
        t->q_words[r] = real ? (const uint32_t *)(q_rows + (i0 + i) * q_stride + (head * group + g) * hd) : zero_words;
        t->last_visible[r] = prefix + i0 + (real ? i : 0);
        s->row_max[r] = -INFINITY;
        s->row_sum[r] = 0.0f;
    }
    memset(s->acc, 0, (size_t)rows * hd * sizeof *s->acc);
    for (int kb = 0; kb <= last_block; kb++) {
        block_scores(t->q_words, rows, t->packed_k + (int64_t)kb * (BK / 16) * pairs * 16, pairs, scale, s->scores);
        softmax_block(s, rows, t->last_visible, kb * BK);
        block_values(s->weights, s->rescale, rows, t->packed_v + (int64_t)kb * (BK / 2) * hd, hd, s->acc);
    }
    uint16_t *o_rows = out + (int64_t)q_start * out_stride;
    for (int g = 0; g < group; g++)
        for (int i = 0; i < nq; i++) {
            const int r = g * positions + i;
            const float inv = 1.0f / s->row_sum[r];
            uint16_t *o = o_rows + (i0 + i) * out_stride + (head * group + g) * hd;
            for (int d = 0; d < hd; d++) o[d] = f32_to_bf16(s->acc[(int64_t)r * hd + d] * inv);
        }
}

int prefill_attention_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *q_starts, const int32_t *q_lens, const int32_t *seq_lens, int num_requests,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, uint16_t *out,
                           int64_t out_stride, int num_threads) {
    if (head_dim % 32 || head_dim > MAX_HD || num_heads % num_kv_heads) return 1;
    int num_items = 0, max_keys = 0;
    for (int r = 0; r < num_requests; r++) {
        if (q_lens[r] < 1 || q_lens[r] > seq_lens[r]) return 1;
        const int positions = item_positions(q_lens[r]);
        num_items += num_kv_heads * ((q_lens[r] + positions - 1) / positions);
        const int keys = (seq_lens[r] + BK - 1) / BK * BK;
        if (keys > max_keys) max_keys = keys;
    }
    const int group = num_heads / num_kv_heads, max_rows = item_rows(group, BQ);
    work_item_t *work = malloc((size_t)num_items * sizeof *work);
    if (!work) return -1;
    /* Per request and KV head, the last query block first: a thread that takes the next item
     * of the same head finds its keys packed already, and the smallest items come last. */
    int n = 0;
    for (int r = 0; r < num_requests; r++)
        for (int h = 0; h < num_kv_heads; h++)
            for (int qb = (q_lens[r] + item_positions(q_lens[r]) - 1) / item_positions(q_lens[r]) - 1; qb >= 0; qb--)
                work[n++] = (work_item_t){r, h, qb};
    static int64_t calls; /* tells one call's packed keys from another's */
    int64_t call;
#pragma omp atomic capture
    call = ++calls;
    if (num_threads > num_items) num_threads = num_items > 0 ? num_items : 1;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
    for (int item = 0; item < num_items; item++) {
        thread_scratch_t *t = thread_scratch(max_keys, max_rows, head_dim);
        if (!t) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const int r = work[item].request;
        const paged_kv_t kv = {key_cache, value_cache, block_tables + r * table_stride, block_size, num_kv_heads,
                               head_dim};
        const int positions = item_positions(q_lens[r]);
        attend_item(query, q_stride, &kv, call, r, q_starts[r], q_lens[r], seq_lens[r], work[item].head, group,
                    work[item].query_block * positions, positions, scale, out, out_stride, t);
    }
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
