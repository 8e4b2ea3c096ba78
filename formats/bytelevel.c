/* Byte-level BPE over a GGUF `gpt2` vocabulary and its merges (the module
 * infer.formats._bytelevel; formats/gguf_bpe.py is its one Python door and
 * says when it applies).
 *
 * Building `tokenizers`' BPE model from a GGUF's 49k tokens and 48k merges
 * takes about 0.1 s of every load: each token and each merge becomes a Python
 * string, then a Rust string, then a hash map entry. Here the stored bytes go
 * into two open-addressing tables directly (spelling -> id, and the pair of
 * ids -> rank and merged id), which takes a few milliseconds.
 *
 * The ids are those of the `tokenizers` build it stands for (formats/
 * gguf_tokenizer.py, `_byte_level_bpe`), reproduced rule by rule:
 *
 * - Spellings: a token holding a character outside GPT-2's byte alphabet is
 *   respelled in it (each UTF-8 byte as its alphabet character), unless it is
 *   a control or user-defined token (`keep`), as `_byte_level_vocab` does.
 * - Merges: "left right" split at the first space after the first character
 *   (llama.cpp's rule, which `_bpe_with_file_merges` ends up with); a pair
 *   listed twice keeps the later rank (tokenizers collects the pairs into a
 *   hash map in order).
 * - Text is split at the added tokens first (leftmost-longest, as tokenizers'
 *   added vocabulary does: `split`); the pieces between them go through the
 *   pre-tokenizer in Python (the `tokenizers` object itself, so the regexes and
 *   their Unicode classes are tokenizers' own), and each pre-tokenized word,
 *   already spelled in the byte alphabet, through `encode_words`.
 * - A word: with `ignore_merges`, a word that is a token is that token; else
 *   each character is its token (a character with none is dropped, as
 *   tokenizers' BPE does without an unknown token), and the pairs merge
 *   lowest rank first, leftmost among equals, a queued pair being stale when
 *   the pair now at its place merges into another token (`merge_all` in
 *   tokenizers' word.rs, check for check).
 * - Decoding: each token's characters map back to bytes, or, for a token with
 *   a character outside the alphabet, its UTF-8 bytes; the bytes are read as
 *   UTF-8 with U+FFFD for each maximal invalid run (tokenizers' ByteLevel
 *   decoder and Rust's from_utf8_lossy, which Python's "replace" handler
 *   matches).
 *
 * The constructor raises ValueError where the vocabulary is outside these
 * rules (an empty or non-UTF-8 spelling, two tokens spelled alike after
 * respelling, a merge naming no token); the caller then builds tokenizers,
 * which reports what is wrong.
 *
 * Portable C99; no SIMD. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bpe.h"

#define MAX_TOKENS (1u << 30)

typedef struct {
    uint64_t key;  /* left id << 32 | right id; EMPTY_PAIR where the slot is free */
    uint32_t rank;
    int32_t merged;
} Pair;

#define EMPTY_PAIR UINT64_MAX

typedef struct {
    PyObject_HEAD
    Spellings sp;      /* the spellings, respelled where they need it (bpe.h) */
    uint8_t *raw;      /* [n]: decoded as its UTF-8 bytes (a character outside the alphabet) */
    Pair *pairs;       /* open addressing, (left, right) -> (rank, merged) */
    uint64_t pair_mask;
    int ignore_merges;
} Vocab;

/* -- GPT-2's byte alphabet ----------------------------------------------------------- */

/* Bytes 0x21-0x7E, 0xA1-0xAC and 0xAE-0xFF stand for themselves; the other 68, in order,
 * for U+0100 onwards (gguf_tokenizer.py, `_bytes_to_unicode`). */
static uint32_t byte_char[256];  /* byte -> code point */
static int16_t char_byte[0x144]; /* code point -> byte, or -1 */

static void init_alphabet(void) {
    int extra = 0;
    for (int c = 0; c < 0x144; c++) char_byte[c] = -1;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        byte_char[b] = printable ? (uint32_t)b : (uint32_t)(256 + extra++);
        char_byte[byte_char[b]] = (int16_t)b;
    }
}

/* The byte the code point stands for, or -1 outside the alphabet. */
static int alphabet_byte(uint32_t cp) { return cp < 0x144 ? char_byte[cp] : -1; }

static int put_char(char *out, uint32_t cp) { /* UTF-8 of an alphabet character: 1 or 2 bytes */
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | cp >> 6);
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

/* -- the tables ---------------------------------------------------------------------- */

/* The id spelled s[0:len], or -1. */
static int32_t lookup(const Vocab *v, const char *s, int64_t len) { return spelling_id(&v->sp, s, len, "", 0); }

static uint64_t mix(uint64_t key) { /* splitmix64's finaliser: ids are dense, spread them */
    key ^= key >> 30;
    key *= 0xbf58476d1ce4e5b9ull;
    key ^= key >> 27;
    key *= 0x94d049bb133111ebull;
    return key ^ (key >> 31);
}

static const Pair *find_pair(const Vocab *v, int32_t left, int32_t right) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (uint64_t slot = mix(key) & v->pair_mask;; slot = (slot + 1) & v->pair_mask) {
        const Pair *p = &v->pairs[slot];
        if (p->key == key) return p;
        if (p->key == EMPTY_PAIR) return NULL;
    }
}

static void vocab_dealloc(Vocab *v) {
    spellings_free(&v->sp);
    free(v->raw);
    free(v->pairs);
    Py_TYPE(v)->tp_free((PyObject *)v);
}

/* Vocab(data, ends, keep, merges, merge_ends, added, ignore_merges): `data` the stored
 * spellings concatenated, `ends` int64 [n] where each ends, `keep` uint8 [n] (1: a control
 * or user-defined token, never respelled), `merges`/`merge_ends` the stored merges the
 * same way, `added` int32 ids matched whole in text. */
static int vocab_init(Vocab *v, PyObject *args, PyObject *kwds) {
    Py_buffer data = {0}, ends = {0}, keep = {0}, merges = {0}, merge_ends = {0}, added = {0};
    int ignore_merges, ok = 0;
    char *respelled = NULL;
    if (kwds && PyDict_Size(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Vocab takes positional arguments only");
        return -1;
    }
    if (v->sp.data) {
        PyErr_SetString(PyExc_TypeError, "Vocab is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*p", &data, &ends, &keep, &merges, &merge_ends, &added, &ignore_merges))
        return -1;
    int64_t n = ends.len / 8, n_merges = merge_ends.len / 8;
    const int64_t *end = ends.buf, *merge_end = merge_ends.buf;
    const uint8_t *kept = keep.buf, *stored = data.buf;
    const int32_t *add = added.buf;
    if (ends.len % 8 || keep.len != n || merge_ends.len % 8 || added.len % 4) {
        PyErr_SetString(PyExc_ValueError, "Vocab: ends int64 [n], keep uint8 [n], merge_ends int64, added int32");
        goto done;
    }
    if (n == 0 || n > MAX_TOKENS || end[n - 1] != data.len || (n_merges && merge_end[n_merges - 1] != merges.len) ||
        (!n_merges && merges.len)) {
        PyErr_SetString(PyExc_ValueError, "Vocab: 1 to 2^30 tokens, spellings and merges ending at their data's end");
        goto done;
    }
    Spellings *sp = &v->sp;
    sp->n = (uint32_t)n;
    v->ignore_merges = ignore_merges;
    /* Respelled, a spelling takes at most two bytes for each stored one. */
    respelled = malloc(2 * (size_t)data.len + 1);
    sp->start = malloc((n + 1) * sizeof *sp->start);
    v->raw = calloc(n, 1);
    uint64_t pair_capacity = 16;
    while (pair_capacity < 2 * (uint64_t)n_merges) pair_capacity *= 2;
    v->pairs = malloc(pair_capacity * sizeof *v->pairs);
    if (!respelled || !sp->start || !v->raw || !v->pairs) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint64_t k = 0; k < pair_capacity; k++) v->pairs[k].key = EMPTY_PAIR;
    v->pair_mask = pair_capacity - 1;

    /* The spellings: checked, respelled where they need it, and put in the table. */
    int64_t out = 0, from = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t to = end[i];
        if (to < from || to > data.len) {
            PyErr_Format(PyExc_ValueError, "Vocab: ends[%lld] is out of order", (long long)i);
            goto done;
        }
        if (to == from) {
            PyErr_Format(PyExc_ValueError, "Vocab: token %lld is empty", (long long)i);
            goto done;
        }
        int inside = 1;
        for (int64_t k = from; k < to;) {
            uint32_t cp;
            int step = utf8_at(stored + k, to - k, &cp);
            if (!step) {
                PyErr_Format(PyExc_ValueError, "Vocab: token %lld is not UTF-8", (long long)i);
                goto done;
            }
            inside &= alphabet_byte(cp) >= 0;
            k += step;
        }
        sp->start[i] = out;
        if (inside || kept[i]) {
            memcpy(respelled + out, stored + from, to - from);
            out += to - from;
            v->raw[i] = !inside;
        } else {
            for (int64_t k = from; k < to; k++) out += put_char(respelled + out, byte_char[stored[k]]);
        }
        from = to;
    }
    sp->start[n] = out;
    sp->data = respelled;
    respelled = NULL;
    if (spellings_index(sp) < 0) goto done;

    /* The merges: (left, right) -> (rank, merged), a later listing replacing an earlier. */
    const char *text = merges.buf;
    from = 0;
    for (int64_t r = 0; r < n_merges; r++) {
        int64_t to = merge_end[r];
        if (to < from || to > merges.len) {
            PyErr_Format(PyExc_ValueError, "Vocab: merge_ends[%lld] is out of order", (long long)r);
            goto done;
        }
        const char *m = text + from;
        int64_t len = to - from, cut = len ? utf8_len((uint8_t)m[0]) : 0;
        while (cut < len && m[cut] != ' ') cut++;
        int32_t left = cut < len ? lookup(v, m, cut) : -1;
        int32_t right = left >= 0 ? lookup(v, m + cut + 1, len - cut - 1) : -1;
        int32_t merged = -1;
        if (right >= 0 && cut + (len - cut - 1) <= sp->max_len) {
            char joined[cut + (len - cut - 1) + 1];
            memcpy(joined, m, cut);
            memcpy(joined + cut, m + cut + 1, len - cut - 1);
            merged = lookup(v, joined, len - 1);
        }
        if (merged < 0) {
            PyErr_Format(PyExc_ValueError, "Vocab: merge %lld does not join two tokens into a token", (long long)r);
            goto done;
        }
        uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
        uint64_t slot = mix(key) & v->pair_mask;
        while (v->pairs[slot].key != EMPTY_PAIR && v->pairs[slot].key != key) slot = (slot + 1) & v->pair_mask;
        v->pairs[slot] = (Pair){key, (uint32_t)r, merged};
        from = to;
    }

    /* The added tokens, matched whole in text. */
    if (spellings_add(sp, add, added.len / 4) < 0) goto done;
    ok = 1;
done:
    free(respelled);
    PyBuffer_Release(&data);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&keep);
    PyBuffer_Release(&merges);
    PyBuffer_Release(&merge_ends);
    PyBuffer_Release(&added);
    return ok ? 0 : -1;
}

/* -- splitting at the added tokens -------------------------------------------------- */

static int append_steal(PyObject *list, PyObject *item) {
    if (!item) return 0;
    int failed = PyList_Append(list, item);
    Py_DECREF(item);
    return !failed;
}

/* split(text) -> list of str (text between added tokens, never empty) and int (an added
 * token's id), in order. */
static PyObject *vocab_split(Vocab *v, PyObject *arg) {
    Py_ssize_t size;
    const char *text = PyUnicode_AsUTF8AndSize(arg, &size);
    if (!text) return NULL; /* not a str, or a lone surrogate */
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    if (!v->sp.n_added_lengths) { /* nothing to split at */
        if (size && PyList_Append(out, arg)) Py_CLEAR(out);
        return out;
    }
    int64_t piece = 0;
    for (int64_t i = 0; i < size;) {
        int64_t len = 0;
        int32_t id = added_at(&v->sp, text, i, size, &len);
        if (id < 0) {
            i += utf8_len((uint8_t)text[i]);
            continue;
        }
        if ((i > piece && !append_steal(out, PyUnicode_DecodeUTF8(text + piece, i - piece, "strict"))) ||
            !append_steal(out, PyLong_FromLong(id))) {
            Py_DECREF(out);
            return NULL;
        }
        i += len;
        piece = i;
    }
    if (size > piece && !append_steal(out, PyUnicode_DecodeUTF8(text + piece, size - piece, "strict"))) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* -- BPE ----------------------------------------------------------------------------- */

typedef struct {
    int32_t id;
    int32_t prev, next; /* neighbours; -1 none */
    int alive;
} Symbol;

/* The merge of symbol `pos` with its next, queued when the pair is a merge. */
static int push_pair(const Vocab *v, Heap *h, const Symbol *sym, int32_t pos) {
    int32_t left = sym[pos].id, right = sym[sym[pos].next].id;
    const Pair *p = find_pair(v, left, right);
    return !p || heap_push(h, (Merge){p->rank, pos, left, right, p->merged});
}

typedef struct {
    Ids out;
    Symbol *sym;
    size_t sym_capacity;
    Heap heap;
} Work;

/* One pre-tokenized word (spelled in the byte alphabet) through BPE, its ids appended. */
static int encode_word(const Vocab *v, const char *word, int64_t len, Work *w) {
    if (len == 0) return 1;
    if (v->ignore_merges) {
        int32_t whole = lookup(v, word, len);
        if (whole >= 0) return ids_push(&w->out, whole);
    }
    if ((size_t)len > w->sym_capacity) { /* at most one symbol a byte */
        Symbol *grown = realloc(w->sym, len * sizeof *grown);
        if (!grown) return 0;
        w->sym = grown;
        w->sym_capacity = len;
    }
    Symbol *sym = w->sym;
    int32_t count = 0;
    for (int64_t i = 0; i < len;) {
        int64_t step = utf8_len((uint8_t)word[i]);
        if (i + step > len) step = len - i;
        int32_t id = lookup(v, word + i, step);
        if (id >= 0) { /* a character without a token is dropped */
            sym[count] = (Symbol){id, count - 1, count + 1, 1};
            count++;
        }
        i += step;
    }
    if (!count) return 1;
    sym[count - 1].next = -1;
    Heap *heap = &w->heap;
    heap->size = 0;
    for (int32_t i = 0; i + 1 < count; i++)
        if (!push_pair(v, heap, sym, i)) return 0;
    while (heap->size) {
        Merge top = heap_pop(heap);
        Symbol *left = &sym[top.pos];
        if (!left->alive || left->next < 0) continue;
        const Pair *now = find_pair(v, left->id, sym[left->next].id);
        if (!now || now->merged != top.merged) continue; /* a stale entry */
        Symbol *right = &sym[left->next];
        left->id = top.merged;
        right->alive = 0;
        left->next = right->next;
        if (right->next >= 0) sym[right->next].prev = top.pos;
        if (left->prev >= 0 && !push_pair(v, heap, sym, left->prev)) return 0;
        if (left->next >= 0 && !push_pair(v, heap, sym, top.pos)) return 0;
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next)
        if (!ids_push(&w->out, sym[i].id)) return 0;
    return 1;
}

/* encode_words(words) -> list of ids: each pre-tokenized word (a sequence of str spelled
 * in the byte alphabet) through BPE, the ids one after another. */
static PyObject *vocab_encode_words(Vocab *v, PyObject *arg) {
    PyObject *fast = PySequence_Fast(arg, "encode_words expects a sequence of str");
    if (!fast) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Work w = {0};
    int ok = 1;
    for (Py_ssize_t k = 0; ok && k < count; k++) {
        Py_ssize_t len;
        const char *word = PyUnicode_AsUTF8AndSize(items[k], &len);
        ok = word != NULL;
        if (ok && !encode_word(v, word, len, &w)) {
            PyErr_NoMemory();
            ok = 0;
        }
    }
    Py_DECREF(fast);
    free(w.sym);
    free(w.heap.items);
    PyObject *list = NULL;
    if (ok && (list = PyList_New(w.out.size))) {
        for (size_t k = 0; k < w.out.size; k++) {
            PyObject *id = PyLong_FromLong(w.out.ids[k]);
            if (!id) {
                Py_CLEAR(list);
                break;
            }
            PyList_SET_ITEM(list, k, id);
        }
    }
    free(w.out.ids);
    return list;
}

/* -- decoding ------------------------------------------------------------------------ */

/* decode(ids) -> text: the tokens' bytes (the byte-level decoder's), read as UTF-8 with
 * U+FFFD for invalid runs. Ids must be in range; the caller leaves out skipped ones. */
static PyObject *vocab_decode(Vocab *v, PyObject *arg) {
    PyObject *fast = PySequence_Fast(arg, "decode expects a sequence of token ids");
    if (!fast) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    size_t total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        long id = PyLong_AsLong(items[k]);
        if (id == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return NULL;
        }
        if (id < 0 || id >= (long)v->sp.n) {
            PyErr_Format(PyExc_ValueError, "token id %ld is out of range", id);
            Py_DECREF(fast);
            return NULL;
        }
        total += spelling_len(&v->sp, (int32_t)id);
    }
    char *bytes = malloc(total ? total : 1);
    if (!bytes) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    size_t size = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        int32_t id = (int32_t)PyLong_AsLong(items[k]);
        const uint8_t *s = (const uint8_t *)v->sp.data + v->sp.start[id];
        int64_t len = spelling_len(&v->sp, id);
        if (v->raw[id]) { /* spelled outside the alphabet: its own bytes */
            memcpy(bytes + size, s, len);
            size += len;
            continue;
        }
        for (int64_t i = 0; i < len;) {
            uint32_t cp;
            int step = utf8_at(s + i, len - i, &cp); /* valid: checked at construction */
            bytes[size++] = (char)alphabet_byte(cp);
            i += step;
        }
    }
    Py_DECREF(fast);
    PyObject *text = PyUnicode_DecodeUTF8(bytes, size, "replace");
    free(bytes);
    return text;
}

static PyMethodDef vocab_methods[] = {
    {"split", (PyCFunction)vocab_split, METH_O, "split(text) -> list of str and added-token ids."},
    {"encode_words", (PyCFunction)vocab_encode_words, METH_O, "encode_words(words) -> list of ids."},
    {"decode", (PyCFunction)vocab_decode, METH_O, "decode(ids) -> text."},
    LOOKUP_METHODS,
    {NULL, NULL, 0, NULL},
};

static PyTypeObject VocabType = VOCAB_TYPE("infer.formats._bytelevel.Vocab",
                                         "A byte-level BPE vocabulary and its merges (see formats/bytelevel.c).");

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bytelevel", "Byte-level BPE over a GGUF vocabulary and its merges.", -1, NULL,
};

PyMODINIT_FUNC PyInit__bytelevel(void) {
    init_alphabet();
    return vocab_module(&module, &VocabType);
}
