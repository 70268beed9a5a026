/* The engine's native CPU kernels: weight-only float16, 4-bit and 8-bit matrix products, and a Llama-style decoder
 * layer over the engine's KV cache, every layer of a pass in one call and one OpenMP region.
 *
 * Built on the user's machine at first use (`hamburger/kernels/native.py`: cc -O3 -march=native -fopenmp, or a
 * variant's own flags) and called through ctypes. Activations, accumulation and outputs are float32. One variant a
 * build, by the instruction sets the compiler targets: x86-64 with AVX-512 F, BW and VNNI (`native_avx512.h`);
 * x86-64 with AVX2, FMA and F16C, AVX-VNNI where there (`native_avx2.h`); aarch64 with NEON, the dot-product and
 * i8mm extensions where there (`native_neon.h`). Built for none of those, hb_isa() is 0 and Python does not use it.
 *
 * Every output is computed the same way however many rows a call has, and by every variant alike (native.h says
 * how): a row's float16 products are 16-lane partial sums over the input in order, then one fixed reduction; its
 * 4-bit and 8-bit products exact integer sums per block, scaled and added in block order; its attention reads
 * exactly the slots its mask allows, in order. So a row's result does not depend on the other rows of the pass,
 * nor on how many cache slots lie beyond its mask: a verify pass over 4 positions gives each position what a
 * one-position step gives it, bit for bit; and the variants give the same bits.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "native.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(HB_NO_AVX512)
#include "native_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "native_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "native_neon.h"
#endif

#ifdef HB_ISA

int hb_isa(void) { return HB_ISA; }

#define HB_MIN(a, b) ((a) < (b) ? (a) : (b))

/* --- matrix products: y (m, n) = x (m, k) . w^T (+ bias). Orphaned `omp for`: inside a parallel region the
   threads split the output rows; outside one, the caller's thread does all. --------------------------------- */

/* kinds 3 (GGUF's Q4_1) and 5 (Q8_0): the activations quantized per block of 32 to int16 (native.h's XQ_BLOCK;
   about 3e-5 of a product off its float value, llama.cpp's int8 blocks 1e-2), each block's product with 16
   outputs' codes summed exactly in int32 (the variant's `codes_tile`), then scaled in float: per row, block and 16
   outputs sum * (scale * dx) + f as one fused multiply-add (Q4_1: and then min * sum(x) + f, fused). The codes are
   unpacked once for all the rows of a tile, so a row more costs little beside the weights' bytes. */
static void quantize_rows16(const float *x, int64_t rows, int64_t k, uint8_t *out, const int a8) {
    const int64_t blocks = k / 32;
    const float limit = a8 ? 127.0f : 32767.0f;  /* kind 7: 8-bit codes (native.h) */
    for (int64_t m = 0; m < rows; m++) {
        int16_t *xs = (int16_t *)(out + m * blocks * XQ_BLOCK);
        float *dx = (float *)(xs + k), *sx = dx + blocks;
        for (int64_t b = 0; b < blocks; b++) {
            const vf a = vf_load(x + m * k + 32 * b), c = vf_load(x + m * k + 32 * b + 16);
            const float top = hmax(vf_max(vf_abs(a), vf_abs(c)));
            dx[b] = top / limit;
            sx[b] = hsum(vf_add(a, c));
            const vf inv = vf_set1(top > 0.0f ? limit / top : 0.0f);
            vf_store_i16(xs + 32 * b, vf_mul(a, inv));
            vf_store_i16(xs + 32 * b + 16, vf_mul(c, inv));
        }
#ifdef HB_A8_BYTES
        if (a8) {  /* the int16 codes (within -127..127) as bytes, in the tiles' nibble order, in place */
            static const int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};
            int8_t *bytes = (int8_t *)xs;
            for (int64_t b = 0; b < blocks; b++) {
                int16_t block[32];
                memcpy(block, xs + 32 * b, sizeof block);
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 8; i++) bytes[32 * b + 8 * j + i] = (int8_t)block[8 * j + order[i]];
            }
        }
#endif
    }
}

/* rows in tiles of MT (or T_MT) and a last partial one */
#define TILES(MT, CALL)                               \
    int64_t r = 0;                                    \
    for (; r + MT <= rows; r += MT) CALL(MT);         \
    switch (rows - r) {                               \
        case 3: CALL(HB_MIN(3, MT)); break;           \
        case 2: CALL(HB_MIN(2, MT)); break;           \
        case 1: CALL(1); break;                       \
    }

INL int int16_activations(int32_t kind) { return kind == 3 || kind == 5 || kind == 7; }  /* (7: 8-bit codes) */

/* kinds 3, 5 and 7 need `xq`: hb_quantized_bytes(rows, k) bytes, filled here (by one thread) */
static void gemm_for(const float *x, const hb_weights *w, float *y, int64_t rows, uint8_t *xq) {
    const int64_t n = w->n, k = w->k;
    if (int16_activations(w->kind)) {
        const int q4 = w->kind == 3 || w->kind == 7, a8 = w->kind == 7;
        const int64_t tb = q4 ? TB_Q4 : TB_Q8, xrow = (k / 32) * XQ_BLOCK, groups = (n + 16 * TW - 1) / (16 * TW);
        #pragma omp single
        quantize_rows16(x, rows, k, xq, a8);
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
#define A8_WIDE(mt) codes_tile(xq + r * xrow, wt, yg + r * n, k, n, width, mt, TW, 2)
#define A8_ONE(mt) codes_tile(xq + r * xrow, wt, yg + r * n, k, n, width, mt, 1, 2)
#ifdef HB_A8_BYTES
            if (a8 && width > 16) { TILES(T_MT, A8_WIDE) }  /* q4 = 2: kind 7's bytes (elsewhere kind 3's code) */
            else if (a8) { TILES(T_MT, A8_ONE) }
            else
#endif
            if (q4 && width > 16) { TILES(T_MT, Q4_WIDE) }
            else if (q4) { TILES(T_MT, Q4_ONE) }
            else if (width > 16) { TILES(T_MT, Q8_WIDE) }
            else { TILES(T_MT, Q8_ONE) }
#undef Q4_WIDE
#undef Q4_ONE
#undef Q8_WIDE
#undef Q8_ONE
#undef A8_WIDE
#undef A8_ONE
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

/* Whether v goes before best as a row's largest output: larger, or the first NaN (NaN counts as the largest). */
INL int beats(float v, float best) { return v > best || (v != v && best == best); }

/* Each row's largest output of x (rows, k) . w^T (+ bias) into idx (rows,): the first of equal ones, the first NaN
   before any number (`torch.max(-1).indices` of hb_linear's y, bit for bit: the same products), without handing
   the products back: greedy decoding's LM head. Called by every thread of a parallel region, with y (rows * n
   floats), best and at (rows a thread) and xq as `argmax_memory` sizes them: each thread finds the best of its
   share of the outputs, one thread then takes the shares in order. */
static void argmax_for(const float *x, const hb_weights *w, int64_t rows, int64_t *idx, float *y, float *best,
                       int64_t *at, uint8_t *xq) {
    const int64_t n = w->n;
    gemm_for(x, w, y, rows, xq);  /* ends at a barrier: every output is there */
#ifdef _OPENMP
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int t = 0, threads = 1;
#endif
    const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
    for (int64_t r = 0; r < rows; r++) {
        const float *yr = y + r * n;
        /* the largest value, 16 lanes apart (the compiler's vector max, no chain of dependent compares)... */
        float lane[16], m = -INFINITY;
        int nan = 0;
        for (int l = 0; l < 16; l++) lane[l] = -INFINITY;
        int64_t j = lo;
        for (; j + 16 <= hi; j += 16)
            for (int l = 0; l < 16; l++) {
                lane[l] = yr[j + l] > lane[l] ? yr[j + l] : lane[l];
                nan |= yr[j + l] != yr[j + l];
            }
        for (; j < hi; j++) {
            m = yr[j] > m ? yr[j] : m;
            nan |= yr[j] != yr[j];
        }
        for (int l = 0; l < 16; l++) m = lane[l] > m ? lane[l] : m;
        /* ...then the first output that holds it (or the first NaN), 16 at a time until a block has it */
        int64_t first = hi;
        for (j = lo; j < hi && first == hi; j += 16) {
            const int64_t end = j + 16 < hi ? j + 16 : hi;
            int hit = 0;
            for (int64_t i = j; i < end; i++) hit |= nan ? yr[i] != yr[i] : yr[i] == m;
            if (hit)
                for (int64_t i = j; i < end; i++)
                    if (nan ? yr[i] != yr[i] : yr[i] == m) { first = i; break; }
        }
        best[t * rows + r] = first < hi ? yr[first] : NAN;
        at[t * rows + r] = first < hi ? first : -1;
    }
    #pragma omp barrier
    #pragma omp single
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = -1;
        float v = 0.0f;
        for (int s = 0; s < threads; s++)  /* in order: a later share wins only by beating the earlier */
            if (at[s * rows + r] >= 0 && (i < 0 || beats(best[s * rows + r], v))) {
                i = at[s * rows + r];
                v = best[s * rows + r];
            }
        idx[r] = i;
    }
}

/* argmax_for's outputs and the threads' bests (xq apart). Returns 0, or -1 (nothing left allocated). */
static int argmax_memory(int64_t rows, int64_t n, float **y, float **best, int64_t **at) {
#ifdef _OPENMP
    const int most = omp_get_max_threads();
#else
    const int most = 1;
#endif
    *y = aligned_alloc(64, (size_t)(rows * n * sizeof(float) + 64));
    *best = malloc(sizeof(float) * most * rows);
    *at = malloc(sizeof(int64_t) * most * rows);
    if (*y == NULL || *best == NULL || *at == NULL) {
        free(*y), free(*best), free(*at);
        return -1;
    }
    return 0;
}

/* argmax_for in a call of its own. Returns 0, or -1 if memory could not be had. */
int hb_linear_argmax(const float *x, const hb_weights *w, int64_t rows, int64_t *idx) {
    float *y, *best;
    int64_t *at;
    if (argmax_memory(rows, w->n, &y, &best, &at)) return -1;
    uint8_t *xq = NULL;
    if (int16_activations(w->kind) && (xq = aligned_alloc(64, (size_t)hb_quantized_bytes(rows, w->k) + 64)) == NULL) {
        free(y), free(best), free(at);
        return -1;
    }
    #pragma omp parallel
    argmax_for(x, w, rows, idx, y, best, at, xq);
    free(y), free(best), free(at), free(xq);
    return 0;
}

/* --- the codes: GGUF's blocks (what `qcodes.q4_1_weights` / `q8_0_weights` compute, bit for bit: the default's
   211 layers in ~0.05 s instead of ~0.8), and the tiles the products read. Quantizing returns -1 if a weight is
   beyond float16's range (its scale or min would not be finite), else 0. --------------------------------------- */

INL float half_round(float x) { return hb_h2f(hb_f2h(x)); }

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
            scales[r * (k / group) + g] = hb_f2h(scale);
            mins[r * (k / group) + g] = hb_f2h(low);
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
            scales[r * (k / 32) + b] = hb_f2h(scale);
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
    vf acc = vf_zero();
    for (int64_t i = 0; i < n; i += 16) acc = vf_fma(vf_load(a + i), vf_load(b + i), acc);
    return hsum(acc);
}

/* e^x for 16 floats (Cephes' expf polynomial: x = n ln2 + r, e^r to about 1 ulp, times 2^n as two exact powers of
   two, so one rounding); every lane alike, so a value's exponential does not depend on its lane. Below -104 it
   gives 0 or a denormal. */
INL vf exp16(vf x) {
    x = vf_min(vf_max(x, vf_set1(-104.0f)), vf_set1(88.7f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnma(n, vf_set1(0.693359375f), x);
    r = vf_fnma(n, vf_set1(-2.12194440e-4f), r);
    vf poly = vf_set1(1.9875691500e-4f);
    poly = vf_fma(poly, r, vf_set1(1.3981999507e-3f));
    poly = vf_fma(poly, r, vf_set1(8.3334519073e-3f));
    poly = vf_fma(poly, r, vf_set1(4.1665795894e-2f));
    poly = vf_fma(poly, r, vf_set1(1.6666665459e-1f));
    poly = vf_fma(poly, r, vf_set1(5.0000001201e-1f));
    poly = vf_fma(poly, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    const vf half = vf_round(vf_mul(n, vf_set1(0.5f)));  /* n in [-150, 128]: both parts in [-75, 64] */
    return vf_mul(vf_mul(poly, vf_pow2(half)), vf_pow2(vf_sub(n, half)));
}

/* out = x / sqrt(mean(x^2) + eps) * weight */
static void rms_norm(const float *x, const float *weight, float *out, int64_t d, float eps) {
    float r = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (int64_t i = 0; i < d; i++) out[i] = x[i] * r * weight[i];
}

/* x * cos + roll(x, half) * sin_signed: rotate_half(x) * sin with only the signs moved */
static void rotate(const float *x, const float *cos, const float *sin, float *out, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < hd; i++) out[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
}

/* 16 of a cache's values from element i on: float32, or float16 widened (exactly) */
INL vf kv_load(const void *p, int64_t i, const int half) {
    return half ? vf_load_h((const uint16_t *)p + i) : vf_load((const float *)p + i);
}

/* One head's attention for one query q (hd floats, rotated) over slots [0, S) of its keys and values (slot stride
   `ss` elements; float16 where `half`), where `allowed`: softmax(q.k * scaling) . v into out (zeros where no slot is
   allowed). Scores go 16 slots at a time (`sum16`; slots past S count as zeros), so a slot's score, and with it the
   result, does not depend on S or on the slot's place in its block: a verify pass's row equals the one-position
   step. */
INL void attend_any(const float *q, const void *keys, const void *values, int64_t ss, const uint8_t *allowed,
                    int64_t S, int64_t hd, float scaling, const float *log_k, const float *merged, float a, float c,
                    float *scores, float *out, const int half) {
    const int64_t chunks = hd / 16;
    vf qv[MAX_HEAD_DIM / 16], o[MAX_HEAD_DIM / 16];
    for (int64_t c = 0; c < chunks; c++) {
        qv[c] = vf_load(q + 16 * c);
        o[c] = vf_zero();
    }
    float best = -INFINITY;
    for (int64_t s0 = 0; s0 < S; s0 += 16) {
        const int64_t n = S - s0 < 16 ? S - s0 : 16;
        int any = 0;
        for (int64_t i = 0; i < n; i++) any |= allowed[s0 + i];
        if (!any) {  /* no slot of the block allowed (the micro-step decoder's window of the base's entries) */
            for (int64_t i = 0; i < n; i++) scores[s0 + i] = -INFINITY;
            continue;
        }
        vf acc[16];
        for (int64_t i = 0; i < 16; i++) {
            acc[i] = vf_zero();
            if (s0 + i < S)
                for (int64_t c = 0; c < chunks; c++)
                    acc[i] = vf_fma(qv[c], kv_load(keys, (s0 + i) * ss + 16 * c, half), acc[i]);
        }
        vf raw = vf_mul(sum16(acc), vf_set1(scaling));
        if (log_k != NULL) {  /* compress mode: the merger's bias on merged entries */
            const vf lk = vf_load_n(log_k + s0, n), on = vf_load_n(merged + s0, n);
            raw = vf_add(raw, vf_mul(vf_fma(vf_set1(a), lk, vf_set1(c)), on));
        }
        vf_store_n(scores + s0, raw, n);
        for (int64_t i = 0; i < n; i++) {
            if (!allowed[s0 + i]) scores[s0 + i] = -INFINITY;
            best = scores[s0 + i] > best ? scores[s0 + i] : best;
        }
    }
    float total = 0.0f;
    if (best > -INFINITY) {
        const vf shift = vf_set1(best);
        for (int64_t s = 0; s < S; s += 16) {  /* each exponential alike in any lane: the same for any S */
            const int64_t n = S - s < 16 ? S - s : 16;
            vf_store_n(scores + s, exp16(vf_sub(vf_load_n(scores + s, n), shift)), n);
        }
        for (int64_t s = 0; s < S; s++) {
            if (!allowed[s]) continue;
            const float e = scores[s];
            const vf ev = vf_set1(e);
            total += e;
            for (int64_t c = 0; c < chunks; c++) o[c] = vf_fma(ev, kv_load(values, s * ss + 16 * c, half), o[c]);
        }
    }
    const vf by = vf_set1(total > 0.0f ? total : 1.0f);  /* no slot allowed: zeros */
    for (int64_t c = 0; c < chunks; c++) vf_store(out + 16 * c, vf_div(o[c], by));
}

static void attend_head(const float *q, const void *keys, const void *values, int64_t ss, const uint8_t *allowed,
                        int64_t S, int64_t hd, float scaling, const float *log_k, const float *merged, float a,
                        float c, float *scores, float *out, int half) {
    if (half) attend_any(q, keys, values, ss, allowed, S, hd, scaling, log_k, merged, a, c, scores, out, 1);
    else attend_any(q, keys, values, ss, allowed, S, hd, scaling, log_k, merged, a, c, scores, out, 0);
}

/* floats of scratch `hb_layers` needs for a pass of `rows` rows */
int64_t hb_scratch_floats(int64_t rows, int64_t d, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inner) {
    return rows * (2 * d + (2 * heads + 2 * kv_heads) * head_dim + 3 * inner);
}

static void layer(const hb_layer *L, const hb_pass *p, float *x, float *h, float *qkv, float *att, float *tmp,
                  float *gu, float *act, float *scores, uint8_t *xq) {
    const int64_t rows = p->b * p->t, d = p->d, hd = p->head_dim, H = p->heads, KV = p->kv_heads;
    const int64_t width = (H + 2 * KV) * hd, group = H / KV, inner = p->inner, S = p->slots_len;
    const int half = p->kv_half != 0;
    const int64_t es = half ? 2 : 4;  /* a cache element's bytes */
    char *kc = (char *)p->k_cache + L->index * p->s_layer * es, *vc = (char *)p->v_cache + L->index * p->s_layer * es;

    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * d, L->norm1, h + r * d, d, p->eps);
    gemm_for(h, &L->qkv, qkv, rows, xq);
    /* keys rotated and values, written to their cache slots */
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * KV; i++) {
        const int64_t r = i / KV, kh = i % KV, row = r / p->t;
        const float *src = qkv + r * width + (H + kh) * hd;
        const int64_t at = (row * p->s_row + kh * p->s_head + p->slots[r] * p->s_slot) * es;
        if (half) {  /* rounded to nearest even, as PyTorch's float16 */
            float key[MAX_HEAD_DIM];
            uint16_t *kd = (uint16_t *)(kc + at), *vd = (uint16_t *)(vc + at);
            rotate(src, p->cos + r * hd, p->sin + r * hd, key, hd);
            for (int64_t j = 0; j < hd; j++) kd[j] = hb_f2h(key[j]), vd[j] = hb_f2h(src[KV * hd + j]);
        } else {
            rotate(src, p->cos + r * hd, p->sin + r * hd, (float *)(kc + at), hd);
            memcpy(vc + at, src + KV * hd, hd * sizeof(float));
        }
    }
    /* attention: each (row, head) over the slots its mask allows */
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * H; i++) {
        const int64_t r = i / H, head = i % H, row = r / p->t, kh = head / group;
        float q[MAX_HEAD_DIM];
        rotate(qkv + r * width + head * hd, p->cos + r * hd, p->sin + r * hd, q, hd);
        float *out = att + r * H * hd + head * hd;
        const int64_t coef = L->index * H + head;
        const int64_t at = (row * p->s_row + kh * p->s_head) * es;
        attend_head(q, kc + at, vc + at, p->s_slot, p->mask + r * S, S, hd, p->scaling,
                    p->log_k == NULL ? NULL : p->log_k + row * S, p->log_k == NULL ? NULL : p->merged + row * S,
                    p->log_k == NULL ? 0.0f : p->bias_a[coef], p->log_k == NULL ? 0.0f : p->bias_c[coef], scores, out,
                    half);
        if (L->ctx_gate != NULL && p->ctx_k != NULL && p->ctx_len > 0) {  /* o + tanh(g) * (o over the base's) */
            float oc[MAX_HEAD_DIM];
            const int64_t ctx = (L->ctx_index * p->c_s_layer + row * p->c_s_row + kh * p->c_s_head) * es;
            attend_head(q, (const char *)p->ctx_k + ctx, (const char *)p->ctx_v + ctx, p->c_s_slot,
                        p->ctx_mask + row * p->ctx_len, p->ctx_len, hd, p->scaling, NULL, NULL, 0.0f, 0.0f, scores, oc,
                        half);
            const vf g = vf_set1(L->ctx_gate[head]);
            for (int64_t c = 0; c < hd; c += 16) vf_store(out + c, vf_fma(g, vf_load(oc + c), vf_load(out + c)));
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
            const int64_t n = inner - j < 16 ? inner - j : 16;
            const vf g = vf_load_n(gu + r * 2 * inner + j, n), up = vf_load_n(gu + r * 2 * inner + inner + j, n);
            const vf silu = vf_div(g, vf_add(vf_set1(1.0f), exp16(vf_sub(vf_zero(), g))));
            vf_store_n(act + r * inner + j, vf_mul(silu, up), n);
        }
    gemm_for(act, &L->down, tmp, rows, xq);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < d; j++) x[r * d + j] += tmp[r * d + j];
}

/* Layers[0..count) over x (b*t, d), in place; then, where the pass says, the final norm and the head's argmax.
   Returns 0, -1 if memory for the scores, the quantized activations or the head's outputs could not be had, or -2
   for a head without the final norm or of another width. */
int hb_layers(const hb_layer *layers, int64_t count, const hb_pass *p, float *x) {
    const int64_t rows = p->b * p->t, d = p->d, hd = p->head_dim;
    const int64_t width = (p->heads + 2 * p->kv_heads) * hd, inner = p->inner;
    float *h = p->scratch, *qkv = h + rows * d, *att = qkv + rows * width, *tmp = att + rows * p->heads * hd;
    float *gu = tmp + rows * d, *act = gu + rows * 2 * inner;
    int64_t widest = p->d > inner ? p->d : inner;
    if (p->heads * hd > widest) widest = p->heads * hd;
    const int64_t outs = p->out_last ? p->b : rows;  /* the final norm's rows */
    if (p->head != NULL && (p->out_norm == NULL || p->head->k != d)) return -2;
    uint8_t *xq = aligned_alloc(64, (size_t)hb_quantized_bytes(rows, widest + 63));  /* the head's too: k = d */
    if (xq == NULL) return -1;
    float *y = NULL, *best = NULL;
    int64_t *at = NULL;
    if (p->head != NULL && argmax_memory(outs, p->head->n, &y, &best, &at)) {
        free(xq);
        return -1;
    }
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
        if (!failed && p->out_norm != NULL) {  /* the model's final norm, in the same region */
            #pragma omp for schedule(static)
            for (int64_t o = 0; o < outs; o++)
                rms_norm(x + (p->out_last ? o * p->t + p->t - 1 : o) * d, p->out_norm, p->normed + o * d, d, p->out_eps);
            if (p->head != NULL)  /* and the LM head's greedy token of each normed row (the for's barrier: all there) */
                argmax_for(p->normed, p->head, outs, p->head_idx, y, best, at, xq);
        }
        free(scores);
    }
    free(xq), free(y), free(best), free(at);
    return failed ? -1 : 0;
}


#else  /* no variant for this CPU: the library says so (hb_isa() == 0) and Python does not use it */
int hb_isa(void) { return 0; }
int64_t hb_scratch_floats(int64_t rows, int64_t d, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inner) {
    return 0;
}
#endif
