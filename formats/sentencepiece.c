/* SentencePiece-style BPE over a GGUF `llama` vocabulary, merged by score
 * (the module infer.formats._sentencepiece; formats/gguf_spm.py is its one
 * Python door and says when it applies).
 *
 * A GGUF stores no merges for such a vocabulary: a pair of adjacent pieces
 * merges when their concatenation is a token, the best-ranked such pair
 * first. Looking the concatenation up in a hash map of the vocabulary, as
 * llama.cpp's SentencePiece tokenizer does, makes the merge table
 * unnecessary: building the map for 262k tokens takes milliseconds, where
 * handing 400k derived merges to `tokenizers` takes most of a second.
 *
 * The order is the one infer's `tokenizers` build uses (merges derived in
 * formats/gguf_tokenizer.py, `_derive_merges`), so that the ids are the same:
 * the merge a+b -> t ranks by
 *   (t's score, best first; then the longer a; then the longer t; then t's id),
 * and among equal ranks the leftmost pair merges first (tokenizers' BPE
 * `merge_all`). Each token's part of that key is packed into 64 bits at
 * construction (`rank`); a's length is added per pair.
 *
 * Text is split at the added tokens (control and user-defined ones, matched
 * whole, leftmost-longest, as tokenizers' added vocabulary does), each other
 * piece has its spaces spelled U+2581 and, per `prefix` mode, one U+2581
 * prepended, and is then one word: its characters are looked up, a character
 * outside the vocabulary becomes its UTF-8 bytes' <0xXX> tokens, and the
 * pieces merge.
 *
 * Decoding joins the spellings with U+2581 as a space, turns runs of <0xXX>
 * tokens into their bytes (U+FFFD for each byte of a run that is not UTF-8,
 * as tokenizers' ByteFallback decoder does), and may strip one leading space.
 *
 * Portable C99; no SIMD. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bpe.h"

/* The prefix modes (formats/gguf_spm.py names them). */
enum {
    METASPACE_NEVER = 0,   /* spaces to U+2581, nothing prepended */
    METASPACE_FIRST = 1,   /* ... and U+2581 before the text's first piece, unless it starts with one */
    NORMALIZE = 2,         /* spaces to U+2581 in every piece (Gemma, Phi-3 without a prefix) */
    NORMALIZE_PREFIX = 3,  /* ... with U+2581 prepended to every non-empty piece */
};

#define MAX_TOKENS (1u << 20)  /* ids fit the rank's 20 bits */
#define MAX_CHARS 4095u        /* characters of a token, 12 bits */

typedef struct {
    PyObject_HEAD
    Spellings sp;      /* the spellings as stored (bpe.h) */
    uint64_t *rank;    /* [n]: group << 44 | (4095 - chars) << 20 | id */
    uint16_t *chars;   /* [n]: code points of each spelling */
    int16_t *byte;     /* [n]: the byte a <0xXX> token stands for when decoding, or -1 */
    int32_t byte_id[256];
    int mode;
} Vocab;

static void vocab_dealloc(Vocab *v) {
    spellings_free(&v->sp);
    free(v->rank);
    free(v->chars);
    free(v->byte);
    Py_TYPE(v)->tp_free((PyObject *)v);
}

/* The byte a decoded <0xXX> spelling stands for (tokenizers' ByteFallback decoder: six
 * bytes, "<0x", two characters that Rust's u8::from_str_radix(_, 16) reads, ">"), or -1. */
static int byte_of(const char *s, int64_t len) {
    if (len != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int value = 0, digits = 0;
    for (int i = (s[3] == '+') ? 4 : 3; i < 5; i++, digits++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return -1;
        value = value * 16 + d;
    }
    return digits ? value : -1;
}

/* Vocab(data, ends, group, added, mode): `data` the spellings concatenated (UTF-8),
 * `ends` int64 [n] where each ends, `group` uint32 [n] the rank of each token's score
 * (0 best, equal scores equal), `added` int32 ids matched whole, `mode` the prefix mode.
 * ValueError where the vocabulary is outside what this encoder does (the caller then
 * uses tokenizers): a spelling twice, a byte token missing, too many tokens or too long a one;
 * UnicodeError (a ValueError) where a spelling is not UTF-8. */
static int vocab_init(Vocab *v, PyObject *args, PyObject *kwds) {
    Py_buffer data = {0}, ends = {0}, group = {0}, added = {0};
    int mode, ok = 0;
    if (kwds && PyDict_Size(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Vocab takes positional arguments only");
        return -1;
    }
    if (v->sp.data) {
        PyErr_SetString(PyExc_TypeError, "Vocab is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "y*y*y*y*i", &data, &ends, &group, &added, &mode)) return -1;
    int64_t n = ends.len / 8;
    const int64_t *end = ends.buf;
    const uint32_t *grp = group.buf;
    const int32_t *add = added.buf;
    if (ends.len % 8 || group.len != n * 4 || added.len % 4 || mode < 0 || mode > 3) {
        PyErr_SetString(PyExc_ValueError, "Vocab: ends must be int64 [n], group uint32 [n], added int32, mode 0-3");
        goto done;
    }
    if (n == 0 || n > MAX_TOKENS || end[n - 1] != data.len) {
        PyErr_Format(PyExc_ValueError, "Vocab: %lld tokens (1 to %u), spellings ending at the data's end",
                     (long long)n, MAX_TOKENS);
        goto done;
    }
    Spellings *sp = &v->sp;
    sp->n = (uint32_t)n;
    v->mode = mode;
    sp->data = malloc(data.len ? data.len : 1);
    sp->start = malloc((n + 1) * sizeof *sp->start);
    v->rank = malloc(n * sizeof *v->rank);
    v->chars = malloc(n * sizeof *v->chars);
    v->byte = malloc(n * sizeof *v->byte);
    if (!sp->data || !sp->start || !v->rank || !v->chars || !v->byte) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(sp->data, data.buf, data.len);
    sp->start[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        if (end[i] < sp->start[i] || end[i] > data.len) {
            PyErr_Format(PyExc_ValueError, "Vocab: ends[%lld] is out of order", (long long)i);
            goto done;
        }
        sp->start[i + 1] = end[i];
    }
    for (int64_t i = 0; i < n; i++) {
        const char *s = sp->data + sp->start[i];
        int64_t len = spelling_len(sp, (int32_t)i);
        int64_t chars = 0;
        for (int64_t k = 0; k < len; k++) chars += ((uint8_t)s[k] & 0xC0) != 0x80;
        if (chars > MAX_CHARS || grp[i] >= MAX_TOKENS) {
            PyErr_Format(PyExc_ValueError, "Vocab: token %lld is longer than %u characters or its group too large",
                         (long long)i, MAX_CHARS);
            goto done;
        }
        if (!run_is_utf8((const uint8_t *)s, len)) {
            PyErr_Format(PyExc_UnicodeError, "Vocab: token %lld is not UTF-8", (long long)i);
            goto done;
        }
        v->chars[i] = (uint16_t)chars;
        v->rank[i] = (uint64_t)grp[i] << 44 | (uint64_t)(MAX_CHARS - chars) << 20 | (uint64_t)i;
        v->byte[i] = (int16_t)byte_of(s, len);
    }
    if (spellings_index(sp) < 0) goto done;
    for (int b = 0; b < 256; b++) {
        char code[7];
        snprintf(code, sizeof code, "<0x%02X>", b);
        v->byte_id[b] = spelling_id(sp, code, 6, "", 0);
        if (v->byte_id[b] < 0) {
            PyErr_Format(PyExc_ValueError, "Vocab: no byte token %s", code);
            goto done;
        }
    }
    if (spellings_add(sp, add, added.len / 4) < 0) goto done;
    ok = 1;
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&group);
    PyBuffer_Release(&added);
    return ok ? 0 : -1;
}

/* -- encoding ---------------------------------------------------------------------- */

typedef struct {
    int32_t id;
    int32_t prev, next;  /* neighbours; -1 none */
    int alive;
} Symbol;

/* The merge of symbols `pos` and its next, pushed when their concatenation is a token. */
static int push_pair(const Vocab *v, Heap *h, const Symbol *sym, int32_t pos) {
    int32_t a = sym[pos].id, b = sym[sym[pos].next].id;
    const Spellings *sp = &v->sp;
    int32_t t = spelling_id(sp, sp->data + sp->start[a], spelling_len(sp, a), sp->data + sp->start[b], spelling_len(sp, b));
    if (t < 0) return 1;
    Merge m = {v->rank[t] | (uint64_t)(MAX_CHARS - v->chars[a]) << 32, pos, a, b, t};
    return heap_push(h, m);
}

/* One word (already spelled with U+2581) through BPE, its ids appended to `out`. */
static int encode_word(const Vocab *v, const char *w, int64_t len, Ids *out, Symbol **sym_buf, size_t *sym_cap,
                       Heap *heap) {
    if (len == 0) return 1;
    if ((size_t)len > *sym_cap) {  /* at most one symbol a byte */
        Symbol *grown = realloc(*sym_buf, len * sizeof *grown);
        if (!grown) return 0;
        *sym_buf = grown;
        *sym_cap = len;
    }
    Symbol *sym = *sym_buf;
    int32_t count = 0;
    for (int64_t i = 0; i < len;) {
        int64_t step = utf8_len((uint8_t)w[i]);
        if (i + step > len) step = len - i;
        int32_t id = spelling_id(&v->sp, w + i, step, "", 0);
        if (id >= 0) {
            sym[count] = (Symbol){id, count - 1, count + 1, 1};
            count++;
        } else {
            for (int64_t k = 0; k < step; k++, count++)
                sym[count] = (Symbol){v->byte_id[(uint8_t)w[i + k]], count - 1, count + 1, 1};
        }
        i += step;
    }
    sym[count - 1].next = -1;
    heap->size = 0;
    for (int32_t i = 0; i + 1 < count; i++)
        if (!push_pair(v, heap, sym, i)) return 0;
    while (heap->size) {
        Merge top = heap_pop(heap);
        Symbol *left = &sym[top.pos];
        if (!left->alive || left->next < 0 || left->id != top.left || sym[left->next].id != top.right) continue;
        Symbol *right = &sym[left->next];
        left->id = top.merged;
        right->alive = 0;
        left->next = right->next;
        if (right->next >= 0) sym[right->next].prev = top.pos;
        if (left->prev >= 0 && !push_pair(v, heap, sym, left->prev)) return 0;
        if (left->next >= 0 && !push_pair(v, heap, sym, top.pos)) return 0;
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next)
        if (!ids_push(out, sym[i].id)) return 0;
    return 1;
}

/* The piece text[0:len] (not an added token) spelled with U+2581 and encoded. */
static int encode_piece(const Vocab *v, const char *text, int64_t len, int at_start, Ids *out, char **word,
                        size_t *word_cap, Symbol **sym, size_t *sym_cap, Heap *heap) {
    static const char SPACE[] = "\xe2\x96\x81";
    size_t need = 3 * (size_t)len + 3;
    if (need > *word_cap) {
        char *grown = realloc(*word, need);
        if (!grown) return 0;
        *word = grown;
        *word_cap = need;
    }
    char *w = *word;
    int64_t n = 0;
    if (v->mode == NORMALIZE_PREFIX && len > 0) {
        memcpy(w, SPACE, 3);
        n = 3;
    }
    for (int64_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(w + n, SPACE, 3);
            n += 3;
        } else {
            w[n++] = text[i];
        }
    }
    if (v->mode == METASPACE_FIRST && at_start && !(n >= 3 && memcmp(w, SPACE, 3) == 0)) {
        memmove(w + 3, w, n);
        memcpy(w, SPACE, 3);
        n += 3;
    }
    return encode_word(v, w, n, out, sym, sym_cap, heap);
}

static PyObject *vocab_encode(Vocab *v, PyObject *arg) {
    Py_ssize_t len;
    const char *text = PyUnicode_AsUTF8AndSize(arg, &len);
    if (!text) return NULL;  /* not a str, or a lone surrogate */
    Ids out = {0};
    char *word = NULL;
    size_t word_cap = 0, sym_cap = 0;
    Symbol *sym = NULL;
    Heap heap = {0};
    int ok = 1;
    int64_t piece = 0;  /* where the current piece (not an added token) starts */
    for (int64_t i = 0; ok && i < len;) {
        int64_t l = 0;
        const int32_t added = added_at(&v->sp, text, i, len, &l);
        if (added < 0) {
            i += utf8_len((uint8_t)text[i]);
            continue;
        }
        if (i > piece)
            ok = encode_piece(v, text + piece, i - piece, piece == 0, &out, &word, &word_cap, &sym, &sym_cap, &heap);
        ok = ok && ids_push(&out, added);
        i += l;
        piece = i;
    }
    if (ok && len > piece)
        ok = encode_piece(v, text + piece, len - piece, piece == 0, &out, &word, &word_cap, &sym, &sym_cap, &heap);
    free(word);
    free(sym);
    free(heap.items);
    PyObject *list = NULL;
    if (!ok) {
        PyErr_NoMemory();
    } else if ((list = PyList_New(out.size))) {
        for (size_t k = 0; k < out.size; k++) {
            PyObject *id = PyLong_FromLong(out.ids[k]);
            if (!id) {
                Py_CLEAR(list);
                break;
            }
            PyList_SET_ITEM(list, k, id);
        }
    }
    free(out.ids);
    return list;
}

/* -- decoding ---------------------------------------------------------------------- */

typedef struct {
    char *buf;
    size_t size, capacity;
} Text;

static int text_add(Text *t, const char *s, size_t len) {
    if (t->size + len > t->capacity) {
        size_t capacity = t->capacity ? t->capacity : 256;
        while (capacity < t->size + len) capacity *= 2;
        char *buf = realloc(t->buf, capacity);
        if (!buf) return 0;
        t->buf = buf;
        t->capacity = capacity;
    }
    memcpy(t->buf + t->size, s, len);
    t->size += len;
    return 1;
}

/* The bytes of a run of <0xXX> tokens: themselves when UTF-8, else U+FFFD for each. */
static int flush_run(Text *t, const char *run, int64_t len) {
    if (run_is_utf8((const uint8_t *)run, len)) return text_add(t, run, len);
    for (int64_t k = 0; k < len; k++)
        if (!text_add(t, "\xef\xbf\xbd", 3)) return 0;
    return 1;
}

/* decode(ids, strip): the text of `ids` (a sequence of ints, each in range; the
 * caller leaves out skipped special tokens), one leading space stripped when `strip`. */
static PyObject *vocab_decode(Vocab *v, PyObject *args) {
    PyObject *seq;
    int strip;
    if (!PyArg_ParseTuple(args, "Op", &seq, &strip)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "decode expects a sequence of token ids");
    if (!fast) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Text t = {0};
    char *run = malloc(count ? count : 1);
    int64_t run_len = 0;
    int ok = run != NULL;
    for (Py_ssize_t k = 0; ok && k < count; k++) {
        long id = PyLong_AsLong(items[k]);
        if (id == -1 && PyErr_Occurred()) {
            ok = 0;
            break;
        }
        if (id < 0 || id >= (long)v->sp.n) {
            PyErr_Format(PyExc_ValueError, "token id %ld is out of range", id);
            ok = 0;
            break;
        }
        if (v->byte[id] >= 0) {
            run[run_len++] = (char)v->byte[id];
            continue;
        }
        if (run_len) {
            ok = flush_run(&t, run, run_len);
            run_len = 0;
        }
        const char *s = v->sp.data + v->sp.start[id];
        int64_t len = spelling_len(&v->sp, id);
        for (int64_t i = 0; ok && i < len;) {
            if (i + 3 <= len && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
                ok = text_add(&t, " ", 1);
                i += 3;
            } else {
                int64_t j = i + 1;
                while (j < len && !(j + 3 <= len && memcmp(s + j, "\xe2\x96\x81", 3) == 0)) j++;
                ok = text_add(&t, s + i, j - i);
                i = j;
            }
        }
    }
    if (ok && run_len) ok = flush_run(&t, run, run_len);
    free(run);
    Py_DECREF(fast);
    PyObject *result = NULL;
    if (ok) {
        size_t from = strip && t.size && t.buf[0] == ' ' ? 1 : 0;
        result = PyUnicode_DecodeUTF8(t.buf ? t.buf + from : "", t.size - from, "strict");
    } else if (!PyErr_Occurred()) {
        PyErr_NoMemory();
    }
    free(t.buf);
    return result;
}

static PyMethodDef vocab_methods[] = {
    {"encode", (PyCFunction)vocab_encode, METH_O, "encode(text) -> list of ids (no BOS/EOS)."},
    {"decode", (PyCFunction)vocab_decode, METH_VARARGS, "decode(ids, strip) -> text."},
    LOOKUP_METHODS,
    {NULL, NULL, 0, NULL},
};

static PyTypeObject VocabType = VOCAB_TYPE("infer.formats._sentencepiece.Vocab",
                                         "A SentencePiece BPE vocabulary merged by score (see formats/sentencepiece.c).");

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sentencepiece", "SentencePiece BPE merged by score over a GGUF vocabulary.", -1, NULL,
};

PyMODINIT_FUNC PyInit__sentencepiece(void) { return vocab_module(&module, &VocabType); }
