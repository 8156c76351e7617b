/* The fused step's query graph compiled: a state's product, p = (q(state) . Wstate) * wstate + bstate.
 *
 * The query graph (service/decoding/fused_graphs.py: the step's QuantizeLinear of the state and its
 * MatMulIntegerToFloat) runs at joins only: the new texts' first states need the product the step carries for the
 * running rows (the middle makes it for the next step). ONNX Runtime runs it on its own prepacked copy of the
 * weights, cold in the cache by then; this runs the middle's next product (middle.c, the same panels, read every
 * step) on q(state): the same integer sums and roundings, so the same bits as the graph (checked at load,
 * service/decoding/fused_middle.py). Each row alone; rows split between threads.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdlib.h>

#include "kernels.h"

typedef struct {
    int64_t H;
    const float *state;
    float unit;
    Product next;
    float *out;
    int form, failed;
} Query;

static void query_rows(const void *ctx, int64_t first, int64_t last) {
    Query *g = (Query *)ctx;
    int64_t n = last - first, H = g->H;
    if (n <= 0) return;
    int32_t *q = malloc((size_t)(n * H / 4) * sizeof(int32_t));
    if (!q) {
        g->failed = 1;
        return;
    }
    for (int64_t i = 0; i < n; i++) quantize_u8(H, g->state + (first + i) * H, g->unit, (uint8_t *)(q + i * H / 4));
    int8_product(&g->next, n, q, g->out + first * g->next.J, g->form);
    free(q);
}

enum { ARRAYS = 6 };
static const char *names[ARRAYS] = {"state", "panels", "colsum", "mult", "bias", "out"};
static const int ndims[ARRAYS] = {2, 3, 1, 1, 1, 2};
static const char fmts[ARRAYS] = {'f', 'i', 'i', 'f', 'f', 'f'};

static int bias_slot(int i) { return i == 4; }

PyObject *py_state_product(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arrays;
    Query g = {0};
    int threads = 1, form = -1;
    if (!PyArg_ParseTuple(args, "Of|ii", &arrays, &g.unit, &threads, &form)) return NULL;
    Py_buffer b[ARRAYS] = {{0}}; /* a product without bias: None */
    int ok = get_buffers(arrays, b, ARRAYS, ndims, fmts, names, 5, bias_slot, "state_product") == 0;
    if (ok && (g.form = product_form("state_product", form)) < 0) ok = 0;
    if (ok) {
        g.H = b[0].shape[1];
        if (b[5].shape[0] != b[0].shape[0] || g.H % 4) {
            PyErr_SetString(PyExc_ValueError, "state_product: shapes do not agree (state (rows, H) with H a multiple "
                            "of 4, out (rows, J))");
            ok = 0;
        }
    }
    if (ok && product_view(b + 1, "state_product", "panels", g.H / 4, b[5].shape[1], &g.next) < 0) ok = 0;
    PyObject *result = NULL;
    if (ok) {
        g.state = b[0].buf, g.out = b[5].buf;
        result = run_rows_released(query_rows, &g, b[0].shape[0], NULL, 0, threads, &g.failed);
    }
    release_buffers(b, ARRAYS);
    return result;
}
