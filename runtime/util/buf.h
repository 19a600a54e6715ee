/* buf.h -- a growable text buffer for responses (metrics text, JSON). Out of memory is sticky:
 * later appends do nothing and rb_buf_failed says so, so a writer checks once at the end. */
#ifndef RB_BUF_H
#define RB_BUF_H

#include <stddef.h>

typedef struct rb_buf {
    char *data;     /* NUL-terminated while not failed; free() it, or take it */
    size_t len, cap;
    int failed;
} rb_buf;

void rb_buf_init(rb_buf *b);
void rb_buf_free(rb_buf *b);
void rb_buf_add(rb_buf *b, const char *s, size_t n);
void rb_buf_puts(rb_buf *b, const char *s);
void rb_buf_printf(rb_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int rb_buf_failed(const rb_buf *b);

#endif
