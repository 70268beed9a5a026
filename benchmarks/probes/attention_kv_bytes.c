/* Probe: the native attention (attend_head) alone over 30 layers' separate caches of 3 KV heads (9 query heads, head_dim
   64, one position), float32 keys and values against float16 ones read through vf_load_h, 1 and 2 threads, rounds
   interleaved, the best of 5. Built beside native.c:

     cp src/hamburger/kernels/native*.[ch] /tmp/p/ && cp benchmarks/probes/attention_kv_bytes.c /tmp/p/ && cd /tmp/p &&
     gcc -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=off attention_kv_bytes.c -o a -lm && ./a 256 && ./a 1024
*/
#include "native.c"
#include <stdio.h>
static void attend_h(const float *q, const uint16_t *keys, const uint16_t *values, int64_t ss, const uint8_t *allowed,
                        int64_t S, int64_t hd, float scaling, float *scores, float *out) {
    const int64_t chunks = hd / 16;
    vf qv[4], o[4];
    for (int64_t c = 0; c < chunks; c++) { qv[c] = vf_load(q + 16 * c); o[c] = vf_zero(); }
    float best = -INFINITY;
    for (int64_t s0 = 0; s0 < S; s0 += 16) {
        const int64_t n = S - s0 < 16 ? S - s0 : 16;
        vf acc[16];
        for (int64_t i = 0; i < 16; i++) {
            acc[i] = vf_zero();
            if (s0 + i < S)
                for (int64_t c = 0; c < chunks; c++) acc[i] = vf_fma(qv[c], vf_load_h(keys + (s0 + i) * ss + 16 * c), acc[i]);
        }
        vf raw = vf_mul(sum16(acc), vf_set1(scaling));
        vf_store_n(scores + s0, raw, n);
        for (int64_t i = 0; i < n; i++) {
            if (!allowed[s0 + i]) scores[s0 + i] = -INFINITY;
            best = scores[s0 + i] > best ? scores[s0 + i] : best;
        }
    }
    float total = 0.0f;
    const vf shift = vf_set1(best);
    for (int64_t s = 0; s < S; s += 16) {
        const int64_t n = S - s < 16 ? S - s : 16;
        vf_store_n(scores + s, exp16(vf_sub(vf_load_n(scores + s, n), shift)), n);
    }
    for (int64_t s = 0; s < S; s++) {
        if (!allowed[s]) continue;
        const float e = scores[s];
        const vf ev = vf_set1(e);
        total += e;
        for (int64_t c = 0; c < chunks; c++) o[c] = vf_fma(ev, vf_load_h(values + s * ss + 16 * c), o[c]);
    }
    const vf by = vf_set1(total);
    for (int64_t c = 0; c < chunks; c++) vf_store(out + 16 * c, vf_div(o[c], by));
}
static double run(int threads, int half, int64_t S, int64_t distinct, void *k, void *v, uint8_t *allowed, int reps) {
    const int64_t L = 30, KV = 3, H = 9, hd = 64;
    float q[64]; for (int i = 0; i < 64; i++) q[i] = 0.01f * i;
    static float outs[9 * 64];
    double t0 = omp_get_wtime();
    for (int r = 0; r < reps; r++)
        #pragma omp parallel num_threads(threads)
        {
            float *scores = malloc((S + 16) * 4);
            for (int64_t l = 0; l < L; l++) {
                #pragma omp for schedule(static)
                for (int64_t h = 0; h < H; h++) {
                    const int64_t at = ((l % distinct) * KV + h / 3) * S * hd;
                    if (half) attend_h(q, (uint16_t *)k + at, (uint16_t *)v + at, hd, allowed, S, hd, 0.125f, scores, outs + h * 64);
                    else attend_head(q, (float *)k + at, (float *)v + at, hd, allowed, S, hd, 0.125f, NULL, NULL, 0, 0, scores, outs + h * 64);
                }
            }
            free(scores);
        }
    return (omp_get_wtime() - t0) / reps * 1e3;
}
int main(int argc, char **argv) {
    const int64_t S = atoi(argv[1]), L = 30, KV = 3, hd = 64, N = L * KV * S * hd;
    float *k = aligned_alloc(64, N * 4), *v = aligned_alloc(64, N * 4);
    uint16_t *kh = aligned_alloc(64, N * 2), *vh = aligned_alloc(64, N * 2);
    for (int64_t i = 0; i < N; i++) { k[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f; v[i] = (float)((i * 104729) % 1000) / 1000.0f; kh[i] = hb_f2h(k[i]); vh[i] = hb_f2h(v[i]); }
    uint8_t *allowed = malloc(S); memset(allowed, 1, S);
    double t[2][2][5];
    for (int round = 0; round < 5; round++)
        for (int th = 1; th <= 2; th++)
            for (int half = 0; half < 2; half++)
                t[th - 1][half][round] = run(th, half, S, 30, half ? (void *)kh : k, half ? (void *)vh : v, allowed, 10);
    for (int th = 0; th < 2; th++) {
        double a[2];
        for (int half = 0; half < 2; half++) { double m = 1e9; for (int r = 0; r < 5; r++) m = t[th][half][r] < m ? t[th][half][r] : m; a[half] = m; }
        printf("S=%ld, %d thread(s), cold: float32 %.3f ms, float16 %.3f ms a pass (best of 5)\n", S, th + 1, a[0], a[1]);
    }
}
