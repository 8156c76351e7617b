/* The int8 step's output layer over each row's own shortlist: its product, bias, log-softmax and top-k.
 *
 * The full layer (output_layer.c) reads the output product of every row with all V words, made by ONNX
 * Runtime. Here row r is scored over the words every text gets (`always`, about 1,000 frequent ones: their
 * product `raw` made by ONNX Runtime for the whole batch, a dense product) and its text's own other words
 * (ids[starts[r] .. + counts[r]), about 170 for en-fr/4: service/decoding/shortlist_rows.py), whose
 * products are computed here, reading the weight by word:
 *   acc[c] = sum_o (a[r, o] - 128) w[c, o]               (a: the maxout quantized, u8 around 128; w: s8)
 *   logit[c] = (acc[c] * wscale[c]) * scale[r] + bias[c]  (as the graph: MatMulIntegerToFloat, Mul, Add)
 * then log-probabilities over those words (logit - (max + log(sum of exp))) and their k best (ties: the
 * lower id, in whatever order the words come). The sums are integers, exact whichever instructions compute
 * them (`form`: 2 AVX-512 VNNI's vpdpbusd on a as u8, less wsum = 128 x each word's weight sum; 1 AVX2's
 * vpmaddwd on both as int16; 0 plain C; -1 the best the CPU has): every form gives the same bits. A row is
 * computed alone, from its own inputs: the same bits in any batch (batch invariance).
 */
#include <immintrin.h>
#include <stdlib.h>

#include "kernels.h"

typedef struct {
    int64_t O4, k, V, F;
    const int32_t *a;              /* (rows, O4): each row's O bytes, u8 around 128, as quads */
    const float *scale;            /* (rows, 1) */
    const float *raw;              /* (rows, F): the always-words' products (acc x wscale) */
    const int32_t *always;         /* (F,) their ids */
    const int32_t *w;              /* (V, O4): word c's O weights, s8, as quads */
    const int32_t *wsum;           /* (V,) 128 x the sum of word c's weights */
    const float *wscale, *bias;    /* (V,) */
    const int64_t *starts, *counts; /* (rows,) */
    const int32_t *ids;            /* each row's own words, ascending, none of them always-words */
    float *values;                 /* (rows, k) */
    int64_t *out_ids;              /* (rows, k) */
    int form, failed;
} Layer;

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* 16 vectors' sums: lane 4q + p of the result is the sum of s[4p + q] (a 4 x 4 transpose) */
VNNI static inline __attribute__((always_inline)) __m512i sums16(__m512i *s) {
    __m512i z[8], w[4], t[2];
    for (int i = 0; i < 8; i++) /* 8 lanes of s[2i], then 8 of s[2i + 1] */
        z[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(s[2 * i], s[2 * i + 1], 0x44),
                                _mm512_shuffle_i64x2(s[2 * i], s[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* block q: 4 lanes of s[4i + q] */
        w[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(z[2 * i], z[2 * i + 1], 0x88),
                                _mm512_shuffle_i64x2(z[2 * i], z[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* block q: s[8i + q], s[8i + 4 + q], s[8i + q], s[8i + 4 + q] halves */
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(w[2 * i], w[2 * i + 1]),
                                _mm512_unpackhi_epi32(w[2 * i], w[2 * i + 1]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
}

/* acc[j] for the n candidates cand of one row a (O4 quads; the last 16 or fewer masked), 16 candidates at a time */
VNNI static void dots_vnni(int64_t O4, const int32_t *a, const int32_t *w, const int32_t *wsum, const int32_t *cand,
                           int64_t n, int32_t *acc) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        int64_t m = n - j0 < 16 ? n - j0 : 16;
        __m512i s[16];
        const int32_t *wc[16];
        for (int j = 0; j < 16; j++) { /* past the last candidate: the first again, its sums unused */
            s[j] = _mm512_setzero_si512();
            wc[j] = w + (int64_t)cand[j0 + (j < m ? j : 0)] * O4;
        }
        int64_t o = 0;
        for (; o + 16 <= O4; o += 16) { /* 16 independent sums: the products' latency overlapped */
            __m512i x = _mm512_loadu_si512(a + o);
            for (int j = 0; j < 16; j++) s[j] = _mm512_dpbusd_epi32(s[j], x, _mm512_loadu_si512(wc[j] + o));
        }
        if (o < O4) {
            __mmask16 in = (__mmask16)((1u << (O4 - o)) - 1);
            __m512i x = _mm512_maskz_loadu_epi32(in, a + o);
            for (int j = 0; j < 16; j++) s[j] = _mm512_dpbusd_epi32(s[j], x, _mm512_maskz_loadu_epi32(in, wc[j] + o));
        }
        int32_t lane[16];
        _mm512_storeu_si512(lane, sums16(s));
        for (int64_t j = 0; j < m; j++) acc[j0 + j] = lane[(j % 4) * 4 + j / 4] - wsum[cand[j0 + j]];
    }
}

/* the same with a and w as int16 (a - 128 given in a16, O int16; past the last 16, plain), 8 candidates at a time */
__attribute__((target("avx2"))) static void dots_avx2(int64_t O, const int16_t *a16, const int8_t *w,
                                                      const int32_t *cand, int64_t n, int32_t *acc) {
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        int64_t m = n - j0 < 8 ? n - j0 : 8;
        __m256i s[8];
        for (int j = 0; j < 8; j++) {
            __m256i sum = _mm256_setzero_si256();
            const int8_t *wc = w + (int64_t)cand[j0 + (j < m ? j : 0)] * O;
            for (int64_t o = 0; j < m && o + 16 <= O; o += 16) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(a16 + o));
                __m256i y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wc + o)));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(x, y));
            }
            s[j] = sum;
        }
        __m256i h01 = _mm256_hadd_epi32(s[0], s[1]), h23 = _mm256_hadd_epi32(s[2], s[3]);
        __m256i h45 = _mm256_hadd_epi32(s[4], s[5]), h67 = _mm256_hadd_epi32(s[6], s[7]);
        __m256i h0 = _mm256_hadd_epi32(h01, h23), h1 = _mm256_hadd_epi32(h45, h67);
        __m256i all = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
        int32_t lane[8];
        _mm256_storeu_si256((__m256i *)lane, all);
        for (int64_t j = 0; j < m; j++) {
            const int8_t *wc = w + (int64_t)cand[j0 + j] * O;
            acc[j0 + j] = lane[j];
            for (int64_t o = O / 16 * 16; o < O; o++) acc[j0 + j] += a16[o] * wc[o];
        }
    }
}

static void dots_plain(int64_t O, const uint8_t *a, const int8_t *w, const int32_t *cand, int64_t n, int32_t *acc) {
    for (int64_t j = 0; j < n; j++) {
        const int8_t *wc = w + (int64_t)cand[j] * O;
        int32_t sum = 0;
        for (int64_t o = 0; o < O; o++) sum += ((int32_t)a[o] - 128) * wc[o];
        acc[j] = sum;
    }
}

/* x[j] = the logit of word id[j] (from raw, its product; or from acc, its integer sum); returns the largest */
static inline __attribute__((always_inline)) float logits(const float *raw, const int32_t *acc, const int32_t *id,
                                                          int64_t n, float s, const Layer *p, float *x) {
    int64_t body = n / LANES * LANES;
    vf top = splat(-INFINITY);
    for (int64_t j0 = 0; j0 < body; j0 += LANES) {
        float rs[LANES], bs[LANES];
        for (int l = 0; l < LANES; l++) {
            rs[l] = raw ? raw[j0 + l] : (float)acc[j0 + l] * p->wscale[id[j0 + l]];
            bs[l] = p->bias[id[j0 + l]];
        }
        vf rv, bv;
        memcpy(&rv, rs, sizeof rv);
        memcpy(&bv, bs, sizeof bv);
        vf v = rv * s + bv;
        memcpy(x + j0, &v, sizeof v);
        top = select_v(v > top, v, top);
    }
    float m = -INFINITY, lane[LANES];
    memcpy(lane, &top, sizeof lane);
    for (int l = 0; l < LANES; l++) m = lane[l] > m ? lane[l] : m;
    for (int64_t j = body; j < n; j++) {
        float r = raw ? raw[j] : (float)acc[j] * p->wscale[id[j]];
        x[j] = r * s + p->bias[id[j]];
        m = x[j] > m ? x[j] : m;
    }
    return m;
}

/* the sum of exp(x - m) over x[0 .. n), and its words into the k best */
static inline __attribute__((always_inline)) float sum_and_top(const float *x, const int32_t *id, int64_t n, float m,
                                                               int64_t k, float *best, int64_t *ids, int64_t *have) {
    int64_t body = n / LANES * LANES;
    vf sums = splat(0.0f);
    for (int64_t j0 = 0; j0 < body; j0 += LANES) {
        vf v;
        memcpy(&v, x + j0, sizeof v);
        sums += exp_v(v - m);
        if (any(v >= (*have == k ? best[k - 1] : -INFINITY)))
            for (int l = 0; l < LANES; l++) offer(best, ids, have, k, x[j0 + l], id[j0 + l]);
    }
    float sum = hsum(sums);
    for (int64_t j = body; j < n; j++) {
        vf e = exp_v(splat(x[j] - m));
        sum += e[0];
        offer(best, ids, have, k, x[j], id[j]);
    }
    return sum;
}

/* row r's log-probabilities over its words (the always-words, then its own n with sums acc), the k best into
 * values and out_ids; x: room for F + n floats */
CLONES static void top_of_row(const Layer *p, int64_t r, const int32_t *acc, float *x, int64_t n) {
    const int32_t *own = p->ids + p->starts[r];
    float s = p->scale[r], best[MAX_K];
    int64_t F = p->F, k = p->k, have = 0, *ids = p->out_ids + r * k;
    float m = fmaxf(logits(p->raw + r * F, NULL, p->always, F, s, p, x), logits(NULL, acc, own, n, s, p, x + F));
    float sum = sum_and_top(x, p->always, F, m, k, best, ids, &have);
    sum += sum_and_top(x + F, own, n, m, k, best, ids, &have);
    float lse = m + logf(sum);
    for (int64_t j = 0; j < k; j++) p->values[r * k + j] = best[j] - lse;
}

/* rows [first, last), each alone: its own words' sums, then its top-k */
static void layer_rows(const void *ctx, int64_t first, int64_t last) {
    Layer *p = (Layer *)ctx;
    int64_t most = 0, O = 4 * p->O4;
    for (int64_t r = first; r < last; r++) most = p->counts[r] > most ? p->counts[r] : most;
    int32_t *acc = malloc((size_t)(most + 1) * sizeof(int32_t));
    float *x = malloc((size_t)(most + p->F + 1) * sizeof(float));
    int16_t *a16 = malloc((size_t)O * sizeof(int16_t) + 1);
    if (!acc || !x || !a16) p->failed = 1; /* another thread may set it too: only ever to 1 */
    for (int64_t r = first; r < last && acc && x && a16; r++) {
        const int32_t *a = p->a + r * p->O4, *own = p->ids + p->starts[r];
        int64_t n = p->counts[r];
        if (p->form == 2) {
            dots_vnni(p->O4, a, p->w, p->wsum, own, n, acc);
        } else if (p->form == 1) {
            for (int64_t o = 0; o < O; o++) a16[o] = (int16_t)(((const uint8_t *)a)[o] - 128);
            dots_avx2(O, a16, (const int8_t *)p->w, own, n, acc);
        } else {
            dots_plain(O, (const uint8_t *)a, (const int8_t *)p->w, own, n, acc);
        }
        top_of_row(p, r, acc, x, n);
    }
    free(acc);
    free(x);
    free(a16);
}

/* the arguments' shapes and words checked, or -1 with a ValueError saying what is wrong */
static int check(const Py_buffer *b, int form) {
    Py_ssize_t rows = b[0].shape[0], O4 = b[0].shape[1], F = b[3].shape[0], V = b[4].shape[0], k = b[11].shape[1];
    if (b[1].shape[0] != rows || b[1].shape[1] != 1 || b[2].shape[0] != rows || b[2].shape[1] != F ||
        b[4].shape[1] != O4 || b[5].shape[0] != V || b[6].shape[0] != V || b[7].shape[0] != V ||
        b[8].shape[0] != rows || b[9].shape[0] != rows || b[11].shape[0] != rows || b[12].shape[0] != rows ||
        b[12].shape[1] != k || k < 1 || k > MAX_K) {
        PyErr_Format(PyExc_ValueError, "shortlist_layer: shapes do not agree (a (rows, O / 4), scale (rows, 1), raw "
                     "(rows, F), always (F,), w (V, O / 4), wsum, wscale and bias (V,), starts and counts (rows,), "
                     "values and out_ids (rows, k) with 1 <= k <= %d)", MAX_K);
        return -1;
    }
    if (form > int8_best_form()) {
        PyErr_Format(PyExc_ValueError, "shortlist_layer: form %d is not available on this CPU (at most %d)", form,
                     int8_best_form());
        return -1;
    }
    const int32_t *always = b[3].buf, *ids = b[10].buf;
    const int64_t *starts = b[8].buf, *counts = b[9].buf;
    for (Py_ssize_t j = 0; j < F; j++)
        if (always[j] < 0 || always[j] >= V) {
            PyErr_Format(PyExc_ValueError, "shortlist_layer: always holds %d, not a word id below V = %zd", always[j], V);
            return -1;
        }
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (counts[r] < 0 || F + counts[r] < k || starts[r] < 0 || starts[r] + counts[r] > b[10].shape[0]) {
            PyErr_Format(PyExc_ValueError, "shortlist_layer: row %zd's words (start %lld, count %lld, and %zd always) must "
                         "be at least k = %zd and lie within the %zd ids", r, (long long)starts[r], (long long)counts[r],
                         F, k, b[10].shape[0]);
            return -1;
        }
        for (int64_t j = 0; j < counts[r]; j++) {
            int32_t c = ids[starts[r] + j];
            if (c < 0 || c >= V || (j > 0 && c <= ids[starts[r] + j - 1])) {
                PyErr_Format(PyExc_ValueError, "shortlist_layer: row %zd's words must be ascending ids below V = %zd "
                             "(got %d)", r, V, c);
                return -1;
            }
        }
    }
    return 0;
}

PyObject *py_shortlist_layer(PyObject *self, PyObject *args) {
    (void)self;
    enum { N = 13 };
    PyObject *o[N];
    static const char *names[N] = {"a", "scale", "raw", "always", "w", "wsum", "wscale", "bias", "starts", "counts",
                                   "ids", "values", "out_ids"};
    static const int ndims[N] = {2, 2, 2, 1, 2, 1, 1, 1, 1, 1, 1, 2, 2};
    static const char fmts[N] = {'i', 'f', 'f', 'i', 'i', 'i', 'f', 'f', 'q', 'q', 'i', 'f', 'q'};
    int threads = 1, form = -1;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOO|ii", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                          &o[9], &o[10], &o[11], &o[12], &threads, &form))
        return NULL;
    Py_buffer b[N];
    int got = 0;
    for (; got < N; got++)
        if (get_buffer(o[got], &b[got], ndims[got], fmts[got], got >= 11, names[got]) < 0) break;
    PyObject *result = NULL;
    if (got == N && check(b, form) == 0) {
        Layer job = {b[0].shape[1], b[12].shape[1], b[4].shape[0], b[3].shape[0], b[0].buf, b[1].buf, b[2].buf,
                     b[3].buf, b[4].buf, b[5].buf, b[6].buf, b[7].buf, b[8].buf, b[9].buf, b[10].buf, b[11].buf,
                     b[12].buf, form < 0 ? int8_best_form() : form, 0};
        Py_BEGIN_ALLOW_THREADS
        run_rows(layer_rows, &job, b[0].shape[0], b[9].buf, job.V, threads);
        Py_END_ALLOW_THREADS
        if (job.failed) PyErr_NoMemory();
        else result = Py_NewRef(Py_None);
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return result;
}
