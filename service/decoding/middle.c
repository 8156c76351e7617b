/* The int8 step's middle as one compiled kernel: from the attention's context to the output layer's input.
 *
 * For each row (service/decoding/fused_middle.py reads the constants from the step graph), as the graph
 * computes it (export/graphs/int8_step.py), with A = P - 3H and the state's product p carried from the step
 * before (its columns A.. are the GRU's hidden gates):
 *   u = [emb[prev] ; q(context)]                     (u8 around 128; q(x) = rint(x / unit) + 128, clamped)
 *   x = (u . Win) * win + bin                        (3H + O columns; int8 product, exact in int32)
 *   r = sigmoid(x[0:H] + p[A:A+H]), z = sigmoid(x[H:2H] + p[A+H:A+2H])
 *   n = tanh(x[2H:3H] + r p[A+2H:A+3H]), h = n + z (state - n)         -> next_state
 *   y = (q(h) . Wso) * wso + x[3H:3H+O], m[i] = max(y[i], y[O/2 + i])            (maxout, O / 2)
 *   s = max(max |m|, tiny), a = rint(m (qmax / s)) + 128                -> a (u8), scale = s inv_qmax
 *   always = (a . Wwords) * wwords                                      (the always-words' logits before scale)
 *   next_product = (q(h) . Wstate) * wstate + bstate                    (the next step's p)
 * The products are integer sums then `acc * mult + bias` in two roundings (no FMA: this file is compiled
 * without contraction), as ONNX Runtime's MatMulIntegerToFloat: the same bits as its products; its
 * QuantizeLinear likewise (divide, clamp, round to even). Sigmoid and tanh are kernels.h's, not ONNX
 * Runtime's: the rows' results are checked against the graph at load within a tolerance. Forms: 2 AVX-512
 * VNNI's vpdpbusd on u as u8 and W as s8 (less 128 x each column's sum), 0 plain C; every form gives the
 * same bits. Each row is computed alone (the same bits in any batch); rows split between threads.
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <stdlib.h>

#include "kernels.h"

typedef struct {
    int64_t H, P, C, E4, O, V;
    const int64_t *prev;
    const float *state, *product, *context;
    const int32_t *emb;        /* (V, E4): each word's embedding, u8 around 128, as quads */
    float unit, qmax, tiny, inv_qmax;
    Product in, so, words, next;
    float *next_state, *scale, *always, *next_product;
    int32_t *a;                /* (rows, O / 8): the maxout quantized, u8, as quads */
    int form, failed;
} Middle;

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define BLOCK 4

/* rows [i0, i0 + R) x panel j0 / 64: 4 x 16 columns, the last ones masked to J */
VNNI static inline __attribute__((always_inline)) void tile(int R, const Product *p, const int32_t *u, const int32_t *w,
                                                            float *out, int64_t i0, int64_t j0) {
    __m512i a[BLOCK][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) a[r][v] = _mm512_setzero_si512();
    for (int64_t k = 0; k < p->K4; k++) {
        __m512i wv[4];
        for (int v = 0; v < 4; v++) wv[v] = _mm512_loadu_si512(w + k * 64 + 16 * v);
        for (int r = 0; r < R; r++) {
            __m512i x = _mm512_set1_epi32(u[(i0 + r) * p->K4 + k]);
            for (int v = 0; v < 4; v++) a[r][v] = _mm512_dpbusd_epi32(a[r][v], x, wv[v]);
        }
    }
    for (int v = 0; v < 4; v++) {
        int64_t j = j0 + 16 * v, left = p->J - j;
        if (left <= 0) break;
        __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512i c = _mm512_loadu_si512(p->colsum + j);
        __m512 m = _mm512_loadu_ps(p->mult + j), b = p->bias ? _mm512_loadu_ps(p->bias + j) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][v], c)), m);
            if (p->bias) y = _mm512_add_ps(y, b);
            _mm512_mask_storeu_ps(out + (i0 + r) * p->J + j, keep, y);
        }
    }
}

/* out (n, J) = the product of u (n, K4 quads) by p: panel by panel, every row through each panel (read once) */
VNNI static void product_vnni(const Product *p, int64_t n, const int32_t *u, float *out) {
    for (int64_t j0 = 0; j0 < p->J; j0 += 64) {
        const int32_t *w = p->panels + j0 * p->K4;
        int64_t i0 = 0;
        for (; i0 + BLOCK <= n; i0 += BLOCK) tile(BLOCK, p, u, w, out, i0, j0);
        switch (n - i0) { /* the last rows in one pass over the panel, not one pass each */
        case 3: tile(3, p, u, w, out, i0, j0); break;
        case 2: tile(2, p, u, w, out, i0, j0); break;
        case 1: tile(1, p, u, w, out, i0, j0); break;
        default: break;
        }
    }
}

static void product_plain(const Product *p, int64_t n, const int32_t *u, float *out) {
    const uint8_t *x = (const uint8_t *)u;
    const int8_t *w = (const int8_t *)p->panels;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < p->J; j++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < 4 * p->K4; k++)
                sum += ((int32_t)x[i * 4 * p->K4 + k] - 128) * w[((j / 64) * p->K4 + k / 4) * 256 + (j % 64) * 4 + k % 4];
            float y = (float)sum * p->mult[j];
            out[i * p->J + j] = p->bias ? y + p->bias[j] : y;
        }
}

void int8_product(const Product *p, int64_t n, const int32_t *u, float *out, int form) {
    if (form == 2) product_vnni(p, n, u, out);
    else product_plain(p, n, u, out);
}

/* ONNX Runtime's QuantizeLinear to u8 with zero point 128: x / scale, clamped, rounded to even */
CLONES void quantize_u8(int64_t n, const float *x, float scale, uint8_t *q) {
    for (int64_t j = 0; j < n; j++) {
        float v = x[j] / scale;
        v = v < -128.0f ? -128.0f : v > 127.0f ? 127.0f : v;
        q[j] = (uint8_t)((int)__builtin_rintf(v) + 128);
    }
}

/* one row's GRU cell from its input gates x (3H) and carried product p: h into out, q(h) into q */
CLONES static void cell(int64_t H, const float *x, const float *p, const float *state, float *out, uint8_t *q,
                        float unit) {
    for (int64_t j = 0; j < H; j += LANES) {
        vf xr, xz, xn, pr, pz, pn, s;
        memcpy(&xr, x + j, sizeof xr), memcpy(&xz, x + H + j, sizeof xz), memcpy(&xn, x + 2 * H + j, sizeof xn);
        memcpy(&pr, p + j, sizeof pr), memcpy(&pz, p + H + j, sizeof pz), memcpy(&pn, p + 2 * H + j, sizeof pn);
        memcpy(&s, state + j, sizeof s);
        vf r = sigmoid_v(xr + pr), z = sigmoid_v(xz + pz);
        vf n = tanh_v(xn + r * pn);
        vf h = n + z * (s - n);
        memcpy(out + j, &h, sizeof h);
    }
    quantize_u8(H, out, unit, q);
}

/* one row's deep output: the maxima of y's halves (maxout: max(y[i], y[O / 2 + i])) quantized per row into a (O / 2
 * bytes); its scale */
static float maxout(int64_t O, const float *y, uint8_t *a, float qmax, float tiny) {
    float most = 0.0f, m[O / 2];
    for (int64_t i = 0; i < O / 2; i++) {
        m[i] = y[i] > y[O / 2 + i] ? y[i] : y[O / 2 + i];
        float abs = m[i] < 0.0f ? -m[i] : m[i];
        most = abs > most ? abs : most;
    }
    float s = most > tiny ? most : tiny, d = qmax / s;
    for (int64_t i = 0; i < O / 2; i++) m[i] = m[i] * d;
    quantize_u8(O / 2, m, 1.0f, a);
    return s;
}

static void middle_rows(const void *ctx, int64_t first, int64_t last) {
    Middle *g = (Middle *)ctx;
    int64_t n = last - first, H = g->H, O = g->O, K4 = g->in.K4, X = g->in.J, A = g->P - 3 * H;
    int32_t *u = calloc((size_t)(n * K4), sizeof(int32_t)), *q = malloc((size_t)(n * H / 4) * sizeof(int32_t));
    float *x = malloc((size_t)(n * X) * sizeof(float)), *y = malloc((size_t)(n * O) * sizeof(float));
    if (!u || !q || !x || !y) {
        g->failed = 1;
    } else {
        for (int64_t i = 0; i < n; i++) {
            int64_t r = first + i;
            memcpy(u + i * K4, g->emb + g->prev[r] * g->E4, (size_t)g->E4 * sizeof(int32_t));
            quantize_u8(g->C, g->context + r * g->C, g->unit, (uint8_t *)(u + i * K4 + g->E4));
        }
        int8_product(&g->in, n, u, x, g->form);
        for (int64_t i = 0; i < n; i++)
            cell(H, x + i * X, g->product + (first + i) * g->P + A, g->state + (first + i) * H,
                 g->next_state + (first + i) * H, (uint8_t *)(q + i * H / 4), g->unit);
        int8_product(&g->so, n, q, y, g->form);
        for (int64_t i = 0; i < n; i++) {
            for (int64_t j = 0; j < O; j++) y[i * O + j] = y[i * O + j] + x[i * X + 3 * H + j];
            float s = maxout(O, y + i * O, (uint8_t *)(g->a + (first + i) * O / 8), g->qmax, g->tiny);
            g->scale[first + i] = s * g->inv_qmax;
        }
        int8_product(&g->words, n, g->a + first * O / 8, g->always + first * g->words.J, g->form);
        int8_product(&g->next, n, q, g->next_product + first * g->P, g->form);
    }
    free(u), free(q), free(x), free(y);
}

enum { INPUTS = 5, PRODUCTS = 4, OUTPUTS = 5, ARRAYS = INPUTS + 4 * PRODUCTS + OUTPUTS };
static const char *names[ARRAYS] = {
    "prev", "state", "product", "context", "emb", "in panels", "in colsum", "in mult", "in bias", "so panels",
    "so colsum", "so mult", "so bias", "words panels", "words colsum", "words mult", "words bias", "next panels",
    "next colsum", "next mult", "next bias", "next_state", "a", "scale", "always", "next_product"};
static const int ndims[ARRAYS] = {1, 2, 2, 2, 2, 3, 1, 1, 1, 3, 1, 1, 1, 3, 1, 1, 1, 3, 1, 1, 1, 2, 2, 2, 2, 2};
static const char fmts[ARRAYS] = {'q', 'f', 'f', 'f', 'i', 'i', 'i', 'f', 'f', 'i', 'i', 'f', 'f', 'i', 'i', 'f',
                                  'f', 'i', 'i', 'f', 'f', 'f', 'i', 'f', 'f', 'f'};

int product_view(const Py_buffer *w, const char *who, const char *name, int64_t K4, int64_t J, Product *p) {
    int64_t Jp = w[0].shape[0] * 64;
    int has_bias = w[3].buf != NULL;
    if (w[0].shape[1] != K4 || w[0].shape[2] != 64 || w[1].shape[0] != Jp || w[2].shape[0] != Jp ||
        (has_bias && w[3].shape[0] != Jp) || J > Jp || J <= Jp - 64) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be (ceil(%lld / 64), %lld, 64) with colsum, mult and bias of "
                     "its padded columns", who, name, (long long)J, (long long)K4);
        return -1;
    }
    *p = (Product){K4, Jp, J, w[0].buf, w[1].buf, w[2].buf, has_bias ? w[3].buf : NULL};
    return 0;
}

int product_form(const char *who, int form) {
    int best = int8_best_form() == 2 ? 2 : 0;
    if (form < 0) return best;
    if (form == 0 || form == best) return form;
    PyErr_Format(PyExc_ValueError, "%s: form %d is not available on this CPU (0, or 2 with AVX-512 VNNI)", who, form);
    return -1;
}

/* product i's view (its buffers from b[INPUTS + 4 i]; J its output's width), or a ValueError */
static int product_of(const Py_buffer *b, int i, int64_t J, int64_t K4, Product *p) {
    return product_view(b + INPUTS + 4 * i, "middle", names[INPUTS + 4 * i], K4, J, p);
}

static int check(const Py_buffer *b, Middle *g) {
    int64_t n = b[0].shape[0], H = b[1].shape[1], M4 = b[INPUTS + 4 * PRODUCTS + 1].shape[1];
    g->H = H, g->P = b[2].shape[1], g->C = b[3].shape[1], g->E4 = b[4].shape[1], g->O = 8 * M4, g->V = b[4].shape[0];
    const Py_buffer *out = b + INPUTS + 4 * PRODUCTS;
    if (b[1].shape[0] != n || b[2].shape[0] != n || b[3].shape[0] != n || H % LANES || g->C % 4 || g->P < 3 * H ||
        out[0].shape[0] != n || out[0].shape[1] != H || out[1].shape[0] != n || out[2].shape[0] != n ||
        out[2].shape[1] != 1 || out[3].shape[0] != n || out[4].shape[0] != n || out[4].shape[1] != g->P) {
        PyErr_SetString(PyExc_ValueError, "middle: shapes do not agree (prev (rows,), state (rows, H) with H a multiple "
                        "of 16, product (rows, P >= 3H), context (rows, C), next_state (rows, H), a (rows, O / 8), "
                        "scale (rows, 1), always (rows, F), next_product (rows, P))");
        return -1;
    }
    if (product_of(b, 0, 3 * H + g->O, g->E4 + g->C / 4, &g->in) || product_of(b, 1, g->O, H / 4, &g->so) ||
        product_of(b, 2, out[3].shape[1], M4, &g->words) || product_of(b, 3, g->P, H / 4, &g->next))
        return -1;
    for (int64_t r = 0; r < n; r++)
        if (g->prev[r] < 0 || g->prev[r] >= g->V) {
            PyErr_Format(PyExc_ValueError, "middle: prev holds %lld, not a word id below %lld", (long long)g->prev[r],
                         (long long)g->V);
            return -1;
        }
    return 0;
}

static int bias_slot(int i) { return i >= INPUTS && i < INPUTS + 4 * PRODUCTS && (i - INPUTS) % 4 == 3; }

PyObject *py_middle(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arrays;
    int threads = 1, form = -1;
    Middle g = {0};
    if (!PyArg_ParseTuple(args, "O(ffff)|ii", &arrays, &g.unit, &g.qmax, &g.tiny, &g.inv_qmax, &threads, &form))
        return NULL;
    Py_buffer b[ARRAYS] = {{0}}; /* a product without bias: None */
    int ok = get_buffers(arrays, b, ARRAYS, ndims, fmts, names, INPUTS + 4 * PRODUCTS, bias_slot, "middle") == 0;
    if (ok && (g.form = product_form("middle", form)) < 0) ok = 0;
    PyObject *result = NULL;
    if (ok) g.prev = b[0].buf, g.state = b[1].buf, g.product = b[2].buf, g.context = b[3].buf, g.emb = b[4].buf;
    if (ok && check(b, &g) == 0) {
        const Py_buffer *out = b + INPUTS + 4 * PRODUCTS;
        g.next_state = out[0].buf, g.a = out[1].buf, g.scale = out[2].buf, g.always = out[3].buf;
        g.next_product = out[4].buf;
        result = run_rows_released(middle_rows, &g, b[0].shape[0], NULL, 0, threads, &g.failed);
    }
    release_buffers(b, ARRAYS);
    return result;
}
