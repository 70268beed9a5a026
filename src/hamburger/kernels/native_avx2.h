/* x86-64 with AVX2, FMA and F16C (Intel since Haswell, AMD since Zen): `vf` is two ymm registers (lanes 0-7 and
 * 8-15), the codes' int16 products vpdpwssd where the CPU has AVX-VNNI (Intel since Alder Lake, AMD since Zen 5),
 * else vpmaddwd and an add. Included by native.c, which says what these must compute. */
#include <immintrin.h>

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HB_ISA HB_AVX2_VNNI
#ifdef __AVXVNNI__
#define DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#endif
#else
#define HB_ISA HB_AVX2
#define DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#define NB 4   /* float16: outputs a tile computes */
#define MT 1   /* float16: rows a tile takes (16 registers: a row's 4 outputs' sums and weights fill them) */
#define TW 1   /* codes: tiles of 16 outputs a call takes side by side */

typedef struct {
    __m256 lo, hi;
} vf;

INL vf vf_make(__m256 lo, __m256 hi) {
    vf r = {lo, hi};
    return r;
}
/* the lanes of a loop's last, partial chunk of 16, as two masks */
INL __m256i lanes8(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left > 16 ? 16 : left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

INL vf vf_zero(void) { return vf_make(_mm256_setzero_ps(), _mm256_setzero_ps()); }
INL vf vf_set1(float a) { return vf_make(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
INL vf vf_load(const float *p) { return vf_make(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
INL vf vf_load_n(const float *p, int64_t n) {
    if (n >= 16) return vf_load(p);
    return vf_make(_mm256_maskload_ps(p, lanes8(n)), _mm256_maskload_ps(p + 8, lanes8(n - 8)));
}
INL void vf_store(float *p, vf a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
INL void vf_store_n(float *p, vf a, int64_t n) {
    if (n >= 16) {
        vf_store(p, a);
        return;
    }
    _mm256_maskstore_ps(p, lanes8(n), a.lo);
    _mm256_maskstore_ps(p + 8, lanes8(n - 8), a.hi);
}
#define VF2(name, op) \
    INL vf name(vf a, vf b) { return vf_make(op(a.lo, b.lo), op(a.hi, b.hi)); }
VF2(vf_add, _mm256_add_ps)
VF2(vf_sub, _mm256_sub_ps)
VF2(vf_mul, _mm256_mul_ps)
VF2(vf_div, _mm256_div_ps)
VF2(vf_max, _mm256_max_ps)
VF2(vf_min, _mm256_min_ps)
#undef VF2
INL vf vf_fma(vf a, vf b, vf c) { return vf_make(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
INL vf vf_fnma(vf a, vf b, vf c) { return vf_make(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); }
INL vf vf_abs(vf a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return vf_make(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
INL vf vf_round(vf a) {
    return vf_make(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                   _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* 2^n for whole n in [-126, 127] */
INL __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
INL vf vf_pow2(vf n) { return vf_make(pow2_8(n.lo), pow2_8(n.hi)); }
INL vf vf_load_h(const uint16_t *p) {
    return vf_make(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                   _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
/* rounded to the nearest integer (even on ties), saturated to int16 */
INL void vf_store_i16(int16_t *p, vf a) {
    const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}
INL float hb_h2f(uint16_t v) { return _cvtsh_ss(v); }
INL uint16_t hb_f2h(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

INL float hsum(vf a) {
    const __m256 t = _mm256_add_ps(a.lo, a.hi);
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
INL float hmax(vf a) {
    const __m256 t = _mm256_max_ps(a.lo, a.hi);
    __m128 u = _mm_max_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    u = _mm_max_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_max_ss(u, _mm_movehdup_ps(u)));
}

/* native.h's order, as native_avx512.h's sum16 within each 128-bit group, then the groups of lanes 0-7 (lo) and
   8-15 (hi) brought together */
INL vf sum16(const vf *a) {
    __m256 xl[8], xh[8], zl[4], zh[4];
    for (int i = 0; i < 8; i++) {
        xl[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i].lo, a[2 * i + 1].lo), _mm256_unpackhi_ps(a[2 * i].lo, a[2 * i + 1].lo));
        xh[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i].hi, a[2 * i + 1].hi), _mm256_unpackhi_ps(a[2 * i].hi, a[2 * i + 1].hi));
    }
    for (int j = 0; j < 4; j++) {
        zl[j] = _mm256_add_ps(_mm256_shuffle_ps(xl[2 * j], xl[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(xl[2 * j], xl[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        zh[j] = _mm256_add_ps(_mm256_shuffle_ps(xh[2 * j], xh[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(xh[2 * j], xh[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    __m256 out[2];
    for (int p = 0; p < 2; p++) {  /* outputs 8p..8p+7: vectors 4(2p)..., groups S0 + S1 (lo), S2 + S3 (hi) */
        const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(zl[2 * p], zl[2 * p + 1], 0x20),
                                         _mm256_permute2f128_ps(zl[2 * p], zl[2 * p + 1], 0x31));
        const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(zh[2 * p], zh[2 * p + 1], 0x20),
                                         _mm256_permute2f128_ps(zh[2 * p], zh[2 * p + 1], 0x31));
        out[p] = _mm256_add_ps(s01, s23);
    }
    return vf_make(out[0], out[1]);
}

/* y[0, j] (one row, NB outputs) = x . w[j]: 16-lane partial sums over the input in order, then hsum */
INL void fp16_tile(const float *x, const uint16_t *w, float *y, int64_t k, int64_t ldy, const int mt) {
    (void)ldy, (void)mt;
    __m256 lo[NB], hi[NB];
    for (int j = 0; j < NB; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        if ((i & 31) == 0)
            for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(w + j * k + i) + AHEAD, _MM_HINT_T0);
        const __m256 xl = _mm256_loadu_ps(x + i), xh = _mm256_loadu_ps(x + i + 8);
        for (int j = 0; j < NB; j++) {
            lo[j] = _mm256_fmadd_ps(xl, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + j * k + i))), lo[j]);
            hi[j] = _mm256_fmadd_ps(xh, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + j * k + i + 8))), hi[j]);
        }
    }
    for (int j = 0; j < NB; j++) y[j] = hsum(vf_make(lo[j], hi[j]));
}

/* part j's nibble (or byte) group h of a block's codes as int16: 8 outputs' input pairs a register, outputs 0-7
   and 8-15 */
INL void unpack_h(const uint8_t *c, int j, int h, int q4, __m256i *w) {
    if (q4) {
        const __m256i nib = _mm256_set1_epi16(0x0F);
        for (int half = 0; half < 2; half++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * j + 32 * half));
            w[half] = _mm256_and_si256(_mm256_srli_epi16(v, 4 * h), nib);
        }
    } else
        for (int half = 0; half < 2; half++)
            w[half] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 32 * (4 * j + h) + 16 * half)));
}

/* y[m, l] for mt rows and one tile of 16 outputs: each block's products summed exactly in int32, then scaled in
   float (native.c says how) */
INL void codes_tile(const uint8_t *xq, const uint8_t *wt, float *y, int64_t k, int64_t ldy, int64_t cols,
                    const int mt, const int tw, const int q4) {
    (void)tw;
    const int64_t blocks = k / 32, tb = q4 ? TB_Q4 : TB_Q8, xrow = blocks * XQ_BLOCK;
    const int chains = mt <= 2 ? 2 : 1;  /* independent sums a row and half: the products' latency hidden */
    __m256 f[T_MT][2];
    for (int m = 0; m < mt; m++) f[m][0] = f[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *c = wt + b * tb;
        __m256i acc[T_MT][2][2];
        for (int m = 0; m < mt; m++)
            for (int half = 0; half < 2; half++) acc[m][half][0] = acc[m][half][1] = _mm256_setzero_si256();
        for (int64_t l = 0; l < tb; l += 64) _mm_prefetch((const char *)(c + l) + AHEAD, _MM_HINT_T0);
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 4; h++) {
                __m256i w[2];
                unpack_h(c, j, h, q4, w);
                const int s = chains == 2 ? h & 1 : 0;
                for (int m = 0; m < mt; m++) {
                    const __m256i xb = _mm256_set1_epi32(((const int32_t *)(xq + m * xrow))[16 * b + 4 * j + h]);
                    acc[m][0][s] = DPWSSD(acc[m][0][s], w[0], xb);
                    acc[m][1][s] = DPWSSD(acc[m][1][s], w[1], xb);
                }
            }
        const __m128i *sp = (const __m128i *)(c + (q4 ? 256 : 512));
        for (int half = 0; half < 2; half++) {
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(sp + half));
            const __m256 low = q4 ? _mm256_cvtph_ps(_mm_loadu_si128(sp + 2 + half)) : scale;
            for (int m = 0; m < mt; m++) {
                const float *dx = (const float *)(xq + m * xrow + 2 * k);
                const __m256i total = chains == 2 ? _mm256_add_epi32(acc[m][half][0], acc[m][half][1]) : acc[m][half][0];
                f[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(scale, _mm256_set1_ps(dx[b])),
                                             f[m][half]);
                if (q4) f[m][half] = _mm256_fmadd_ps(low, _mm256_set1_ps(dx[blocks + b]), f[m][half]);
            }
        }
    }
    for (int m = 0; m < mt; m++) vf_store_n(y + m * ldy, vf_make(f[m][0], f[m][1]), cols);
}
