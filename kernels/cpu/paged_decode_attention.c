/* Decode attention over a paged KV cache, for the CPU (see kernels/paged_attention_torch.py).
 *
 * One query token per request. Request i attends to its first seq_lens[i] cached tokens
 * (with window > 0, to its last `window` of them only: the blocks before are never read),
 * read in place through block_tables[i] from caches laid out
 * [num_blocks, block_size, num_kv_heads, head_dim]: no gathered copy of K/V. Work is split
 * over requests; each K/V row read serves all the request's query heads. Arithmetic is in
 * float32 whatever the storage type: float32 or bfloat16 query and output, caches of the
 * same type or bfloat16 caches under a float32 query (`--kv-cache-dtype bfloat16`). Threads
 * come from the OpenMP runtime PyTorch itself loaded (same soname), so no second thread
 * pool appears. Head dims 64 and 128 get code compiled for that size. A bf16 query over
 * bf16 caches takes AVX512_BF16 (vdpbf16ps) where the library is compiled for it; the
 * other pairings, and that one without AVX512_BF16, take AVX2 + FMA (bf16 widened to
 * float32 by a shift) where the library is compiled for AVX2 (AVX-512 builds included),
 * and the generic code otherwise. On the AVX512_BF16 path (with an even block size) the
 * softmax numerators are rounded to bf16 and the values summed by pairs of positions, one
 * vdpbf16ps per pair (pair_values_512), and the same library's multi-row entry,
 * decode_attention_rows_bf16 (at the end), attends a prompt chunk's tokens several at a
 * time with each row's arithmetic exactly a decode's: the batch-invariant attention of
 * prompt chunks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "isa.h"

#define MAX_HEADS 256
/* Fewer requests than threads (a batch of one): their KV heads are split between the
 * threads from this context length on. Below it a second thread gained nothing measurable;
 * from it, 1.1-1.3x on two threads of an AVX2 Zen 3 with the KV read from memory
 * (scripts/bench_decode_attention_threads.py). */
#define SPLIT_HEADS_MIN_LEN 256
#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef struct {
    const void *query;
    int64_t query_row_stride; /* elements */
    const void *key_cache, *value_cache;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *seq_lens;
    int num_kv_heads, group, block_size;
    int window; /* > 0: each query sees only its last `window` positions */
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

#define MAX_DOT_GROUP 8
#define PAIR_WORK_FLOATS(hd) (8 * (size_t)(hd)) /* PAIR_RUN / 2 pairs' V vectors */
#define MAX_DOT_HD 128
#define MAX_VALUE_GROUP 4

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_512 1 /* bf16 query over bf16 caches: the query read in place */
#define SCORE_RUN_512 16 /* tokens per block_scores_512 call */

/* Lane j of the result: the sum of v[j]'s 16 lanes (a 16 x 16 transpose folded into adds). */
ALWAYS_INLINE __m512 lane_sums16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++) /* per 128-bit quarter: [v0 0+2, v1 0+2, v0 1+3, v1 1+3] */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per quarter: that quarter's sums of vectors 4i .. 4i + 3 */
        const __m512d lo = _mm512_castps_pd(w[2 * i]), hi = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    /* Add the quarters: 0x88 takes quarters 0, 2 of each source, 0xDD quarters 1, 3. */
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

/* Scores of `count` <= 16 consecutive cached tokens for the G query heads of one KV head,
 * bfloat16 only, hd <= 128 a multiple of 32. Each K row is read whole and multiplied with a
 * head's query by vdpbf16ps (products of bf16 pairs summed in float32), leaving 16
 * partial sums per token; lane_sums16 reduces the 16 tokens' partial sums at once.
 * k_cache + k_at is the first token's values of this KV head, `q` the first of the G
 * heads' query values; scores[g * len + j] receives the scaled score of token j. */
ALWAYS_INLINE void block_scores_512(const void *k_cache, int64_t k_at, int64_t token_stride, int count,
                                    const uint16_t *q, float scale, float *scores, int len, const int G, const int hd) {
    const uint16_t *k = (const uint16_t *)k_cache + k_at;
    const __mmask16 live = (__mmask16)((1u << count) - 1u);
    for (int g = 0; g < G; g++) {
        __m512i qv[MAX_DOT_HD / 32]; /* fixed sizes (not hd's): the compiler keeps them in registers */
        for (int c = 0; c < hd / 32; c++) qv[c] = _mm512_loadu_si512(q + g * hd + 32 * c);
        __m512 part[16];
        for (int j = 0; j < 16; j++) {
            __m512 s = _mm512_setzero_ps();
            if (j < count)
                for (int c = 0; c < hd / 32; c++)
                    s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(k + j * token_stride + 32 * c), (__m512bh)qv[c]);
            part[j] = s;
        }
        _mm512_mask_storeu_ps(scores + (int64_t)g * len, live, _mm512_mul_ps(lane_sums16(part), _mm512_set1_ps(scale)));
    }
}

/* acc[g] += sum over `count` tokens of probs[g * len + j] * V[j] for one KV head's G <= 4
 * query heads, bfloat16 V, hd <= 128 a multiple of 16, the accumulators held in registers. */
ALWAYS_INLINE void block_values_512(const void *v_rows, int64_t token_stride, int count, const float *probs, int len,
                                    float *acc_io, const int G, const int hd) {
    const uint16_t *v = v_rows;
    __m512 acc[MAX_VALUE_GROUP][MAX_DOT_HD / 16];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < hd / 16; c++) acc[g][c] = _mm512_loadu_ps(acc_io + g * hd + 16 * c);
    for (int j = 0; j < count; j++) {
        __m512 vf[MAX_DOT_HD / 16];
        for (int c = 0; c < hd / 16; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(v + j * token_stride + 16 * c));
            vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(probs[(int64_t)g * len + j]);
            for (int c = 0; c < hd / 16; c++) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < hd / 16; c++) _mm512_storeu_ps(acc_io + g * hd + 16 * c, acc[g][c]);
}
#else
#define HAVE_512 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 without native bf16 products: bf16 -> float32 by a 16-bit shift, then FMA; float32
 * caches take the same code. The query is read converted to float32 once. */
#include <immintrin.h>
#define HAVE_256 1
#define SCORE_RUN_256 8

/* 8 values from element `at` of a bfloat16 or float32 array, as float32. */
ALWAYS_INLINE __m256 load8(const void *base, int64_t at, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + at);
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Lane j of the result: the sum of v[j]'s 8 lanes. */
ALWAYS_INLINE __m256 lane_sums8(const __m256 *v) {
    /* hadd of hadds: per 128-bit half, [v0, v1, v2, v3] (and [v4 .. v7]) summed over that half. */
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* Scores of `count` <= 8 consecutive cached tokens for the G query heads of one KV head,
 * bfloat16 or float32 keys, hd <= 128 a multiple of 8. A full run of float32 keys is read in
 * place; other runs are copied as float32 (zero-padded) once for all G heads. Each token
 * keeps 8 partial sums, and lane_sums8 reduces the 8 tokens' at once. k_cache + k_at is the first token's values of this KV head, `q` the
 * first of the G heads' float32 query values; scores[g * len + j] receives the scaled
 * score of token j. */
ALWAYS_INLINE void block_scores_256(const void *k_cache, int64_t k_at, int64_t token_stride, int count, const float *q,
                                    float scale, float *scores, int len, const int G, const int hd, const int bf16) {
    const int in_place = !bf16 && count == SCORE_RUN_256;
    float kf[SCORE_RUN_256 * MAX_DOT_HD];
    if (!in_place)
        for (int j = 0; j < SCORE_RUN_256; j++)
            for (int c = 0; c < hd / 8; c++)
                _mm256_storeu_ps(kf + j * hd + 8 * c,
                                 j < count ? load8(k_cache, k_at + j * token_stride + 8 * c, bf16) : _mm256_setzero_ps());
    const float *keys = in_place ? (const float *)k_cache + k_at : kf;
    const int64_t key_stride = in_place ? token_stride : hd;
    for (int g = 0; g < G; g++) {
        __m256 part[SCORE_RUN_256];
        for (int j = 0; j < SCORE_RUN_256; j++) part[j] = _mm256_setzero_ps();
        for (int c = 0; c < hd / 8; c++) {
            const __m256 qv = _mm256_loadu_ps(q + g * hd + 8 * c);
            for (int j = 0; j < SCORE_RUN_256; j++)
                part[j] = _mm256_fmadd_ps(_mm256_loadu_ps(keys + j * key_stride + 8 * c), qv, part[j]);
        }
        float sums[SCORE_RUN_256];
        _mm256_storeu_ps(sums, _mm256_mul_ps(lane_sums8(part), _mm256_set1_ps(scale)));
        memcpy(scores + (int64_t)g * len, sums, sizeof(float) * (size_t)count);
    }
}

/* acc[g] += sum over `count` tokens of probs[g * len + j] * V[j] for one KV head's G <= 4
 * query heads, bfloat16 or float32 V, hd <= 128 a multiple of 16: 16 columns at a time, so
 * that the 2G accumulators stay in registers. */
ALWAYS_INLINE void block_values_256(const void *v, int64_t token_stride, int count, const float *probs, int len,
                                    float *acc_io, const int G, const int hd, const int bf16) {
    for (int c = 0; c < hd / 16; c++) {
        __m256 acc[MAX_VALUE_GROUP][2];
        for (int g = 0; g < G; g++) {
            acc[g][0] = _mm256_loadu_ps(acc_io + g * hd + 16 * c);
            acc[g][1] = _mm256_loadu_ps(acc_io + g * hd + 16 * c + 8);
        }
        for (int j = 0; j < count; j++) {
            const __m256 v0 = load8(v, j * token_stride + 16 * c, bf16);
            const __m256 v1 = load8(v, j * token_stride + 16 * c + 8, bf16);
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_broadcast_ss(probs + (int64_t)g * len + j);
                acc[g][0] = _mm256_fmadd_ps(p, v0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(p, v1, acc[g][1]);
            }
        }
        for (int g = 0; g < G; g++) {
            _mm256_storeu_ps(acc_io + g * hd + 16 * c, acc[g][0]);
            _mm256_storeu_ps(acc_io + g * hd + 16 * c + 8, acc[g][1]);
        }
    }
}
#else
#define HAVE_256 0
#endif

#if HAVE_512
/* exp(x) lane by lane: fast_expf's method (kernels/cpu/fast_exp.h) in explicit 16-lane code. */
ALWAYS_INLINE __m512 fast_exp16(__m512 x) {
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860682030941723e-6f), r);
    static const float coefficients[] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    for (int c = 0; c < 7; c++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coefficients[c]));
    const __m512i ki = _mm512_cvtps_epi32(k), k1 = _mm512_srai_epi32(ki, 1), k2 = _mm512_sub_epi32(ki, k1);
    const __m512i bias = _mm512_set1_epi32(127);
    const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k1, bias), 23));
    const __m512 f2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k2, bias), 23));
    return _mm512_mask_blend_ps(over, _mm512_mul_ps(_mm512_mul_ps(p, f1), f2), _mm512_set1_ps(INFINITY));
}
#endif

#if HAVE_512
/* Values by pairs of positions (2k, 2k + 1), bf16 query over bf16 caches: a row's softmax
 * numerators rounded to bfloat16 and multiplied into its float32 accumulators by vdpbf16ps
 * (two products per lane), two positions per instruction. A pair member the row does not
 * see has weight 0 and its V row 0, so every pair's instruction inputs are a function of
 * the row alone. The accumulators hold the head dims in the order unpacklo/hi_epi16 leave
 * them (pair_lane_of). */
#define PAIR_RUN 16 /* positions per values run (within a block: block sizes are even) */
#define VALUE_REGS 24 /* accumulator registers of one pair_values_512 call: rows x hd / 16 */
#define MAX_VALUE_ROWS 12 /* VALUE_REGS / (hd / 16) for the smallest head dim, 32 */

/* Element of the accumulators holding head dim d: per 32 dims, the unpacklo vector (dims
 * 8L .. 8L + 3 of each 128-bit lane L) then the unpackhi one (8L + 4 .. 8L + 7). */
ALWAYS_INLINE int pair_lane_of(int d) {
    const int r = d & 31;
    return ((d >> 5) * 2 + ((r >> 2) & 1)) * 16 + 4 * (r >> 3) + (r & 3);
}

/* V rows of the pair's even (`a`) and odd (`b`) positions, NULL for a member the row does
 * not see, interleaved for vdpbf16ps: hd / 16 vectors of (even, odd) bf16 pairs. */
ALWAYS_INLINE void pair_vectors(const uint16_t *a, const uint16_t *b, __m512i *out, const int hd) {
    for (int c = 0; c < hd / 32; c++) {
        const __m512i ra = a ? _mm512_loadu_si512(a + 32 * c) : _mm512_setzero_si512();
        const __m512i rb = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
        out[2 * c] = _mm512_unpacklo_epi16(ra, rb);
        out[2 * c + 1] = _mm512_unpackhi_epi16(ra, rb);
    }
}

/* acc[b] += the weights times V over the pairs of positions start .. start + count - 1
 * (start even) for NB rows (a row: one query head of one query token); p[b] holds the
 * row's weight pairs (two bf16 in a word) from start on. The pairs' V vectors come from
 * vpairs (hd words a pair, built by pair_vectors from rows every one of the NB rows sees
 * whole) or, vpairs NULL, are built here from the V rows from v on (position start's row
 * of this KV head), members outside [lo, len) zeroed. One vdpbf16ps per (pair, 16 lanes),
 * in pair order. */
ALWAYS_INLINE void pair_values_512(const uint32_t *vpairs, const uint16_t *v, int64_t token_stride, int start,
                                   int count, int lo, int len, const uint32_t *const *p, float *const *acc_io,
                                   const int NB, const int hd) {
    __m512 acc[MAX_VALUE_ROWS][MAX_DOT_HD / 16]; /* fixed sizes: kept in registers */
    for (int b = 0; b < NB; b++)
        for (int c = 0; c < hd / 16; c++) acc[b][c] = _mm512_loadu_ps(acc_io[b] + 16 * c);
    for (int k = 0; 2 * k < count; k++) {
        __m512i pv[MAX_DOT_HD / 16];
        if (vpairs) {
            for (int c = 0; c < hd / 16; c++) pv[c] = _mm512_loadu_si512(vpairs + (int64_t)k * hd + 16 * c);
        } else {
            const int pos = start + 2 * k;
            pair_vectors(pos >= lo && pos < len ? v + 2 * k * token_stride : NULL,
                         pos + 1 >= lo && pos + 1 < len ? v + (2 * k + 1) * token_stride : NULL, pv, hd);
        }
#pragma GCC unroll 8
        for (int b = 0; b < NB; b++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)p[b][k]);
#pragma GCC unroll 8
            for (int c = 0; c < hd / 16; c++) acc[b][c] = _mm512_dpbf16_ps(acc[b][c], (__m512bh)pv[c], w);
        }
    }
    for (int b = 0; b < NB; b++)
        for (int c = 0; c < hd / 16; c++) _mm512_storeu_ps(acc_io[b] + 16 * c, acc[b][c]);
}
#endif

#if HAVE_512
/* A row's softmax numerators exp(s[t] - max) over s[0 .. n), rounded to bfloat16 into
 * w[0 .. n); returns their float32 sum. Explicit 16-lane code (lane k sums elements k,
 * k + 16, ... in order, then one fixed tree), so that the decode and the multi-row kernel
 * give a row the same bits (a compiler-vectorized loop may split a sum differently in two
 * places). */
ALWAYS_INLINE float softmax_weights_bf16(const float *s, const int n, uint16_t *w) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 vmax = neg_inf;
    int t = 0;
    for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1u);
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, tail, s + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= n; t += 16) {
        const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
        _mm256_storeu_si256((__m256i *)(w + t), (__m256i)_mm512_cvtneps_pbh(e));
        sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
        const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), m));
        _mm256_mask_storeu_epi16(w + t, tail, (__m256i)_mm512_cvtneps_pbh(e));
        sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* A row's bf16 weights for the values by pairs, w[0] at the even position pbase <= lo:
 * the softmax numerators over [lo, len), zeros for the pair members before lo and at len;
 * returns 1 / their float32 sum. */
ALWAYS_INLINE float row_weights_bf16(const float *s, int pbase, int lo, int len, uint16_t *w) {
    const float total = softmax_weights_bf16(s + (lo - pbase), len - lo, w + (lo - pbase));
    w[0] = lo > pbase ? 0 : w[0];
    if ((len - pbase) % 2) w[len - pbase] = 0;
    return 1.0f / total;
}
#endif

/* Prefetches queued a block at a time and issued a few lines at a time between the
 * kernel's computations: a block's lines issued all at once fill the core's miss buffers
 * and stall it until they arrive, so computing and loading would not overlap. Of each
 * token's row (row bytes: every KV head's values) only the slice the call reads is
 * fetched: all of it, or its KV heads' part where a call takes some of them (another
 * thread reads the rest). */
typedef struct {
    const char *at[2]; /* the slice of a queued block's first row */
    int64_t left[2];   /* bytes of the block's slices still to fetch */
    int64_t done[2];   /* bytes of them fetched */
    int64_t slice, row, slice_at; /* bytes: the slice's length, a row's, where the slice starts in it */
} Prefetcher;

ALWAYS_INLINE void prefetch_line(Prefetcher *pf, int slot) {
    const int64_t done = pf->done[slot];
    __builtin_prefetch(pf->at[slot] + (pf->slice == pf->row ? done : done / pf->slice * pf->row + done % pf->slice), 0, 1);
    pf->done[slot] += 64;
    pf->left[slot] -= 64;
}

/* The block's slices now, all at once. */
ALWAYS_INLINE void prefetch_block(const Prefetcher *pf, const void *base, int64_t first_element, int64_t elements,
                                  const int elem_size) {
    const char *p = (const char *)base + first_element * elem_size + pf->slice_at;
    for (int64_t row = 0; row < elements * elem_size; row += pf->row)
        for (int64_t offset = 0; offset < pf->slice; offset += 64) __builtin_prefetch(p + row + offset, 0, 1);
}

ALWAYS_INLINE void prefetch_queue(Prefetcher *pf, int slot, const void *base, int64_t first_element, int64_t elements,
                                  const int elem_size) {
    while (pf->left[slot] > 0) prefetch_line(pf, slot);
    pf->at[slot] = (const char *)base + first_element * elem_size + pf->slice_at;
    pf->left[slot] = elements * elem_size / pf->row * pf->slice;
    pf->done[slot] = 0;
}

ALWAYS_INLINE void prefetch_some(Prefetcher *pf, int lines) {
    for (int slot = 0; slot < 2; slot++)
        for (; lines > 0 && pf->left[slot] > 0; lines--) prefetch_line(pf, slot);
}

/* acc[g] += sum over a block's `count` tokens of probs[g * len + j] * V[j], for one KV
 * head's `G` query heads (probs and V start at the block's first token). With G and hd
 * known at compile time the accumulators stay in registers within the block. */
ALWAYS_INLINE void weighted_values(const void *v_rows, int64_t token_stride, int count, const float *probs, int len,
                                   float *acc_io, const int G, const int hd, const int bf16) {
    if (hd % 16 == 0 && hd <= MAX_DOT_HD && G <= MAX_VALUE_GROUP) {
#if HAVE_512
        if (bf16) {
            block_values_512(v_rows, token_stride, count, probs, len, acc_io, G, hd);
            return;
        }
#endif
#if HAVE_256
        block_values_256(v_rows, token_stride, count, probs, len, acc_io, G, hd, bf16);
        return;
#endif
    }
    float acc[G][hd];
    memcpy(acc, acc_io, sizeof(float) * (size_t)(G * hd));
    for (int j = 0; j < count; j++) {
        float v[hd];
        load_row(v_rows, j * token_stride, v, hd, bf16);
        for (int g = 0; g < G; g++) {
            const float p = probs[(int64_t)g * len + j];
#pragma omp simd
            for (int d = 0; d < hd; d++) acc[g][d] += p * v[d];
        }
    }
    memcpy(acc_io, acc, sizeof(float) * (size_t)(G * hd));
}

/* Request i, the query heads of KV heads kv_lo .. kv_hi - 1. A block's rows hold every KV
 * head side by side (block_size * num_kv_heads * head_dim contiguous values), so one
 * request reads each of its blocks as one contiguous run, and the next block is prefetched
 * while this one is used. Each head's arithmetic is the same whichever KV heads a call
 * takes (a thread may take some of a request's heads, another the rest: the same bits).
 * `work` holds num_heads * (seq_lens[i] + 2 * head_dim) + num_kv_heads * head_dim floats.
 * q_bf16: the query and output are bfloat16 (else float32); bf16: the caches are. */
ALWAYS_INLINE void attend(const Args *a, int i, int kv_lo, int kv_hi, float *work, const int hd, const int q_bf16,
                          const int bf16) {
    const int group = a->group, kvh = a->num_kv_heads, nh = kvh * group;
    const int kv_count = kv_hi - kv_lo, h_lo = kv_lo * group, h_hi = kv_hi * group;
    const int len = a->seq_lens[i], bs = a->block_size;
    /* The first position the query sees: scores, softmax and values run over [lo, len). */
    const int lo = a->window > 0 && len > a->window ? len - a->window : 0;
    const int32_t *blocks = a->block_tables + (int64_t)i * a->block_table_stride;
    const int64_t token_stride = (int64_t)kvh * hd, block_elements = (int64_t)bs * token_stride;
    const int elem = bf16 ? 2 : 4;
    /* Which score code runs: the compiler settles it for each compiled head size. */
    const int simd_fits = hd <= MAX_DOT_HD && group <= MAX_DOT_GROUP;
    const int use_512 = HAVE_512 && simd_fits && q_bf16 && bf16 && hd % 32 == 0;
    const int use_256 = HAVE_256 && simd_fits && !use_512 && hd % 8 == 0;
    (void)use_256; /* unused where neither SIMD path is compiled */
    float *scores = work, *q = scores + (int64_t)nh * len, *acc = q + (int64_t)nh * hd, *row = acc + (int64_t)nh * hd;
    memset(acc, 0, sizeof(float) * (size_t)(nh * hd));
    Prefetcher pf = {{0, 0}, {0, 0}, {0, 0}, (int64_t)kv_count * hd * elem, token_stride * elem, (int64_t)kv_lo * hd * elem};
    const int64_t block_slice_bytes = bs * pf.slice; /* what the call reads of a block (K or V) */
    int kv_head_of[MAX_HEADS]; /* no integer division in the token loops */
    for (int h = 0; h < nh; h++) kv_head_of[h] = h / group;
    /* Scores, token by token through the blocks. */
#if HAVE_512 || HAVE_256
    if (use_512 || use_256) {
        /* The 512-bit code reads the bf16 query in place, the 256-bit code a float32 copy. */
        if (use_256) load_row(a->query, (int64_t)i * a->query_row_stride, q, nh * hd, q_bf16);
#if HAVE_512
        const uint16_t *q_in_place = (const uint16_t *)a->query + (int64_t)i * a->query_row_stride;
        const int run = use_512 ? SCORE_RUN_512 : SCORE_RUN_256;
#else
        const int run = SCORE_RUN_256;
#endif
        /* Two blocks' lines (K, V) over a block's block_scores calls. */
        const int block_lines = (int)((block_slice_bytes + 63) / 64);
        const int score_lines = 2 * block_lines / (((bs + run - 1) / run) * kv_count) + 1;
        /* Runs of up to `run` tokens, never across a block's end. */
        for (int start = lo; start < len;) {
            const int in_block = start % bs;
            int count = bs - in_block < run ? bs - in_block : run;
            if (count > len - start) count = len - start;
            if (in_block == 0) { /* the next K block, and this block's V rows for the values pass */
                if (start + bs < len)
                    prefetch_queue(&pf, 0, a->key_cache, (int64_t)blocks[start / bs + 1] * block_elements, block_elements, elem);
                prefetch_queue(&pf, 1, a->value_cache, (int64_t)blocks[start / bs] * block_elements, block_elements, elem);
            }
            const int64_t k_at = ((int64_t)blocks[start / bs] * bs + in_block) * token_stride;
            for (int kv = kv_lo; kv < kv_hi; kv++) {
                const int64_t k_kv = k_at + (int64_t)kv * hd, q_at = (int64_t)kv * group * hd;
                float *s_kv = scores + (int64_t)kv * group * len + start;
#if HAVE_512
                uint16_t k_copy[SCORE_RUN_512 * MAX_DOT_HD];
                if (use_512)
                    for (int j = 0; j < count; j++)
                        memcpy(k_copy + j * hd, (const uint16_t *)a->key_cache + k_kv + j * token_stride, sizeof(uint16_t) * (size_t)hd);
#define SCORES(G) \
    case G: block_scores_512(k_copy, 0, hd, count, q_in_place + q_at, a->scale, s_kv, len, G, hd); break;
                if (use_512) switch (group) { SCORES(1) SCORES(2) SCORES(3) SCORES(4) SCORES(5) SCORES(6) SCORES(7) SCORES(8) }
#undef SCORES
#endif
#if HAVE_256
#define SCORES(G) \
    case G: block_scores_256(a->key_cache, k_kv, token_stride, count, q + q_at, a->scale, s_kv, len, G, hd, bf16); break;
                if (use_256) switch (group) { SCORES(1) SCORES(2) SCORES(3) SCORES(4) SCORES(5) SCORES(6) SCORES(7) SCORES(8) }
#undef SCORES
#endif
                prefetch_some(&pf, score_lines);
            }
            start += count;
        }
    } else
#endif
    {
        /* The query in float32, scaled once, for the generic dot products. */
        load_row(a->query, (int64_t)i * a->query_row_stride, q, nh * hd, q_bf16);
        for (int d = 0; d < nh * hd; d++) q[d] *= a->scale;
        for (int start = lo, count; start < len; start += count) {
            const int64_t first = (int64_t)blocks[start / bs] * bs + start % bs;
            count = bs - start % bs < len - start ? bs - start % bs : len - start;
            if (start + count < len) prefetch_block(&pf, a->key_cache, (int64_t)blocks[start / bs + 1] * block_elements, block_elements, elem);
            for (int j = 0; j < count; j++) {
                load_row(a->key_cache, (first + j) * token_stride, row, kvh * hd, bf16);
                for (int h = h_lo; h < h_hi; h++) {
                    const float *qh = q + (int64_t)h * hd, *kh = row + (int64_t)kv_head_of[h] * hd;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < hd; d++) s += qh[d] * kh[d];
                    scores[(int64_t)h * len + start + j] = s;
                }
            }
        }
    }
    /* Softmax numerators; the denominators divide at the end. */
    float inv_sum[MAX_HEADS];
    const int by_pairs = use_512 && bs % 2 == 0 && len > 0; /* the weights: row_weights_bf16 below */
    for (int h = h_lo; h < h_hi && !by_pairs; h++) {
        float *sh = scores + (int64_t)h * len, m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
        for (int t = lo; t < len; t++) m = sh[t] > m ? sh[t] : m;
#pragma omp simd reduction(+ : total)
        for (int t = lo; t < len; t++) {
            sh[t] = fast_expf(sh[t] - m);
            total += sh[t];
        }
        inv_sum[h] = len > 0 ? 1.0f / total : 0.0f;
    }
    /* Weighted values. */
    if (len > 0) prefetch_block(&pf, a->value_cache, (int64_t)blocks[lo / bs] * block_elements, block_elements, elem);
#if HAVE_512
    if (by_pairs) {
        /* Positions from the even one at or before lo; weights and V rows the query does not
         * see are zeros. */
        const int pbase = lo & ~1, npos = len - pbase, pstride = (npos + 15) / 16 * 16, NB = VALUE_REGS / (hd / 16);
        uint16_t *weights = (uint16_t *)(row + (int64_t)kvh * hd);
        for (int h = h_lo; h < h_hi; h++)
            inv_sum[h] = row_weights_bf16(scores + (int64_t)h * len + pbase, pbase, lo, len, weights + (int64_t)h * pstride);
        const uint32_t *p[MAX_DOT_GROUP];
        float *acc_of[MAX_DOT_GROUP];
        const int value_lines = (int)((block_slice_bytes + 63) / 64) / kv_count + 1;
        for (int start = pbase, count; start < len; start += count) {
            const int in_block = start % bs;
            count = bs - in_block < PAIR_RUN ? bs - in_block : PAIR_RUN;
            if (count > len - start) count = len - start;
            if (in_block == 0 && start + bs < len)
                prefetch_queue(&pf, 0, a->value_cache, (int64_t)blocks[start / bs + 1] * block_elements, block_elements, elem);
            const uint16_t *v_run = (const uint16_t *)a->value_cache + ((int64_t)blocks[start / bs] * bs + in_block) * token_stride;
            for (int kv = kv_lo; kv < kv_hi; kv++) {
                prefetch_some(&pf, value_lines);
                for (int g0 = 0; g0 < group; g0 += NB) {
                    const int nb = group - g0 < NB ? group - g0 : NB;
                    for (int b = 0; b < nb; b++) {
                        const int h = kv * group + g0 + b;
                        p[b] = (const uint32_t *)(weights + (int64_t)h * pstride + (start - pbase));
                        acc_of[b] = acc + (int64_t)h * hd;
                    }
#define VALUES(N) \
    case N: pair_values_512(NULL, v_run + (int64_t)kv * hd, token_stride, start, count, lo, len, p, acc_of, N, hd); break;
                    switch (nb) { VALUES(1) VALUES(2) VALUES(3) VALUES(4) VALUES(5) VALUES(6) VALUES(7) VALUES(8) }
#undef VALUES
                }
            }
        }
    } else
#endif
    if (hd == 64 && group <= 4) {
        const int value_lines = (int)((block_slice_bytes + 63) / 64) / kv_count + 1;
        /* Block by block, each KV head in turn while the block is in cache. */
        for (int start = lo, count; start < len; start += count) {
            const int64_t first = (int64_t)blocks[start / bs] * bs + start % bs;
            count = bs - start % bs < len - start ? bs - start % bs : len - start;
            if (start + count < len) prefetch_queue(&pf, 0, a->value_cache, (int64_t)blocks[start / bs + 1] * block_elements, block_elements, elem);
            for (int kv = kv_lo; kv < kv_hi; kv++) {
                prefetch_some(&pf, value_lines);
                const void *v_rows = (const char *)a->value_cache + (first * token_stride + (int64_t)kv * hd) * elem;
                const float *probs = scores + (int64_t)kv * group * len + start;
                float *acc_kv = acc + (int64_t)kv * group * hd;
                switch (group) {
                    case 1: weighted_values(v_rows, token_stride, count, probs, len, acc_kv, 1, 64, bf16); break;
                    case 2: weighted_values(v_rows, token_stride, count, probs, len, acc_kv, 2, 64, bf16); break;
                    case 3: weighted_values(v_rows, token_stride, count, probs, len, acc_kv, 3, 64, bf16); break;
                    default: weighted_values(v_rows, token_stride, count, probs, len, acc_kv, 4, 64, bf16); break;
                }
            }
        }
    } else {
        for (int start = lo, count; start < len; start += count) {
            const int64_t first = (int64_t)blocks[start / bs] * bs + start % bs;
            count = bs - start % bs < len - start ? bs - start % bs : len - start;
            if (start + count < len) prefetch_block(&pf, a->value_cache, (int64_t)blocks[start / bs + 1] * block_elements, block_elements, elem);
            for (int j = 0; j < count; j++) {
                load_row(a->value_cache, (first + j) * token_stride, row, kvh * hd, bf16);
                for (int h = h_lo; h < h_hi; h++) {
                    const float p = scores[(int64_t)h * len + start + j], *vh = row + (int64_t)kv_head_of[h] * hd;
                    float *ah = acc + (int64_t)h * hd;
#pragma omp simd
                    for (int d = 0; d < hd; d++) ah[d] += p * vh[d];
                }
            }
        }
    }
    for (int h = h_lo; h < h_hi; h++) {
        const int64_t dst = (int64_t)i * a->out_row_stride + (int64_t)h * hd;
        if (by_pairs) {
#if HAVE_512
            for (int d = 0; d < hd; d++)
                ((uint16_t *)a->out)[dst + d] = f32_to_bf16(acc[(int64_t)h * hd + pair_lane_of(d)] * inv_sum[h]);
#endif
        } else if (q_bf16) {
            for (int d = 0; d < hd; d++) ((uint16_t *)a->out)[dst + d] = f32_to_bf16(acc[(int64_t)h * hd + d] * inv_sum[h]);
        } else {
            for (int d = 0; d < hd; d++) ((float *)a->out)[dst + d] = acc[(int64_t)h * hd + d] * inv_sum[h];
        }
    }
}

/* One compiled copy per head size (64, 128, any) and pairing: q: query and output type,
 * kv: cache type. */
#define ATTEND_COPIES(name, q_bf16, kv_bf16)                                                    \
    static void name##_hd64(const Args *a, int i, int lo, int hi, float *w) {                   \
        attend(a, i, lo, hi, w, 64, q_bf16, kv_bf16);                                           \
    }                                                                                           \
    static void name##_hd128(const Args *a, int i, int lo, int hi, float *w) {                  \
        attend(a, i, lo, hi, w, 128, q_bf16, kv_bf16);                                          \
    }                                                                                           \
    static void name##_any(const Args *a, int i, int lo, int hi, float *w, int hd) {            \
        attend(a, i, lo, hi, w, hd, q_bf16, kv_bf16);                                           \
    }
ATTEND_COPIES(attend_f32, 0, 0)
ATTEND_COPIES(attend_bf16, 1, 1)
ATTEND_COPIES(attend_f32_bf16kv, 0, 1)
#undef ATTEND_COPIES

enum pairing { F32, BF16, F32_BF16KV };

/* Returns 0 on success, 1 for shapes the fixed buffers cannot take (nothing written),
 * 2 when a thread could not allocate its score buffer. */
static int decode_attention(const void *query, int64_t query_row_stride, const void *key_cache,
                            const void *value_cache, const int32_t *block_tables,
                            int64_t block_table_stride, const int32_t *seq_lens, int num_requests,
                            int num_heads, int num_kv_heads, int head_dim, int block_size, int window, float scale,
                            void *out, int64_t out_row_stride, int num_threads, enum pairing pairing) {
    if (num_heads > MAX_HEADS || num_kv_heads <= 0 || num_heads % num_kv_heads || block_size <= 0 || head_dim <= 0)
        return 1;
    const Args a = {query, query_row_stride, key_cache, value_cache, block_tables, block_table_stride,
                    seq_lens, num_kv_heads, num_heads / num_kv_heads, block_size, window, scale, out, out_row_stride};
    int max_len = 1;
    for (int i = 0; i < num_requests; i++)
        if (seq_lens[i] > max_len) max_len = seq_lens[i];
    /* scores, query, accumulators, a K/V row; the values by pairs' bf16 weights */
    const size_t work_floats = (size_t)num_heads * ((size_t)max_len + 2 * (size_t)head_dim) + (size_t)num_kv_heads * head_dim +
                               (size_t)num_heads * ((size_t)max_len / 2 + 16);
    int failed = 0;
    /* Work is split by request, and where there are fewer requests than threads and their
     * contexts are long (SPLIT_HEADS_MIN_LEN), by request and KV head: each thread attends
     * with some of a request's heads, with the same bits as one thread with all of them.
     * Below that a batch of one opens no parallel region: waking an idle thread for a few
     * microseconds of work costs more than the work when the cores are busy. */
    /* parts: how many runs of consecutive KV heads each request's heads are split into */
    int parts = 1;
    if (num_requests < num_threads && max_len >= SPLIT_HEADS_MIN_LEN)
        parts = num_threads < num_kv_heads ? num_threads : num_kv_heads;
    const int units = num_requests * parts;
    if (num_threads > units) num_threads = units > 0 ? units : 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *work = malloc(sizeof(float) * work_floats);
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < units; u++) {
            if (!work) continue;
            const int i = u / parts, part = u % parts;
            const int kv_lo = part * num_kv_heads / parts, kv_hi = (part + 1) * num_kv_heads / parts;
#define DISPATCH(name)                                                             \
    (head_dim == 64    ? name##_hd64(&a, i, kv_lo, kv_hi, work)                    \
     : head_dim == 128 ? name##_hd128(&a, i, kv_lo, kv_hi, work)                   \
                       : name##_any(&a, i, kv_lo, kv_hi, work, head_dim))
            if (pairing == BF16) DISPATCH(attend_bf16);
            else if (pairing == F32_BF16KV) DISPATCH(attend_f32_bf16kv);
            else DISPATCH(attend_f32);
#undef DISPATCH
        }
        free(work);
    }
    return failed ? 2 : 0;
}

/* The entry points: Q the query's and output's element type, KV the caches'. */
#define DECODE_ATTENTION_ENTRY(NAME, Q, KV, PAIRING)                                                            \
    int NAME(const Q *query, int64_t query_row_stride, const KV *key_cache, const KV *value_cache,             \
             const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens, int num_requests, \
             int num_heads, int num_kv_heads, int head_dim, int block_size, int window, float scale, Q *out,     \
             int64_t out_row_stride, int num_threads) {                                                          \
        return decode_attention(query, query_row_stride, key_cache, value_cache, block_tables,                  \
                                block_table_stride, seq_lens, num_requests, num_heads, num_kv_heads, head_dim,  \
                                block_size, window, scale, out, out_row_stride, num_threads, PAIRING);          \
    }

DECODE_ATTENTION_ENTRY(decode_attention_f32, float, float, F32)
DECODE_ATTENTION_ENTRY(decode_attention_bf16, uint16_t, uint16_t, BF16)
/* A float32 query over bfloat16 caches (`--kv-cache-dtype bfloat16` under a float32 model). */
DECODE_ATTENTION_ENTRY(decode_attention_f32_bf16kv, float, uint16_t, F32_BF16KV)

/* ------------------------------------------------------------------------------------------
 * Prompt chunks with the decode kernel's arithmetic: several query tokens at once.
 *
 * Each query token of a chunk is attended exactly as `attend` attends it as a decode (bf16
 * query over bf16 caches, the AVX512_BF16 path, even block size): block_scores_512 per
 * token and head, its bf16 weights from row_weights_bf16 over the positions it sees, one
 * vdpbf16ps per (pair of positions, 16 lanes) in pair order from the even position at or
 * before its first one, with the same inputs (a pair member it does not see: weight 0, V
 * row 0), the same rounding of acc * (1 / sum). So every row gets the bits it gets as a
 * decode of its own, by construction. What changes is the order of the work: a tile of
 * consecutive query tokens of one request (TILE_ROW_HEADS / group of them) and all the
 * query heads of one KV head go through the context together, so each K run is read from
 * memory once for all of them (copied side by side, then read from L1 by every row) and
 * each V run is interleaved into pairs once and multiplied into the accumulators of
 * VALUE_REGS / (hd / 16) rows at a time held in registers. A row's scores past its own
 * last position (the tile's later tokens) are computed and never read; its values pass
 * skips them, and the pairs at the edges of what a row sees take V pairs of its own.
 */
#if HAVE_512
#define MAX_TILE_ROW_HEADS 48
#define TILE_ROW_HEADS 48 /* query tokens x query heads of one KV head per tile */

typedef struct {
    const uint16_t *query;
    int64_t query_row_stride;
    const uint16_t *key_cache, *value_cache;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *query_starts, *query_lens, *seq_lens;
    int num_kv_heads, group, block_size, window;
    float scale;
    uint16_t *out;
    int64_t out_row_stride;
} RowsArgs;

/* Floats of one thread's work buffer for tiles of `rows` tokens of contexts up to max_len. */
static size_t rows_work_floats(int rows, int group, int max_len, int hd) {
    const size_t rh = (size_t)rows * group, pstride = ((size_t)max_len + 1 + 15) / 16 * 16;
    return rh * ((size_t)max_len + 1) + rh * hd + PAIR_WORK_FLOATS(hd) + rh * pstride / 2 + 16;
}

/* Tokens first .. first + rows - 1 of request i's query, all heads. */
ALWAYS_INLINE void attend_rows(const RowsArgs *a, int i, int first, int rows, float *work, const int hd) {
    const int G = a->group, kvh = a->num_kv_heads, bs = a->block_size, RH = rows * G;
    const int NB = VALUE_REGS / (hd / 16); /* rows per pair_values_512 call */
    const int q_len = a->query_lens[i], seq_len = a->seq_lens[i];
    const int32_t *blocks = a->block_tables + (int64_t)i * a->block_table_stride;
    const int64_t token_stride = (int64_t)kvh * hd, row0 = (int64_t)a->query_starts[i] + first;
    int len[MAX_TILE_ROW_HEADS], lo[MAX_TILE_ROW_HEADS]; /* token r sees positions [lo[r], len[r]) */
    for (int r = 0; r < rows; r++) {
        len[r] = seq_len - q_len + first + r + 1;
        lo[r] = a->window > 0 && len[r] > a->window ? len[r] - a->window : 0;
    }
    /* Positions [base, top) are read; scores and weights are indexed from pbase. */
    const int base = lo[0], top = len[rows - 1], pbase = base & ~1, span = top - pbase;
    const int pstride = (span + 15) / 16 * 16;
    float *scores = work, *acc = scores + (int64_t)RH * span;
    uint32_t *vpairs = (uint32_t *)(acc + (int64_t)RH * hd);
    uint16_t *weights = (uint16_t *)(vpairs + PAIR_RUN / 2 * hd);
    float inv_sum[MAX_TILE_ROW_HEADS];
    uint16_t k_copy[SCORE_RUN_512 * MAX_DOT_HD];
    const uint32_t *p[MAX_TILE_ROW_HEADS];
    float *acc_of[MAX_TILE_ROW_HEADS];
    for (int kv = 0; kv < kvh; kv++) {
        /* Scores: token r's G heads in rows r * G .. r * G + G - 1 of `scores`. */
        for (int start = base, count; start < top; start += count) {
            const int in_block = start % bs;
            count = bs - in_block < SCORE_RUN_512 ? bs - in_block : SCORE_RUN_512;
            if (count > top - start) count = top - start;
            /* The run's K rows side by side first: the rows' score code then addresses them
             * at fixed offsets from one pointer. */
            const uint16_t *k_run = a->key_cache + ((int64_t)blocks[start / bs] * bs + in_block) * token_stride + (int64_t)kv * hd;
            for (int j = 0; j < count; j++) memcpy(k_copy + j * hd, k_run + j * token_stride, sizeof(uint16_t) * (size_t)hd);
            for (int r = 0; r < rows; r++) {
                const uint16_t *q = a->query + (row0 + r) * a->query_row_stride + (int64_t)kv * G * hd;
                float *s = scores + (int64_t)r * G * span + (start - pbase);
#define SCORES(NG) \
    case NG: block_scores_512(k_copy, 0, hd, count, q, a->scale, s, span, NG, hd); break;
                switch (G) { SCORES(1) SCORES(2) SCORES(3) SCORES(4) SCORES(5) SCORES(6) SCORES(7) SCORES(8) }
#undef SCORES
            }
        }
        for (int rh = 0; rh < RH; rh++) { /* indexed from pbase, not the row's own even start: a shift by pairs */
            const int r = rh / G, own = lo[r] & ~1;
            inv_sum[rh] = row_weights_bf16(scores + (int64_t)rh * span + (own - pbase), own, lo[r], len[r],
                                           weights + (int64_t)rh * pstride + (own - pbase));
        }
        memset(acc, 0, sizeof(float) * (size_t)RH * (size_t)hd);
        /* Values, run by run: the run's V pairs built once, then NB rows at a time over the
         * pairs they all see whole, row by row at the edges. */
        for (int start = pbase, count; start < top; start += count) {
            const int in_block = start % bs;
            count = bs - in_block < PAIR_RUN ? bs - in_block : PAIR_RUN;
            if (count > top - start) count = top - start;
            const int npairs = (count + 1) / 2, end = start + 2 * npairs;
            const uint16_t *v = a->value_cache + ((int64_t)blocks[start / bs] * bs + in_block) * token_stride + (int64_t)kv * hd;
            for (int k = 0; k < npairs; k++) {
                __m512i pv[MAX_DOT_HD / 16];
                const int pos = start + 2 * k;
                pair_vectors(pos >= base ? v + 2 * k * token_stride : NULL, pos + 1 < top ? v + (2 * k + 1) * token_stride : NULL, pv, hd);
                for (int c = 0; c < hd / 16; c++) _mm512_storeu_si512(vpairs + (int64_t)k * hd + 16 * c, pv[c]);
            }
            for (int b0 = 0; b0 < RH; b0 += NB) {
                const int nb = RH - b0 < NB ? RH - b0 : NB, first_row = b0 / G, last_row = (b0 + nb - 1) / G;
                if (nb == NB && lo[last_row] <= start && len[first_row] >= end) { /* all pairs seen whole by all */
                    for (int b = 0; b < nb; b++) {
                        p[b] = (const uint32_t *)(weights + (int64_t)(b0 + b) * pstride + (start - pbase));
                        acc_of[b] = acc + (int64_t)(b0 + b) * hd;
                    }
                    pair_values_512(vpairs, NULL, 0, start, count, 0, 0, p, acc_of, NB, hd);
                    continue;
                }
                for (int rh = b0; rh < b0 + nb; rh++) { /* row by row over the pairs it sees, as a decode */
                    const int r = rh / G, own = lo[r] & ~1;
                    const int from = own > start ? own : start, to = len[r] < start + count ? len[r] : start + count;
                    if (to <= from) continue;
                    const uint32_t *pr = (const uint32_t *)(weights + (int64_t)rh * pstride + (from - pbase));
                    float *ar = acc + (int64_t)rh * hd;
                    const int whole = from >= lo[r] && from + 2 * ((to - from + 1) / 2) <= len[r];
                    pair_values_512(whole ? vpairs + (int64_t)(from - start) / 2 * hd : NULL, v + (from - start) * token_stride,
                                    token_stride, from, to - from, lo[r], len[r], &pr, &ar, 1, hd);
                }
            }
        }
        for (int rh = 0; rh < RH; rh++) {
            uint16_t *dst = a->out + (row0 + rh / G) * a->out_row_stride + (int64_t)(kv * G + rh % G) * hd;
            for (int d = 0; d < hd; d++) dst[d] = f32_to_bf16(acc[(int64_t)rh * hd + pair_lane_of(d)] * inv_sum[rh]);
        }
    }
}

static void attend_rows_hd64(const RowsArgs *a, int i, int first, int rows, float *w) { attend_rows(a, i, first, rows, w, 64); }
static void attend_rows_hd128(const RowsArgs *a, int i, int first, int rows, float *w) { attend_rows(a, i, first, rows, w, 128); }
static void attend_rows_any(const RowsArgs *a, int i, int first, int rows, float *w, int hd) { attend_rows(a, i, first, rows, w, hd); }

/* One thread's work buffer, kept between calls (grown as needed). */
static float *rows_scratch(size_t floats) {
    static __thread float *buffer;
    static __thread size_t capacity;
    if (capacity >= floats) return buffer;
    free(buffer);
    buffer = malloc(sizeof(float) * floats);
    capacity = buffer ? floats : 0;
    return buffer;
}
#endif

/* Every query token of each request (query_lens[i] of them from row query_starts[i], the
 * last at position seq_lens[i] - 1) attended as `decode_attention_bf16` attends a decode
 * there, bit for bit; a step's requests in one call, tiles of consecutive tokens spread over
 * the threads, the latest (longest) first. Returns 0 on success, 1 where this build or
 * these shapes have no multi-row code (no AVX512_BF16; head dim not a multiple of 32 up to
 * 128, GQA group above 8: the caller then runs one decode per token), 2 without memory. */
int decode_attention_rows_bf16(const uint16_t *query, int64_t query_row_stride, const uint16_t *key_cache,
                               const uint16_t *value_cache, const int32_t *block_tables, int64_t block_table_stride,
                               const int32_t *query_starts, const int32_t *query_lens, const int32_t *seq_lens,
                               int num_requests, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int window, float scale, uint16_t *out, int64_t out_row_stride, int num_threads) {
#if HAVE_512
    if (num_heads > MAX_HEADS || num_kv_heads <= 0 || num_heads % num_kv_heads || block_size <= 0 || block_size % 2 ||
        head_dim % 32 || head_dim > MAX_DOT_HD || num_heads / num_kv_heads > MAX_DOT_GROUP)
        return 1;
    const RowsArgs a = {query, query_row_stride, key_cache, value_cache, block_tables, block_table_stride,
                        query_starts, query_lens, seq_lens, num_kv_heads, num_heads / num_kv_heads, block_size,
                        window, scale, out, out_row_stride};
    const int rows_per_tile = TILE_ROW_HEADS / a.group > 0 ? TILE_ROW_HEADS / a.group : 1;
    int num_items = 0, max_len = 1;
    for (int i = 0; i < num_requests; i++) {
        num_items += (query_lens[i] + rows_per_tile - 1) / rows_per_tile;
        if (seq_lens[i] > max_len) max_len = seq_lens[i];
    }
    if (num_items == 0) return 0;
    /* Work items (request, first token), each request's last tile first. */
    int *items = malloc(sizeof(int) * 2 * (size_t)num_items);
    if (!items) return 2;
    for (int i = 0, n = 0; i < num_requests; i++)
        for (int first = (query_lens[i] - 1) / rows_per_tile * rows_per_tile; first >= 0 && query_lens[i] > 0;
             first -= rows_per_tile)
            items[2 * n] = i, items[2 * n + 1] = first, n++;
    const size_t work_floats = rows_work_floats(rows_per_tile, a.group, max_len, head_dim);
    if (num_threads > num_items) num_threads = num_items;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *work = rows_scratch(work_floats);
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int n = 0; n < num_items; n++) {
            if (!work) continue;
            const int i = items[2 * n], first = items[2 * n + 1];
            const int rows = query_lens[i] - first < rows_per_tile ? query_lens[i] - first : rows_per_tile;
            if (head_dim == 64) attend_rows_hd64(&a, i, first, rows, work);
            else if (head_dim == 128) attend_rows_hd128(&a, i, first, rows, work);
            else attend_rows_any(&a, i, first, rows, work, head_dim);
        }
    }
    free(items);
    return failed ? 2 : 0;
#else
    (void)query, (void)query_row_stride, (void)key_cache, (void)value_cache, (void)block_tables;
    (void)block_table_stride, (void)query_starts, (void)query_lens, (void)seq_lens, (void)num_requests;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)window, (void)scale, (void)out;
    (void)out_row_stride, (void)num_threads;
    return 1;
#endif
}
