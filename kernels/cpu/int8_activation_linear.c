/* Quantized-weight products with int8 activations (see kernels/int8_activations.py):
 *
 *     y[m, n] = sum_b  da[m, b] * dw[n, b] * sum_i qa[m, 32b + i] * u[n, 32b + i]
 *                    + sa[m, b] * ow[n, b]
 *
 * Each activation row is quantized per block of 32 (da = max|x| / 127, qa = round(x / da)
 * in -127..127, sa = da * sum(qa)); a weight block is w = dw * u + ow with u unsigned:
 * int4's 0..15 with ow its offset, int8's q + 128 (q ^ 0x80) with ow = -128 dw. So every
 * block is one integer dot product of u8 by s8 (AVX512_VNNI vpdpbusd, or vpmaddubsw +
 * vpmaddwd on AVX2) and two float multiply-adds.
 *
 * Each thread takes tiles of TILE_N output columns (OpenMP static, as quant_linear.c);
 * per tile it gathers the weight into an L1 buffer in the layout vpdpbusd reads (per block
 * and per 4-byte group g, one vector whose lane n holds column n's bytes 4g .. 4g+3), then
 * runs every activation row over it, MR rows at a time: per group, one weight vector times
 * each row's 4 bytes broadcast.
 *
 * Activation rows come as float32 or bfloat16 (widened in registers as they are quantized:
 * the same values), results go out as float32, bfloat16 (rounded in registers as PyTorch's
 * `.to` rounds) or that bfloat16 widened back (the LM head's logits): the model's bfloat16
 * rows need no float32 copy on either side of a product.
 *
 * linear_i8_tiled skips the gather (both builds): it reads a weight repacked once at load
 * (kernels/int8_activations.py repack_tiles) into tiles, per block:
 * - int4, TILED4_BLOCK_BYTES: the 4 packed dwords as 4 vectors (lane n: column n's bytes
 *   4g .. 4g+3, still two nibbles a byte), then TILE_N scales and TILE_N offsets. The nibbles
 *   are split in the product loop (one and, or shift and and, per two groups).
 * - int8, TILED8_BLOCK_BYTES: the 8 dwords of signed codes as 8 vectors, then TILE_N scales
 *   (the AVX-512 product flips each vector to q + 128 as it loads it).
 * Both take as many bytes as the row layout with float32 scales (and offsets). A weight
 * whose scales (and offsets) are all float16 values, as every GGUF block's are, is repacked
 * with them as float16 (TILED4H, TILED8H): a block then takes as many bytes as in the GGUF
 * file (Q4_1's 20 a column, Q8_0's 34), 17% and 6% fewer than with float32 ones, and a
 * one-row product, which streams the weight once, reads that much less. The values, and so
 * every result, are the same: float16 widens to float32 exactly (F16C's vcvtph2ps).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

#define BLOCK 32
#define TILE_N 16 /* output columns per tile: one zmm of int32 / float lanes */
#define GROUPS 8  /* 4-byte groups per block */
/* Per block in the tile buffer: GROUPS vectors of TILE_N x 4 bytes, then TILE_N scales and
 * TILE_N offsets. */
#define TILE_BLOCK_BYTES (GROUPS * TILE_N * 4 + 2 * TILE_N * 4)
#define PACKED_GROUPS 4 /* packed dwords per int4 block */
#define TILED4_BLOCK_BYTES (PACKED_GROUPS * TILE_N * 4 + 2 * TILE_N * 4)
#define TILED8_BLOCK_BYTES (GROUPS * TILE_N * 4 + TILE_N * 4)
#define TILED4H_BLOCK_BYTES (PACKED_GROUPS * TILE_N * 4 + 2 * TILE_N * 2)
#define TILED8H_BLOCK_BYTES (GROUPS * TILE_N * 4 + TILE_N * 2)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 1
#define MR 8 /* activation rows per micro-tile: 8 int32 + 8 float accumulators */
#elif defined(__AVX2__) && defined(__FMA__)
#define WIDE 0
#define MR 4 /* 16 ymm: 4 int32 + 4 float accumulators (one half tile at a time) */
#endif
/* float16 scales widen with AVX-512F's or F16C's vcvtph2ps (every AVX2 CPU made has F16C;
 * a build without it repacks with float32 scales: tiled_block_bytes says so). */
#if WIDE || defined(__F16C__)
#define HALF_SCALES 1
#else
#define HALF_SCALES 0
#endif

#ifdef MR

/* ------------------------------------------------------------------ activations */

/* Rows come as float32 or bfloat16 (x_bf16): a bfloat16 value widens to float32 exactly,
 * so both give a row the same quantization. */
#if WIDE
static inline __attribute__((always_inline)) __m512 load16(const void *x, int x_bf16, int at) {
    if (x_bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at))), 16));
    return _mm512_loadu_ps((const float *)x + at);
}
#else
static inline __attribute__((always_inline)) __m256 load8(const void *x, int x_bf16, int at) {
    if (x_bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at))), 16));
    return _mm256_loadu_ps((const float *)x + at);
}
#endif

/* One row's blocks: q (K int8), d and s (K / 32 floats each). The arithmetic is
 * quantize_activations_ref's, operation for operation: d = amax / 127, inv = 1 / d (0 for
 * an all-zero block), q = round-half-even(x * inv), s = d * sum(q). */
static inline __attribute__((always_inline)) void quantize_row(const void *x, int x_bf16, int K, int8_t *q, float *d,
                                                                float *s) {
    for (int b = 0; b < K / BLOCK; b++) {
        const int xb = BLOCK * b;
#if WIDE
        const __m512 v0 = load16(x, x_bf16, xb), v1 = load16(x, x_bf16, xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
        _mm_storeu_si128((__m128i *)(q + BLOCK * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + BLOCK * b + 16), _mm512_cvtepi32_epi8(q1));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < BLOCK; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(x, x_bf16, xb + i)));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        float amax = lanes[0];
        for (int i = 1; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < BLOCK; i += 8) {
            int32_t qi[8];
            _mm256_storeu_si256((__m256i *)qi, _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, x_bf16, xb + i),
                                                                                _mm256_set1_ps(inv))));
            for (int j = 0; j < 8; j++) {
                q[BLOCK * b + i + j] = (int8_t)qi[j];
                sum += qi[j];
            }
        }
#endif
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

/* Rows m0 .. m1 of x (float32, or bfloat16 where x_bf16); row m starts x_stride values in. */
static void quantize_rows(const void *x, int64_t x_stride, int x_bf16, int m0, int m1, int K, int8_t *q, float *d,
                          float *s) {
    const size_t value_bytes = x_bf16 ? 2 : 4;
    for (int m = m0; m < m1; m++) {
        const void *row = (const char *)x + (size_t)m * x_stride * value_bytes;
        int8_t *qm = q + (int64_t)m * K;
        float *dm = d + (int64_t)m * (K / BLOCK), *sm = s + (int64_t)m * (K / BLOCK);
        if (x_bf16) quantize_row(row, 1, K, qm, dm, sm);
        else quantize_row(row, 0, K, qm, dm, sm);
    }
}

void quantize_activations(const float *x, int64_t x_stride, int M, int K, int8_t *q, float *d, float *s,
                          int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int m = 0; m < M; m++) quantize_rows(x, x_stride, 0, m, m + 1, K, q, d, s);
}

/* ------------------------------------------------------------------ results */

/* y row `row`, columns n0 .. n0+count (count <= 16 on AVX-512, <= 8 on AVX2), as y_type
 * says: float32, bfloat16 rounded to nearest even as bf16.h's f32_to_bf16 (PyTorch's
 * `.to`), or that bfloat16 value widened back to float32 (`.to(torch.bfloat16).float()`). */
enum { Y_FLOAT32, Y_BFLOAT16, Y_BFLOAT16_AS_FLOAT32 };

#if WIDE
static inline __attribute__((always_inline)) void store_row(void *y, int64_t y_stride, int y_type, int64_t row,
                                                             int n0, int count, __m512 v) {
    const __mmask16 keep = (__mmask16)((1u << count) - 1);
    if (y_type == Y_FLOAT32) {
        _mm512_mask_storeu_ps((float *)y + row * y_stride + n0, keep, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)),
                                 _mm512_and_si512(high, _mm512_set1_epi32(1)));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), high, _mm512_set1_epi32(0x40));
    if (y_type == Y_BFLOAT16_AS_FLOAT32) {
        _mm512_mask_storeu_epi32((float *)y + row * y_stride + n0, keep, _mm512_slli_epi32(r, 16));
        return;
    }
    const __m256i half = _mm512_cvtepi32_epi16(r);
    uint16_t *at = (uint16_t *)y + row * y_stride + n0;
    if (count == 16) {
        _mm256_storeu_si256((__m256i *)at, half);
    } else {
        uint16_t out[16];
        _mm256_storeu_si256((__m256i *)out, half);
        memcpy(at, out, sizeof(uint16_t) * count);
    }
}
#else
static inline __attribute__((always_inline)) void store_row(void *y, int64_t y_stride, int y_type, int64_t row,
                                                             int n0, int count, __m256 v) {
    if (y_type == Y_FLOAT32) {
        float out[8];
        _mm256_storeu_ps(out, v);
        memcpy((float *)y + row * y_stride + n0, out, sizeof(float) * count);
        return;
    }
    const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)),
                                 _mm256_and_si256(high, _mm256_set1_epi32(1)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
    if (y_type == Y_BFLOAT16_AS_FLOAT32) {
        int32_t out[8];
        _mm256_storeu_si256((__m256i *)out, _mm256_slli_epi32(r, 16));
        memcpy((float *)y + row * y_stride + n0, out, sizeof(float) * count);
        return;
    }
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    uint16_t out[16];
    _mm256_storeu_si256((__m256i *)out, packed);
    memcpy((uint16_t *)y + row * y_stride + n0, out, sizeof(uint16_t) * count);
}
#endif

/* ------------------------------------------------------------------ weight tiles */

#if WIDE
/* z[l] = 128-bit lane l of t0, t1, t2, t3 side by side. */
static inline __attribute__((always_inline)) void lanes_transpose(__m512i t0, __m512i t1, __m512i t2, __m512i t3,
                                                                  __m512i z[4]) {
    const __m512i lo01 = _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi01 = _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i lo23 = _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi23 = _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(3, 2, 3, 2));
    z[0] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
    z[1] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
    z[2] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
    z[3] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
}

/* z[c] lane j = srow[j][c] for c < count (<= 16), the rest 0: a 16 x 16 transpose of 32-bit
 * values (4 x 4 inside each 128-bit lane, then of the lanes). */
static inline void transpose_16x16(const float *const srow[TILE_N], int count, __m512 z[TILE_N]) {
    const __mmask16 valid = (__mmask16)((1u << count) - 1);
    __m512 r[TILE_N], t[TILE_N];
    /* Masked loads only where needed: a masked load across two cache lines (rows start
     * mid-line) costs more, 10% of the whole product at 8 rows. */
    if (count == TILE_N)
        for (int j = 0; j < TILE_N; j++) r[j] = _mm512_loadu_ps(srow[j]);
    else
        for (int j = 0; j < TILE_N; j++) r[j] = _mm512_maskz_loadu_ps(valid, srow[j]);
    for (int i = 0; i < TILE_N; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < TILE_N; i += 4) { /* r[i + c], 128-bit lane L: rows i..i+3 of column 4L + c */
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        __m512i lanes[4];
        lanes_transpose(_mm512_castps_si512(r[c]), _mm512_castps_si512(r[4 + c]), _mm512_castps_si512(r[8 + c]),
                        _mm512_castps_si512(r[12 + c]), lanes);
        for (int l = 0; l < 4; l++) z[4 * l + c] = _mm512_castsi512_ps(lanes[l]);
    }
}

/* Blocks b0 .. b0+count of the tile's weight codes into buf (int4: nibbles unpacked; int8:
 * q ^ 0x80), 64 bytes of each row at a time: 4 int4 blocks or 2 int8 ones. */
static inline void tile_block_codes(const uint8_t *const rows[TILE_N], int b0, int count, int is_int4, uint8_t *buf) {
    const int row_bytes_per_block = is_int4 ? 16 : BLOCK;
    const int per_load = 64 / row_bytes_per_block;
    const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    for (int b = b0; b < b0 + count; b += per_load) {
        const int blocks = b0 + count - b < per_load ? b0 + count - b : per_load;
        const float *at[TILE_N];
        for (int j = 0; j < TILE_N; j++) at[j] = (const float *)(rows[j] + (int64_t)row_bytes_per_block * b);
        __m512 z[TILE_N]; /* z[d] lane j: dword d of row j's 64 bytes */
        transpose_16x16(at, blocks * row_bytes_per_block / 4, z);
        for (int i = 0; i < blocks; i++) {
            __m512i *w = (__m512i *)(buf + (int64_t)(b + i) * TILE_BLOCK_BYTES);
            if (is_int4) {
                /* Packed dword g: elements 4g..4g+3 in the low nibbles, 16+4g.. in the high ones. */
                for (int g = 0; g < 4; g++) {
                    const __m512i v = _mm512_castps_si512(z[4 * i + g]);
                    _mm512_store_si512(w + g, _mm512_and_si512(v, nibble));
                    _mm512_store_si512(w + 4 + g, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
                }
            } else {
                for (int g = 0; g < GROUPS; g++)
                    _mm512_store_si512(w + g, _mm512_xor_si512(_mm512_castps_si512(z[GROUPS * i + g]), flip));
            }
        }
    }
}
#else
static inline void tile_block_codes(const uint8_t *const rows[TILE_N], int b0, int count, int is_int4, uint8_t *buf) {
    for (int b = b0; b < b0 + count; b++) {
        uint32_t *w32 = (uint32_t *)(buf + (int64_t)b * TILE_BLOCK_BYTES);
        for (int j = 0; j < TILE_N; j++) {
        uint32_t g4[GROUPS];
        if (is_int4) {
            uint32_t packed[4];
            memcpy(packed, rows[j] + 16 * b, 16);
            for (int g = 0; g < 4; g++) {
                g4[g] = packed[g] & 0x0F0F0F0Fu;
                g4[4 + g] = (packed[g] >> 4) & 0x0F0F0F0Fu;
            }
        } else {
            memcpy(g4, rows[j] + BLOCK * b, BLOCK);
        }
        for (int g = 0; g < GROUPS; g++) w32[g * TILE_N + j] = g4[g];
        }
    }
}
#endif

/* Columns n0 .. n0+TILE_N of the weight into buf (columns past N repeat the last one; their
 * results are not stored). int4 when offsets is given, else int8. On AVX2, int8 bytes stay
 * signed (the product takes |w| and moves w's sign onto the activation) and the offset is 0. */
static void gather_tile(const void *data, const float *scales, const float *offsets, int N, int K, int n0,
                        uint8_t *buf) {
    const int nb = K / BLOCK;
    const int64_t row_bytes = offsets != NULL ? K / 2 : K;
    const uint8_t *rows[TILE_N];
    const float *srow[TILE_N], *orow[TILE_N];
    for (int j = 0; j < TILE_N; j++) {
        const int n = n0 + j < N ? n0 + j : N - 1;
        rows[j] = (const uint8_t *)data + n * row_bytes;
        srow[j] = scales + (int64_t)n * nb;
        orow[j] = offsets != NULL ? offsets + (int64_t)n * nb : NULL;
    }
    for (int b0 = 0; b0 < nb; b0 += TILE_N) {
        const int count = nb - b0 < TILE_N ? nb - b0 : TILE_N;
        tile_block_codes(rows, b0, count, offsets != NULL, buf);
#if WIDE
        __m512 sc[TILE_N], off[TILE_N];
        const float *s_at[TILE_N], *o_at[TILE_N];
        for (int j = 0; j < TILE_N; j++) {
            s_at[j] = srow[j] + b0;
            o_at[j] = offsets != NULL ? orow[j] + b0 : NULL;
        }
        transpose_16x16(s_at, count, sc);
        if (offsets != NULL) transpose_16x16(o_at, count, off);
        for (int c = 0; c < count; c++) {
            float *at = (float *)(buf + (int64_t)(b0 + c) * TILE_BLOCK_BYTES + GROUPS * TILE_N * 4);
            _mm512_store_ps(at, sc[c]);
            _mm512_store_ps(at + TILE_N, offsets != NULL ? off[c] : _mm512_mul_ps(sc[c], _mm512_set1_ps(-128.0f)));
        }
#else
        for (int c = 0; c < count; c++) {
            float *at = (float *)(buf + (int64_t)(b0 + c) * TILE_BLOCK_BYTES + GROUPS * TILE_N * 4);
            for (int j = 0; j < TILE_N; j++) {
                at[j] = srow[j][b0 + c];
                at[TILE_N + j] = offsets != NULL ? orow[j][b0 + c] : 0.0f;
            }
        }
#endif
    }
}

/* ------------------------------------------------------------------ micro-tiles */

static inline int32_t act4(const int8_t *qa, int64_t row, int K, int b, int g) {
    int32_t v;
    memcpy(&v, qa + row * K + BLOCK * b + 4 * g, 4);
    return v;
}

/* How a tile's blocks are laid out: a thread's gather buffer (TILE_BLOCK_BYTES a block:
 * codes ready for the product, then scales and offsets), or a weight repacked at load. */
enum layout {
    GATHERED,
    TILED4,  /* TILED4_BLOCK_BYTES: 4 packed dwords (two nibbles a byte), scales, offsets */
    TILED8,  /* TILED8_BLOCK_BYTES: 8 dwords of signed int8, scales (offsets are -128 scales) */
    TILED4H, /* TILED4's with float16 scales and offsets */
    TILED8H, /* TILED8's with float16 scales */
};

static inline int block_bytes(enum layout layout) {
    switch (layout) {
    case TILED4: return TILED4_BLOCK_BYTES;
    case TILED8: return TILED8_BLOCK_BYTES;
    case TILED4H: return TILED4H_BLOCK_BYTES;
    case TILED8H: return TILED8H_BLOCK_BYTES;
    default: return TILE_BLOCK_BYTES;
    }
}

static inline int packed_int4(enum layout layout) { return layout == TILED4 || layout == TILED4H; }
static inline int signed_int8(enum layout layout) { return layout == TILED8 || layout == TILED8H; }
static inline int half_scales(enum layout layout) { return layout == TILED4H || layout == TILED8H; }

#if !WIDE
/* Half h's 8 of a block's TILE_N float32 (half: float16) scales or offsets at `at`. */
static inline __attribute__((always_inline)) __m256 load_8_scales(const uint8_t *at, int half, int h) {
#if HALF_SCALES
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 16 * h)));
#endif
    (void)half;
    return _mm256_load_ps((const float *)(at + 32 * h));
}
#endif

/* y[m0 .. m0+mr, n0 .. n0+nt] from the tile's blocks. */
static inline __attribute__((always_inline)) void micro_tile(const uint8_t *buf, int K, const int8_t *qa,
                                                             const float *da, const float *sa, int m0, int mr,
                                                             int is_int8, enum layout layout, void *y,
                                                             int64_t y_stride, int y_type, int n0, int nt) {
    const int nb = K / BLOCK;
    const int vectors = packed_int4(layout) ? PACKED_GROUPS : GROUPS;
#if WIDE
    (void)is_int8;
    const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = buf + (int64_t)b * block_bytes(layout);
        __m512i iacc[MR];
        for (int i = 0; i < mr; i++) iacc[i] = _mm512_setzero_si512();
        if (packed_int4(layout)) {
            for (int g = 0; g < PACKED_GROUPS; g++) {
                const __m512i v = _mm512_loadu_si512(blk + 64 * g);
                const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                for (int i = 0; i < mr; i++) {
                    iacc[i] = _mm512_dpbusd_epi32(iacc[i], lo, _mm512_set1_epi32(act4(qa, m0 + i, K, b, g)));
                    iacc[i] = _mm512_dpbusd_epi32(iacc[i], hi, _mm512_set1_epi32(act4(qa, m0 + i, K, b, 4 + g)));
                }
            }
        } else {
            for (int g = 0; g < GROUPS; g++) {
                __m512i w = _mm512_loadu_si512(blk + 64 * g); /* a TILED8H block (544 bytes) is 32-byte aligned */
                if (signed_int8(layout)) w = _mm512_xor_si512(w, flip); /* q + 128, as the gather stores it */
                for (int i = 0; i < mr; i++)
                    iacc[i] = _mm512_dpbusd_epi32(iacc[i], w, _mm512_set1_epi32(act4(qa, m0 + i, K, b, g)));
            }
        }
        const uint8_t *floats = blk + 64 * vectors;
        const __m512 sc = half_scales(layout) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)floats))
                                              : _mm512_loadu_ps((const float *)floats);
        const __m512 off = signed_int8(layout) ? _mm512_mul_ps(sc, _mm512_set1_ps(-128.0f))
                           : half_scales(layout)
                               ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(floats + 2 * TILE_N)))
                               : _mm512_loadu_ps((const float *)(floats + 4 * TILE_N));
        for (int i = 0; i < mr; i++) {
            const int64_t ab = (int64_t)(m0 + i) * nb + b;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i]), _mm512_mul_ps(sc, _mm512_set1_ps(da[ab])), acc[i]);
            acc[i] = _mm512_fmadd_ps(off, _mm512_set1_ps(sa[ab]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) store_row(y, y_stride, y_type, m0 + i, n0, nt, acc[i]);
#else
    /* One half of the tile (8 columns, one ymm) at a time over every block, so MR rows
     * share each weight vector and its nibble split. int8 codes stay signed here: the
     * product takes |w| and moves w's sign onto the activation, and the offset is 0. */
    const int signed8 = signed_int8(layout) || (layout == GATHERED && is_int8);
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2 && 8 * h < nt; h++) {
        __m256 acc[MR];
        for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = buf + (int64_t)b * block_bytes(layout);
            __m256i iacc[MR];
            if (packed_int4(layout)) {
                /* The block's 8 int4 products summed in int16 (8 * 2 * 15 * 127 = 30480
                 * fits), widened to int32 once: one vpmaddwd a block, not one a group. */
                __m256i sum16[MR];
                for (int i = 0; i < mr; i++) sum16[i] = _mm256_setzero_si256();
                for (int g = 0; g < PACKED_GROUPS; g++) {
                    const __m256i v = _mm256_load_si256((const __m256i *)(blk + 64 * g + 32 * h));
                    const __m256i lo = _mm256_and_si256(v, nibble);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                    for (int i = 0; i < mr; i++) {
                        sum16[i] = _mm256_add_epi16(
                            sum16[i], _mm256_add_epi16(
                                          _mm256_maddubs_epi16(lo, _mm256_set1_epi32(act4(qa, m0 + i, K, b, g))),
                                          _mm256_maddubs_epi16(hi, _mm256_set1_epi32(act4(qa, m0 + i, K, b, 4 + g)))));
                        /* Keeps each row's sum a chain: GCC otherwise reassociates the
                         * integer adds, hoists all 32 products and spills them. */
                        __asm__("" : "+x"(sum16[i]));
                    }
                }
                for (int i = 0; i < mr; i++) iacc[i] = _mm256_madd_epi16(sum16[i], ones);
            } else {
                for (int i = 0; i < mr; i++) iacc[i] = _mm256_setzero_si256();
                for (int g = 0; g < GROUPS; g++) {
                    const __m256i w = _mm256_load_si256((const __m256i *)(blk + 64 * g + 32 * h));
                    /* vpmaddubsw saturates int16: int4 pairs reach 2 * 15 * 127, int8 ones
                     * 2 * 128 * 127: both fit. */
                    const __m256i u = signed8 ? _mm256_abs_epi8(w) : w;
                    for (int i = 0; i < mr; i++) {
                        __m256i a = _mm256_set1_epi32(act4(qa, m0 + i, K, b, g));
                        if (signed8) a = _mm256_sign_epi8(a, w);
                        iacc[i] = _mm256_add_epi32(iacc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), ones));
                    }
                }
            }
            const uint8_t *floats = blk + 64 * vectors;
            const __m256 sc = load_8_scales(floats, half_scales(layout), h);
            for (int i = 0; i < mr; i++) {
                const int64_t ab = (int64_t)(m0 + i) * nb + b;
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i]), _mm256_mul_ps(sc, _mm256_set1_ps(da[ab])), acc[i]);
                if (!signed8) {
                    const __m256 off = load_8_scales(floats + (half_scales(layout) ? 2 : 4) * TILE_N,
                                                     half_scales(layout), h);
                    acc[i] = _mm256_fmadd_ps(off, _mm256_set1_ps(sa[ab]), acc[i]);
                }
            }
        }
        const int cols = nt - 8 * h < 8 ? nt - 8 * h : 8;
        for (int i = 0; i < mr; i++) store_row(y, y_stride, y_type, m0 + i, n0 + 8 * h, cols, acc[i]);
    }
#endif
}

/* Every activation row over one tile: full MR micro-tiles, then the rest (mr and layout
 * constants in each call, so the loops over rows unroll). `next` (next_bytes long, or
 * NULL) is prefetched a share before each micro-tile: the next tile's first pass then
 * finds it near, where a decode step's few rows leave too little work per tile for the
 * hardware prefetcher to run ahead of. */
static inline __attribute__((always_inline)) void rows_over_tile(const uint8_t *buf, int K, const int8_t *qa,
                                                                  const float *da, const float *sa, int M,
                                                                  int is_int8, enum layout layout, void *y,
                                                                  int64_t y_stride, int y_type, int n0, int nt,
                                                                  const uint8_t *next, int64_t next_bytes) {
    const int64_t share = next ? (next_bytes / ((M + MR - 1) / MR) + 63) / 64 * 64 : 0;
    int64_t fetched = 0;
    int m0 = 0;
    for (; m0 + MR <= M; m0 += MR) {
        for (const int64_t end = fetched + share < next_bytes ? fetched + share : next_bytes; fetched < end; fetched += 64)
            __builtin_prefetch(next + fetched, 0, 1);
        micro_tile(buf, K, qa, da, sa, m0, MR, is_int8, layout, y, y_stride, y_type, n0, nt);
    }
    switch (M - m0) {
#if MR > 4
    case 7: micro_tile(buf, K, qa, da, sa, m0, 7, is_int8, layout, y, y_stride, y_type, n0, nt); break;
    case 6: micro_tile(buf, K, qa, da, sa, m0, 6, is_int8, layout, y, y_stride, y_type, n0, nt); break;
    case 5: micro_tile(buf, K, qa, da, sa, m0, 5, is_int8, layout, y, y_stride, y_type, n0, nt); break;
    case 4: micro_tile(buf, K, qa, da, sa, m0, 4, is_int8, layout, y, y_stride, y_type, n0, nt); break;
#endif
#if MR > 2
    case 3: micro_tile(buf, K, qa, da, sa, m0, 3, is_int8, layout, y, y_stride, y_type, n0, nt); break;
    case 2: micro_tile(buf, K, qa, da, sa, m0, 2, is_int8, layout, y, y_stride, y_type, n0, nt); break;
#endif
    case 1: micro_tile(buf, K, qa, da, sa, m0, 1, is_int8, layout, y, y_stride, y_type, n0, nt); break;
    default: break;
    }
}

/* Tile n0's columns of y for every row (tiles: repacked weight, else gathered into buf). */
static inline __attribute__((always_inline)) void one_tile(const uint8_t *tiles, enum layout layout, const void *data,
                                                           const float *scales, const float *offsets, uint8_t *buf,
                                                           const int8_t *qa, const float *da, const float *sa, int M,
                                                           int K, int N, int n0, void *y, int64_t y_stride,
                                                           int y_type) {
    const int nb = K / BLOCK;
    const int nt = N - n0 < TILE_N ? N - n0 : TILE_N;
    if (tiles != NULL) {
        const int64_t tile_bytes = (int64_t)nb * block_bytes(layout);
        const uint8_t *tile = tiles + (int64_t)(n0 / TILE_N) * tile_bytes;
        const uint8_t *next = n0 + TILE_N < N ? tile + tile_bytes : NULL;
        /* One call per layout, so that each inlined copy has its layout constant. */
        switch (layout) {
        case TILED4: rows_over_tile(tile, K, qa, da, sa, M, 0, TILED4, y, y_stride, y_type, n0, nt, next, tile_bytes); break;
        case TILED8: rows_over_tile(tile, K, qa, da, sa, M, 1, TILED8, y, y_stride, y_type, n0, nt, next, tile_bytes); break;
#if HALF_SCALES
        case TILED4H: rows_over_tile(tile, K, qa, da, sa, M, 0, TILED4H, y, y_stride, y_type, n0, nt, next, tile_bytes); break;
        case TILED8H: rows_over_tile(tile, K, qa, da, sa, M, 1, TILED8H, y, y_stride, y_type, n0, nt, next, tile_bytes); break;
#endif
        default: break;
        }
        return;
    }
    gather_tile(data, scales, offsets, N, K, n0, buf);
    rows_over_tile(buf, K, qa, da, sa, M, offsets == NULL, GATHERED, y, y_stride, y_type, n0, nt, NULL, 0);
}

/* Up to this many activation rows (a decode step's few), every thread quantizes them
 * itself into buffers of its own, and its tiles start at once: quantized by the threads
 * together, the tiles must wait for all of them at a barrier, and a batch-1 step runs about
 * 120 products, each barrier a futex wake. The same rows give every thread the same codes. */
#define OWN_QUANTIZED_ROWS 4

/* Whether y's rows share bytes with x's (kernels/decode_layers.c writes the down
 * product's result over its input): then no thread may write y before all have read x. */
static int overlapping(const void *x, int64_t x_stride, int x_bf16, int M, int K, const void *y, int64_t y_stride,
                       int y_type, int N) {
    const char *x0 = x, *y0 = y;
    const char *x1 = x0 + ((int64_t)(M - 1) * x_stride + K) * (x_bf16 ? 2 : 4);
    const char *y1 = y0 + ((int64_t)(M - 1) * y_stride + N) * (y_type == Y_BFLOAT16 ? 2 : 4);
    return x0 < y1 && y0 < x1;
}

/* Returns 0, -1 when memory could not be had (y is then incomplete). tiles: the weight
 * repacked as `layout` says (data, scales and offsets then unused), else (GATHERED) each
 * thread gathers its tiles from the row layout. x: float32 rows, or bfloat16 (x_bf16); y:
 * as y_type says (store_row), rounded at most once from the same float32 sums. One parallel
 * region: the rows' quantization (each thread its own copy, or split between the threads
 * and then a barrier), then the tiles. */
static int i8_linear(const void *x, int64_t x_stride, int x_bf16, int M, int K, const void *data, const float *scales,
                     const float *offsets, const uint8_t *tiles, enum layout layout, int N, void *y,
                     int64_t y_stride, int y_type, int num_threads) {
    const int nb = K / BLOCK;
    const int own_rows = M <= OWN_QUANTIZED_ROWS;
    const int in_place = own_rows && overlapping(x, x_stride, x_bf16, M, K, y, y_stride, y_type, N);
    int8_t *shared_qa = own_rows ? NULL : malloc((size_t)M * K);
    float *shared_da = own_rows ? NULL : malloc(sizeof(float) * 2 * (size_t)M * nb);
    int failed = !own_rows && (shared_qa == NULL || shared_da == NULL);
    const int setup_failed = failed; /* read in the region, where `failed` may be written */
#pragma omp parallel num_threads(num_threads) if (!setup_failed)
    {
        int8_t *qa = shared_qa;
        float *da = shared_da;
        if (own_rows) {
            qa = malloc((size_t)M * K);
            da = malloc(sizeof(float) * 2 * (size_t)M * nb);
            if (qa != NULL && da != NULL) quantize_rows(x, x_stride, x_bf16, 0, M, K, qa, da, da + (int64_t)M * nb);
            if (in_place) {
#pragma omp barrier
            }
        } else if (!setup_failed) {
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) quantize_rows(x, x_stride, x_bf16, m, m + 1, K, qa, da, da + (int64_t)M * nb);
        }
        uint8_t *buf = setup_failed || tiles != NULL ? NULL : aligned_alloc(64, (size_t)TILE_BLOCK_BYTES * nb);
        const int skip = setup_failed || qa == NULL || da == NULL || (buf == NULL && tiles == NULL);
        if (skip) {
#pragma omp atomic write
            failed = 1;
        }
        const float *sa = skip ? NULL : da + (int64_t)M * nb;
        /* Static: each thread streams its own run of the weight, prefetching its next tile
         * (handing tiles out dynamically served fewer tokens, docs/BENCHMARKS-diary.md).
         * nowait: the region's end is the barrier. */
#pragma omp for schedule(static) nowait
        for (int n0 = 0; n0 < N; n0 += TILE_N)
            if (!skip) one_tile(tiles, layout, data, scales, offsets, buf, qa, da, sa, M, K, N, n0, y, y_stride, y_type);
        free(buf);
        if (own_rows) {
            free(qa);
            free(da);
        }
    }
    free(shared_qa);
    free(shared_da);
    return failed ? -1 : 0;
}

/* x_bf16: the activations' type, 0 float32, 1 bfloat16; y_type: the result's (store_row). */
int int4_linear_i8(const void *x, int64_t x_stride, int x_bf16, int M, int K, const uint8_t *packed,
                   const float *scales, const float *offsets, int N, void *y, int64_t y_stride, int y_type,
                   int num_threads) {
    return i8_linear(x, x_stride, x_bf16, M, K, packed, scales, offsets, NULL, GATHERED, N, y, y_stride, y_type,
                     num_threads);
}

int int8_linear_i8(const void *x, int64_t x_stride, int x_bf16, int M, int K, const int8_t *q, const float *scales,
                   int N, void *y, int64_t y_stride, int y_type, int num_threads) {
    return i8_linear(x, x_stride, x_bf16, M, K, q, scales, NULL, NULL, GATHERED, N, y, y_stride, y_type,
                     num_threads);
}

static enum layout tiled_layout(int bits, int scale_bytes) {
    if (scale_bytes == 2) return bits == 4 ? TILED4H : TILED8H;
    return bits == 4 ? TILED4 : TILED8;
}

int tiled_block_bytes(int bits, int scale_bytes);

/* The products of a weight repacked at load (kernels/int8_activations.py repack_tiles):
 * bits 4 or 8, scale_bytes 4 (float32 scales and offsets) or 2 (float16). Returns 0, -1
 * (no memory), -2 (a layout this build does not read: nothing written). */
int linear_i8_tiled(const void *x, int64_t x_stride, int x_bf16, int M, int K, const uint8_t *tiles, int bits,
                    int scale_bytes, int N, void *y, int64_t y_stride, int y_type, int num_threads) {
    if (!tiled_block_bytes(bits, scale_bytes)) return -2;
    return i8_linear(x, x_stride, x_bf16, M, K, NULL, NULL, NULL, tiles, tiled_layout(bits, scale_bytes), N, y,
                     y_stride, y_type, num_threads);
}

/* Bytes a block of a repacked tile takes for `bits` 4 or 8 and `scale_bytes` 4 or 2; 0
 * where this build does not read that layout (no vector path; float16 scales without F16C). */
int tiled_block_bytes(int bits, int scale_bytes) {
    if (scale_bytes == 2 && !HALF_SCALES) return 0;
    return block_bytes(tiled_layout(bits, scale_bytes));
}

/* Whether the products use AVX512_VNNI's vpdpbusd (1) or AVX2's vpmaddubsw (0). */
int int8_products_use_vnni(void) { return WIDE; }

#else /* neither AVX-512 VNNI nor AVX2: the Python side runs the reference */

int int4_linear_i8(void) { return -2; }
int int8_linear_i8(void) { return -2; }
int linear_i8_tiled(void) { return -2; }
int tiled_block_bytes(void) { return 0; }
int int8_products_use_vnni(void) { return 0; }
void quantize_activations(void) {}

#endif
