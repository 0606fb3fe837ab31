/* An experiment, not kvscope's tracer: a request's load record (its lookup, the load and each group's
 * scan) packed in C, with its ids drawn in C, into a batch written to a file descriptor every 64 loads.
 * `bench/c_recorder/measure.py` times the planner with it beside kvscope's Python tracer, to size what
 * recording outside Python would save (issue 3's 15% at small loads). The record layout is `HEADER`, then one
 * `SCAN` per group, in `bench/c_recorder/build.py` (int64 fields, native byte order). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define BATCH 64
#define BUF_BYTES (1 << 20)
static unsigned char buf[BUF_BYTES];
static size_t used = 0;
static int records = 0;
static int out_fd = -1;
static uint64_t s0 = 0x9E3779B97F4A7C15ULL, s1 = 0xD1B54A32D192ED03ULL;
static PyObject *s_group_index, *s_blocks_total, *s_null_skipped, *s_start, *s_block_ids, *s_start_ns, *s_end_ns,
    *s_local_tokens, *reason_codes;

static inline uint64_t next_id(void) { /* xorshift128+: ids need to be unique, not secret */
    uint64_t x = s0, y = s1;
    s0 = y;
    x ^= x << 23;
    s1 = x ^ y ^ (x >> 17) ^ (y >> 26);
    uint64_t r = s1 + y;
    return r ? r : 1;
}

static inline void put(int64_t v) { memcpy(buf + used, &v, 8); used += 8; }

static inline int64_t attr_int(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int64_t r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return r;
}

static void flush_batch(void) {
    if (out_fd >= 0 && used) {
        ssize_t written = write(out_fd, buf, used); /* an experiment: a short write is not retried */
        (void)written;
    }
    used = 0;
    records = 0;
}

/* record_load(req_id, local, external, start_ns, end_ns, scans, times, lookup, queried, reason)
 * -> (trace id high 64 bits, low 64 bits, load span id): what a carrier needs */
static PyObject *record_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "record_load takes 10 arguments");
        return NULL;
    }
    Py_ssize_t id_len;
    const char *req_id = PyUnicode_AsUTF8AndSize(args[0], &id_len);
    if (!req_id) return NULL;
    PyObject *scans = args[5], *times = args[6], *lookup = args[7];
    if (!PyList_Check(scans) || !PyList_Check(times) || PyList_GET_SIZE(times) != PyList_GET_SIZE(scans) + 1) {
        PyErr_SetString(PyExc_TypeError, "scans and times must be lists, times one longer");
        return NULL;
    }
    Py_ssize_t groups = PyList_GET_SIZE(scans);
    if (used + 8 * (16 + 8 * (size_t)groups) + (size_t)id_len + 8 > BUF_BYTES) flush_batch();
    uint64_t trace_hi = next_id(), trace_lo = next_id(), lookup_span = next_id(), load_span = next_id();
    PyObject *code = PyDict_GetItemWithError(reason_codes, args[9]);
    if (!code && PyErr_Occurred()) return NULL;
    put((int64_t)trace_hi); put((int64_t)trace_lo); put((int64_t)lookup_span); put((int64_t)load_span);
    put(attr_int(lookup, s_start_ns)); put(attr_int(lookup, s_end_ns)); put(PyLong_AsLongLong(args[8]));
    put(PyLong_AsLongLong(args[2])); put(code ? PyLong_AsLongLong(code) : -1); put(attr_int(lookup, s_local_tokens));
    put(PyLong_AsLongLong(args[3])); put(PyLong_AsLongLong(args[4])); put(PyLong_AsLongLong(args[1]));
    put(PyLong_AsLongLong(args[2])); put(groups); put(id_len);
    for (Py_ssize_t i = 0; i < groups; i++) {
        PyObject *scan = PyList_GET_ITEM(scans, i);
        PyObject *ids = PyObject_GetAttr(scan, s_block_ids);
        if (!ids) return NULL;
        put((int64_t)next_id());
        put(PyLong_AsLongLong(PyList_GET_ITEM(times, i)));
        put(PyLong_AsLongLong(PyList_GET_ITEM(times, i + 1)));
        put(attr_int(scan, s_group_index)); put(attr_int(scan, s_blocks_total));
        put(attr_int(scan, s_null_skipped)); put(PyObject_Length(ids)); put(attr_int(scan, s_start));
        Py_DECREF(ids);
    }
    memcpy(buf + used, req_id, id_len);
    used += id_len;
    if (++records >= BATCH) flush_batch();
    if (PyErr_Occurred()) return NULL;
    return Py_BuildValue("(KKK)", (unsigned long long)trace_hi, (unsigned long long)trace_lo,
                         (unsigned long long)load_span);
}

static PyObject *configure(PyObject *self, PyObject *args) {
    int fd;
    PyObject *codes;
    if (!PyArg_ParseTuple(args, "iO!", &fd, &PyDict_Type, &codes)) return NULL;
    out_fd = fd;
    Py_INCREF(codes);
    Py_XSETREF(reason_codes, codes);
    Py_RETURN_NONE;
}

static PyObject *flush(PyObject *self, PyObject *unused) {
    flush_batch();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"record_load", (PyCFunction)(void (*)(void))record_load, METH_FASTCALL, "pack one load record"},
    {"configure", configure, METH_VARARGS, "configure(fd, {miss reason: code})"},
    {"flush", flush, METH_NOARGS, "write the batch so far"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvscope_c_recorder", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvscope_c_recorder(void) {
    s_group_index = PyUnicode_InternFromString("group_index");
    s_blocks_total = PyUnicode_InternFromString("blocks_total");
    s_null_skipped = PyUnicode_InternFromString("null_skipped");
    s_start = PyUnicode_InternFromString("start");
    s_block_ids = PyUnicode_InternFromString("block_ids");
    s_start_ns = PyUnicode_InternFromString("start_ns");
    s_end_ns = PyUnicode_InternFromString("end_ns");
    s_local_tokens = PyUnicode_InternFromString("local_tokens");
    reason_codes = PyDict_New();
    return PyModule_Create(&module);
}
