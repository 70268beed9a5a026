/* x86-64 with AVX-512 F, BW and VNNI (Intel since Cascade Lake, AMD since Zen 4): `vf` is one zmm register, the
 * codes' int16 products are vpdpwssd. Included by native.c, which says what these must compute. */
#include <immintrin.h>

#define HB_ISA HB_AVX512_VNNI
#define NB 4   /* float16: outputs a tile computes */
#define MT 4   /* float16: rows a tile takes */
#define TW 2   /* codes: tiles of 16 outputs a call takes side by side */
#define HB_A8_BYTES 1  /* kind 7's activations as bytes, multiplied by vpdpbusd (native.h) */

typedef __m512 vf;

/* the lanes of a loop's last, partial chunk of 16 */
INL __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

INL vf vf_zero(void) { return _mm512_setzero_ps(); }
INL vf vf_set1(float a) { return _mm512_set1_ps(a); }
INL vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
INL vf vf_load_n(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
INL void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
INL void vf_store_n(float *p, vf a, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), a); }
INL vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
INL vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INL vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INL vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
INL vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INL vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
INL vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
INL vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
INL vf vf_abs(vf a) { return _mm512_abs_ps(a); }
INL vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* 2^n for whole n in [-126, 127] */
INL vf vf_pow2(vf n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
INL vf vf_load_h(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* rounded to the nearest integer (even on ties), saturated to int16 */
INL void vf_store_i16(int16_t *p, vf a) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(a)));
}
INL float hb_h2f(uint16_t v) { return _cvtsh_ss(v); }
INL uint16_t hb_f2h(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

INL float hsum(vf a) {
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
INL float hmax(vf a) { return _mm512_reduce_max_ps(a); }

INL vf sum16(const vf *a) {
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

/* y[m, j] (mt rows, NB outputs) = x[m] . w[j]: 16-lane partial sums over the input in order, then hsum */
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
        for (int j = 0; j < NB; j++) y[m * ldy + j] = hsum(acc[m][j]);
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

/* y[m, 16t + l] for mt rows and tw tiles of 16 outputs (`wt`: the first tile's blocks): each block's products
   summed exactly in int32 (vpdpwssd, the row's input pairs broadcast), then scaled in float (native.c says how) */
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
        if (q4 == 2) {  /* kind 7: a part's codes as two byte vectors (inputs 8j + 0 4 1 5 and 2 6 3 7 of an
                           output in each lane), each taking four of the row's byte codes a product */
            const __m512i nib = _mm512_set1_epi16(0x0F0F);
            for (int j = 0; j < 4; j++) {
                __m512i lo[TW], hi[TW];
                for (int t = 0; t < tw; t++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(wt + (t * blocks + b) * tb + 64 * j));
                    lo[t] = _mm512_and_si512(v, nib);
                    hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                }
                for (int m = 0; m < mt; m++) {
                    const int32_t *quads = (const int32_t *)(xq + m * xrow) + 8 * b + 2 * j;
                    const __m512i xa = _mm512_set1_epi32(quads[0]), xb = _mm512_set1_epi32(quads[1]);
                    for (int t = 0; t < tw; t++) {
                        acc[m][t][0] = _mm512_dpbusd_epi32(acc[m][t][0], lo[t], xa);
                        acc[m][t][1] = _mm512_dpbusd_epi32(acc[m][t][1], hi[t], xb);
                    }
                }
            }
        } else
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
