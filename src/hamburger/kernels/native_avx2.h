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
#define TW 2   /* codes: tiles of 16 outputs a call takes side by side */

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

/* Keeps an exact integer sum in its own register as written: GCC would otherwise reassociate the products' adds
   into trees that spill to the stack (the sum is the same, the speed is not) */
#define KEEP(v) __asm__("" : "+x"(v))

/* nibble group h of a 32-byte half of part j (8 outputs' 16-bit words, nibble h: inputs 8j + 2h, +1) as int16
   pairs. `times16`: nibble 1 as 16 x its code (one and, no shift), summed apart and divided back exactly (a
   block's 8 such products: |sum| <= 8 * 32767 * 240, far inside int32). */
INL __m256i nibbles(const uint8_t *p, const int h, const int times16) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), low = _mm256_set1_epi16(0x0F);
    if (h == 0) return _mm256_and_si256(v, low);
    if (h == 1) return times16 ? _mm256_and_si256(v, _mm256_set1_epi16(0xF0)) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if (h == 2) return _mm256_and_si256(_mm256_srli_epi16(v, 8), low);
    return _mm256_srli_epi16(v, 12);
}

/* part p's 32 bytes of Q8_0 codes (16 outputs' input pairs 2p, 2p + 1) as int16 pairs, sign-extended within each
   128-bit lane (vpmovsxbw crosses lanes: by LLVM's scheduling model of Zen 3, a third of this rate): half 0 holds outputs 0-3 and 8-11, half 1
   outputs 4-7 and 12-15 (`codes_tiles` orders the scales and the outputs alike) */
INL __m256i bytes16(const uint8_t *p, const int half) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
    return half ? _mm256_unpackhi_epi8(v, sign) : _mm256_unpacklo_epi8(v, sign);
}

/* input pair h of part j (inputs 8j + 2h, +1) for mt rows and nt tiles: the codes unpacked once, each row's pair
   broadcast, the products added to the row's sums */
INL void codes_pair(const uint8_t *const *c, const int32_t *const *xp, __m256i (*a)[2][2], __m256i (*s)[2][2],
                    const int j, const int h, const int mt, const int nt, const int q4, const int apart) {
    __m256i w[2][2];
    for (int t = 0; t < nt; t++)
        for (int half = 0; half < 2; half++)
            w[t][half] = q4 ? nibbles(c[t] + 64 * j + 32 * half, h, apart) : bytes16(c[t] + 32 * (4 * j + h), half);
    for (int m = 0; m < mt; m++) {
        const __m256i xb = _mm256_set1_epi32(xp[m][4 * j + h]);
        for (int t = 0; t < nt; t++)
            for (int half = 0; half < 2; half++)
                if (apart && h == 1) {
                    s[m][t][half] = DPWSSD(s[m][t][half], w[t][half], xb);
                    KEEP(s[m][t][half]);
                } else {
                    a[m][t][half] = DPWSSD(a[m][t][half], w[t][half], xb);
                    KEEP(a[m][t][half]);
                }
    }
}

/* y[m, 16t + l] for mt rows and nt tiles of 16 outputs computed together (`wt`: the first tile's blocks): each
   block's products summed exactly in int32 (the codes unpacked once for all the rows, each row's input pair
   broadcast), then scaled in float (native.c says how) */
INL void codes_tiles(const uint8_t *xq, const uint8_t *wt, float *y, int64_t k, int64_t ldy, int64_t cols,
                     const int mt, const int nt, const int q4) {
    const int64_t blocks = k / 32, tb = q4 ? TB_Q4 : TB_Q8, xrow = blocks * XQ_BLOCK;
    /* nibble 1 apart (times16) where the registers allow a second sum per row, tile and half */
    const int apart = q4 && mt * nt <= 2;
    __m256 f[T_MT][2][2];
#pragma GCC unroll 4
    for (int m = 0; m < mt; m++)
#pragma GCC unroll 2
        for (int t = 0; t < nt; t++) f[m][t][0] = f[m][t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i a[T_MT][2][2], s[T_MT][2][2];
        const uint8_t *c[2];
        const int32_t *xp[T_MT];
#pragma GCC unroll 2
        for (int t = 0; t < nt; t++) {
            c[t] = wt + (t * blocks + b) * tb;
            for (int64_t l = 0; l < tb; l += 64) _mm_prefetch((const char *)(c[t] + l) + AHEAD, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int m = 0; m < mt; m++) {
            xp[m] = (const int32_t *)(xq + m * xrow) + 16 * b;
#pragma GCC unroll 2
            for (int t = 0; t < nt; t++)
                a[m][t][0] = a[m][t][1] = s[m][t][0] = s[m][t][1] = _mm256_setzero_si256();
        }
        /* the 16 input pairs of the block, written out: GCC leaves loops over them rolled, the sums then in memory */
#define PAIR(j, h) codes_pair(c, xp, a, s, j, h, mt, nt, q4, apart);
#define PART(j) PAIR(j, 0) PAIR(j, 1) PAIR(j, 2) PAIR(j, 3)
        PART(0) PART(1) PART(2) PART(3)
#undef PART
#undef PAIR
#pragma GCC unroll 2
        for (int t = 0; t < nt; t++) {
            const __m128i *sp = (const __m128i *)(c[t] + (q4 ? 256 : 512));
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const __m128i s0 = _mm_loadu_si128(sp), s1 = _mm_loadu_si128(sp + 1);
                const __m256 scale = _mm256_cvtph_ps(q4 ? (half ? s1 : s0)  /* Q8_0: bytes16's order */
                                                        : half ? _mm_unpackhi_epi64(s0, s1) : _mm_unpacklo_epi64(s0, s1));
                const __m256 low = q4 ? _mm256_cvtph_ps(_mm_loadu_si128(sp + 2 + half)) : scale;
#pragma GCC unroll 4
                for (int m = 0; m < mt; m++) {
                    const float *dx = (const float *)(xq + m * xrow + 2 * k);
                    const __m256i total = apart ? _mm256_add_epi32(a[m][t][half], _mm256_srai_epi32(s[m][t][half], 4))
                                                : a[m][t][half];
                    f[m][t][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(scale, _mm256_set1_ps(dx[b])),
                                                    f[m][t][half]);
                    if (q4) f[m][t][half] = _mm256_fmadd_ps(low, _mm256_set1_ps(dx[blocks + b]), f[m][t][half]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < mt; m++)
#pragma GCC unroll 2
        for (int t = 0; t < nt; t++)
            vf_store_n(y + m * ldy + 16 * t,
                       q4 ? vf_make(f[m][t][0], f[m][t][1])
                          : vf_make(_mm256_permute2f128_ps(f[m][t][0], f[m][t][1], 0x20),
                                    _mm256_permute2f128_ps(f[m][t][0], f[m][t][1], 0x31)),
                       cols - 16 * t);
}

/* y[m, 16t + l] for mt rows and tw tiles of 16 outputs: one row's two tiles together (two streams of weights, each
   input pair broadcast once for both), more rows a tile at a time (the registers hold their sums) */
INL void codes_tile(const uint8_t *xq, const uint8_t *wt, float *y, int64_t k, int64_t ldy, int64_t cols,
                    const int mt, const int tw, const int q4) {
    const int64_t step = (k / 32) * (q4 ? TB_Q4 : TB_Q8);
    if (mt == 1 && tw == 2) codes_tiles(xq, wt, y, k, ldy, cols, 1, 2, q4);
    else
        for (int t = 0; t < tw; t++) codes_tiles(xq, wt + t * step, y + 16 * t, k, ldy, cols - 16 * t, mt, 1, q4);
}
