/* Batch-invariant dense products y = x @ W.T on CPU (see kernels/dense_linear.py):
 * bfloat16 or float32 weights, repacked once at load into tiles of TILE_N columns.
 *
 * Every output y[m, n] is one chain of multiply-adds over k in ascending order, computed
 * by one thread, whatever M, whatever the row's place in x, whatever the thread count:
 * threads split the column tiles, never K, and the row blocking only decides which
 * outputs share a weight load. oneDNN's products (services/worker/linear.py) pick their
 * K blocking by M, so a row's result there depends on how many rows came with it.
 *
 * bf16 tiles: per column tile and per pair of k, TILE_N lanes of (W[n, 2p], W[n, 2p + 1])
 * (vdpbf16ps's operand layout). With AVX512_BF16 each pair is one vdpbf16ps per output
 * lane; elsewhere each bf16 is widened to float32 and added by two fused multiply-adds
 * (a different rounding, so another build gives other bits, but the same bits at any
 * batch). f32 tiles: per k, TILE_N lanes of W[n, k]; one fused multiply-add per k.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "isa.h"

#define TILE_N 16
#define MC 96 /* rows per pass over the weight: their activations stay in L2 */

#if defined(__AVX512F__)
#define MR 4 /* rows x NT tiles of accumulators: 16 zmm (4 x 4: 1.2-1.4x 6 x 2's speed here) */
#define NT 4
#else
#define MR 4 /* 4 x 1 tiles, two ymm each */
#define NT 1
#endif

/* Vectors of the host's width (16 floats with AVX-512, 8 otherwise), VPT of them per tile:
 * GCC lowers wider vectors than the host has through the stack (8-10x slower on a Zen 3). */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define VPT (TILE_N / VL)
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define DPBF16 1
#else
#define DPBF16 0
#endif

static inline __attribute__((always_inline)) vf loadvf(const void *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) vu loadvu(const void *p) {
    vu v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* y[m0 .. m0+mr, tile t0 .. t0+nt] from tiles of bf16 pairs; K even. */
static inline __attribute__((always_inline)) void micro_bf16(const uint16_t *x, int64_t x_stride, int m0, const int mr,
                                                             const uint8_t *tiles, int64_t tile_bytes, int t0,
                                                             const int nt, int K, float acc_out[MR][NT][TILE_N]) {
    const int pairs = K / 2;
#if DPBF16
    __m512 acc[MR][NT];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        __m512i w[NT];
        for (int j = 0; j < nt; j++) w[j] = _mm512_loadu_si512(tiles + (int64_t)(t0 + j) * tile_bytes + 64 * (int64_t)p);
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, x + (int64_t)(m0 + i) * x_stride + 2 * p, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, (__m512bh)w[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) _mm512_storeu_ps(acc_out[i][j], acc[i][j]);
#else
    vf acc[MR][NT][VPT];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < VPT; h++) acc[i][j][h] = (vf){0};
    for (int p = 0; p < pairs; p++) {
        vf even[NT][VPT], odd[NT][VPT];
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < VPT; h++) {
                const vu w = loadvu(tiles + (int64_t)(t0 + j) * tile_bytes + 64 * (int64_t)p + 4 * VL * h);
                even[j][h] = (vf)(w << 16);
                odd[j][h] = (vf)(w & 0xffff0000u);
            }
        for (int i = 0; i < mr; i++) {
            const uint16_t *xr = x + (int64_t)(m0 + i) * x_stride + 2 * p;
            const float a0 = bf16_to_f32(xr[0]), a1 = bf16_to_f32(xr[1]);
            for (int j = 0; j < nt; j++)
                for (int h = 0; h < VPT; h++) {
                    acc[i][j][h] += a0 * even[j][h];
                    acc[i][j][h] += a1 * odd[j][h];
                }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < VPT; h++) memcpy(acc_out[i][j] + VL * h, &acc[i][j][h], sizeof(vf));
#endif
}

/* The same for float32 tiles (TILE_N floats per k). */
static inline __attribute__((always_inline)) void micro_f32(const float *x, int64_t x_stride, int m0, const int mr,
                                                            const uint8_t *tiles, int64_t tile_bytes, int t0,
                                                            const int nt, int K, float acc_out[MR][NT][TILE_N]) {
    vf acc[MR][NT][VPT];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < VPT; h++) acc[i][j][h] = (vf){0};
    for (int k = 0; k < K; k++) {
        vf w[NT][VPT];
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < VPT; h++)
                w[j][h] = loadvf(tiles + (int64_t)(t0 + j) * tile_bytes + 64 * (int64_t)k + 4 * VL * h);
        for (int i = 0; i < mr; i++) {
            const float a = x[(int64_t)(m0 + i) * x_stride + k];
            for (int j = 0; j < nt; j++)
                for (int h = 0; h < VPT; h++) acc[i][j][h] += a * w[j][h];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < VPT; h++) memcpy(acc_out[i][j] + VL * h, &acc[i][j][h], sizeof(vf));
}

/* Store a micro-tile's accumulators: float32 or bf16 (rounded to nearest even) outputs,
 * columns past N dropped. */
static inline void store(const float acc[MR][NT][TILE_N], int m0, int mr, int t0, int nt, int N, void *y,
                         int64_t y_stride, int out_bf16) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) {
            const int n0 = (t0 + j) * TILE_N, cols = N - n0 < TILE_N ? N - n0 : TILE_N;
            const int64_t at = (int64_t)(m0 + i) * y_stride + n0;
            if (out_bf16)
                for (int c = 0; c < cols; c++) ((uint16_t *)y)[at + c] = f32_to_bf16(acc[i][j][c]);
            else
                memcpy((float *)y + at, acc[i][j], sizeof(float) * (size_t)cols);
        }
}

/* One column-tile group over rows mc .. m_end: full MR x NT micro-tiles, the rest a row at
 * a time (mr and nt constant in each call, so the loops unroll). */
#define TILE_GROUP(KIND, XT)                                                                                      \
    static void group_##KIND(const XT *x, int64_t x_stride, int mc, int m_end, const uint8_t *tiles,            \
                             int64_t tile_bytes, int t0, int nt, int K, int N, void *y, int64_t y_stride,       \
                             int out_bf16) {                                                                     \
        float acc[MR][NT][TILE_N];                                                                               \
        int m0 = mc;                                                                                             \
        if (nt == NT)                                                                                            \
            for (; m0 + MR <= m_end; m0 += MR) {                                                                 \
                micro_##KIND(x, x_stride, m0, MR, tiles, tile_bytes, t0, NT, K, acc);                            \
                store(acc, m0, MR, t0, NT, N, y, y_stride, out_bf16);                                            \
            }                                                                                                    \
        for (; m0 < m_end; m0++) {                                                                               \
            if (nt == NT) {                                                                                      \
                micro_##KIND(x, x_stride, m0, 1, tiles, tile_bytes, t0, NT, K, acc);                             \
                store(acc, m0, 1, t0, NT, N, y, y_stride, out_bf16);                                             \
            } else                                                                                               \
                for (int t = t0; t < t0 + nt; t++) {                                                             \
                    micro_##KIND(x, x_stride, m0, 1, tiles, tile_bytes, t, 1, K, acc);                           \
                    store(acc, m0, 1, t, 1, N, y, y_stride, out_bf16);                                           \
                }                                                                                                \
        }                                                                                                        \
    }
TILE_GROUP(bf16, uint16_t)
TILE_GROUP(f32, float)
#undef TILE_GROUP

static void dense_linear(const void *x, int64_t x_stride, int M, int K, const uint8_t *tiles, int N, void *y,
                         int64_t y_stride, int in_bf16, int out_bf16, int num_threads) {
    const int num_tiles = (N + TILE_N - 1) / TILE_N, groups = (num_tiles + NT - 1) / NT;
    const int64_t tile_bytes = (int64_t)K * TILE_N * (in_bf16 ? 2 : 4);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    for (int mc = 0; mc < M; mc += MC) {
        const int m_end = M - mc < MC ? M : mc + MC;
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            const int t0 = g * NT, nt = num_tiles - t0 < NT ? num_tiles - t0 : NT;
            if (in_bf16) group_bf16(x, x_stride, mc, m_end, tiles, tile_bytes, t0, nt, K, N, y, y_stride, out_bf16);
            else group_f32(x, x_stride, mc, m_end, tiles, tile_bytes, t0, nt, K, N, y, y_stride, out_bf16);
        }
    }
}

/* x bf16 [M, K] (rows x_stride elements apart), tiles from repack (bf16 pairs), K even;
 * y [M, N] bf16 (out_f32 0) or float32 (out_f32 1), rows y_stride elements apart. */
void dense_linear_bf16(const uint16_t *x, int64_t x_stride, int M, int K, const uint8_t *tiles, int N, void *y,
                       int64_t y_stride, int out_f32, int num_threads) {
    dense_linear(x, x_stride, M, K, tiles, N, y, y_stride, 1, !out_f32, num_threads);
}

/* x float32 [M, K], float32 tiles; y float32 [M, N]. */
void dense_linear_f32(const float *x, int64_t x_stride, int M, int K, const uint8_t *tiles, int N, float *y,
                      int64_t y_stride, int num_threads) {
    dense_linear(x, x_stride, M, K, tiles, N, y, y_stride, 0, 0, num_threads);
}

/* Whether bf16 products use vdpbf16ps (1) or widen to float32 (0). */
int dense_linear_uses_dpbf16(void) { return DPBF16; }
