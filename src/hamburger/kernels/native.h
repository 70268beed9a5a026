/* The native kernels' contract, shared by every instruction set (`native.c` and the files it includes):
 * the structures Python fills through ctypes (`native.py`'s Weights, Layer and Pass: the same fields, the same
 * order), the tiles' layout, and the arithmetic every variant computes alike, bit for bit.
 *
 * Each variant (`native_avx512.h`, `native_avx2.h`, `native_neon.h`) supplies a vector of 16 floats `vf` with the
 * operations below, the 16-lane sums in `hsum` / `sum16`'s fixed orders, and the two inner products
 * (`fp16_tile`, `codes_tile`); `native.c` writes everything else once on top of them. Every float operation is one
 * IEEE operation (a fused multiply-add where `vf_fma` says so, nothing contracted elsewhere: -ffp-contract=off),
 * and every sum has one order, so the variants give the same bits; integer sums are exact.
 *
 *   hsum(a)   the sum of a vector's 16 lanes: t[i] = a[i] + a[i+8], u[i] = t[i] + t[i+4] (i < 4), then
 *             (u[0] + u[2]) + (u[1] + u[3])
 *   sum16(a)  16 vectors' sums, one per lane: per group of 4 lanes G (lanes 4G..4G+3), S_G = (e0 + e2) + (e1 + e3);
 *             then (S_0 + S_1) + (S_2 + S_3)
 */
#ifndef HB_NATIVE_H
#define HB_NATIVE_H

#include <stdint.h>

typedef struct hb_weights_ {
    int32_t kind;        /* 1: float16 (n, k) row-major; 3: GGUF's Q4_1, 5: GGUF's Q8_0, in tiles (below) */
    int32_t unused;
    int64_t n, k, group;
    const void *w;       /* kind 1: uint16 (n, k); kinds 3, 5: the tiles of codes and scales (below) */
    const uint16_t *sz;  /* unused */
    const float *bias;   /* (n) or NULL */
} hb_weights;

typedef struct {
    const float *norm1, *norm2;
    hb_weights qkv, o, gate_up, down;
    int64_t index;       /* the layer's index in the cache */
    const float *ctx_gate;  /* the micro-step decoder's layers: tanh(gate) per head of the attention to the base's
                               entries of layer ctx_index (`hb_pass.ctx_*`), added to the layer's own; or NULL */
    int64_t ctx_index;
} hb_layer;

typedef struct {
    int64_t b, t, d, heads, kv_heads, head_dim, inner, slots_len;
    float eps, scaling;
    const float *cos, *sin;          /* (b*t, head_dim); sin with its first half negated */
    void *k_cache, *v_cache;         /* float32, or float16 where kv_half; element strides: layer, row, head, slot;
                                        head_dim contiguous */
    int64_t s_layer, s_row, s_head, s_slot;
    const int64_t *slots;            /* (b*t): the cache slot of each row's position */
    const uint8_t *mask;             /* (b, t, slots_len): 1 where a position may attend */
    float *scratch;                  /* hb_scratch_floats(...) floats */
    int64_t copies;                  /* x after layer copy_after[j] (counted from the call's first) into copy_to[j] */
    const int64_t *copy_after;
    float *const *copy_to;
    const void *ctx_k, *ctx_v;       /* the base's cache the layers with a ctx_gate also attend to (NULL: none), of
                                        k_cache's type */
    int64_t c_s_layer, c_s_row, c_s_head, c_s_slot, ctx_len;
    const uint8_t *ctx_mask;         /* (b, ctx_len): 1 where a row may read the base's entry */
    const float *log_k, *merged;     /* compress mode (or NULL): (b, slots_len) log of the tokens an entry merges,
                                        1 where it merges; a score gains merged * (a * log_k + c) */
    const float *bias_a, *bias_c;    /* (layers, heads): the KV merger's a and c of each layer's heads */
    const float *out_norm;           /* the model's final RMSNorm weight (d), or NULL: after the last layer, x's rows
                                        (each row's last position where out_last) normed into `normed` */
    float *normed;                   /* (b, d) where out_last, else (b*t, d) */
    float out_eps;
    int64_t out_last;
    const struct hb_weights_ *head;  /* the LM head (k = d), or NULL: each normed row's greedy token (hb_linear_argmax's)
                                        into head_idx; needs out_norm */
    int64_t *head_idx;
    int64_t kv_half;                 /* 1: the caches hold float16 (the new keys and values rounded to nearest even,
                                        read back exactly), 0: float32 */
} hb_pass;

/* The codes' tiles: 16 outputs by 32 inputs, a tile's blocks one after the other (`hb_tile` makes them). Kind 3:
   4 x 64 bytes of codes, 16-bit word w of part j holding in nibble h output w / 2's input 8j + 2h + w % 2; then 16
   scales and 16 mins, float16. Kind 5: 16 x 32 bytes of codes, part p's byte w output w / 2's input 2p + w % 2;
   then 16 scales, float16. */
#define TB_Q4 320
#define TB_Q8 544
#define T_MT 4  /* rows a codes product takes at once */
/* A row's activations quantized for kinds 3 and 5, per block of 32 inputs: x ~ x16 * dx, dx = max|x| / 32767
   (rounded to nearest even, saturated), int16; stored as the row's k int16 in order, then dx and sum(x) of each
   block (floats): this many bytes a block */
#define XQ_BLOCK 72
/* Kind 7: kind 3's tiles with the activations in 8 bits (x ~ x8 * dx, dx = max|x| / 127, per block of 32, as
   llama.cpp's Q8 blocks): the same bytes a block. Where the variant multiplies bytes (HB_A8_BYTES: AVX-512's
   vpdpbusd) the row's k codes are int8 in the order a tile's nibbles come out in (part j: inputs
   8j + 0 4 1 5 2 6 3 7), else int16 as kind 3's, within -127..127: the same integer sums either way. */
#define MAX_HEAD_DIM 256
#ifndef AHEAD
#define AHEAD 8192  /* bytes of weights prefetched ahead of each row's reads */
#endif

/* hb_isa()'s codes: the variant a library was built as */
#define HB_AVX512_VNNI 512
#define HB_AVX2 256
#define HB_AVX2_VNNI 257
#define HB_NEON 1
#define HB_NEON_DOTPROD 2
#define HB_NEON_I8MM 3

#define INL static inline __attribute__((always_inline))

#endif
