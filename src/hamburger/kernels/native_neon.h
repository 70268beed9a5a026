/* aarch64 with NEON (every 64-bit ARM CPU): `vf` is four 128-bit registers (lanes 0-3, 4-7, 8-11, 12-15). The
 * codes' products: with the dot-product extension (Armv8.2+: Apple M1 on, Graviton 2 on, Ampere Altra) each int16
 * activation as a high and a low byte (x = 256 * hi + lo), their sums with the codes by sdot / udot, and usdot's
 * mixed signs with i8mm (Armv8.6+: Apple M2 on, Graviton 3 on) for the 8-bit codes; without it widening int16
 * multiply-adds. Included by native.c, which says what these must compute. */
#include <arm_neon.h>
#include <string.h>

#if defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8)
#define HB_ISA HB_NEON_I8MM
#elif defined(__ARM_FEATURE_DOTPROD)
#define HB_ISA HB_NEON_DOTPROD
#else
#define HB_ISA HB_NEON
#endif
#define NB 4   /* float16: outputs a tile computes */
#define MT 1   /* float16: rows a tile takes (a row's 4 outputs' sums are 16 registers) */
#define TW 1   /* codes: tiles of 16 outputs a call takes side by side */

typedef struct {
    float32x4_t q[4];
} vf;

INL vf vf_set1(float a) {
    vf r;
    for (int i = 0; i < 4; i++) r.q[i] = vdupq_n_f32(a);
    return r;
}
INL vf vf_zero(void) { return vf_set1(0.0f); }
INL vf vf_load(const float *p) {
    vf r;
    for (int i = 0; i < 4; i++) r.q[i] = vld1q_f32(p + 4 * i);
    return r;
}
INL vf vf_load_n(const float *p, int64_t n) {
    if (n >= 16) return vf_load(p);
    float tmp[16] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(float));
    return vf_load(tmp);
}
INL void vf_store(float *p, vf a) {
    for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, a.q[i]);
}
INL void vf_store_n(float *p, vf a, int64_t n) {
    if (n >= 16) {
        vf_store(p, a);
        return;
    }
    float tmp[16];
    vf_store(tmp, a);
    memcpy(p, tmp, (size_t)n * sizeof(float));
}
#define VF2(name, op)                                   \
    INL vf name(vf a, vf b) {                           \
        vf r;                                           \
        for (int i = 0; i < 4; i++) r.q[i] = op(a.q[i], b.q[i]); \
        return r;                                       \
    }
VF2(vf_add, vaddq_f32)
VF2(vf_sub, vsubq_f32)
VF2(vf_mul, vmulq_f32)
VF2(vf_div, vdivq_f32)
VF2(vf_max, vmaxq_f32)
VF2(vf_min, vminq_f32)
#undef VF2
INL vf vf_fma(vf a, vf b, vf c) {  /* a * b + c, one rounding */
    vf r;
    for (int i = 0; i < 4; i++) r.q[i] = vfmaq_f32(c.q[i], a.q[i], b.q[i]);
    return r;
}
INL vf vf_fnma(vf a, vf b, vf c) {  /* c - a * b, one rounding */
    vf r;
    for (int i = 0; i < 4; i++) r.q[i] = vfmsq_f32(c.q[i], a.q[i], b.q[i]);
    return r;
}
INL vf vf_abs(vf a) {
    for (int i = 0; i < 4; i++) a.q[i] = vabsq_f32(a.q[i]);
    return a;
}
INL vf vf_round(vf a) {
    for (int i = 0; i < 4; i++) a.q[i] = vrndnq_f32(a.q[i]);
    return a;
}
/* 2^n for whole n in [-126, 127] */
INL vf vf_pow2(vf n) {
    vf r;
    for (int i = 0; i < 4; i++)
        r.q[i] = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.q[i]), vdupq_n_s32(127)), 23));
    return r;
}
INL vf vf_load_h(const uint16_t *p) {
    vf r;
    for (int i = 0; i < 4; i++) r.q[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
    return r;
}
/* rounded to the nearest integer (even on ties), saturated to int16 */
INL void vf_store_i16(int16_t *p, vf a) {
    for (int i = 0; i < 2; i++)
        vst1q_s16(p + 8 * i, vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(a.q[2 * i])), vqmovn_s32(vcvtnq_s32_f32(a.q[2 * i + 1]))));
}
INL float hb_h2f(uint16_t v) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(v))), 0); }
INL uint16_t hb_f2h(float x) { return vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(x))), 0); }

INL float hsum(vf a) {
    const float32x4_t u = vaddq_f32(vaddq_f32(a.q[0], a.q[2]), vaddq_f32(a.q[1], a.q[3]));
    const float32x2_t v = vadd_f32(vget_low_f32(u), vget_high_f32(u));
    return vget_lane_f32(v, 0) + vget_lane_f32(v, 1);
}
INL float hmax(vf a) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.q[0], a.q[1]), vmaxq_f32(a.q[2], a.q[3]))); }

/* [x0 + x2, x1 + x3, y0 + y2, y1 + y3] */
INL float32x4_t pair_sums(float32x4_t x, float32x4_t y) {
    const float64x2_t a = vreinterpretq_f64_f32(x), b = vreinterpretq_f64_f32(y);
    return vaddq_f32(vreinterpretq_f32_f64(vzip1q_f64(a, b)), vreinterpretq_f32_f64(vzip2q_f64(a, b)));
}

/* native.h's order: per 4 vectors and group G, S_G by pair_sums and a pairwise add, then the groups */
INL vf sum16(const vf *a) {
    vf r;
    for (int v = 0; v < 4; v++) {
        float32x4_t s[4];
        for (int g = 0; g < 4; g++)
            s[g] = vpaddq_f32(pair_sums(a[4 * v].q[g], a[4 * v + 1].q[g]), pair_sums(a[4 * v + 2].q[g], a[4 * v + 3].q[g]));
        r.q[v] = vaddq_f32(vaddq_f32(s[0], s[1]), vaddq_f32(s[2], s[3]));
    }
    return r;
}

/* y[0, j] (one row, NB outputs) = x . w[j]: 16-lane partial sums over the input in order, then hsum */
INL void fp16_tile(const float *x, const uint16_t *w, float *y, int64_t k, int64_t ldy, const int mt) {
    (void)ldy, (void)mt;
    vf acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = vf_zero();
    for (int64_t i = 0; i < k; i += 16) {
        if ((i & 31) == 0)
            for (int j = 0; j < NB; j++) __builtin_prefetch((const char *)(w + j * k + i) + AHEAD);
        const vf xv = vf_load(x + i);
        for (int j = 0; j < NB; j++) acc[j] = vf_fma(xv, vf_load_h(w + j * k + i), acc[j]);
    }
    for (int j = 0; j < NB; j++) y[j] = hsum(acc[j]);
}

#if defined(__ARM_FEATURE_DOTPROD)
/* the codes of inputs 4g..4g+3 of 16 outputs as bytes, 4 outputs' 4 inputs a register (sdot's lanes) */
INL void codes_bytes(const uint8_t *c, int g, int q4, uint8x16_t *w) {
    if (q4) {  /* part g / 2; the words' low bytes hold nibbles 0 and 1, the high bytes 2 and 3 */
        static const uint8_t index[2][16] = {{0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30},
                                             {1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31}};
        const uint8x16_t idx = vld1q_u8(index[g & 1]);
        for (int a = 0; a < 4; a++) {
            const uint8x16_t v = vld1q_u8(c + 64 * (g / 2) + 16 * a);
            const uint8x16x2_t nib = {{vandq_u8(v, vdupq_n_u8(0x0F)), vshrq_n_u8(v, 4)}};
            w[a] = vqtbl2q_u8(nib, idx);
        }
    } else {  /* parts 2g and 2g + 1: each output's two input pairs side by side */
        const uint16x8_t p0 = vld1q_u16((const uint16_t *)(c + 64 * g)), p1 = vld1q_u16((const uint16_t *)(c + 64 * g + 16));
        const uint16x8_t q0 = vld1q_u16((const uint16_t *)(c + 64 * g + 32)), q1 = vld1q_u16((const uint16_t *)(c + 64 * g + 48));
        w[0] = vreinterpretq_u8_u16(vzip1q_u16(p0, q0));
        w[1] = vreinterpretq_u8_u16(vzip2q_u16(p0, q0));
        w[2] = vreinterpretq_u8_u16(vzip1q_u16(p1, q1));
        w[3] = vreinterpretq_u8_u16(vzip2q_u16(p1, q1));
    }
}
#define LANE_DOT(kind, acc, w, x, lane)                                              \
    switch (lane) {                                                                  \
        case 0: acc = kind(acc, w, x, 0); break;                                     \
        case 1: acc = kind(acc, w, x, 1); break;                                     \
        case 2: acc = kind(acc, w, x, 2); break;                                     \
        default: acc = kind(acc, w, x, 3); break;                                    \
    }

/* 16 outputs' exact int32 sums over block b for one row (`x`: its int16 activations of the block) */
INL void block_sums(const int16_t *x, const uint8x16_t w[8][4], const int32x4_t *wsum, int q4, int32x4_t *out) {
    int8x16_t hi[2];
    uint8x16_t lo[2];
    for (int i = 0; i < 2; i++) {
        const int16x8_t a = vld1q_s16(x + 16 * i), b = vld1q_s16(x + 16 * i + 8);
        hi[i] = vcombine_s8(vshrn_n_s16(a, 8), vshrn_n_s16(b, 8));
        lo[i] = vcombine_u8(vmovn_u16(vreinterpretq_u16_s16(a)), vmovn_u16(vreinterpretq_u16_s16(b)));
    }
    int32x4_t sh[4], sl[4];
    uint32x4_t ul[4];
    for (int a = 0; a < 4; a++) sh[a] = sl[a] = vdupq_n_s32(0), ul[a] = vdupq_n_u32(0);
    for (int g = 0; g < 8; g++)
        for (int a = 0; a < 4; a++) {
            const int8x16_t ws = vreinterpretq_s8_u8(w[g][a]);
            LANE_DOT(vdotq_laneq_s32, sh[a], ws, hi[g / 4], g % 4)
            if (q4) {
                LANE_DOT(vdotq_laneq_u32, ul[a], w[g][a], lo[g / 4], g % 4)
            } else {
#if defined(__ARM_FEATURE_MATMUL_INT8)
                LANE_DOT(vsudotq_laneq_s32, sl[a], ws, lo[g / 4], g % 4)
#else  /* lo - 128 as signed bytes; 128 * the codes' sum added back below */
                const int8x16_t l2 = vreinterpretq_s8_u8(veorq_u8(lo[g / 4], vdupq_n_u8(0x80)));
                LANE_DOT(vdotq_laneq_s32, sl[a], ws, l2, g % 4)
#endif
            }
        }
    for (int a = 0; a < 4; a++) {
        int32x4_t low = q4 ? vreinterpretq_s32_u32(ul[a]) : sl[a];
        if (wsum != NULL) low = vmlaq_n_s32(low, wsum[a], 128);
        out[a] = vmlaq_n_s32(low, sh[a], 256);
    }
}
#else
/* 16 outputs' exact int32 sums over block b for one row: widening int16 multiply-adds, each output's two input
   parities in neighbouring lanes until the end */
INL void block_sums(const int16_t *x, const uint8_t *c, int q4, int32x4_t *out) {
    int32x4_t acc[4][2];
    for (int a = 0; a < 4; a++) acc[a][0] = acc[a][1] = vdupq_n_s32(0);
    const int32_t *pairs = (const int32_t *)x;
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 4; h++) {
            const int16x8_t xb = vreinterpretq_s16_s32(vdupq_n_s32(pairs[4 * j + h]));
            for (int a = 0; a < 4; a++) {
                int16x8_t w;
                if (q4)
                    w = vreinterpretq_s16_u16(vandq_u16(vshlq_u16(vld1q_u16((const uint16_t *)(c + 64 * j + 16 * a)),
                                                                  vdupq_n_s16((int16_t)(-4 * h))), vdupq_n_u16(0x0F)));
                else {
                    const int8x16_t v = vld1q_s8((const int8_t *)(c + 32 * (4 * j + h) + 16 * (a / 2)));
                    w = (a & 1) ? vmovl_high_s8(v) : vmovl_s8(vget_low_s8(v));
                }
                acc[a][0] = vmlal_s16(acc[a][0], vget_low_s16(w), vget_low_s16(xb));
                acc[a][1] = vmlal_high_s16(acc[a][1], w, xb);
            }
        }
    for (int a = 0; a < 4; a++) out[a] = vpaddq_s32(acc[a][0], acc[a][1]);
}
#endif

/* y[m, l] for mt rows and one tile of 16 outputs: each block's products summed exactly in int32, then scaled in
   float (native.c says how) */
INL void codes_tile(const uint8_t *xq, const uint8_t *wt, float *y, int64_t k, int64_t ldy, int64_t cols,
                    const int mt, const int tw, const int q4) {
    (void)tw;
    const int64_t blocks = k / 32, tb = q4 ? TB_Q4 : TB_Q8, xrow = blocks * XQ_BLOCK;
    float32x4_t f[T_MT][4];
    for (int m = 0; m < mt; m++)
        for (int a = 0; a < 4; a++) f[m][a] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *c = wt + b * tb;
        for (int64_t l = 0; l < tb; l += 64) __builtin_prefetch((const char *)(c + l) + AHEAD);
#if defined(__ARM_FEATURE_DOTPROD)
        uint8x16_t w[8][4];
        for (int g = 0; g < 8; g++) codes_bytes(c, g, q4, w[g]);
        int32x4_t wsum_[4], *wsum = NULL;
#if !defined(__ARM_FEATURE_MATMUL_INT8)
        if (!q4) {
            for (int a = 0; a < 4; a++) {
                wsum_[a] = vdupq_n_s32(0);
                for (int g = 0; g < 8; g++) wsum_[a] = vdotq_s32(wsum_[a], vreinterpretq_s8_u8(w[g][a]), vdupq_n_s8(1));
            }
            wsum = wsum_;
        }
#endif
        (void)wsum_;
#endif
        const uint16_t *sp = (const uint16_t *)(c + (q4 ? 256 : 512));
        for (int m = 0; m < mt; m++) {
            const int16_t *x = (const int16_t *)(xq + m * xrow) + 32 * b;
            const float *dx = (const float *)(xq + m * xrow + 2 * k);
            int32x4_t sums[4];
#if defined(__ARM_FEATURE_DOTPROD)
            block_sums(x, (const uint8x16_t(*)[4])w, wsum, q4, sums);
#else
            block_sums(x, c, q4, sums);
#endif
            for (int a = 0; a < 4; a++) {
                const float32x4_t scale = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sp + 4 * a)));
                f[m][a] = vfmaq_f32(f[m][a], vcvtq_f32_s32(sums[a]), vmulq_n_f32(scale, dx[b]));
                if (q4)
                    f[m][a] = vfmaq_f32(f[m][a], vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sp + 16 + 4 * a))),
                                        vdupq_n_f32(dx[blocks + b]));
            }
        }
    }
    for (int m = 0; m < mt; m++) {
        vf r;
        for (int a = 0; a < 4; a++) r.q[a] = f[m][a];
        vf_store_n(y + m * ldy, r, cols);
    }
}
