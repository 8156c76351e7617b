/* A text's shortlist words (service/decoding/shortlist.py, Shortlist.of_text): the union of its source
 * pieces' candidate lists, ascending, without repeats: marked in a bitmap of the target vocabulary and read
 * back in order (numpy's concatenate and unique cost about 24 us a text; this about 2). */
#include <stdlib.h>

#include "kernels.h"

PyObject *py_shortlist_words(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[4], *pieces, *list;
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &pieces, &o[3]) ||
        !(list = PySequence_Fast(pieces, "shortlist_words: pieces must be a sequence of ints")))
        return NULL;
    static const char *names[4] = {"offsets", "ids", "pieces", "out"};
    static const char fmts[4] = {'q', 'i', 0, 'i'};
    Py_buffer b[4] = {{0}};
    int got = 0, ok = 1;
    for (; got < 4 && ok; got++)
        if (got != 2 && get_buffer(o[got], &b[got], 1, fmts[got], got == 3, names[got]) < 0) ok = 0;
    if (!ok) got--;
    PyObject *result = NULL;
    if (ok) {
        const int64_t *offsets = b[0].buf, P = b[0].shape[0] - 1, N = b[1].shape[0], V = b[3].shape[0];
        const int32_t *ids = b[1].buf;
        int32_t *out = b[3].buf;
        uint64_t *seen = calloc((size_t)(V + 63) / 64, sizeof(uint64_t));
        Py_ssize_t n = PySequence_Fast_GET_SIZE(list);
        for (Py_ssize_t i = 0; seen && i < n && ok; i++) {
            long long p = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(list, i));
            if (p == -1 && PyErr_Occurred()) ok = 0;
            else if (p >= 0 && p < P) { /* pieces without a list (out of range) bring nothing */
                if (offsets[p] < 0 || offsets[p] > offsets[p + 1] || offsets[p + 1] > N) {
                    PyErr_Format(PyExc_ValueError, "shortlist_words: piece %lld's list (offsets %lld to %lld) must lie "
                                 "within the %lld ids", p, (long long)offsets[p], (long long)offsets[p + 1], (long long)N);
                    ok = 0;
                }
                for (int64_t j = offsets[p]; ok && j < offsets[p + 1]; j++) {
                    if (ids[j] < 0 || ids[j] >= V) {
                        PyErr_Format(PyExc_ValueError, "shortlist_words: ids holds %d, not a word below out's %lld",
                                     ids[j], (long long)V);
                        ok = 0;
                    } else {
                        seen[ids[j] / 64] |= 1ull << (ids[j] % 64);
                    }
                }
            }
        }
        if (!seen) {
            PyErr_NoMemory();
        } else if (ok) {
            Py_ssize_t count = 0;
            for (int64_t w = 0; w < (V + 63) / 64; w++)
                for (uint64_t bits = seen[w]; bits; bits &= bits - 1) out[count++] = (int32_t)(w * 64 + __builtin_ctzll(bits));
            result = PyLong_FromSsize_t(count);
        }
        free(seen);
    }
    for (int i = 0; i < got; i++)
        if (i != 2) PyBuffer_Release(&b[i]);
    Py_DECREF(list);
    return result;
}
