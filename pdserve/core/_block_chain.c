/* The chained block hash of pdserve/core/block_hash.py over a whole packed prompt, in C.
 *
 * hash(block i) = BLAKE2b with an 8-byte digest (RFC 7693; no key, no salt, fanout 1, depth 1)
 * of (parent hash as 8 little-endian bytes || the block's packed tokens), read as a
 * little-endian integer with its top bit cleared; parent = the previous block's hash, the given
 * root for the first. The Python loop pays ~1 us of interpreter work per block around a ~0.1 us
 * compression; the router hashes 256 blocks per 4096-token prompt. The Python code stays the
 * reference: tests compare the two on random prompts, and block_hash.py uses it when this
 * module could not be built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* Message word order of each round; rounds 10 and 11 use rows 0 and 1 again (r % 10). */
static const uint8_t SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i]; /* little-endian, any host */
    return v;
}

#define MIX(a, b, c, d, x, y)           \
    do {                                \
        v[a] = v[a] + v[b] + (x);       \
        v[d] = rotr64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];             \
        v[b] = rotr64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);       \
        v[d] = rotr64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];             \
        v[b] = rotr64(v[b] ^ v[c], 63); \
    } while (0)

/* One compression of a 128-byte chunk; `bytes` = message bytes so far including this chunk. */
static void compress(uint64_t h[8], const uint8_t chunk[128], uint64_t bytes, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(chunk + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= bytes; /* the counter's high word stays 0: inputs are far below 2^64 bytes */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r % 10];
        MIX(0, 4, 8, 12, m[s[0]], m[s[1]]);
        MIX(1, 5, 9, 13, m[s[2]], m[s[3]]);
        MIX(2, 6, 10, 14, m[s[4]], m[s[5]]);
        MIX(3, 7, 11, 15, m[s[6]], m[s[7]]);
        MIX(0, 5, 10, 15, m[s[8]], m[s[9]]);
        MIX(1, 6, 11, 12, m[s[10]], m[s[11]]);
        MIX(2, 7, 8, 13, m[s[12]], m[s[13]]);
        MIX(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-64 of `parent` (8 bytes, little-endian) then `tokens`, top bit cleared. */
static uint64_t block_digest(uint64_t parent, const uint8_t *tokens, Py_ssize_t n) {
    uint64_t h[8];
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 8; /* depth 1, fanout 1, no key, 8-byte digest */
    uint8_t chunk[128];
    for (int i = 0; i < 8; i++) chunk[i] = (uint8_t)(parent >> (8 * i));
    Py_ssize_t fill = 8, total = 8 + n, done = 0;
    while (1) {
        Py_ssize_t take = n - done < 128 - fill ? n - done : 128 - fill;
        memcpy(chunk + fill, tokens + done, (size_t)take);
        fill += take;
        done += take;
        uint64_t seen = (uint64_t)(total - (n - done));
        if (done == n) { /* the last chunk, zero-padded */
            memset(chunk + fill, 0, (size_t)(128 - fill));
            compress(h, chunk, seen, 1);
            break;
        }
        compress(h, chunk, seen, 0); /* full, and more input follows */
        fill = 0;
    }
    return h[0] & 0x7fffffffffffffffULL;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer packed;
    Py_ssize_t block_bytes;
    unsigned long long root;
    if (!PyArg_ParseTuple(args, "y*nK", &packed, &block_bytes, &root)) return NULL;
    if (block_bytes <= 0) {
        PyBuffer_Release(&packed);
        return PyErr_Format(PyExc_ValueError, "block_bytes must be > 0, got %zd", block_bytes);
    }
    Py_ssize_t blocks = packed.len / block_bytes;
    PyObject *hashes = PyList_New(blocks);
    if (hashes == NULL) {
        PyBuffer_Release(&packed);
        return NULL;
    }
    uint64_t parent = root;
    const uint8_t *data = packed.buf;
    for (Py_ssize_t i = 0; i < blocks; i++) {
        parent = block_digest(parent, data + i * block_bytes, block_bytes);
        PyObject *value = PyLong_FromUnsignedLongLong(parent);
        if (value == NULL) {
            Py_DECREF(hashes);
            PyBuffer_Release(&packed);
            return NULL;
        }
        PyList_SET_ITEM(hashes, i, value);
    }
    PyBuffer_Release(&packed);
    return hashes;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(packed, block_bytes, root) -> the chained hash of each whole block of `packed`"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__block_chain(void) { return PyModule_Create(&module); }
