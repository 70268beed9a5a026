/* The engine's native CPU kernels (x86-64 with AVX-512 F, BW and VNNI): weight-only float16, 4-bit and 8-bit matrix
 * products, and a Llama-style decoder layer over the engine's KV cache, every layer of a pass in one call and one
 * OpenMP region. Built for a CPU without those, the library says so (hb_isa() == 0) and is not used.
 *
 * Built on the user's machine at first use (`hamburger/kernels/native.py`: cc -O3 -march=native -fopenmp) and
 * called through ctypes. Activations, accumulation and outputs are float32.
 *
 * Every output is computed the same way however many rows a call has: a row's float16 products are 16-lane partial
 * sums over the input in order, then one fixed reduction; its 4-bit and 8-bit products exact integer sums per block,
 * scaled and added in block order; its attention reads exactly the slots its mask allows, in order. So a row's result does not depend on the other rows of the pass, nor on how many cache slots lie beyond
 * its mask: a verify pass over 4 positions gives each position what a one-position step gives it, bit for bit.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 4   /* float16: output rows per tile */
#define MT 4   /* float16: input rows per tile */
#define MAX_HEAD_DIM 256
#ifndef AHEAD
#define AHEAD 8192  /* bytes of weights prefetched ahead of each row's reads: 1.45x on the default's float16 step */
#endif
#define INL static inline __attribute__((always_inline))

int hb_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 512;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

typedef struct {
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
    float *k_cache, *v_cache;        /* element strides: layer, row, head, slot; head_dim contiguous */
    int64_t s_layer, s_row, s_head, s_slot;
    const int64_t *slots;            /* (b*t): the cache slot of each row's position */
    const uint8_t *mask;             /* (b, t, slots_len): 1 where a position may attend */
    float *scratch;                  /* hb_scratch_floats(...) floats */
    int64_t copies;                  /* x after layer copy_after[j] (counted from the call's first) into copy_to[j] */
    const int64_t *copy_after;
    float *const *copy_to;
    const float *ctx_k, *ctx_v;      /* the base's cache the layers with a ctx_gate also attend to (NULL: none) */
    int64_t c_s_layer, c_s_row, c_s_head, c_s_slot, ctx_len;
    const uint8_t *ctx_mask;         /* (b, ctx_len): 1 where a row may read the base's entry */
    const float *log_k, *merged;     /* compress mode (or NULL): (b, slots_len) log of the tokens an entry merges,
                                        1 where it merges; a score gains merged * (a * log_k + c) */
    const float *bias_a, *bias_c;    /* (layers, heads): the KV merger's a and c of each layer's heads */
} hb_pass;

INL float f16(uint16_t v) { return _cvtsh_ss(v); }

/* the lanes of a loop's last, partial chunk of 16 */
INL __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

/* --- matrix products: y (m, n) = x (m, k) . w^T (+ bias). Orphaned `omp for`: inside a parallel region the
   threads split the output rows; outside one, the caller's thread does all. --------------------------------- */

INL void fp16_tile(const float *x, const uint16_t *w, float *y, int64_t k, int64_t ldy, const int mt) {
    __m512 acc[MT][NB];
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < NB; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        __m512 wv[NB];
        if ((i & 31) == 0)  /* a cache line of each row: the hardware's prefetchers alone leave half the bandwidth */
            for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(w + j * k + i) + AHEAD, _MM_HINT_T0);
        for (int j = 0; j < NB; j++) wv[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + j * k + i)));
        for (int m = 0; m < mt; m++) {
            __m512 xv = _mm512_loadu_ps(x + m * k + i);
            for (int j = 0; j < NB; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < NB; j++) y[m * ldy + j] = _mm512_reduce_add_ps(acc[m][j]);
}

/* kinds 3 (GGUF's Q4_1) and 5 (Q8_0): the activations quantized per block of 32 to int16 (x ~ x16 * dx, dx =
   max|x| / 32767; about 3e-5 of a product off its float value, llama.cpp's int8 blocks 1e-2), each block's
   product with 16 outputs' codes summed exactly in int32 (vpdpwssd, the row's input pairs broadcast), then
   scaled in float: per row, block and 16 outputs one conversion, a product and one fused multiply-add (Q4_1: and
   min * sum(x)). The codes are unpacked once for all the rows of a tile, so a row more costs little beside the
   weights' bytes. A row's activations: its k int16 in order, then dx and sum(x) of each block (floats).

   The weights lie in tiles of 16 outputs by 32 inputs (`TB_Q4` / `TB_Q8` bytes), a tile's blocks one after the
   other (`hb_tile` makes them). Kind 3: 4 x 64 bytes of codes, 16-bit word w of part j holding
   in nibble h output w / 2's input 8j + 2h + w % 2; then 16 scales and 16 mins, float16. Kind 5: 16 x 32 bytes of
   codes, part p's byte w output w / 2's input 2p + w % 2; then 16 scales, float16. */
#define TB_Q4 320
#define TB_Q8 544
#define TW 2    /* tiles of 16 outputs a call takes side by side */
#define T_MT 4  /* rows a call takes */
#define XQ_BLOCK 72  /* bytes of a row's quantized activations per block of 32 inputs */

static void quantize_rows16(const float *x, int64_t rows, int64_t k, uint8_t *out) {
    const int64_t blocks = k / 32;
    for (int64_t m = 0; m < rows; m++) {
        int16_t *xs = (int16_t *)(out + m * blocks * XQ_BLOCK);
        float *dx = (float *)(xs + k), *sx = dx + blocks;
        for (int64_t b = 0; b < blocks; b++) {
            const __m512 a = _mm512_loadu_ps(x + m * k + 32 * b), c = _mm512_loadu_ps(x + m * k + 32 * b + 16);
            const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
            dx[b] = top / 32767.0f;
            sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
            const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
            _mm256_storeu_si256((__m256i *)(xs + 32 * b),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
            _mm256_storeu_si256((__m256i *)(xs + 32 * b + 16),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(c, inv))));
        }
    }
}

/* part j of a block's codes as int16, 4 vectors of 16 outputs' input pairs (one pair per 32-bit lane) */
INL void unpack_part(const uint8_t *c, int j, int q4, __m512i *w) {
    if (q4) {
        const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * j)), nib = _mm512_set1_epi16(0x0F);
        w[0] = _mm512_and_si512(v, nib);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        w[2] = _mm512_and_si512(_mm512_srli_epi16(v, 8), nib);
        w[3] = _mm512_srli_epi16(v, 12);
    } else
        for (int h = 0; h < 4; h++) w[h] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(c + 32 * (4 * j + h))));
}

/* y[m, 16t + l] for mt rows and tw tiles of 16 outputs (`wt`: the first tile's blocks) */
INL void codes_tile(const uint8_t *xq, const uint8_t *wt, float *y, int64_t k, int64_t ldy, int64_t cols,
                    const int mt, const int tw, const int q4) {
    const int64_t blocks = k / 32, tb = q4 ? TB_Q4 : TB_Q8, xrow = blocks * XQ_BLOCK;
    __m512 f[T_MT][TW];
    for (int m = 0; m < mt; m++)
        for (int t = 0; t < tw; t++) f[m][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc[T_MT][TW][2];  /* two sums a tile and row: half the chain of dependent products */
        for (int m = 0; m < mt; m++)
            for (int t = 0; t < tw; t++) acc[m][t][0] = acc[m][t][1] = _mm512_setzero_si512();
        for (int t = 0; t < tw; t++)
            for (int64_t l = 0; l < tb; l += 64)
                _mm_prefetch((const char *)(wt + (t * blocks + b) * tb + l) + AHEAD, _MM_HINT_T0);
        for (int j = 0; j < 4; j++) {
            __m512i w[TW][4];
            for (int t = 0; t < tw; t++) unpack_part(wt + (t * blocks + b) * tb, j, q4, w[t]);
            for (int m = 0; m < mt; m++) {
                const int32_t *pairs = (const int32_t *)(xq + m * xrow) + 16 * b + 4 * j;
                for (int h = 0; h < 4; h++) {
                    const __m512i xb = _mm512_set1_epi32(pairs[h]);
                    for (int t = 0; t < tw; t++) acc[m][t][h & 1] = _mm512_dpwssd_epi32(acc[m][t][h & 1], w[t][h], xb);
                }
            }
        }
        for (int t = 0; t < tw; t++) {
            const __m256i *s = (const __m256i *)(wt + (t * blocks + b) * tb + (q4 ? 256 : 512));
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(s));
            const __m512 low = q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(s + 1)) : scale;
            for (int m = 0; m < mt; m++) {
                const float *dx = (const float *)(xq + m * xrow + 2 * k);
                const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[m][t][0], acc[m][t][1]));
                f[m][t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(scale, _mm512_set1_ps(dx[b])), f[m][t]);
                if (q4) f[m][t] = _mm512_fmadd_ps(low, _mm512_set1_ps(dx[blocks + b]), f[m][t]);
            }
        }
    }
    for (int m = 0; m < mt; m++)
        for (int t = 0; t < tw; t++) _mm512_mask_storeu_ps(y + m * ldy + 16 * t, lanes(cols - 16 * t), f[m][t]);
}

/* rows in tiles of MT (or T_MT) and a last partial one */
#define TILES(MT, CALL)                               \
    int64_t r = 0;                                    \
    for (; r + MT <= rows; r += MT) CALL(MT);         \
    switch (rows - r) {                               \
        case 3: CALL(3); break;                       \
        case 2: CALL(2); break;                       \
        case 1: CALL(1); break;                       \
    }

INL int int16_activations(int32_t kind) { return kind == 3 || kind == 5; }

/* kinds 3 and 5 need `xq`: hb_quantized_bytes(rows, k) bytes, filled here (by one thread) */
static void gemm_for(const float *x, const hb_weights *w, float *y, int64_t rows, uint8_t *xq) {
    const int64_t n = w->n, k = w->k;
    if (int16_activations(w->kind)) {
        const int q4 = w->kind == 3;
        const int64_t tb = q4 ? TB_Q4 : TB_Q8, xrow = (k / 32) * XQ_BLOCK, groups = (n + 16 * TW - 1) / (16 * TW);
        #pragma omp single
        quantize_rows16(x, rows, k, xq);
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wt = (const uint8_t *)w->w + g * TW * (k / 32) * tb;
            float *yg = y + g * 16 * TW;
            const int64_t width = n - g * 16 * TW < 16 * TW ? n - g * 16 * TW : 16 * TW;  /* the last: what is left */
            /* each branch with its tile's shape a constant */
#define Q4_WIDE(mt) codes_tile(xq + r * xrow, wt, yg + r * n, k, n, width, mt, TW, 1)
#define Q4_ONE(mt) codes_tile(xq + r * xrow, wt, yg + r * n, k, n, width, mt, 1, 1)
#define Q8_WIDE(mt) codes_tile(xq + r * xrow, wt, yg + r * n, k, n, width, mt, TW, 0)
#define Q8_ONE(mt) codes_tile(xq + r * xrow, wt, yg + r * n, k, n, width, mt, 1, 0)
            if (q4 && width > 16) { TILES(T_MT, Q4_WIDE) }
            else if (q4) { TILES(T_MT, Q4_ONE) }
            else if (width > 16) { TILES(T_MT, Q8_WIDE) }
            else { TILES(T_MT, Q8_ONE) }
#undef Q4_WIDE
#undef Q4_ONE
#undef Q8_WIDE
#undef Q8_ONE
            if (w->bias)
                for (int64_t i = 0; i < rows; i++)
                    for (int64_t j = 0; j < width; j++) yg[i * n + j] += w->bias[g * 16 * TW + j];
        }
        return;
    }
    const int64_t blocks = n / NB;
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t col = b * NB;
        const uint16_t *wb = (const uint16_t *)w->w + col * k;
#define FP16(mt) fp16_tile(x + r * k, wb, y + r * n + col, k, n, mt)
        TILES(MT, FP16)
#undef FP16
        if (w->bias)
            for (int64_t i = 0; i < rows; i++)
                for (int j = 0; j < NB; j++) y[i * n + col + j] += w->bias[col + j];
    }
}

int64_t hb_quantized_bytes(int64_t rows, int64_t k) { return rows * (k / 32) * XQ_BLOCK; }

/* Returns 0, or -1 if the quantized activations' memory could not be had. */
int hb_linear(const float *x, const hb_weights *w, float *y, int64_t rows) {
    uint8_t *xq = NULL;
    if (int16_activations(w->kind) && (xq = aligned_alloc(64, (size_t)hb_quantized_bytes(rows, w->k) + 64)) == NULL)
        return -1;
    #pragma omp parallel
    gemm_for(x, w, y, rows, xq);
    free(xq);
    return 0;
}

/* --- the codes: GGUF's blocks (what `qcodes.q4_1_weights` / `q8_0_weights` compute, bit for bit: the default's
   211 layers in ~0.05 s instead of ~0.8), and the tiles the products read. Quantizing returns -1 if a weight is
   beyond float16's range (its scale or min would not be finite), else 0. --------------------------------------- */

INL float half_round(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }

/* w (n, k) -> q (n, k) codes 0..15, float16 scale and min (n, k/group): w ~ q * scale + min */
int hb_quantize_q4_1(const float *w, int64_t n, int64_t k, int64_t group, uint8_t *q, uint16_t *scales,
                     uint16_t *mins) {
    int bad = 0;
    #pragma omp parallel for schedule(static) reduction(|: bad)
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < k / group; g++) {
            const float *x = w + r * k + g * group;
            float lo = x[0], hi = x[0];
            for (int64_t i = 1; i < group; i++) {
                lo = x[i] < lo ? x[i] : lo;
                hi = x[i] > hi ? x[i] : hi;
            }
            bad |= !(lo >= -65504.0f && hi <= 65504.0f);
            const float scale = half_round((hi - lo) / 15.0f), low = half_round(lo);
            const float step = scale > 0.0f ? scale : 1.0f;
            scales[r * (k / group) + g] = _cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT);
            mins[r * (k / group) + g] = _cvtss_sh(low, _MM_FROUND_TO_NEAREST_INT);
            for (int64_t i = 0; i < group; i++) {
                const float c = scale > 0.0f ? nearbyintf((x[i] - low) / step) : 0.0f;
                q[r * k + g * group + i] = (uint8_t)(c < 0.0f ? 0.0f : (c > 15.0f ? 15.0f : c));
            }
        }
    return bad ? -1 : 0;
}

/* w (n, k) -> q (n, k) codes -127..127, float16 scales (n, k/32): w ~ q * scale */
int hb_quantize_q8_0(const float *w, int64_t n, int64_t k, int8_t *q, uint16_t *scales) {
    int bad = 0;
    #pragma omp parallel for schedule(static) reduction(|: bad)
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < k / 32; b++) {
            const float *x = w + r * k + b * 32;
            float top = 0.0f;
            for (int i = 0; i < 32; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
            bad |= !(top <= 65504.0f);
            const float scale = half_round(top / 127.0f), step = scale > 0.0f ? scale : 1.0f;
            scales[r * (k / 32) + b] = _cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT);
            for (int i = 0; i < 32; i++) {
                const float c = nearbyintf(x[i] / step);
                q[r * k + b * 32 + i] = (int8_t)(c < -127.0f ? -127.0f : (c > 127.0f ? 127.0f : c));
            }
        }
    return bad ? -1 : 0;
}

/* q (n, k) codes, scales (and mins) (n, k/group) float16 -> the tiles (ceil(n / 16) of them, `out` zeroed: the
   last tile's missing outputs stay zero and are never stored): kind 3's where there are mins (codes 0..15), else
   kind 5's (codes -127..127 as bytes, group 32) */
void hb_tile(const uint8_t *q, const uint16_t *scales, const uint16_t *mins, int64_t n, int64_t k, int64_t group,
             uint8_t *out) {
    const int64_t blocks = k / 32, tb = mins != NULL ? TB_Q4 : TB_Q8;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const int64_t l = r % 16;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *t = out + ((r / 16) * blocks + b) * tb;
            const uint8_t *c = q + r * k + 32 * b;
            if (mins != NULL) {
                for (int j = 0; j < 4; j++)
                    for (int e = 0; e < 2; e++) {
                        const int i = 8 * j + e;  /* nibble h of the word: input i + 2h */
                        t[64 * j + 2 * (2 * l + e)] = (uint8_t)(c[i] | c[i + 2] << 4);
                        t[64 * j + 2 * (2 * l + e) + 1] = (uint8_t)(c[i + 4] | c[i + 6] << 4);
                    }
                memcpy(t + 288 + 2 * l, mins + r * (k / group) + (32 * b) / group, 2);
            } else
                for (int i = 0; i < 32; i++) t[32 * (i / 2) + 2 * l + i % 2] = c[i];
            memcpy(t + (mins != NULL ? 256 : 512) + 2 * l, scales + r * (k / group) + (32 * b) / group, 2);
        }
    }
}

/* --- the decoder layer ------------------------------------------------------------------------------------ */

INL float dot(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}

/* e^x for 16 floats (Cephes' expf polynomial: x = n ln2 + r, e^r to about 1 ulp, times 2^n by vscalefps); every
   lane alike, so a value's exponential does not depend on its lane. Below -104 it gives 0 or a denormal. */
INL __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 poly = _mm512_set1_ps(1.9875691500e-4f);
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.3981999507e-3f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073e-3f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894e-2f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459e-1f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201e-1f));
    poly = _mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(poly, n);
}


/* out = x / sqrt(mean(x^2) + eps) * weight */
static void rms_norm(const float *x, const float *weight, float *out, int64_t d, float eps) {
    float r = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (int64_t i = 0; i < d; i++) out[i] = x[i] * r * weight[i];
}

/* x * cos + roll(x, half) * sin_signed, as the engine's fast layers rotate */
static void rotate(const float *x, const float *cos, const float *sin, float *out, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < hd; i++) out[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
}

/* The sums of 16 vectors' lanes, one per lane of the result (lane i: the sum of a[i]'s 16 lanes), each summed in the
   same order whatever its place among the 16: ((0+2)+(1+3)) within each 128-bit lane, then the lanes pairwise. */
INL __m512 sum16(const __m512 *a) {
    __m512 x[8], z[4];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++)
        z[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One head's attention for one query q (hd floats, rotated) over slots [0, S) of its keys and values (slot stride
   `ss`), where `allowed`: softmax(q.k * scaling) . v into out (zeros where no slot is allowed). Scores go 16 slots
   at a time (`sum16`; slots past S count as zeros), so a slot's score, and with it the result, does not depend on
   S or on the slot's place in its block: a verify pass's row equals the one-position step. */
static void attend_head(const float *q, const float *keys, const float *values, int64_t ss, const uint8_t *allowed,
                        int64_t S, int64_t hd, float scaling, const float *log_k, const float *merged, float a,
                        float c, float *scores, float *out) {
    const int64_t chunks = hd / 16;
    __m512 qv[MAX_HEAD_DIM / 16], o[MAX_HEAD_DIM / 16];
    for (int64_t c = 0; c < chunks; c++) {
        qv[c] = _mm512_loadu_ps(q + 16 * c);
        o[c] = _mm512_setzero_ps();
    }
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s0 = 0; s0 < S; s0 += 16) {
        const __m128i flags = _mm_maskz_loadu_epi8(lanes(S - s0), allowed + s0);
        const __mmask16 m = _mm_test_epi8_mask(flags, flags);
        if (m == 0) {  /* no slot of the block allowed (the micro-step decoder's window of the base's entries) */
            _mm512_mask_storeu_ps(scores + s0, lanes(S - s0), _mm512_set1_ps(-INFINITY));
            continue;
        }
        __m512 acc[16];
        for (int64_t i = 0; i < 16; i++) {
            acc[i] = _mm512_setzero_ps();
            if (s0 + i < S)
                for (int64_t c = 0; c < chunks; c++)
                    acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(keys + (s0 + i) * ss + 16 * c), acc[i]);
        }
        __m512 raw = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scaling));
        if (log_k != NULL) {  /* compress mode: the merger's bias on merged entries */
            const __m512 lk = _mm512_maskz_loadu_ps(lanes(S - s0), log_k + s0);
            const __m512 on = _mm512_maskz_loadu_ps(lanes(S - s0), merged + s0);
            raw = _mm512_add_ps(raw, _mm512_mul_ps(_mm512_fmadd_ps(_mm512_set1_ps(a), lk, _mm512_set1_ps(c)), on));
        }
        const __m512 sc = _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), raw);
        top = _mm512_max_ps(top, sc);
        _mm512_mask_storeu_ps(scores + s0, lanes(S - s0), sc);
    }
    const float best = _mm512_reduce_max_ps(top);
    float total = 0.0f;
    if (best > -INFINITY) {
        const __m512 shift = _mm512_set1_ps(best);
        for (int64_t s = 0; s < S; s += 16) {  /* each exponential alike in any lane: the same for any S */
            const __mmask16 m = lanes(S - s);
            _mm512_mask_storeu_ps(scores + s, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + s), shift)));
        }
        for (int64_t s = 0; s < S; s++) {
            if (!allowed[s]) continue;
            const float e = scores[s];
            const __m512 ev = _mm512_set1_ps(e);
            total += e;
            for (int64_t c = 0; c < chunks; c++)
                o[c] = _mm512_fmadd_ps(ev, _mm512_loadu_ps(values + s * ss + 16 * c), o[c]);
        }
    }
    const __m512 by = _mm512_set1_ps(total > 0.0f ? total : 1.0f);  /* no slot allowed: zeros */
    for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(out + 16 * c, _mm512_div_ps(o[c], by));
}

/* floats of scratch `hb_layers` needs for a pass of `rows` rows */
int64_t hb_scratch_floats(int64_t rows, int64_t d, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inner) {
    return rows * (2 * d + (2 * heads + 2 * kv_heads) * head_dim + 3 * inner);
}

static void layer(const hb_layer *L, const hb_pass *p, float *x, float *h, float *qkv, float *att, float *tmp,
                  float *gu, float *act, float *scores, uint8_t *xq) {
    const int64_t rows = p->b * p->t, d = p->d, hd = p->head_dim, H = p->heads, KV = p->kv_heads;
    const int64_t width = (H + 2 * KV) * hd, group = H / KV, inner = p->inner, S = p->slots_len;
    float *kc = p->k_cache + L->index * p->s_layer, *vc = p->v_cache + L->index * p->s_layer;

    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * d, L->norm1, h + r * d, d, p->eps);
    gemm_for(h, &L->qkv, qkv, rows, xq);
    /* keys rotated and values, written to their cache slots */
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * KV; i++) {
        const int64_t r = i / KV, kh = i % KV, row = r / p->t;
        const float *src = qkv + r * width + (H + kh) * hd;
        float *kd = kc + row * p->s_row + kh * p->s_head + p->slots[r] * p->s_slot;
        float *vd = vc + row * p->s_row + kh * p->s_head + p->slots[r] * p->s_slot;
        rotate(src, p->cos + r * hd, p->sin + r * hd, kd, hd);
        memcpy(vd, src + KV * hd, hd * sizeof(float));
    }
    /* attention: each (row, head) over the slots its mask allows */
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * H; i++) {
        const int64_t r = i / H, head = i % H, row = r / p->t, kh = head / group;
        float q[MAX_HEAD_DIM];
        rotate(qkv + r * width + head * hd, p->cos + r * hd, p->sin + r * hd, q, hd);
        float *out = att + r * H * hd + head * hd;
        const int64_t coef = L->index * H + head;
        attend_head(q, kc + row * p->s_row + kh * p->s_head, vc + row * p->s_row + kh * p->s_head, p->s_slot,
                    p->mask + r * S, S, hd, p->scaling, p->log_k == NULL ? NULL : p->log_k + row * S,
                    p->log_k == NULL ? NULL : p->merged + row * S, p->log_k == NULL ? 0.0f : p->bias_a[coef],
                    p->log_k == NULL ? 0.0f : p->bias_c[coef], scores, out);
        if (L->ctx_gate != NULL && p->ctx_k != NULL && p->ctx_len > 0) {  /* o + tanh(g) * (o over the base's) */
            float oc[MAX_HEAD_DIM];
            const int64_t at = L->ctx_index * p->c_s_layer + row * p->c_s_row + kh * p->c_s_head;
            attend_head(q, p->ctx_k + at, p->ctx_v + at, p->c_s_slot, p->ctx_mask + row * p->ctx_len, p->ctx_len, hd,
                        p->scaling, NULL, NULL, 0.0f, 0.0f, scores, oc);
            const __m512 g = _mm512_set1_ps(L->ctx_gate[head]);
            for (int64_t c = 0; c < hd; c += 16)
                _mm512_storeu_ps(out + c, _mm512_fmadd_ps(g, _mm512_loadu_ps(oc + c), _mm512_loadu_ps(out + c)));
        }
    }
    gemm_for(att, &L->o, tmp, rows, xq);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < d; j++) x[r * d + j] += tmp[r * d + j];
        rms_norm(x + r * d, L->norm2, h + r * d, d, p->eps);
    }
    gemm_for(h, &L->gate_up, gu, rows, xq);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < inner; j += 16) {  /* silu(gate) * up */
            const __mmask16 m = lanes(inner - j);
            const __m512 g = _mm512_maskz_loadu_ps(m, gu + r * 2 * inner + j);
            const __m512 up = _mm512_maskz_loadu_ps(m, gu + r * 2 * inner + inner + j);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_mask_storeu_ps(act + r * inner + j, m, _mm512_mul_ps(silu, up));
        }
    gemm_for(act, &L->down, tmp, rows, xq);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < d; j++) x[r * d + j] += tmp[r * d + j];
}

/* Layers[0..count) over x (b*t, d), in place. Returns 0, or -1 if memory for the scores or the quantized
   activations could not be had. */
int hb_layers(const hb_layer *layers, int64_t count, const hb_pass *p, float *x) {
    const int64_t rows = p->b * p->t, d = p->d, hd = p->head_dim;
    const int64_t width = (p->heads + 2 * p->kv_heads) * hd, inner = p->inner;
    float *h = p->scratch, *qkv = h + rows * d, *att = qkv + rows * width, *tmp = att + rows * p->heads * hd;
    float *gu = tmp + rows * d, *act = gu + rows * 2 * inner;
    int64_t widest = p->d > inner ? p->d : inner;
    if (p->heads * hd > widest) widest = p->heads * hd;
    uint8_t *xq = aligned_alloc(64, (size_t)hb_quantized_bytes(rows, widest + 63));
    if (xq == NULL) return -1;
    int failed = 0;
    #pragma omp parallel
    {
        const int64_t most = p->ctx_k != NULL && p->ctx_len > p->slots_len ? p->ctx_len : p->slots_len;
        float *scores = malloc((size_t)(most + 16) * sizeof(float));
        int ok = scores != NULL;
        #pragma omp atomic
        failed += !ok;
        #pragma omp barrier
        if (!failed)
            for (int64_t i = 0; i < count; i++) {
                layer(&layers[i], p, x, h, qkv, att, tmp, gu, act, scores, xq);
                for (int64_t j = 0; j < p->copies; j++)  /* the features a pass keeps, without a call per stop */
                    if (p->copy_after[j] == i + 1) {
                        #pragma omp for schedule(static)
                        for (int64_t r = 0; r < rows; r++) memcpy(p->copy_to[j] + r * d, x + r * d, d * sizeof(float));
                    }
            }
        free(scores);
    }
    free(xq);
    return failed ? -1 : 0;
}

#else  /* no AVX-512: the library says so (hb_isa() == 0) and Python does not use it */
int64_t hb_scratch_floats(int64_t rows, int64_t d, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inner) {
    return 0;
}
#endif
