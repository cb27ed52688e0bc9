/* Every decoder layer of a Llama-shaped model for one query token, in one call (see
 * kernels/decode_layers.py).
 *
 * At batch 1 a layer is ten small kernels; called one by one from Python, their wrappers
 * and the module calls around them cost about as much as their work. This runs the same
 * kernels in the same order on the same rows, through pointers to the entry points the
 * Python side binds (each library keeps its own build flags), every product taking and
 * returning bfloat16 rows as the Python side's does. So the result is the per-kernel
 * path's, bit for bit.
 */
#include <stdint.h>

#include "bf16.h"
#include "isa.h"

/* The entry points, as kernels/cpu/{rms_norm,int8_activation_linear,rotary,
 * paged_decode_attention,silu_and_mul}.c define them. */
typedef void (*rms_norm_fn)(const uint16_t *x, int64_t x_stride, uint16_t *residual, int64_t residual_stride,
                            const uint16_t *weight, uint16_t *out, int64_t out_stride, int rows, int hidden,
                            float eps, int num_threads);
typedef int (*linear_fn)(const void *x, int64_t x_stride, int x_bf16, int M, int K, const uint8_t *tiles, int bits,
                         int scale_bytes, int N, void *y, int64_t y_stride, int y_type, int num_threads);
typedef int (*rotary_write_kv_fn)(const int64_t *positions, int rows, uint16_t *q, int64_t q_stride, int num_q_heads,
                                  uint16_t *k, int64_t k_stride, int num_k_heads, const float *cos_sin,
                                  int64_t cos_sin_stride, int64_t cos_sin_rows, int head_dim, int num_threads,
                                  const uint16_t *v, int64_t v_stride, uint16_t *key_cache, uint16_t *value_cache,
                                  const int64_t *slots, int64_t num_slots);
typedef int (*decode_attention_fn)(const uint16_t *query, int64_t query_row_stride, const uint16_t *key_cache,
                                   const uint16_t *value_cache, const int32_t *block_tables,
                                   int64_t block_table_stride, const int32_t *seq_lens, int num_requests,
                                   int num_heads, int num_kv_heads, int head_dim, int block_size, int window,
                                   float scale, uint16_t *out, int64_t out_row_stride, int num_threads);
typedef void (*silu_and_mul_fn)(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride, int rows,
                                int inter, int num_threads);

/* Field order and types mirror kernels/decode_layers.py's ctypes structures. */
typedef struct {
    rms_norm_fn rms_norm;
    linear_fn linear;
    rotary_write_kv_fn rotary_write_kv;
    decode_attention_fn decode_attention;
    silu_and_mul_fn silu_and_mul;
} Kernels;

typedef struct {
    int hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, window;
    float eps, scale;
    const float *cos_sin;
    int64_t cos_sin_stride, cos_sin_rows, num_slots;
} Shape;

typedef struct {
    const uint16_t *input_norm, *post_norm;
    const uint8_t *qkv, *o, *gate_up, *down; /* repacked tiles (kernels/int8_activations.py) */
    int qkv_bits, o_bits, gate_up_bits, down_bits;
    int qkv_scale_bytes, o_scale_bytes, gate_up_scale_bytes, down_scale_bytes; /* 4 float32, 2 float16 */
    uint16_t *key_cache, *value_cache;
} Layer;

/* Scratch rows, each at least as long as the model needs (kernels/decode_layers.py). */
typedef struct {
    uint16_t *normed, *qkv, *attn, *gate_up, *act;
} Scratch;

/* bfloat16 x[K] times a tiled weight [N, K] -> bfloat16 out[N], as
 * kernels/int8_activations.py tiled_linear_cpu does it on a bfloat16 row. */
static int product(const Kernels *k, const uint16_t *x, int K, const uint8_t *tiles, int bits, int scale_bytes, int N,
                   uint16_t *out, int num_threads) {
    return k->linear(x, K, 1, 1, K, tiles, bits, scale_bytes, N, out, N, 1, num_threads);
}

/* Row `row` of a weight repacked into tiles (kernels/int8_activations.py repack_tiles; K
 * values a row) dequantized to bfloat16, as kernels/linear.py quantized_embedding does
 * it: int4 q * scale + offset, int8 q * scale, in float32 (no fused multiply-add: this
 * file is built with -ffp-contract=off), rounded once. */
/* float16 bits as float32, exactly (subnormals, infinities and NaNs too). */
static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits = sign;
    if (exponent == 0x1F) bits |= 0x7F800000u | mantissa << 13;
    else if (exponent) bits |= (exponent + 112) << 23 | mantissa << 13;
    else if (mantissa) {
        const float subnormal = (float)mantissa * 0x1p-24f; /* exact: 10 bits times a power of two */
        uint32_t magnitude;
        memcpy(&magnitude, &subnormal, 4);
        bits |= magnitude;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A block's scale or offset of column `lane` of its tile, from the TILE_N at `at`. */
static float tile_float(const uint8_t *at, int scale_bytes, int lane) {
    if (scale_bytes == 2) {
        uint16_t h;
        memcpy(&h, at + 2 * lane, 2);
        return f16_to_f32(h);
    }
    float f;
    memcpy(&f, at + 4 * lane, 4);
    return f;
}

static void tiles_row(const uint8_t *tiles, int bits, int scale_bytes, int K, int64_t row, uint16_t *out) {
    const int nb = K / 32, dwords = bits == 4 ? 4 : 8;
    const int64_t block_bytes = dwords * 64 + (bits == 4 ? 2 : 1) * 16 * scale_bytes;
    const int lane = (int)(row % 16);
    const uint8_t *tile = tiles + (row / 16) * nb * block_bytes;
    for (int b = 0; b < nb; b++) {
        const uint8_t *block = tile + b * block_bytes;
        const float scale = tile_float(block + dwords * 64, scale_bytes, lane);
        const float offset = bits == 4 ? tile_float(block + dwords * 64 + 16 * scale_bytes, scale_bytes, lane) : 0.0f;
        uint16_t *o = out + b * 32;
        for (int j = 0; j < dwords * 4; j++) {
            const uint8_t byte = block[(j / 4) * 64 + lane * 4 + j % 4];
            if (bits == 4) {
                o[j] = f32_to_bf16((float)(byte & 15) * scale + offset);
                o[16 + j] = f32_to_bf16((float)(byte >> 4) * scale + offset);
            } else {
                o[j] = f32_to_bf16((float)(int8_t)byte * scale);
            }
        }
    }
}

/* embedding: the token's table as tiles (its `embedding_rows` rows), or NULL when x holds
 * the embedded token already; token: its id.
 * x: the embedded token (bfloat16 [hidden]), used as the residual stream in place;
 * hidden_out: the final norm of the last layer's output. Returns 0; else the failing
 * layer * 16 + what failed: 1 a product (no memory), 2 a position outside the rotary
 * table, 3 a slot outside the cache, 4 attention shapes its kernel does not take, 5
 * attention out of memory; 6: the token is outside the embedding. Layers before the failing one have written their KV rows
 * (the same rows the per-kernel path writes). */
int decode_layers_bf16(const Kernels *k, const Shape *m, const Layer *layers, int num_layers,
                       const uint16_t *final_norm, const uint8_t *embedding, int embedding_bits,
                       int embedding_scale_bytes, int64_t embedding_rows, const int64_t *token, uint16_t *x, uint16_t *hidden_out, const int64_t *position,
                       const int64_t *slot, const int32_t *block_table, const int32_t *seq_len, const Scratch *s,
                       int num_threads) {
    const int H = m->hidden, q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    const int qkv_size = q_size + 2 * kv_size, I = m->intermediate;
    uint16_t *residual = x; /* the first layer's input is its residual, unnormed sum */
    if (embedding) {
        if (*token < 0 || *token >= embedding_rows) return 6;
        tiles_row(embedding, embedding_bits, embedding_scale_bytes, H, *token, x);
    }
    for (int i = 0; i < num_layers; i++) {
        const Layer *l = layers + i;
        const int fail = i * 16;
        if (i == 0) k->rms_norm(x, H, NULL, 0, l->input_norm, s->normed, H, 1, H, m->eps, num_threads);
        else k->rms_norm(s->act, H, residual, H, l->input_norm, s->normed, H, 1, H, m->eps, num_threads);
        if (product(k, s->normed, H, l->qkv, l->qkv_bits, l->qkv_scale_bytes, qkv_size, s->qkv, num_threads)) return fail + 1;
        uint16_t *q = s->qkv, *kk = s->qkv + q_size, *v = s->qkv + q_size + kv_size;
        const int rotated = k->rotary_write_kv(position, 1, q, qkv_size, m->num_heads, kk, qkv_size, m->num_kv_heads,
                                               m->cos_sin, m->cos_sin_stride, m->cos_sin_rows, m->head_dim,
                                               num_threads, v, qkv_size, l->key_cache, l->value_cache, slot,
                                               m->num_slots);
        if (rotated) return fail + 1 + rotated;
        const int attended = k->decode_attention(q, qkv_size, l->key_cache, l->value_cache, block_table, 0, seq_len, 1,
                                                 m->num_heads, m->num_kv_heads, m->head_dim, m->block_size, m->window,
                                                 m->scale, s->attn, q_size, num_threads);
        if (attended) return fail + 3 + attended;
        /* o's output goes where the next norm reads it: act's first H values (act is free
         * until the MLP). */
        if (product(k, s->attn, q_size, l->o, l->o_bits, l->o_scale_bytes, H, s->act, num_threads)) return fail + 1;
        k->rms_norm(s->act, H, residual, H, l->post_norm, s->normed, H, 1, H, m->eps, num_threads);
        if (product(k, s->normed, H, l->gate_up, l->gate_up_bits, l->gate_up_scale_bytes, 2 * I, s->gate_up, num_threads)) return fail + 1;
        k->silu_and_mul(s->gate_up, 2 * I, s->act, I, 1, I, num_threads);
        /* down's output overwrites act's first H values after its input is quantized. */
        if (product(k, s->act, I, l->down, l->down_bits, l->down_scale_bytes, H, s->act, num_threads)) return fail + 1;
    }
    k->rms_norm(s->act, H, residual, H, final_norm, hidden_out, H, 1, H, m->eps, num_threads);
    return 0;
}
