/* What the two GGUF BPE encoders share (formats/sentencepiece.c, formats/bytelevel.c):
 * the spelling hash, UTF-8 as Rust's str::from_utf8 reads it, the queue of candidate
 * merges, the growing list of ids, and the vocabulary's spellings (the table from
 * spelling to id, the added tokens matched whole in text, and the Vocab type's lookups
 * and module boilerplate). Static functions, one copy per module; included after
 * Python.h. */

#ifndef INFER_FORMATS_BPE_H
#define INFER_FORMATS_BPE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* FNV-1a over s[0:len], continuing from h (FNV_START to begin). */
#define FNV_START 14695981039346656037ull

static uint64_t fnv(const char *s, int64_t len, uint64_t h) {
    for (int64_t i = 0; i < len; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* Bytes of the character a lead byte starts (1 for a stray continuation byte). */
static int utf8_len(uint8_t lead) {
    return lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
}

/* Bytes of the valid UTF-8 sequence at s[0:len] (Rust's str::from_utf8 rules), or 0;
 * its code point in *cp. */
static int utf8_at(const uint8_t *s, int64_t len, uint32_t *cp) {
    uint8_t c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!n || n > len) return 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
    if (s[1] < lo || s[1] > hi) return 0;
    uint32_t value = c & (0x7F >> n);
    for (int k = 1; k < n; k++) {
        if (k > 1 && (s[k] < 0x80 || s[k] > 0xBF)) return 0;
        value = value << 6 | (s[k] & 0x3F);
    }
    *cp = value;
    return n;
}

/* Whether s[0:len] is all valid UTF-8. */
static int run_is_utf8(const uint8_t *s, int64_t len) {
    uint32_t cp;
    for (int64_t i = 0; i < len;) {
        int n = utf8_at(s + i, len - i, &cp);
        if (!n) return 0;
        i += n;
    }
    return 1;
}

/* A candidate merge of the symbol at `pos` with its next: lowest `key` first, then
 * leftmost. What makes an entry stale is each encoder's own check (left/right or merged). */
typedef struct {
    uint64_t key;
    int32_t pos;
    int32_t left, right; /* the pair's ids when pushed */
    int32_t merged;
} Merge;

typedef struct {
    Merge *items;
    size_t size, capacity;
} Heap;

static int earlier(const Merge *a, const Merge *b) {
    return a->key < b->key || (a->key == b->key && a->pos < b->pos);
}

static int heap_push(Heap *h, Merge m) {
    if (h->size == h->capacity) {
        size_t capacity = h->capacity ? 2 * h->capacity : 64;
        Merge *items = realloc(h->items, capacity * sizeof *items);
        if (!items) return 0;
        h->items = items;
        h->capacity = capacity;
    }
    size_t i = h->size++;
    while (i > 0 && earlier(&m, &h->items[(i - 1) / 2])) {
        h->items[i] = h->items[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->items[i] = m;
    return 1;
}

static Merge heap_pop(Heap *h) {
    Merge top = h->items[0], last = h->items[--h->size];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= h->size) break;
        if (child + 1 < h->size && earlier(&h->items[child + 1], &h->items[child])) child++;
        if (!earlier(&h->items[child], &last)) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->size) h->items[i] = last;
    return top;
}

typedef struct {
    int32_t *ids;
    size_t size, capacity;
} Ids;

static int ids_push(Ids *out, int32_t id) {
    if (out->size == out->capacity) {
        size_t capacity = out->capacity ? 2 * out->capacity : 256;
        int32_t *ids = realloc(out->ids, capacity * sizeof *ids);
        if (!ids) return 0;
        out->ids = ids;
        out->capacity = capacity;
    }
    out->ids[out->size++] = id;
    return 1;
}

/* -- the spellings ------------------------------------------------------------------ */

/* A vocabulary's spellings: token i is data[start[i]:start[i + 1]]; `table` maps a
 * spelling to its id (open addressing, -1 empty); the added tokens (matched whole in
 * text, leftmost-longest) are flagged in `added`, with their distinct byte lengths,
 * longest first, and the bytes they start with. Each module's Vocab starts with
 * PyObject_HEAD and then one of these (VocabHead), so the lookups below serve both types. */
typedef struct {
    char *data;
    int64_t *start; /* [n + 1] */
    uint32_t n;
    uint8_t *added; /* [n] */
    int32_t *table;
    uint64_t mask;
    int64_t max_len; /* bytes of the longest spelling */
    int64_t added_lengths[64];
    int n_added_lengths;
    uint8_t added_first[256];
} Spellings;

typedef struct {
    PyObject_HEAD
    Spellings sp;
} VocabHead;

#define SPELLINGS(self) (&((VocabHead *)(self))->sp)

static int64_t spelling_len(const Spellings *v, int32_t id) { return v->start[id + 1] - v->start[id]; }

/* The id spelled a ++ b (b may be empty), or -1. */
static int32_t spelling_id(const Spellings *v, const char *a, int64_t la, const char *b, int64_t lb) {
    if (la + lb > v->max_len) return -1;
    for (uint64_t slot = fnv(b, lb, fnv(a, la, FNV_START)) & v->mask;; slot = (slot + 1) & v->mask) {
        int32_t id = v->table[slot];
        if (id < 0) return -1;
        if (spelling_len(v, id) == la + lb && memcmp(v->data + v->start[id], a, la) == 0 &&
            memcmp(v->data + v->start[id] + la, b, lb) == 0)
            return id;
    }
}

/* The table for the n spellings (data and start set), and max_len: 0, or -1 with
 * MemoryError, or ValueError where two tokens are spelled alike. */
static int spellings_index(Spellings *v) {
    uint64_t capacity = 16;
    while (capacity < 2 * (uint64_t)v->n) capacity *= 2;
    if (!(v->table = malloc(capacity * sizeof *v->table))) {
        PyErr_NoMemory();
        return -1;
    }
    memset(v->table, 0xff, capacity * sizeof *v->table);
    v->mask = capacity - 1;
    v->max_len = 0;
    for (int64_t i = 0; i < v->n; i++) {
        const char *s = v->data + v->start[i];
        int64_t len = spelling_len(v, (int32_t)i);
        uint64_t slot = fnv(s, len, FNV_START) & v->mask;
        for (;; slot = (slot + 1) & v->mask) {
            int32_t id = v->table[slot];
            if (id < 0) break;
            if (spelling_len(v, id) == len && memcmp(v->data + v->start[id], s, len) == 0) {
                PyErr_Format(PyExc_ValueError, "Vocab: tokens %d and %lld are spelled alike", id, (long long)i);
                return -1;
            }
        }
        v->table[slot] = (int32_t)i;
        if (len > v->max_len) v->max_len = len;
    }
    return 0;
}

/* The `count` added token ids: 0, or -1 with MemoryError, or ValueError for an id that
 * is no non-empty token, or added tokens of more than 64 byte lengths. */
static int spellings_add(Spellings *v, const int32_t *ids, Py_ssize_t count) {
    if (!(v->added = calloc(v->n, 1))) {
        PyErr_NoMemory();
        return -1;
    }
    memset(v->added_first, 0, sizeof v->added_first);
    v->n_added_lengths = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        int32_t id = ids[k];
        if (id < 0 || id >= (int64_t)v->n || spelling_len(v, id) == 0) {
            PyErr_Format(PyExc_ValueError, "Vocab: added token id %d is not a non-empty token", id);
            return -1;
        }
        v->added[id] = 1;
        v->added_first[(uint8_t)v->data[v->start[id]]] = 1;
        int64_t len = spelling_len(v, id);
        int seen = 0;
        for (int j = 0; j < v->n_added_lengths; j++) seen |= v->added_lengths[j] == len;
        if (!seen) {
            if (v->n_added_lengths == 64) {
                PyErr_SetString(PyExc_ValueError, "Vocab: added tokens of more than 64 lengths");
                return -1;
            }
            int j = v->n_added_lengths++;
            while (j > 0 && v->added_lengths[j - 1] < len) { /* longest first */
                v->added_lengths[j] = v->added_lengths[j - 1];
                j--;
            }
            v->added_lengths[j] = len;
        }
    }
    return 0;
}

/* The added token starting at text[i] (the longest), its id, or -1; its length in *len. */
static int32_t added_at(const Spellings *v, const char *text, int64_t i, int64_t size, int64_t *len) {
    if (!v->added_first[(uint8_t)text[i]]) return -1;
    for (int j = 0; j < v->n_added_lengths; j++) {
        int64_t l = v->added_lengths[j];
        if (i + l > size) continue;
        int32_t id = spelling_id(v, text + i, l, "", 0);
        if (id >= 0 && v->added[id]) {
            *len = l;
            return id;
        }
    }
    return -1;
}

static void spellings_free(Spellings *v) {
    free(v->data);
    free(v->start);
    free(v->added);
    free(v->table);
}

/* Vocab.token_to_id, id_to_token and len(). */
static PyObject *vocab_token_to_id(PyObject *self, PyObject *arg) {
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(arg, &len);
    if (!s) return NULL;
    int32_t id = spelling_id(SPELLINGS(self), s, len, "", 0);
    if (id < 0) Py_RETURN_NONE;
    return PyLong_FromLong(id);
}

static PyObject *vocab_id_to_token(PyObject *self, PyObject *arg) {
    const Spellings *v = SPELLINGS(self);
    long id = PyLong_AsLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    if (id < 0 || id >= (long)v->n) Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(v->data + v->start[id], spelling_len(v, (int32_t)id), "strict");
}

static Py_ssize_t vocab_length(PyObject *self) { return SPELLINGS(self)->n; }

static PySequenceMethods vocab_sequence = {.sq_length = vocab_length};

#define LOOKUP_METHODS                                                                        \
    {"token_to_id", (PyCFunction)vocab_token_to_id, METH_O, "The id of a spelling, or None."}, \
    {"id_to_token", (PyCFunction)vocab_id_to_token, METH_O, "The spelling of an id, or None."}

/* The Vocab type of a module that defines Vocab, vocab_dealloc, vocab_methods and vocab_init. */
#define VOCAB_TYPE(qualname, doc)                                                                               \
    {                                                                                                           \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = qualname, .tp_basicsize = sizeof(Vocab),                      \
        .tp_dealloc = (destructor)vocab_dealloc, .tp_flags = Py_TPFLAGS_DEFAULT, .tp_doc = doc,                 \
        .tp_methods = vocab_methods, .tp_as_sequence = &vocab_sequence, .tp_init = (initproc)vocab_init,       \
        .tp_new = PyType_GenericNew,                                                                            \
    }

/* A module holding the one type as "Vocab", or NULL. */
static PyObject *vocab_module(struct PyModuleDef *def, PyTypeObject *type) {
    if (PyType_Ready(type) < 0) return NULL;
    PyObject *m = PyModule_Create(def);
    if (!m) return NULL;
    Py_INCREF(type);
    if (PyModule_AddObject(m, "Vocab", (PyObject *)type) < 0) {
        Py_DECREF(type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

#endif
