/* json.c -- relaybus.json: the codec between Lua values and the JSON text the stores keep,
 * exact both ways (docs/lua.md "relaybus.json": integers stay integers over all of int64,
 * floats keep every bit and stay floats, strings keep every byte).
 *
 * Decoding parses with Jansson (strict about UTF-8, escapes and surrogates) and turns its tree
 * into Lua values. Encoding writes straight from the Lua values into one buffer: Jansson's
 * encoder prints reals with 17 digits (0.1 as 0.10000000000000001) and a tree per payload
 * costs an allocation per value. Object keys are written sorted, so one value always gives
 * one text (the fuzz target checks encode(decode(encode(v))) == encode(v) byte for byte).
 *
 * Both directions run the Lua side under lua_pcall: a memory error, or a finalizer that runs
 * in the middle and changes a table, ends in an error message, never in a leak. */
#include <float.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>
#include "internal.h"
#include "util/text.h"

#define JSON_MAX_DEPTH 1000         /* nested arrays and objects, both ways */
#define STACK_KEYS 4096             /* an object's keys kept on the Lua stack; more: a table */
#define PARSE_FLAGS (JSON_DECODE_ANY | JSON_ALLOW_NUL)

static const char ARRAY_MT_KEY = 'a';   /* registry: light userdata of this address */

/* ---- positions in a JSON text --------------------------------------------------------------- */

/* Index of the quote that closes the string opening at s[i] (or len). */
static size_t skip_string(const char *s, size_t len, size_t i)
{
    for (i++; i < len && s[i] != '"'; i++)
        if (s[i] == '\\') i++;
    return i;
}

/* Line and column (in characters, as Jansson counts them) of the byte at off. */
static void line_col(const char *s, size_t len, size_t off, int *line, int *col)
{
    *line = 1;
    *col = 0;
    for (size_t i = 0; i <= off && i < len; i++) {
        if (s[i] == '\n') {
            (*line)++;
            *col = 0;
        } else if (((unsigned char)s[i] & 0xc0) != 0x80) {
            (*col)++;
        }
    }
}

/* Offset of the bracket that opens nesting level `level` outside strings, or len. */
static size_t level_offset(const char *s, size_t len, int level)
{
    int d = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '"') i = skip_string(s, len, i);
        else if (s[i] == '[' || s[i] == '{') {
            if (++d == level) return i;
        } else if (s[i] == ']' || s[i] == '}') d--;
    }
    return len;
}

/* Copies Jansson's message into out with every byte that is not printable ASCII or part of
 * valid UTF-8 written as \xNN: its "near '...'" quotes the input. */
static void clean_copy(char *out, size_t cap, const char *msg)
{
    size_t n = 0, len = strlen(msg);
    for (size_t i = 0; i < len && n + 5 < cap;) {
        unsigned char c = (unsigned char)msg[i];
        size_t k = c >= 0x80 ? rb_utf8_seq(msg + i, len - i) : (c >= 0x20 && c != 0x7f);
        if (k) {
            if (n + k + 1 > cap) break;
            memcpy(out + n, msg + i, k);
            n += k;
            i += k;
        } else {
            n += (size_t)snprintf(out + n, cap - n, "\\x%02x", c);
            i++;
        }
    }
    out[n] = 0;
}

/* ---- decoding: Jansson's parser ---------------------------------------------------------- */

/* 1 when t[0..n) is an integer literal (no fraction, no exponent) that int64 cannot hold. */
static int is_big_integer(const char *t, size_t n)
{
    int neg = n > 0 && t[0] == '-';
    const char *d = t + neg;
    size_t nd = n - (size_t)neg;
    if (nd == 0 || (d[0] == '0' && nd > 1)) return 0;
    for (size_t i = 0; i < nd; i++)
        if (d[i] < '0' || d[i] > '9') return 0;
    if (nd != 19) return nd > 19;
    return memcmp(d, neg ? "9223372036854775808" : "9223372036854775807", 19) > 0;
}

/* The end offset of the next integer literal at or after *i (outside strings) that int64
 * cannot hold, or 0 when there is none; *i moves past it. */
static size_t next_big_integer(const char *s, size_t len, size_t *i)
{
    while (*i < len) {
        char c = s[*i];
        if (c == '"') {
            *i = skip_string(s, len, *i) + 1;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            size_t start = *i;
            while (*i < len && (strchr("0123456789+-.eE", s[*i]) && s[*i])) (*i)++;
            if (is_big_integer(s + start, *i - start)) return *i;
        } else {
            (*i)++;
        }
    }
    return 0;
}

/* Integer literals beyond int64 (written by hand, or PostgreSQL's jsonb printing 1e300 in
 * full) make Jansson refuse the whole text ("too big integer"). They are read as floats
 * instead, the one inexact case: the text is parsed again with ".0" after each of them, so
 * every other number keeps its type. A failure's position is mapped back to the text given. */
static json_t *parse_big_integers(const char *s, size_t len, json_error_t *err)
{
    size_t n = 0, i = 0;
    while (next_big_integer(s, len, &i)) n++;
    char *w = rb_malloc(len + 2 * n + 1);
    if (!w) {
        snprintf(err->text, sizeof err->text, "out of memory");
        return NULL;
    }
    size_t from = 0, wl = 0, end;
    i = 0;
    while ((end = next_big_integer(s, len, &i))) {
        memcpy(w + wl, s + from, end - from);
        wl += end - from;
        memcpy(w + wl, ".0", 2);
        wl += 2;
        from = end;
    }
    memcpy(w + wl, s + from, len - from);
    wl += len - from;
    json_t *j = json_loadb(w, wl, PARSE_FLAGS, err);
    free(w);
    if (j) return j;
    /* err->position counts bytes of w: take out the insertions before it */
    size_t pos = (size_t)err->position, k = 0;
    i = 0;
    while ((end = next_big_integer(s, len, &i))) {
        size_t at = end + 2 * k;
        if (at + 2 <= pos) k++;
        else {
            if (at < pos) pos = at + 2;   /* inside an inserted ".0": at its literal's end */
            break;
        }
    }
    pos -= 2 * k;
    err->position = (int)pos;
    line_col(s, len, pos ? pos - 1 : 0, &err->line, &err->column);
    return NULL;
}

/* Parses s[0..len) with Jansson; NULL with a one-line message in msg when it is not JSON. */
static json_t *parse(const char *s, size_t len, char *msg, size_t cap)
{
    int line, col;
    const char *nul = memchr(s, 0, len);
    if (nul) {
        /* Jansson would stop there: a text must hold no NUL byte ("\u0000" is fine) */
        line_col(s, len, (size_t)(nul - s), &line, &col);
        snprintf(msg, cap, "invalid JSON at line %d, column %d: NUL byte (offset %zu)", line, col,
                 (size_t)(nul - s));
        return NULL;
    }
    json_error_t err;
    json_t *j = json_loadb(s, len, PARSE_FLAGS, &err);
    if (j) return j;
    if (json_error_code(&err) == json_error_numeric_overflow && strncmp(err.text, "too big", 7) == 0) {
        j = parse_big_integers(s, len, &err);
        if (j) return j;
    }
    if (json_error_code(&err) == json_error_stack_overflow) {
        line_col(s, len, level_offset(s, len, JSON_MAX_DEPTH + 1), &line, &col);
        snprintf(msg, cap, "invalid JSON at line %d, column %d: nesting deeper than %d levels",
                 line, col, JSON_MAX_DEPTH);
        return NULL;
    }
    char text[JSON_ERROR_TEXT_LENGTH * 4];
    clean_copy(text, sizeof text, err.text);
    snprintf(msg, cap, "invalid JSON at line %d, column %d: %s", err.line, err.column, text);
    return NULL;
}

/* The deepest nesting of arrays and objects in j (1 for a non-empty leaf container). */
static int depth_of(const json_t *j)
{
    int d = 0;
    if (json_is_array(j)) {
        for (size_t i = 0; i < json_array_size(j); i++) {
            int c = depth_of(json_array_get(j, i));
            if (c > d) d = c;
        }
        return d + 1;
    }
    if (json_is_object(j)) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)j, k, v) {
            int c = depth_of(v);
            if (c > d) d = c;
        }
        return d + 1;
    }
    return 0;
}

int rb_json_check(const char *s, size_t len, char *msg, size_t cap)
{
    json_t *j = parse(s, len, msg, cap);
    if (!j) return 0;
    int deep = depth_of(j) > JSON_MAX_DEPTH;
    json_decref(j);
    if (deep) {
        int line, col;
        line_col(s, len, level_offset(s, len, JSON_MAX_DEPTH + 1), &line, &col);
        snprintf(msg, cap, "invalid JSON at line %d, column %d: nesting deeper than %d levels",
                 line, col, JSON_MAX_DEPTH);
    }
    return !deep;
}

/* ---- decoding: Jansson's tree to Lua values ---------------------------------------------- */
typedef struct decoder {
    const char *s;
    size_t len;
    json_t *root;
    int depth;
} decoder;

#define DEC_ARRAY_MT 2      /* stack index of the array metatable in decode_protected */

static void push_json(lua_State *L, decoder *d, const json_t *j);

static void enter(lua_State *L, decoder *d)
{
    if (++d->depth > JSON_MAX_DEPTH) {
        int line, col;
        line_col(d->s, d->len, level_offset(d->s, d->len, JSON_MAX_DEPTH + 1), &line, &col);
        luaL_error(L, "invalid JSON at line %d, column %d: nesting deeper than %d levels", line,
                   col, JSON_MAX_DEPTH);
    }
    if (!lua_checkstack(L, 4)) luaL_error(L, "JSON too deep for the Lua stack");
}

static int size_hint(size_t n) { return n > INT_MAX ? INT_MAX : (int)n; }

static void push_json(lua_State *L, decoder *d, const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        enter(L, d);
        lua_createtable(L, 0, size_hint(json_object_size(j)));
        const char *k;
        size_t kl;
        json_t *v;
        json_object_keylen_foreach((json_t *)j, k, kl, v) {
            lua_pushlstring(L, k, kl);
            push_json(L, d, v);
            lua_rawset(L, -3);
        }
        d->depth--;
        break;
    }
    case JSON_ARRAY: {
        enter(L, d);
        size_t n = json_array_size(j);
        lua_createtable(L, size_hint(n), 0);
        for (size_t i = 0; i < n; i++) {
            push_json(L, d, json_array_get(j, i));
            lua_rawseti(L, -2, (lua_Integer)i + 1);
        }
        lua_pushvalue(L, DEC_ARRAY_MT);
        lua_setmetatable(L, -2);
        d->depth--;
        break;
    }
    case JSON_STRING: lua_pushlstring(L, json_string_value(j), json_string_length(j)); break;
    case JSON_INTEGER: lua_pushinteger(L, (lua_Integer)json_integer_value(j)); break;
    case JSON_REAL: lua_pushnumber(L, json_real_value(j)); break;
    case JSON_TRUE: lua_pushboolean(L, 1); break;
    case JSON_FALSE: lua_pushboolean(L, 0); break;
    case JSON_NULL: lua_pushlightuserdata(L, NULL); break;   /* relaybus.json.null */
    }
}

static int decode_protected(lua_State *L)
{
    decoder *d = lua_touserdata(L, 1);
    lua_rawgetp(L, LUA_REGISTRYINDEX, &ARRAY_MT_KEY);   /* at DEC_ARRAY_MT */
    if (json_is_null(d->root)) lua_pushnil(L);            /* null at the top: no payload */
    else push_json(L, d, d->root);
    return 1;
}

int rb_json_decode(lua_State *L, const char *s, size_t len)
{
    char msg[400];
    json_t *j = parse(s, len, msg, sizeof msg);
    if (!j) {
        lua_pushstring(L, msg);
        return 0;
    }
    decoder d = {s, len, j, 0};
    luaL_checkstack(L, 4, "relaybus: json");
    lua_pushcfunction(L, decode_protected);
    lua_pushlightuserdata(L, &d);
    int rc = lua_pcall(L, 1, 1, 0);
    json_decref(j);
    return rc == LUA_OK;
}

/* ---- encoding ---------------------------------------------------------------------------- */

/* One key of the object being written: its text, and where the key itself is kept alive (a
 * stack slot, or an index of the anchor table). */
typedef struct key_ent {
    const char *s;          /* a string key's bytes; integer keys use num */
    size_t len;
    int slot;
    int is_int;
    char num[24];           /* an integer key's decimal text */
} key_ent;

/* One table on the path from the value being encoded down to where encoding is now. */
enum { AT_NONE, AT_INDEX, AT_KEY };
typedef struct frame {
    const void *table;
    int at;                 /* what of it is being written: AT_INDEX index, AT_KEY key */
    lua_Integer index;
    size_t key;             /* in encoder.keys */
} frame;

typedef struct encoder {
    lua_State *L;
    const char *root;       /* the name of the value in messages: "payload", "value" */
    int array_mt;           /* stack index of relaybus.json.array_mt */
    char *buf;
    size_t len, cap;
    key_ent *keys;          /* a stack: each object's entries above its parent's */
    size_t nkeys, keys_cap;
    frame *frames;
    size_t depth, frames_cap;
    char buf0[1024];        /* the first storage of each, on the C stack */
    key_ent keys0[32];
    frame frames0[32];
} encoder;

static void enc_init(encoder *e, lua_State *L, const char *root)
{
    e->L = L;
    e->root = root;
    e->buf = e->buf0;
    e->len = 0;
    e->cap = sizeof e->buf0;
    e->keys = e->keys0;
    e->nkeys = 0;
    e->keys_cap = sizeof e->keys0 / sizeof e->keys0[0];
    e->frames = e->frames0;
    e->depth = 0;
    e->frames_cap = sizeof e->frames0 / sizeof e->frames0[0];
}

static void enc_release(encoder *e)
{
    if (e->buf != e->buf0) free(e->buf);
    if (e->keys != e->keys0) free(e->keys);
    if (e->frames != e->frames0) free(e->frames);
}

/* A bounded text: appends past its end are dropped (n stays below cap). */
typedef struct text_buf {
    char *p;
    size_t n, cap;
} text_buf;

static void __attribute__((format(printf, 2, 3))) tb_add(text_buf *b, const char *fmt, ...)
{
    if (b->n + 1 >= b->cap) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap);
    va_end(ap);
    if (k > 0) b->n += (size_t)k;
    if (b->n >= b->cap) b->n = b->cap - 1;
}

/* A key as a step of a path: .name when it is an identifier, else ["..."] with the bytes that
 * are not printable (or not UTF-8) as \xNN, cut after 40 bytes. */
static void path_key(text_buf *b, const char *k, size_t kl)
{
    int ident = kl > 0 && kl <= 40 && !(k[0] >= '0' && k[0] <= '9');
    for (size_t i = 0; ident && i < kl; i++) {
        char c = k[i];
        ident = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    }
    if (ident) {
        tb_add(b, ".%.*s", (int)kl, k);
        return;
    }
    tb_add(b, "[\"");
    size_t i = 0;
    while (i < kl && i < 40) {
        unsigned char c = (unsigned char)k[i];
        size_t q = c >= 0x80 ? rb_utf8_seq(k + i, kl - i) : (c >= 0x20 && c != 0x7f);
        if (c == '"' || c == '\\') tb_add(b, "\\%c", c);
        else if (q) tb_add(b, "%.*s", (int)q, k + i);
        else tb_add(b, "\\x%02x", c);
        i += q ? q : 1;
    }
    tb_add(b, i < kl ? "...\"]" : "\"]");
}

/* The path of the part being encoded, for messages: payload.items[3].price */
static void path_text(const encoder *e, char *out, size_t cap)
{
    text_buf b = {out, 0, cap};
    out[0] = 0;
    tb_add(&b, "%s", e->root);
    for (size_t d = 0; d < e->depth; d++) {
        /* a path 1000 deep keeps its first and last steps */
        if (e->depth > 16 && d == 6) {
            tb_add(&b, "...(%zu more)...", e->depth - 12);
            d = e->depth - 7;
            continue;
        }
        const frame *f = &e->frames[d];
        if (f->at == AT_INDEX) {
            tb_add(&b, "[%lld]", (long long)f->index);
        } else if (f->at == AT_KEY) {
            const key_ent *k = &e->keys[f->key];
            if (k->is_int) tb_add(&b, "[%s]", k->num);
            else path_key(&b, k->s, k->len);
        }
    }
}

/* Raises "PATH: message" (inside encode_protected's lua_pcall). */
static void __attribute__((format(printf, 2, 3))) enc_fail(encoder *e, const char *fmt, ...)
{
    char path[400], msg[200];
    path_text(e, path, sizeof path);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    lua_pushfstring(e->L, "%s: %s", path, msg);
    lua_error(e->L);
}

/* Grows *arr (its first storage inline) to hold need elements of size sz. */
static void grow(encoder *e, void **arr, size_t *cap, size_t need, size_t sz, void *inline_store)
{
    if (need <= *cap) return;
    size_t ncap = *cap;
    while (ncap < need) {
        if (ncap > SIZE_MAX / 2 / sz) enc_fail(e, "out of memory");
        ncap *= 2;
    }
    void *p = rb_realloc(*arr == inline_store ? NULL : *arr, ncap * sz);
    if (!p) enc_fail(e, "out of memory");
    if (*arr == inline_store) memcpy(p, inline_store, *cap * sz);
    *arr = p;
    *cap = ncap;
}

static inline void reserve(encoder *e, size_t n)
{
    if (e->cap - e->len >= n) return;
    if (n > SIZE_MAX / 2 - e->len) enc_fail(e, "out of memory");
    grow(e, (void **)&e->buf, &e->cap, e->len + n, 1, e->buf0);
}

static inline void put(encoder *e, const char *s, size_t n)
{
    reserve(e, n);
    memcpy(e->buf + e->len, s, n);
    e->len += n;
}

static inline void put_char(encoder *e, char c)
{
    reserve(e, 1);
    e->buf[e->len++] = c;
}

/* A float as rb_json_float writes it (text.h): the shortest text of the same bits, always
 * recognisably a float. */
static void put_float(encoder *e, double x)
{
    char buf[RB_NUM_TEXT];
    size_t n;
    if (isnan(x)) {
        enc_fail(e, "cannot encode NaN as JSON");
        return;
    }
    if (isinf(x)) {
        enc_fail(e, x > 0 ? "cannot encode inf as JSON" : "cannot encode -inf as JSON");
        return;
    }
    n = rb_json_float(buf, x);
    put(e, buf, n);
}

static void put_integer(encoder *e, lua_Integer v)
{
    char buf[RB_NUM_TEXT];
    put(e, buf, rb_json_int(buf, v));
}

/* 1: the byte is written as it is; 0: escaped (or, from 0x80, checked as UTF-8). */
static const unsigned char plain[256] = {
    ['\x20'] = 1, 1, 0 /* " */, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0 /* \ */, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
};

/* Writes s[0..len) as a JSON string. It must be valid UTF-8; a key must hold no NUL (Jansson
 * cannot read one back in a key). */
static void put_string(encoder *e, const char *s, size_t len, int is_key)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    reserve(e, len + 2);
    char *o = e->buf + e->len;
    *o++ = '"';
    for (size_t i = 0; i < len;) {
        unsigned char c = p[i];
        if (plain[c]) {
            *o++ = (char)c;
            i++;
            continue;
        }
        if (c >= 0x80) {
            size_t k = rb_utf8_seq(s + i, len - i);
            if (!k) {
                e->len = (size_t)(o - e->buf);
                enc_fail(e, "%s is not valid UTF-8 (byte 0x%02x at offset %zu)",
                         is_key ? "a key" : "string", c, i);
                return;
            }
            memcpy(o, s + i, k);
            o += k;
            i += k;
            continue;
        }
        if (c == 0 && is_key) {
            e->len = (size_t)(o - e->buf);
            enc_fail(e, "a key holds a NUL byte (offset %zu), which JSON keys cannot bring back", i);
            return;
        }
        /* an escape: up to 6 bytes for this one, then the rest as it is */
        e->len = (size_t)(o - e->buf);
        reserve(e, 6 + (len - i - 1) + 1);
        o = e->buf + e->len;
        *o++ = '\\';
        switch (c) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '\b': *o++ = 'b'; break;
        case '\f': *o++ = 'f'; break;
        case '\n': *o++ = 'n'; break;
        case '\r': *o++ = 'r'; break;
        case '\t': *o++ = 't'; break;
        default:
            memcpy(o, "u00", 3);
            o[3] = hex[c >> 4];
            o[4] = hex[c & 15];
            o += 5;
        }
        i++;
    }
    *o++ = '"';
    e->len = (size_t)(o - e->buf);
}

static void encode_value(encoder *e, int idx);

/* Writes t as an array when its keys are exactly 1..n (n > 0); an empty table as [] when it
 * carries relaybus.json.array_mt, else {}. Returns 0, having written nothing, otherwise. */
static int encode_sequence(encoder *e, int t)
{
    lua_State *L = e->L;
    size_t start = e->len;
    lua_Integer next = 1;
    /* Tables built as sequences give their keys in order: write while they do. */
    lua_pushnil(L);
    while (lua_next(L, t)) {
        if (!lua_isinteger(L, -2) || lua_tointeger(L, -2) != next) {
            lua_pop(L, 2);
            goto out_of_order;
        }
        put_char(e, next == 1 ? '[' : ',');
        frame *f = &e->frames[e->depth - 1];
        f->at = AT_INDEX;
        f->index = next;
        encode_value(e, lua_gettop(L));
        lua_pop(L, 1);
        next++;
    }
    if (next > 1) {
        put_char(e, ']');
        return 1;
    }
    int is_array = 0;
    if (lua_getmetatable(L, t)) {
        is_array = lua_rawequal(L, -1, e->array_mt);
        lua_pop(L, 1);
    }
    put(e, is_array ? "[]" : "{}", 2);
    return 1;

out_of_order:
    e->len = start;
    lua_Unsigned n = lua_rawlen(L, t), count = 0;
    if (n == 0 || n > (lua_Unsigned)LUA_MAXINTEGER) return 0;
    lua_pushnil(L);
    while (lua_next(L, t)) {
        lua_pop(L, 1);
        lua_Integer k = lua_isinteger(L, -1) ? lua_tointeger(L, -1) : 0;
        if (k < 1 || (lua_Unsigned)k > n) {
            lua_pop(L, 1);
            return 0;
        }
        count++;
    }
    if (count != n) return 0;
    put_char(e, '[');
    for (lua_Integer i = 1; i <= (lua_Integer)n; i++) {
        if (i > 1) put_char(e, ',');
        frame *f = &e->frames[e->depth - 1];
        f->at = AT_INDEX;
        f->index = i;
        lua_rawgeti(L, t, i);
        encode_value(e, lua_gettop(L));
        lua_pop(L, 1);
    }
    put_char(e, ']');
    return 1;
}

static const char *key_bytes(const key_ent *k) { return k->is_int ? k->num : k->s; }

static int key_cmp(const void *a, const void *b)
{
    const key_ent *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(key_bytes(x), key_bytes(y), n);
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* Reads the keys of t into e->keys[first..]: their values stay on the stack, or in a table at
 * *anchor once there are many. 0, or -1 after enc_fail. */
static int collect_keys(encoder *e, int t, size_t first, int base, int *anchor)
{
    lua_State *L = e->L;
collect:
    lua_pushnil(L);
    while (lua_next(L, t)) {
        lua_pop(L, 1);                  /* the value is read again in key order */
        size_t i = e->nkeys - first;
        if (!*anchor && (i >= STACK_KEYS || !lua_checkstack(L, 4))) {
            /* many keys: keep them in a table rather than on the stack */
            lua_settop(L, base);
            e->nkeys = first;
            lua_createtable(L, STACK_KEYS * 2, 0);
            *anchor = lua_gettop(L);
            goto collect;
        }
        grow(e, (void **)&e->keys, &e->keys_cap, e->nkeys + 1, sizeof *e->keys, e->keys0);
        key_ent *k = &e->keys[e->nkeys];
        int kt = lua_type(L, -1);
        if (kt == LUA_TSTRING) {
            k->s = lua_tolstring(L, -1, &k->len);
            k->is_int = 0;
        } else if (kt == LUA_TNUMBER && lua_isinteger(L, -1)) {
            k->len = rb_json_int(k->num, lua_tointeger(L, -1));
            k->num[k->len] = 0;
            k->is_int = 1;
        } else {
            enc_fail(e, "cannot encode a key of type %s (keys are strings or integers)",
                     kt == LUA_TNUMBER ? "float" : lua_typename(L, kt));
            return -1;
        }
        lua_pushvalue(L, -1);
        if (*anchor) {
            lua_rawseti(L, *anchor, (lua_Integer)i + 1);
            k->slot = (int)i + 1;
        } else {
            k->slot = lua_gettop(L) - 1;
        }
        e->nkeys++;
    }
    return 0;
}

/* Sorts the n keys from first; -1 after enc_fail when two would be written alike. */
static int sort_keys(encoder *e, size_t first, size_t n)
{
    qsort(e->keys + first, n, sizeof *e->keys, key_cmp);
    for (size_t i = 1; i < n; i++) {
        const key_ent *a = &e->keys[first + i - 1], *b = &e->keys[first + i];
        if (key_cmp(a, b) == 0) {
            /* t[1] and t["1"] would both be written "1": the text could not say which */
            enc_fail(e, "key %s is there both as an integer and as a string", a->is_int ? a->num : b->num);
            return -1;
        }
    }
    return 0;
}

static void put_key(encoder *e, const key_ent *k)
{
    if (k->is_int) {
        reserve(e, k->len + 2);
        e->buf[e->len++] = '"';
        memcpy(e->buf + e->len, k->num, k->len);
        e->len += k->len;
        e->buf[e->len++] = '"';
    } else {
        put_string(e, k->s, k->len, 1);
    }
    put_char(e, ':');
}

/* Writes t as an object, its keys sorted (bytewise, which is code point order). */
static void encode_object(encoder *e, int t)
{
    lua_State *L = e->L;
    int base = lua_gettop(L), anchor = 0;
    size_t first = e->nkeys;
    frame *f = &e->frames[e->depth - 1];
    f->at = AT_NONE;
    if (collect_keys(e, t, first, base, &anchor) != 0) return;
    size_t n = e->nkeys - first;
    if (sort_keys(e, first, n) != 0) return;
    put_char(e, '{');
    size_t written = 0;
    for (size_t i = 0; i < n; i++) {
        key_ent *k = &e->keys[first + i];   /* again each time: nested objects grow keys */
        if (anchor) lua_rawgeti(L, anchor, k->slot);
        else lua_pushvalue(L, k->slot);
        lua_rawget(L, t);
        if (lua_isnil(L, -1)) {           /* taken out meanwhile (by a finalizer) */
            lua_pop(L, 1);
            continue;
        }
        if (written++) put_char(e, ',');
        f = &e->frames[e->depth - 1];
        f->at = AT_KEY;
        f->key = first + i;
        put_key(e, k);
        encode_value(e, lua_gettop(L));
        lua_pop(L, 1);
    }
    put_char(e, '}');
    e->nkeys = first;
    lua_settop(L, base);
}

static void encode_table(encoder *e, int t)
{
    const void *p = lua_topointer(e->L, t);
    if (e->depth >= JSON_MAX_DEPTH) {
        enc_fail(e, "nesting deeper than %d levels", JSON_MAX_DEPTH);
        return;
    }
    for (size_t d = 0; d < e->depth; d++) {
        if (e->frames[d].table == p) {
            enc_fail(e, "cannot encode a cycle (the table contains itself)");
            return;
        }
    }
    if (!lua_checkstack(e->L, 8)) {
        enc_fail(e, "out of Lua stack");
        return;
    }
    grow(e, (void **)&e->frames, &e->frames_cap, e->depth + 1, sizeof *e->frames, e->frames0);
    e->frames[e->depth++] = (frame){p, AT_NONE, 0, 0};
    if (!encode_sequence(e, t)) encode_object(e, t);
    e->depth--;
}

static void encode_value(encoder *e, int idx)
{
    lua_State *L = e->L;
    int type = lua_type(L, idx);
    switch (type) {
    case LUA_TNIL: put(e, "null", 4); return;
    case LUA_TBOOLEAN:
        if (lua_toboolean(L, idx)) put(e, "true", 4);
        else put(e, "false", 5);
        return;
    case LUA_TNUMBER:
        if (lua_isinteger(L, idx)) put_integer(e, lua_tointeger(L, idx));
        else put_float(e, lua_tonumber(L, idx));
        return;
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        put_string(e, s, n, 0);
        return;
    }
    case LUA_TTABLE: encode_table(e, idx); return;
    case LUA_TLIGHTUSERDATA:
        if (lua_touserdata(L, idx) == NULL) {   /* relaybus.json.null */
            put(e, "null", 4);
            return;
        }
        break;
    }
    enc_fail(e, "cannot encode a %s", lua_typename(L, type));
}

/* encode_protected(encoder, value, array_mt) -> text */
static int encode_protected(lua_State *L)
{
    encoder *e = lua_touserdata(L, 1);
    e->array_mt = 3;
    encode_value(e, 2);
    lua_pushlstring(L, e->buf, e->len);
    return 1;
}

int rb_json_encode_as(lua_State *L, int idx, const char *root)
{
    idx = lua_absindex(L, idx);
    luaL_checkstack(L, 6, "relaybus: json");
    encoder e;
    enc_init(&e, L, root);
    lua_pushcfunction(L, encode_protected);
    lua_pushlightuserdata(L, &e);
    lua_pushvalue(L, idx);
    lua_rawgetp(L, LUA_REGISTRYINDEX, &ARRAY_MT_KEY);
    int rc = lua_pcall(L, 3, 1, 0);
    enc_release(&e);
    return rc == LUA_OK;
}

int rb_json_encode(lua_State *L, int idx) { return rb_json_encode_as(L, idx, "payload"); }

/* ---- relaybus.json ------------------------------------------------------------------------ */
static int l_encode(lua_State *L)
{
    lua_settop(L, 1);
    if (!rb_json_encode_as(L, 1, "value"))
        return rb_misuse(L, "cannot encode as JSON: %s", lua_tostring(L, -1));
    return 1;
}

static int l_decode(lua_State *L)
{
    size_t len;
    const char *s = luaL_checklstring(L, 1, &len);
    if (!rb_json_decode(L, s, len)) {
        lua_pushnil(L);
        lua_insert(L, -2);
        return 2;
    }
    return 1;
}

/* json.array([t]): marks t (or a new table) as an array, so that it encodes as [] when empty. */
static int l_array(lua_State *L)
{
    if (lua_isnoneornil(L, 1)) {
        lua_settop(L, 0);
        lua_newtable(L);
    } else {
        luaL_checktype(L, 1, LUA_TTABLE);
        lua_settop(L, 1);
    }
    lua_rawgetp(L, LUA_REGISTRYINDEX, &ARRAY_MT_KEY);
    if (lua_getmetatable(L, 1)) {
        if (!lua_rawequal(L, -1, -2)) return rb_misuse(L, "json.array: the table already has a metatable");
        lua_pop(L, 1);
    }
    lua_setmetatable(L, 1);
    return 1;
}

void rb_lua_open_json(lua_State *L)
{
    lua_rawgetp(L, LUA_REGISTRYINDEX, &ARRAY_MT_KEY);
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        lua_createtable(L, 0, 1);
        lua_pushliteral(L, "relaybus.json.array");
        lua_setfield(L, -2, "__name");
        lua_pushvalue(L, -1);
        lua_rawsetp(L, LUA_REGISTRYINDEX, &ARRAY_MT_KEY);
    }
    int mt = lua_gettop(L);
    static const luaL_Reg fns[] = {
        {"encode", l_encode},
        {"decode", l_decode},
        {"array", l_array},
        {NULL, NULL}
    };
    luaL_newlib(L, fns);
    lua_pushlightuserdata(L, NULL);
    lua_setfield(L, -2, "null");
    lua_pushvalue(L, mt);
    lua_setfield(L, -2, "array_mt");
    lua_remove(L, mt);
}
