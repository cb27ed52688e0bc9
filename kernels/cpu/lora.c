/* The LoRA delta of one fused projection for all tokens of a step, in one call
 * (punica's bgmv idea on CPU; see kernels/lora_cpu.py):
 *
 *     y[t] += B[s]^T (A[s] x[t])      s = slot[t]; tokens with s < 0 are left alone
 *
 * a [S, R, in] and b [S, R, out] contiguous (the slots of services/worker/lora/batched.py,
 * the scaling folded into B); x [T, in] and y [T, out] rows with any stride; all float32 or
 * all bfloat16. h = A x is kept in float32 and y[t] is read, added to in float32 and
 * rounded once.
 *
 * The tokens are grouped by slot (a counting sort) into blocks of up to TB tokens of one
 * slot, so each row of a slot's A and B is loaded once per block and used for all of its
 * tokens, with no padding and no copy of the weights. Shrink work items are (token block,
 * RB rows of A); expand items are (token block, CB output columns), both spread over the
 * OpenMP threads, with a barrier between the two.
 *
 * B of a fused projection is block-diagonal (services/worker/lora/adapter.py): rows
 * [m R/M, (m+1) R/M) are zero outside sub-module m's output columns col_splits[m] ..
 * col_splits[m+1]; the expand reads only those rows for those columns (M = 1: all).
 *
 * Vector code: AVX-512 (bf16 dot products by vdpbf16ps where AVX512_BF16 is there),
 * AVX2 + FMA (bf16 widened to float32 by a 16-bit shift), or plain C.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "isa.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#include <immintrin.h>
#define W 16 /* float32 lanes */
#define TB 4 /* tokens per block */
#define RB 4 /* A rows per shrink item */
#define NV 4 /* vectors of output columns per expand item */
typedef __m512 vf;
ALWAYS_INLINE vf vzero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE vf vset1(float v) { return _mm512_set1_ps(v); }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE float vsum(vf v) { return _mm512_reduce_add_ps(v); }
ALWAYS_INLINE void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vf vload_f32(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE vf vload_bf16(const uint16_t *p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W 8
#define TB 2 /* 16 ymm registers: RB x TB accumulators and their operands */
#define RB 4
#define NV 4
typedef __m256 vf;
ALWAYS_INLINE vf vzero(void) { return _mm256_setzero_ps(); }
ALWAYS_INLINE vf vset1(float v) { return _mm256_set1_ps(v); }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS_INLINE float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
ALWAYS_INLINE void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
ALWAYS_INLINE vf vload_f32(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE vf vload_bf16(const uint16_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#else
#define W 1
#define TB 1
#define RB 1
#define NV 8
typedef float vf;
ALWAYS_INLINE vf vzero(void) { return 0.0f; }
ALWAYS_INLINE vf vset1(float v) { return v; }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
ALWAYS_INLINE float vsum(vf v) { return v; }
ALWAYS_INLINE void vstore(float *p, vf v) { *p = v; }
ALWAYS_INLINE vf vload_f32(const float *p) { return *p; }
ALWAYS_INLINE vf vload_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
#endif

#define CB (NV * W) /* output columns per expand item */

ALWAYS_INLINE float to_f32_f32(float v) { return v; }

/* out[i][j] = A row i . x row j (float32 sums) for RB rows and TB tokens; `in` values. */
#define DEFINE_SHRINK(NAME, T, LOAD, TO_F32)                                                   \
    static void NAME(const T *const *xs, const T *const *as, int in, float out[RB][TB]) {      \
        vf acc[RB][TB];                                                                        \
        for (int i = 0; i < RB; i++)                                                           \
            for (int j = 0; j < TB; j++) acc[i][j] = vzero();                                  \
        int k = 0;                                                                             \
        for (; k + W <= in; k += W) {                                                          \
            vf xv[TB];                                                                         \
            for (int j = 0; j < TB; j++) xv[j] = LOAD(xs[j] + k);                              \
            for (int i = 0; i < RB; i++) {                                                     \
                const vf av = LOAD(as[i] + k);                                                 \
                for (int j = 0; j < TB; j++) acc[i][j] = vfma(av, xv[j], acc[i][j]);           \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < RB; i++)                                                           \
            for (int j = 0; j < TB; j++) {                                                     \
                float s = vsum(acc[i][j]);                                                     \
                for (int kk = k; kk < in; kk++) s += TO_F32(as[i][kk]) * TO_F32(xs[j][kk]);    \
                out[i][j] = s;                                                                 \
            }                                                                                  \
    }
DEFINE_SHRINK(shrink_f32, float, vload_f32, to_f32_f32)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bfloat16 pairs multiplied and summed into float32 by vdpbf16ps, 32 values a step; the
 * tail by masked loads (zeros add nothing). */
static void shrink_bf16(const uint16_t *const *xs, const uint16_t *const *as, int in, float out[RB][TB]) {
    __m512 acc[RB][TB];
    for (int i = 0; i < RB; i++)
        for (int j = 0; j < TB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int k = 0; k < in; k += 32) {
        const __mmask32 live = in - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (in - k)) - 1u);
        __m512i xv[TB];
        for (int j = 0; j < TB; j++) xv[j] = _mm512_maskz_loadu_epi16(live, xs[j] + k);
        for (int i = 0; i < RB; i++) {
            const __m512i av = _mm512_maskz_loadu_epi16(live, as[i] + k);
            for (int j = 0; j < TB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)av, (__m512bh)xv[j]);
        }
    }
    for (int i = 0; i < RB; i++)
        for (int j = 0; j < TB; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
#else
DEFINE_SHRINK(shrink_bf16, uint16_t, vload_bf16, bf16_to_f32)
#endif

/* out[j][c] = sum over rows r in [r0, r1) of h_j[r] * B row r's column c0 + c, for TB
 * tokens and `nc` <= CB columns (vectors when the block is whole). */
#define DEFINE_EXPAND(NAME, T, LOAD, TO_F32)                                                     \
    static void NAME(const T *b, int64_t out_features, const float *const *hs, int r0, int r1,   \
                     int c0, int nc, float out[TB][CB]) {                                       \
        if (nc == CB) {                                                                          \
            vf acc[TB][NV];                                                                      \
            for (int j = 0; j < TB; j++)                                                         \
                for (int v = 0; v < NV; v++) acc[j][v] = vzero();                                \
            for (int r = r0; r < r1; r++) {                                                      \
                const T *row = b + r * out_features + c0;                                        \
                vf bv[NV];                                                                       \
                for (int v = 0; v < NV; v++) bv[v] = LOAD(row + v * W);                          \
                for (int j = 0; j < TB; j++) {                                                   \
                    const vf hv = vset1(hs[j][r]);                                               \
                    for (int v = 0; v < NV; v++) acc[j][v] = vfma(hv, bv[v], acc[j][v]);         \
                }                                                                                \
            }                                                                                    \
            for (int j = 0; j < TB; j++)                                                         \
                for (int v = 0; v < NV; v++) vstore(out[j] + v * W, acc[j][v]);                  \
            return;                                                                              \
        }                                                                                        \
        for (int j = 0; j < TB; j++)                                                             \
            for (int c = 0; c < nc; c++) out[j][c] = 0.0f;                                       \
        for (int r = r0; r < r1; r++) {                                                          \
            const T *row = b + r * out_features + c0;                                            \
            for (int j = 0; j < TB; j++)                                                         \
                for (int c = 0; c < nc; c++) out[j][c] += hs[j][r] * TO_F32(row[c]);             \
        }                                                                                        \
    }
DEFINE_EXPAND(expand_f32, float, vload_f32, to_f32_f32)
DEFINE_EXPAND(expand_bf16, uint16_t, vload_bf16, bf16_to_f32)

typedef struct {
    int slot, pos, count; /* `count` <= TB tokens of one slot: order[pos .. pos + count) */
} TokenBlock;

typedef struct {
    int block, c0, nc; /* columns [c0, c0 + nc) of sub-module `block` */
} ColumnBlock;

typedef struct {
    int bf16;
    const void *x, *a, *b;
    void *y;
    int64_t x_stride, y_stride;
    int in, rank, out, sub_rank;
    const int *order; /* the tokens with a slot, grouped by slot */
    const TokenBlock *tokens;
    const ColumnBlock *columns;
    float *h; /* [positions in `order`, rank] */
} Args;

ALWAYS_INLINE const void *row_of(const void *base, int bf16, int64_t index) {
    return bf16 ? (const void *)((const uint16_t *)base + index) : (const void *)((const float *)base + index);
}

/* h rows [r0, r0 + RB) of one token block. Missing tokens and rows (a short block) repeat
 * the last one; their sums are not stored. */
static void shrink_item(const Args *p, const TokenBlock *tb, int r0) {
    const int nr = p->rank - r0 < RB ? p->rank - r0 : RB;
    const void *xs[TB], *as[RB];
    for (int j = 0; j < TB; j++) {
        const int t = p->order[tb->pos + (j < tb->count ? j : tb->count - 1)];
        xs[j] = row_of(p->x, p->bf16, (int64_t)t * p->x_stride);
    }
    for (int i = 0; i < RB; i++)
        as[i] = row_of(p->a, p->bf16, ((int64_t)tb->slot * p->rank + r0 + (i < nr ? i : nr - 1)) * p->in);
    float sums[RB][TB];
    if (p->bf16)
        shrink_bf16((const uint16_t *const *)xs, (const uint16_t *const *)as, p->in, sums);
    else
        shrink_f32((const float *const *)xs, (const float *const *)as, p->in, sums);
    for (int j = 0; j < tb->count; j++)
        for (int i = 0; i < nr; i++) p->h[(int64_t)(tb->pos + j) * p->rank + r0 + i] = sums[i][j];
}

static void expand_item(const Args *p, const TokenBlock *tb, const ColumnBlock *cb) {
    const float *hs[TB];
    for (int j = 0; j < TB; j++) hs[j] = p->h + (int64_t)(tb->pos + (j < tb->count ? j : tb->count - 1)) * p->rank;
    const int r0 = cb->block * p->sub_rank, r1 = r0 + p->sub_rank;
    const int64_t slot_offset = (int64_t)tb->slot * p->rank * p->out;
    float delta[TB][CB];
    if (p->bf16)
        expand_bf16((const uint16_t *)p->b + slot_offset, p->out, hs, r0, r1, cb->c0, cb->nc, delta);
    else
        expand_f32((const float *)p->b + slot_offset, p->out, hs, r0, r1, cb->c0, cb->nc, delta);
    for (int j = 0; j < tb->count; j++) {
        const int64_t t = p->order[tb->pos + j];
        const float *d = delta[j];
        if (p->bf16) {
            uint16_t *yr = (uint16_t *)p->y + t * p->y_stride + cb->c0;
#pragma omp simd
            for (int c = 0; c < cb->nc; c++) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + d[c]);
        } else {
            float *yr = (float *)p->y + t * p->y_stride + cb->c0;
#pragma omp simd
            for (int c = 0; c < cb->nc; c++) yr[c] += d[c];
        }
    }
}

/* The work is split over threads only when it is worth a fork (multiply-adds). */
#define PARALLEL_MIN_WORK 65536

/* Returns 0, or -1 when scratch memory could not be had (y untouched). `col_splits`:
 * num_blocks + 1 column boundaries, rank a multiple of num_blocks; slots outside
 * [0, num_slots) count as no adapter. */
static int lora_delta(int bf16, const void *x, int64_t x_stride, const void *a, const void *b, const int64_t *slot,
                      int num_slots, void *y, int64_t y_stride, int num_tokens, int in, int rank, int out,
                      int num_blocks, const int *col_splits, int num_threads) {
    int *count = calloc((size_t)num_slots + 1, sizeof(int));
    int *order = malloc(sizeof(int) * ((size_t)num_tokens + 1));
    TokenBlock *tokens = malloc(sizeof(TokenBlock) * ((size_t)num_tokens + 1));
    int max_column_blocks = num_blocks;
    for (int m = 0; m < num_blocks; m++) max_column_blocks += (col_splits[m + 1] - col_splits[m]) / CB;
    ColumnBlock *columns = malloc(sizeof(ColumnBlock) * (size_t)max_column_blocks);
    float *h = malloc(sizeof(float) * ((size_t)num_tokens * rank + 1));
    int status = -1;
    if (!count || !order || !tokens || !columns || !h) goto done;
    status = 0;

    /* Counting sort of the tokens with a slot; then blocks of up to TB tokens per slot. */
    for (int t = 0; t < num_tokens; t++)
        if (slot[t] >= 0 && slot[t] < num_slots) count[slot[t] + 1]++;
    for (int s = 0; s < num_slots; s++) count[s + 1] += count[s];
    const int with_slot = count[num_slots];
    if (with_slot == 0) goto done;
    int num_token_blocks = 0;
    for (int s = 0; s < num_slots; s++)
        for (int pos = count[s]; pos < count[s + 1]; pos += TB) {
            const int left = count[s + 1] - pos;
            tokens[num_token_blocks++] = (TokenBlock){s, pos, left < TB ? left : TB};
        }
    for (int t = 0; t < num_tokens; t++)
        if (slot[t] >= 0 && slot[t] < num_slots) order[count[slot[t]]++] = t;

    int num_column_blocks = 0;
    for (int m = 0; m < num_blocks; m++)
        for (int c0 = col_splits[m]; c0 < col_splits[m + 1]; c0 += CB) {
            const int left = col_splits[m + 1] - c0;
            columns[num_column_blocks++] = (ColumnBlock){m, c0, left < CB ? left : CB};
        }

    const Args p = {bf16, x, a, b, y, x_stride, y_stride, in, rank, out, rank / num_blocks, order, tokens, columns, h};
    const int row_blocks = (rank + RB - 1) / RB;
    const int64_t shrink_items = (int64_t)num_token_blocks * row_blocks;
    const int64_t expand_items = (int64_t)num_token_blocks * num_column_blocks;
    const int64_t work = (int64_t)with_slot * rank * (in + out / num_blocks);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && work >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < shrink_items; item++)
            shrink_item(&p, &tokens[item / row_blocks], (int)(item % row_blocks) * RB);
        /* the implicit barrier: every h row is complete before the expand reads it */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < expand_items; item++)
            expand_item(&p, &tokens[item / num_column_blocks], &columns[item % num_column_blocks]);
    }
done:
    free(count);
    free(order);
    free(tokens);
    free(columns);
    free(h);
    return status;
}

int lora_delta_f32(const float *x, int64_t x_stride, const float *a, const float *b, const int64_t *slot,
                   int num_slots, float *y, int64_t y_stride, int num_tokens, int in, int rank, int out,
                   int num_blocks, const int *col_splits, int num_threads) {
    return lora_delta(0, x, x_stride, a, b, slot, num_slots, y, y_stride, num_tokens, in, rank, out, num_blocks,
                      col_splits, num_threads);
}

int lora_delta_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *a, const uint16_t *b, const int64_t *slot,
                    int num_slots, uint16_t *y, int64_t y_stride, int num_tokens, int in, int rank, int out,
                    int num_blocks, const int *col_splits, int num_threads) {
    return lora_delta(1, x, x_stride, a, b, slot, num_slots, y, y_stride, num_tokens, in, rank, out, num_blocks,
                      col_splits, num_threads);
}
