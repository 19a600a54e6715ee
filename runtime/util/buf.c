/* buf.c -- see buf.h. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util/alloc.h"
#include "util/buf.h"

void rb_buf_init(rb_buf *b) { memset(b, 0, sizeof *b); }

void rb_buf_free(rb_buf *b)
{
    free(b->data);
    rb_buf_init(b);
}

static int grow(rb_buf *b, size_t need)
{
    if (b->failed) return 0;
    if (b->len + need + 1 <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + need + 1) {
        if (cap > ((size_t)-1) / 2) { b->failed = 1; return 0; }
        cap *= 2;
    }
    char *p = rb_realloc(b->data, cap);
    if (!p) { b->failed = 1; return 0; }
    b->data = p;
    b->cap = cap;
    return 1;
}

void rb_buf_add(rb_buf *b, const char *s, size_t n)
{
    if (!grow(b, n)) return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

void rb_buf_puts(rb_buf *b, const char *s) { rb_buf_add(b, s, strlen(s)); }

void rb_buf_printf(rb_buf *b, const char *fmt, ...)
{
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) { b->failed = 1; return; }
    if ((size_t)n < sizeof small) { rb_buf_add(b, small, (size_t)n); return; }
    if (!grow(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

int rb_buf_failed(const rb_buf *b) { return b->failed; }
