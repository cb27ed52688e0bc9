/* Weight-only quantized matrix products on CPU (see kernels/quant_linear.py):
 *
 *     y[m, n] = sum_k x[m, k] * w[n, k]      x, y float32; w kept quantized in blocks of 32
 *
 * int4: w[n, 32b + i] = scale[n, b] * q + offset[n, b], q = packed[n, 16b + i] & 15 for i < 16
 *       and packed[n, 16b + i - 16] >> 4 for i >= 16 (GGUF Q4_0 / Q4_1's nibble order).
 * int8: w[n, 32b + i] = scale[n, b] * q[n, 32b + i] (GGUF Q8_0).
 *
 * Each thread takes a range of output columns n; for NT columns at a time it dequantizes
 * their rows once into a float buffer (exactly the dequantized reference's values: scale * q
 * is exact in float32, so the fused multiply-add rounds once, as the reference does), then
 * runs every row of x over them, MT rows at a time. Written with GCC vector extensions at the
 * host's vector width (16 floats with AVX-512, 8 otherwise), so one source serves both.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define MT 4 /* activation rows per tile */

/* Vector width, and weight rows per tile so that the NT x MT accumulators, NT weight
 * vectors and one activation vector fit in the vector registers (32 zmm / 16 ymm). */
#if defined(__AVX512F__)
#define VL 16
#define NT 4
#else
#define VL 8
#define NT 2
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi32 __attribute__((vector_size(VL * 4)));
typedef uint8_t vu8 __attribute__((vector_size(VL)));

/* VL bytes widened to int32 lanes (GCC converts 8-bit lanes straight to float one lane at
 * a time, and lowers vectors wider than the host's through the stack). */
static inline __attribute__((always_inline)) vi32 load_widened(const void *p) {
    vu8 q;
    memcpy(&q, p, VL);
    return __builtin_convertvector(q, vi32);
}

static inline __attribute__((always_inline)) vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* Sum of the lanes as a tree of halves (a lane-by-lane loop costs as much as the products;
 * shuffles, not memcpy, keep the accumulators in registers). */
static inline __attribute__((always_inline)) float hsum(vf v) {
#if VL == 16
    const v8f s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const v8f s8 = v;
#endif
    const v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline __attribute__((always_inline)) void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

static void dequant_row_int4(const uint8_t *packed, const float *scale, const float *offset, int nb, float *w) {
    for (int b = 0; b < nb; b++) {
        const float s = scale[b], o = offset[b];
        for (int h = 0; h < 16; h += VL) {
            const vi32 q = load_widened(packed + 16 * b + h);
            storev(w + BLOCK * b + h, __builtin_convertvector(q & 15, vf) * s + o);
            storev(w + BLOCK * b + 16 + h, __builtin_convertvector(q >> 4, vf) * s + o);
        }
    }
}

/* q + 128 as uint8 (GCC widens signed bytes one lane at a time); scale * (u - 128) is
 * scale * q exactly for GGUF's float16 scales (scale * u fits float32's 24 bits). */
static void dequant_row_int8(const int8_t *q8, const float *scale, int nb, float *w) {
    for (int b = 0; b < nb; b++) {
        const float s = scale[b], o = -128.0f * s;
        for (int h = 0; h < BLOCK; h += VL)
            storev(w + BLOCK * b + h, __builtin_convertvector(load_widened(q8 + BLOCK * b + h) ^ 0x80, vf) * s + o);
    }
}

/* y[m0 .. m0+mt, n0 .. n0+nt] from the dequantized rows w (nt rows of K floats). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, int m0, int mt,
                                                       const float *w, int nt, int K, float *y,
                                                       int64_t y_stride, int n0) {
    vf acc[NT][MT];
    for (int j = 0; j < NT; j++)
        for (int i = 0; i < MT; i++) acc[j][i] = (vf){0};
    for (int k = 0; k < K; k += VL) {
        vf wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = loadv(w + (int64_t)j * K + k);
        for (int i = 0; i < mt; i++) {
            const vf xv = loadv(x + (int64_t)(m0 + i) * x_stride + k);
            for (int j = 0; j < nt; j++) acc[j][i] += xv * wv[j];
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) y[(int64_t)(m0 + i) * y_stride + n0 + j] = hsum(acc[j][i]);
}

/* Every row of x against nt dequantized weight rows: full MT tiles, then the rest. */
static void rows_times_tile(const float *x, int64_t x_stride, int M, const float *w, int nt, int K, float *y,
                            int64_t y_stride, int n0) {
    int m0 = 0;
    if (nt == NT) {
        for (; m0 + MT <= M; m0 += MT) tile(x, x_stride, m0, MT, w, NT, K, y, y_stride, n0);
        for (; m0 < M; m0++) tile(x, x_stride, m0, 1, w, NT, K, y, y_stride, n0);
    } else {
        for (int j = 0; j < nt; j++)
            for (m0 = 0; m0 < M; m0++) tile(x, x_stride, m0, 1, w + (int64_t)j * K, 1, K, y, y_stride, n0 + j);
    }
}

/* Row n of the weight, dequantized into w: int4 when offsets is given, else int8. */
static inline void dequant_row(const void *data, const float *scales, const float *offsets, int64_t n, int K,
                               float *w) {
    const int nb = K / BLOCK;
    if (offsets != NULL)
        dequant_row_int4((const uint8_t *)data + n * nb * 16, scales + n * nb, offsets + n * nb, nb, w);
    else
        dequant_row_int8((const int8_t *)data + n * K, scales + n * nb, nb, w);
}

/* Returns 0, or -1 when a thread could not get its row buffer (y is then incomplete). */
static int quant_linear(const float *x, int64_t x_stride, int M, int K, const void *data, const float *scales,
                        const float *offsets, int N, float *y, int64_t y_stride, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *w = aligned_alloc(64, sizeof(float) * NT * (size_t)K);
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int n0 = 0; n0 < N; n0 += NT) {
            if (w == NULL) continue;
            const int nt = N - n0 < NT ? N - n0 : NT;
            for (int j = 0; j < nt; j++) dequant_row(data, scales, offsets, n0 + j, K, w + (int64_t)j * K);
            rows_times_tile(x, x_stride, M, w, nt, K, y, y_stride, n0);
        }
        free(w);
    }
    return failed ? -1 : 0;
}

int int4_linear(const float *x, int64_t x_stride, int M, int K, const uint8_t *packed, const float *scales,
                const float *offsets, int N, float *y, int64_t y_stride, int num_threads) {
    return quant_linear(x, x_stride, M, K, packed, scales, offsets, N, y, y_stride, num_threads);
}

int int8_linear(const float *x, int64_t x_stride, int M, int K, const int8_t *q, const float *scales, int N,
                float *y, int64_t y_stride, int num_threads) {
    return quant_linear(x, x_stride, M, K, q, scales, NULL, N, y, y_stride, num_threads);
}

/* The whole weight as float32 [N, K] (for products with many rows: dequantize, then a GEMM). */
void int4_dequantize(const uint8_t *packed, const float *scales, const float *offsets, int N, int K, float *out,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int n = 0; n < N; n++) dequant_row(packed, scales, offsets, n, K, out + (int64_t)n * K);
}

void int8_dequantize(const int8_t *q, const float *scales, int N, int K, float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int n = 0; n < N; n++) dequant_row(q, scales, NULL, n, K, out + (int64_t)n * K);
}
