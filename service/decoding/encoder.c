/* The encoder's bidirectional GRU as one compiled kernel, its recurrence in int8.
 *
 * For each row b with source length L (positions L.. are padding, written as zeros) and direction d
 * (0: forward over positions 0..L-1, 1: backward over L-1..0), h = 0 at the start:
 *   x = table[ids[b, pos], d]                       (3H float16: W x + Wb, with Rb added for z and r)
 *   g = (q(h) . Rq[d]^T) * s(h) * wscale[d]         (int8 products, exact in int32)
 *   z = sigmoid(x_z + g_z), r = sigmoid(x_r + g_r), n = tanh(x_n + r (g_n + rbn[d]))
 *   h = (1 - z) n + z h                             written to out[b, pos, d H : (d + 1) H]
 * ONNX's GRU with linear_before_reset = 1 (PyTorch's), gates in ONNX's order z, r, h. q(h) is h
 * quantized per row to [-127, 127] with s(h) = max |h| / 127; Rq is R quantized per output column.
 * The input projections of every token are a table made once at load (service/decoding/fused_encoder.py),
 * so a step reads them instead of multiplying: the recurrence is all that is computed per token.
 *
 * The products are integer sums, exact whichever instructions compute them (AVX-512 VNNI's vpdpbusd on
 * q + 128 as u8 and Rq as s8, less 128 x each column's sum; AVX2's vpmaddwd on both as int16; or plain C:
 * `form` chooses, -1 the best the CPU has), so every form gives the same bits; each row is computed alone, in
 * the same order whatever the batch (batch invariance). The two directions run on two threads when
 * `threads` > 1.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>

#include "kernels.h"

#define BLOCK 4 /* rows per product block */

typedef struct {
    int64_t B, T, H, V;
    const uint16_t *table;   /* (V, 2, 3H) float16 */
    const int64_t *ids;      /* (B, T) */
    const int64_t *lengths;  /* (B,) */
    const int32_t *weights;  /* (2, H / 2, 3H): column j's int16 pair (k, k + 1) in one int32 */
    const int32_t *weights8; /* (2, H / 4, 3H): column j's s8 quad (k .. k + 3) in one int32 */
    const int32_t *colsum;   /* (2, 3H): 128 x the sum of column j's weights */
    const float *wscale;     /* (2, 3H) */
    const float *rbn;        /* (2, H) */
    float *out;              /* (B, T, 2H) */
    int form;
    int failed;
} Gru;

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* acc rows [i0, i0 + R) x columns [j0, j0 + 16 V) = u (rows of K4 quads of q + 128 as u8) . w (K4, J quads of
 * s8) - colsum (128 x each column's sum): vpdpbusd's u8 x s8 products, exact in int32 */
VNNI static inline __attribute__((always_inline)) void tile_vnni(int R, int V, int64_t K4, int64_t J, const int32_t *u,
                                                                 const int32_t *w, const int32_t *colsum,
                                                                 int32_t *acc, int64_t i0, int64_t j0) {
    __m512i a[BLOCK][4], wv[4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) a[r][v] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K4; k++) {
        for (int v = 0; v < V; v++) wv[v] = _mm512_loadu_si512(w + k * J + j0 + 16 * v);
        for (int r = 0; r < R; r++) {
            __m512i x = _mm512_set1_epi32(u[(i0 + r) * K4 + k]);
            for (int v = 0; v < V; v++) a[r][v] = _mm512_dpbusd_epi32(a[r][v], x, wv[v]);
        }
    }
    for (int v = 0; v < V; v++) {
        __m512i c = _mm512_loadu_si512(colsum + j0 + 16 * v);
        for (int r = 0; r < R; r++) _mm512_storeu_si512(acc + (i0 + r) * J + j0 + 16 * v, _mm512_sub_epi32(a[r][v], c));
    }
}

/* every row of u (n), BLOCK rows at a time and the last ones alone; columns 64 at a time, the last ones
 * (J a multiple of 16) 16 at a time */
VNNI static void product_vnni(int64_t n, int64_t K4, int64_t J, const int32_t *u, const int32_t *w,
                              const int32_t *colsum, int32_t *acc) {
    int64_t wide = J / 64 * 64, i0 = 0;
    for (; i0 + BLOCK <= n; i0 += BLOCK) {
        for (int64_t j0 = 0; j0 < wide; j0 += 64) tile_vnni(BLOCK, 4, K4, J, u, w, colsum, acc, i0, j0);
        for (int64_t j0 = wide; j0 < J; j0 += 16) tile_vnni(BLOCK, 1, K4, J, u, w, colsum, acc, i0, j0);
    }
    for (; i0 < n; i0++) {
        for (int64_t j0 = 0; j0 < wide; j0 += 64) tile_vnni(1, 4, K4, J, u, w, colsum, acc, i0, j0);
        for (int64_t j0 = wide; j0 < J; j0 += 16) tile_vnni(1, 1, K4, J, u, w, colsum, acc, i0, j0);
    }
}

/* acc (n rows of J) = q (n rows of K2 int16 pairs, n a multiple of BLOCK) . w (K2, J pairs): vpmaddwd */
__attribute__((target("avx2")))
static void product_avx2(int64_t n, int64_t K2, int64_t J, const int32_t *q, const int32_t *w, int32_t *acc) {
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
        for (int64_t j0 = 0; j0 < J; j0 += 16) {
            __m256i a[BLOCK][2];
            for (int r = 0; r < BLOCK; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
            for (int64_t k = 0; k < K2; k++) {
                const int32_t *wk = w + k * J + j0;
                __m256i w0 = _mm256_loadu_si256((const __m256i *)wk), w1 = _mm256_loadu_si256((const __m256i *)(wk + 8));
                for (int r = 0; r < BLOCK; r++) {
                    __m256i x = _mm256_set1_epi32(q[(i0 + r) * K2 + k]);
                    a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(x, w0));
                    a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(x, w1));
                }
            }
            for (int r = 0; r < BLOCK; r++) {
                _mm256_storeu_si256((__m256i *)(acc + (i0 + r) * J + j0), a[r][0]);
                _mm256_storeu_si256((__m256i *)(acc + (i0 + r) * J + j0 + 8), a[r][1]);
            }
        }
}

static void product_plain(int64_t n, int64_t K2, int64_t J, const int32_t *q, const int32_t *w, int32_t *acc) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < J; j++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < K2; k++) {
                int32_t x = q[i * K2 + k], y = w[k * J + j];
                sum += (int32_t)(int16_t)x * (int16_t)y + (x >> 16) * (y >> 16);
            }
            acc[i * J + j] = sum;
        }
}

int int8_best_form(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}

/* 16 float16 (their bits) as floats: normal and subnormal numbers exactly (the exponent rebased by
 * multiplying by 2^112), the sign put back; the table has no infinities or NaNs */
static inline __attribute__((always_inline)) vf half_v(const uint16_t *p) {
    typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
    vh bits;
    memcpy(&bits, p, sizeof bits);
    vi wide = __builtin_convertvector(bits, vi);
    vf magnitude = (vf)((wide & 0x7fff) << 13) * 0x1p112f;
    return (vf)((vi)magnitude | ((wide & 0x8000) << 16));
}

/* one row's new state from its products (acc, 3H) and inputs (x, 3H); h updated in place, written to
 * out; quantized into q in the form the next product reads (VNNI: q + 128 as H bytes; else H int16), its
 * scale returned */
CLONES
static float cell(int64_t H, const int32_t *acc, const uint16_t *x, const float *ws, const float *rbn, float scale,
                  float *h, float *out, void *q, int form) {
    vf top = splat(0.0f);
    for (int64_t j = 0; j < H; j += LANES) {
        vf g[3], xs[3], wv[3];
        for (int p = 0; p < 3; p++) {
            vi a;
            memcpy(&a, acc + p * H + j, sizeof a);
            memcpy(&wv[p], ws + p * H + j, sizeof wv[p]);
            xs[p] = half_v(x + p * H + j);
            g[p] = __builtin_convertvector(a, vf) * (wv[p] * scale);
        }
        vf bn, hv;
        memcpy(&bn, rbn + j, sizeof bn);
        memcpy(&hv, h + j, sizeof hv);
        vf z = sigmoid_v(xs[0] + g[0]), r = sigmoid_v(xs[1] + g[1]);
        vf n = tanh_v(xs[2] + r * (g[2] + bn));
        hv = (1.0f - z) * n + z * hv;
        memcpy(h + j, &hv, sizeof hv);
        memcpy(out + j, &hv, sizeof hv);
        vf m = (vf)((vi)hv & 0x7fffffff);
        top = select_v(m > top, m, top);
    }
    float lane[LANES], most = 0.0f;
    memcpy(lane, &top, sizeof lane);
    for (int l = 0; l < LANES; l++) most = lane[l] > most ? lane[l] : most;
    float inverse = most > 0.0f ? 127.0f / most : 0.0f;
    if (form == 2)
        for (int64_t j = 0; j < H; j++) ((uint8_t *)q)[j] = (uint8_t)((int)__builtin_rintf(h[j] * inverse) + 128);
    else
        for (int64_t j = 0; j < H; j++) ((int16_t *)q)[j] = (int16_t)__builtin_rintf(h[j] * inverse);
    return most / 127.0f;
}

/* the products of the n running rows (their states q, gathered into block) for direction d */
static void product(const Gru *g, int64_t d, int64_t n, const int32_t *q, const int64_t *running, int32_t *block,
                    int32_t *acc) {
    int64_t H = g->H, J = 3 * H, K2 = H / 2, K4 = H / 4, words = g->form == 2 ? K4 : K2;
    for (int64_t i = 0; i < n; i++) memcpy(block + i * words, q + running[i] * K2, (size_t)words * sizeof(int32_t));
    if (g->form == 2) { /* u8 quads: rows one by one past the last whole block, no padding */
        product_vnni(n, K4, J, block, g->weights8 + d * K4 * J, g->colsum + d * J, acc);
        return;
    }
    int64_t padded = (n + BLOCK - 1) / BLOCK * BLOCK;
    memset(block + n * K2, 0, (size_t)((padded - n) * K2) * sizeof(int32_t));
    if (g->form == 1) product_avx2(padded, K2, J, block, g->weights + d * K2 * J, acc);
    else product_plain(padded, K2, J, block, g->weights + d * K2 * J, acc);
}

/* one direction over every row: the rows still running at step t (those longer than t) are gathered
 * into blocks for the product, then each takes its cell step at its own position */
static void *direction(void *arg) {
    Gru *g = ((Gru **)arg)[0];
    int64_t d = (int64_t)(intptr_t)((Gru **)arg)[1];
    int64_t B = g->B, T = g->T, H = g->H, J = 3 * H, K2 = H / 2, rows = (B + BLOCK - 1) / BLOCK * BLOCK, most = 0;
    float *h = calloc((size_t)(B * H), sizeof(float)), *scale = calloc((size_t)B, sizeof(float));
    int32_t *q = calloc((size_t)(B * K2), sizeof(int32_t)), *block = calloc((size_t)(rows * K2), sizeof(int32_t));
    int32_t *acc = malloc((size_t)(rows * J) * sizeof(int32_t));
    int64_t *running = malloc((size_t)B * sizeof(int64_t));
    if (!h || !scale || !q || !block || !acc || !running) {
        g->failed = 1;
    } else {
        if (g->form == 2) memset(q, 128, (size_t)(B * K2) * sizeof(int32_t)); /* the zero state, as u8 */
        for (int64_t b = 0; b < B; b++) {
            int64_t L = g->lengths[b] < T ? (g->lengths[b] > 0 ? g->lengths[b] : 0) : T;
            most = L > most ? L : most;
            for (int64_t t = L; t < T; t++) memset(g->out + (b * T + t) * 2 * H + d * H, 0, (size_t)H * sizeof(float));
        }
        for (int64_t t = 0; t < most; t++) {
            int64_t n = 0;
            for (int64_t b = 0; b < B; b++)
                if (g->lengths[b] > t) running[n++] = b;
            product(g, d, n, q, running, block, acc);
            for (int64_t i = 0; i < n; i++) {
                int64_t b = running[i], L = g->lengths[b] < T ? g->lengths[b] : T;
                int64_t pos = d == 0 ? t : L - 1 - t;
                const uint16_t *x = g->table + (g->ids[b * T + pos] * 2 + d) * J;
                scale[b] = cell(H, acc + i * J, x, g->wscale + d * J, g->rbn + d * H, scale[b], h + b * H,
                                g->out + (b * T + pos) * 2 * H + d * H, q + b * K2, g->form);
            }
        }
    }
    free(h), free(scale), free(q), free(block), free(acc), free(running);
    return NULL;
}

static void run_gru(Gru *g, int threads) {
    void *args[2][2] = {{g, (void *)0}, {g, (void *)1}};
    pthread_t other;
    int started = threads > 1 && pthread_create(&other, NULL, direction, args[1]) == 0;
    direction(args[0]);
    if (started) pthread_join(other, NULL);
    else direction(args[1]);
}

#define ARRAYS 9

PyObject *py_gru_encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[ARRAYS];
    static const char *names[ARRAYS] = {"table", "ids", "lengths", "weights", "weights8", "colsum", "wscale", "rbn",
                                        "out"};
    static const int ndims[ARRAYS] = {3, 2, 1, 3, 3, 2, 2, 2, 3};
    static const char fmts[ARRAYS] = {'H', 'q', 'q', 'i', 'i', 'i', 'f', 'f', 'f'};
    int threads = 1, form = -1;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO|ii", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                          &threads, &form))
        return NULL;
    Py_buffer b[ARRAYS];
    int got = 0;
    for (; got < ARRAYS; got++)
        if (get_buffer(o[got], &b[got], ndims[got], fmts[got], got == ARRAYS - 1, names[got]) < 0) break;
    PyObject *result = NULL;
    if (got == ARRAYS) {
        Py_ssize_t V = b[0].shape[0], J = b[0].shape[2], H = J / 3, B = b[1].shape[0], T = b[1].shape[1];
        int best = int8_best_form();
        const int64_t *ids = b[1].buf;
        Py_ssize_t bad = -1;
        for (Py_ssize_t i = 0; i < B * T && bad < 0; i++)
            if (ids[i] < 0 || ids[i] >= V) bad = i;
        if (b[0].shape[1] != 2 || J % 3 || H % LANES || b[2].shape[0] != B || b[3].shape[0] != 2 ||
            b[3].shape[1] != H / 2 || b[3].shape[2] != J || b[4].shape[0] != 2 || b[4].shape[1] != H / 4 ||
            b[4].shape[2] != J || b[5].shape[0] != 2 || b[5].shape[1] != J || b[6].shape[0] != 2 ||
            b[6].shape[1] != J || b[7].shape[0] != 2 || b[7].shape[1] != H || b[8].shape[0] != B ||
            b[8].shape[1] != T || b[8].shape[2] != 2 * H) {
            PyErr_SetString(PyExc_ValueError, "gru_encode: shapes do not agree (table (V, 2, 3H) with H a multiple "
                            "of 16, ids (B, T), lengths (B,), weights (2, H / 2, 3H), weights8 (2, H / 4, 3H), "
                            "colsum (2, 3H), wscale (2, 3H), rbn (2, H), out (B, T, 2H))");
        } else if (bad >= 0) {
            PyErr_Format(PyExc_ValueError, "gru_encode: ids[%zd, %zd] = %lld is outside the vocabulary [0, %zd)",
                         bad / T, bad % T, (long long)ids[bad], V);
        } else if (form > best) {
            PyErr_Format(PyExc_ValueError, "gru_encode: form %d is not available on this CPU (at most %d)", form, best);
        } else {
            Gru g = {B, T, H, V, b[0].buf, ids, b[2].buf, b[3].buf, b[4].buf, b[5].buf, b[6].buf, b[7].buf, b[8].buf,
                     form < 0 ? best : form, 0};
            Py_BEGIN_ALLOW_THREADS
            run_gru(&g, threads);
            Py_END_ALLOW_THREADS
            result = g.failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
        }
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return result;
}

PyObject *py_gru_form(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    static const char *forms[3] = {"plain", "avx2", "avx512-vnni"};
    return PyUnicode_FromString(forms[int8_best_form()]);
}
