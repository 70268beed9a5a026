/* Runs the native kernels' C API on cases read from a file and writes every buffer back: how the ARM variants are
 * tested under qemu-aarch64 against the outputs the x86 variants compute (tests/kernels/test_native_variants.py
 * writes the cases and compares).
 *
 *   native_check IN OUT
 *
 * IN: int64 count of cases; each case: int64 op, int64 buffer count, each buffer as int64 bytes and its bytes, then
 * the op's arguments: op 1 (hb_linear): an hb_weights, int64 x, y, rows; op 2 (hb_layers): int64 count, that many
 * hb_layer, an hb_pass, int64 x; op 3 (hb_quantize_q4_1): int64 w, n, k, group, q, scales, mins; op 4
 * (hb_quantize_q8_0): int64 w, n, k, q, scales. A pointer field or a buffer argument is a buffer's index + 1 (0:
 * NULL). OUT: int64 hb_isa(), then per case int64 the op's return value and every buffer (int64 bytes and the
 * bytes) after it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "native.h"

int hb_isa(void);
int hb_linear(const float *x, const hb_weights *w, float *y, int64_t rows);
int hb_layers(const hb_layer *layers, int64_t count, const hb_pass *p, float *x);
int hb_quantize_q4_1(const float *w, int64_t n, int64_t k, int64_t group, uint8_t *q, uint16_t *scales,
                     uint16_t *mins);
int hb_quantize_q8_0(const float *w, int64_t n, int64_t k, int8_t *q, uint16_t *scales);

static FILE *in;
static void **buf;
static int64_t nbuf;

static void die(const char *what) {
    fprintf(stderr, "native_check: %s\n", what);
    exit(2);
}
static void get(void *p, size_t n) {
    if (fread(p, 1, n, in) != n) die("short input");
}
static int64_t i64(void) {
    int64_t v;
    get(&v, 8);
    return v;
}
/* a buffer index + 1 (0: NULL) as its address */
static void *at(uintptr_t index) {
    if (index == 0) return NULL;
    if ((int64_t)index > nbuf) die("buffer index out of range");
    return buf[index - 1];
}
#define FIX(field) (field) = at((uintptr_t)(field))
static void fix_weights(hb_weights *w) {
    FIX(w->w);
    FIX(w->sz);
    FIX(w->bias);
}

int main(int argc, char **argv) {
    if (argc != 3) die("usage: native_check IN OUT");
    if ((in = fopen(argv[1], "rb")) == NULL) die("cannot open IN");
    FILE *out = fopen(argv[2], "wb");
    if (out == NULL) die("cannot open OUT");
    const int64_t isa = hb_isa();
    if (isa == 0) die("built for no variant");
    fwrite(&isa, 8, 1, out);
    const int64_t cases = i64();
    for (int64_t c = 0; c < cases; c++) {
        const int64_t op = i64();
        nbuf = i64();
        buf = calloc((size_t)nbuf, sizeof(void *));
        int64_t *size = calloc((size_t)nbuf, sizeof(int64_t));
        for (int64_t i = 0; i < nbuf; i++) {
            size[i] = i64();
            buf[i] = aligned_alloc(64, (size_t)((size[i] + 63) / 64 * 64 + 64));
            get(buf[i], (size_t)size[i]);
        }
        int64_t ret = -99;
        if (op == 1) {
            hb_weights w;
            get(&w, sizeof w);
            fix_weights(&w);
            const int64_t x = i64(), y = i64(), rows = i64();
            ret = hb_linear(at((uintptr_t)x), &w, at((uintptr_t)y), rows);
        } else if (op == 2) {
            const int64_t count = i64();
            hb_layer *layers = calloc((size_t)count, sizeof(hb_layer));
            get(layers, sizeof(hb_layer) * (size_t)count);
            for (int64_t i = 0; i < count; i++) {
                hb_layer *L = &layers[i];
                FIX(L->norm1);
                FIX(L->norm2);
                FIX(L->ctx_gate);
                fix_weights(&L->qkv);
                fix_weights(&L->o);
                fix_weights(&L->gate_up);
                fix_weights(&L->down);
            }
            hb_pass p;
            get(&p, sizeof p);
            FIX(p.cos);
            FIX(p.sin);
            FIX(p.k_cache);
            FIX(p.v_cache);
            FIX(p.slots);
            FIX(p.mask);
            FIX(p.scratch);
            FIX(p.ctx_k);
            FIX(p.ctx_v);
            FIX(p.ctx_mask);
            FIX(p.log_k);
            FIX(p.merged);
            FIX(p.bias_a);
            FIX(p.bias_c);
            FIX(p.out_norm);
            FIX(p.normed);
            if (p.copies != 0) die("copies are not taken here");
            if (p.head != NULL) die("a head is not taken here");
            p.copy_after = NULL;
            p.copy_to = NULL;
            const int64_t x = i64();
            ret = hb_layers(layers, count, &p, at((uintptr_t)x));
            free(layers);
        } else if (op == 3) {
            const int64_t w = i64(), n = i64(), k = i64(), group = i64(), q = i64(), s = i64(), m = i64();
            ret = hb_quantize_q4_1(at((uintptr_t)w), n, k, group, at((uintptr_t)q), at((uintptr_t)s), at((uintptr_t)m));
        } else if (op == 4) {
            const int64_t w = i64(), n = i64(), k = i64(), q = i64(), s = i64();
            ret = hb_quantize_q8_0(at((uintptr_t)w), n, k, at((uintptr_t)q), at((uintptr_t)s));
        } else
            die("unknown op");
        fwrite(&ret, 8, 1, out);
        for (int64_t i = 0; i < nbuf; i++) {
            fwrite(&size[i], 8, 1, out);
            fwrite(buf[i], 1, (size_t)size[i], out);
            free(buf[i]);
        }
        free(buf);
        free(size);
    }
    fclose(out);
    fclose(in);
    return 0;
}
