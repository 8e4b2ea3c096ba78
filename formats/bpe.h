/* What the two GGUF BPE encoders share (formats/sentencepiece.c, formats/bytelevel.c):
 * the spelling hash, UTF-8 as Rust's str::from_utf8 reads it, the queue of candidate
 * merges, and the growing list of ids. Static functions, one copy per module. */

#ifndef INFER_FORMATS_BPE_H
#define INFER_FORMATS_BPE_H

#include <stdint.h>
#include <stdlib.h>

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

#endif
