/* The sampler's per-row work on float32 logits (see kernels/sampling.py): temperature,
 * min-p, top-k and top-p, then one draw by inverse CDF from the row's uniform, and/or the
 * filtered distribution written out. Without a sort of the vocabulary and without a noise
 * value per entry: per row
 *
 *   1. the maximum (and, for greedy rows, the first index holding it);
 *   2. e = exp((x - max) / T) in place of softmax's numerators (e <= 1, the leader's is 1),
 *      min-p a threshold on e, written to a buffer with the sum of each block of BLOCK;
 *   3. without top-k and top-p: target = u * (sum of the block sums, in double, in block
 *      order); the block sums are walked in the same order to the block holding the target,
 *      then its entries;
 *   4. with top-k or top-p: the candidates, entries of e >= CANDIDATE_FLOOR (every non-zero
 *      entry when a boundary may lie below), gathered in vocabulary order; the k-th largest
 *      value and then top-p's boundary value found by a radix search over their float bits
 *      (histograms of count or mass, largest bin first, each level over the previous
 *      level's boundary bin only); the kept candidates are those at least as large as the
 *      boundary (ties at a boundary are all kept, as vLLM's top-k keeps them); the draw
 *      walks them in vocabulary order to target = u * their mass (in double).
 *
 * An entry of weight 0 is never drawn; when rounding leaves the target past the last entry
 * (of a block), the last entry of non-zero weight is drawn.
 *
 * Rows are spread over the OpenMP threads; each thread keeps its scratch between calls.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "isa.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 64
/* Radix levels over the bits of e in (0, 1] (positive floats order as their bits; bit 31
 * and bit 30 are 0): bits 20-29 (7 exponent bits and 3 mantissa bits: 8 bins per octave),
 * bits 8-19, bits 0-7. */
#define RADIX_LEVELS 3
#define MAX_BINS 4096
/* Top-k and top-p look first among the entries at least this share of the likeliest
 * one's probability (where the boundary nearly always lies), then among all. */
#define CANDIDATE_FLOOR 0x1p-16f

/* A row's candidates for top-k / top-p, in vocabulary order. */
typedef struct {
    float *values;
    int32_t *index;
    int64_t n;
} candidates_t;

/* Scratch of one thread. */
typedef struct {
    float *e; /* unused when the probabilities are written out (e lives there) */
    float *block_sums;
    candidates_t candidates;
    float *work;      /* a radix level's entries */
    int32_t *counts;  /* a radix level's histogram */
    double *mass;
} scratch_t;

static inline uint32_t bits_of(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits;
}

/* The entries of e at least `floor` (> 0), in vocabulary order. */
static void collect_at_least(const float *e, int64_t vocab, float floor, candidates_t *c) {
    int64_t n = 0, i = 0;
#if defined(__AVX512F__)
    const __m512 f = _mm512_set1_ps(floor);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= vocab; i += 16) {
        const __m512 v = _mm512_loadu_ps(e + i);
        const __mmask16 m = _mm512_cmp_ps_mask(v, f, _CMP_GE_OQ);
        if (m) {
            _mm512_mask_compressstoreu_ps(c->values + n, m, v);
            _mm512_mask_compressstoreu_epi32(c->index + n, m, idx);
            n += __builtin_popcount(m);
        }
        idx = _mm512_add_epi32(idx, step);
    }
#endif
    for (; i < vocab; i++) {
        if (e[i] >= floor) {
            c->values[n] = e[i];
            c->index[n] = (int32_t)i;
            n++;
        }
    }
    c->n = n;
}

/* Keeps the candidates at least `threshold`, in their order; their mass. */
static double keep_at_least(candidates_t *c, float threshold) {
    int64_t n = 0;
    double mass = 0.0;
    for (int64_t j = 0; j < c->n; j++) {
        if (c->values[j] >= threshold) {
            c->values[n] = c->values[j];
            c->index[n] = c->index[j];
            mass += c->values[n];
            n++;
        }
    }
    c->n = n;
    return mass;
}

static const int LEVEL_SHIFT[RADIX_LEVELS] = {20, 8, 0};
static const uint32_t LEVEL_BINS[RADIX_LEVELS] = {1u << 10, 1u << 12, 1u << 8};

/* The largest of values[0..n) at which the entries at least it reach `want` in count
 * (by_mass 0) or in mass (by_mass 1): the k-th largest value, or top-p's boundary value.
 * A radix search: each level histograms the entries left in the previous level's
 * boundary bin (copied to `work`), largest bin first. */
static float radix_select(const float *values, int64_t n, double want, int by_mass, float *work, int32_t *counts,
                          double *mass) {
    const float *cur = values;
    double before = 0.0;
    for (int level = 0; level < RADIX_LEVELS; level++) {
        const int shift = LEVEL_SHIFT[level];
        const uint32_t mask = LEVEL_BINS[level] - 1;
        memset(counts, 0, LEVEL_BINS[level] * sizeof *counts);
        memset(mass, 0, LEVEL_BINS[level] * sizeof *mass);
        for (int64_t j = 0; j < n; j++) {
            const uint32_t b = (bits_of(cur[j]) >> shift) & mask;
            counts[b]++;
            mass[b] += cur[j];
        }
        int64_t bin = (int64_t)mask, lowest = -1;
        for (; bin >= 0; bin--) {
            if (!counts[bin]) continue;
            lowest = bin;
            const double amount = by_mass ? mass[bin] : (double)counts[bin];
            if (before + amount >= want) break;
            before += amount;
        }
        if (bin < 0) bin = lowest; /* (rounding) the values hold less than `want`: keep all */
        int64_t m = 0;
        for (int64_t j = 0; j < n; j++)
            if (((bits_of(cur[j]) >> shift) & mask) == (uint32_t)bin) work[m++] = cur[j];
        /* One entry, or one value (the last level): that is the boundary. */
        if (m == 1 || level == RADIX_LEVELS - 1) return work[0];
        cur = work;
        n = m;
    }
    return cur[0]; /* not reached */
}

/* Applies top-k (use_k) then top-p (use_p) to the candidates: keeps those at least as large
 * as each boundary. Returns 0, the candidates untouched, when a boundary may lie below
 * them. `complete`: the candidates are every non-zero entry; otherwise `total` is the
 * row's whole mass (what top-p takes a share of when top-k is off). Returns 1 and the mass
 * kept in *kept, and the smallest value kept in *threshold (0: every non-zero entry). */
static int filter(candidates_t *c, int complete, int use_k, int64_t top_k, int use_p, float top_p, double total,
                  scratch_t *s, double *kept, float *threshold) {
    float k_value = 0.0f;
    if (use_k && c->n >= top_k) {
        k_value = radix_select(c->values, c->n, (double)top_k, 0, s->work, s->counts, s->mass);
    } else if (use_k && !complete) {
        return 0;
    }
    double kept_mass = 0.0;
    if (use_k || complete) {
        kept_mass = keep_at_least(c, k_value);
    } else {
        for (int64_t j = 0; j < c->n; j++) kept_mass += c->values[j];
        if (kept_mass < (double)top_p * total) return 0;
        kept_mass = total;
    }
    float p_value = k_value;
    if (use_p) {
        p_value = radix_select(c->values, c->n, (double)top_p * kept_mass, 1, s->work, s->counts, s->mass);
        kept_mass = keep_at_least(c, p_value);
    }
    *kept = kept_mass;
    *threshold = p_value;
    return 1;
}

/* The index of the entry whose interval of the cumulative weight holds target (weights in
 * block_sums / e, walked in the order `total` was summed). */
static int64_t draw_by_blocks(const float *e, int64_t vocab, const float *block_sums, double target) {
    const int64_t num_blocks = (vocab + BLOCK - 1) / BLOCK;
    double cum = 0.0;
    int64_t b = 0, last_block = 0;
    for (; b < num_blocks; b++) {
        if (block_sums[b] > 0.0f) last_block = b;
        if (cum + block_sums[b] > target) break;
        cum += block_sums[b];
    }
    if (b == num_blocks) b = last_block; /* rounding: the target at the very end */
    const int64_t start = b * BLOCK, end = start + BLOCK < vocab ? start + BLOCK : vocab;
    int64_t token = start;
    for (int64_t i = start; i < end; i++) {
        if (e[i] <= 0.0f) continue;
        token = i;
        cum += e[i];
        if (cum > target) break;
    }
    return token;
}


/* One row: its token (-1 when `want_token` is 0) and, with `write_probs`, its distribution
 * in e. */
static int64_t sample_row(const float *x, int64_t vocab, float temperature, int64_t top_k, float top_p,
                          float min_p, double u, int want_token, float *e, scratch_t *s, int write_probs) {
    float max = -INFINITY;
#pragma omp simd reduction(max : max)
    for (int64_t i = 0; i < vocab; i++) max = x[i] > max ? x[i] : max;
    const int greedy = temperature < 1e-5f;
    int64_t argmax = 0;
    if (greedy || max == -INFINITY) {
        for (int64_t i = 0; i < vocab; i++)
            if (x[i] == max) { argmax = i; break; }
    }
    if (max == -INFINITY) { /* every entry banned: nothing to draw from */
        if (write_probs) memset(e, 0, (size_t)vocab * sizeof *e);
        return want_token ? argmax : -1;
    }
    if (greedy && !write_probs) return want_token ? argmax : -1;

    const float scale = greedy ? 1.0f : 1.0f / temperature;
    float *block_sums = s->block_sums;
    for (int64_t start = 0, b = 0; start < vocab; start += BLOCK, b++) {
        const int64_t end = start + BLOCK < vocab ? start + BLOCK : vocab;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = start; i < end; i++) {
            const float v = fast_expf((x[i] - max) * scale);
            const float kept = (x[i] == -INFINITY || v < min_p) ? 0.0f : v;
            e[i] = kept;
            sum += kept;
        }
        block_sums[b] = sum;
    }
    const int64_t num_blocks = (vocab + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) total += block_sums[b];

    const int use_k = top_k > 0 && top_k < vocab, use_p = top_p < 1.0f;
    if (!use_k && !use_p) {
        const int64_t token = want_token ? (greedy ? argmax : draw_by_blocks(e, vocab, block_sums, u * total)) : -1;
        if (write_probs) {
            const float inv = (float)(1.0 / total);
#pragma omp simd
            for (int64_t i = 0; i < vocab; i++) e[i] *= inv;
        }
        return token;
    }

    /* Top-k / top-p among the entries >= CANDIDATE_FLOOR, or among all when a boundary
     * may lie below. */
    candidates_t *c = &s->candidates;
    float threshold;
    double kept_total;
    collect_at_least(e, vocab, CANDIDATE_FLOOR, c);
    if (!filter(c, 0, use_k, top_k, use_p, top_p, total, s, &kept_total, &threshold)) {
        collect_at_least(e, vocab, FLT_MIN, c);
        filter(c, 1, use_k, top_k, use_p, top_p, total, s, &kept_total, &threshold);
    }
    const int64_t n = c->n;
    int64_t token = -1;
    if (want_token && greedy) {
        token = argmax;
    } else if (want_token) {
        const double target = u * kept_total;
        double cum = 0.0;
        token = c->index[n - 1]; /* rounding: the target at the very end */
        for (int64_t j = 0; j < n; j++) {
            cum += c->values[j];
            if (cum > target) {
                token = c->index[j];
                break;
            }
        }
    }
    if (write_probs) {
        const float inv = (float)(1.0 / kept_total), keep_from = threshold > 0.0f ? threshold : FLT_MIN;
#pragma omp simd
        for (int64_t i = 0; i < vocab; i++) e[i] = e[i] >= keep_from ? e[i] * inv : 0.0f;
    }
    return token;
}

/* This thread's scratch for rows of `vocab` entries, kept between calls (grown as needed);
 * NULL when memory could not be had. */
static scratch_t *thread_scratch(int64_t vocab) {
    static __thread scratch_t s;
    static __thread int64_t capacity;
    if (capacity >= vocab) return &s;
    free(s.e);
    free(s.block_sums);
    free(s.candidates.values);
    free(s.candidates.index);
    free(s.work);
    free(s.counts);
    free(s.mass);
    s.e = malloc((size_t)vocab * sizeof *s.e);
    s.block_sums = malloc((size_t)((vocab + BLOCK - 1) / BLOCK) * sizeof *s.block_sums);
    s.candidates.values = malloc((size_t)vocab * sizeof *s.candidates.values);
    s.candidates.index = malloc((size_t)vocab * sizeof *s.candidates.index);
    s.work = malloc((size_t)vocab * sizeof *s.work);
    s.counts = malloc(MAX_BINS * sizeof *s.counts);
    s.mass = malloc(MAX_BINS * sizeof *s.mass);
    capacity = (s.e && s.block_sums && s.candidates.values && s.candidates.index && s.work && s.counts && s.mass)
                   ? vocab : 0;
    return capacity ? &s : NULL;
}

/* logits [rows, vocab] (row stride logits_stride); per row temperature (< 1e-5: greedy,
 * whose distribution is taken at temperature 1), top_k (<= 0 or >= vocab: off), top_p,
 * min_p, and a uniform in [0, 1) (read when `tokens` is given). `tokens` [rows] (may be
 * NULL); `probs` [rows, vocab] (row stride probs_stride; may be NULL). Returns 0, or -1
 * when scratch memory could not be had (the outputs are then incomplete). */
int sample_rows(const float *logits, int64_t logits_stride, int64_t rows, int64_t vocab, const float *temperature,
                const int64_t *top_k, const float *top_p, const float *min_p, const double *uniforms,
                int64_t *tokens, float *probs, int64_t probs_stride, int num_threads) {
    int failed = 0;
    if (rows < num_threads) num_threads = rows > 0 ? (int)rows : 1;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
        scratch_t *s = thread_scratch(vocab);
        if (!s) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *e = probs ? probs + r * probs_stride : s->e;
        const int64_t token = sample_row(logits + r * logits_stride, vocab, temperature[r], top_k[r], top_p[r],
                                         min_p[r], tokens ? uniforms[r] : 0.0, tokens != NULL, e, s, probs != NULL);
        if (tokens) tokens[r] = token;
    }
    return failed ? -1 : 0;
}
