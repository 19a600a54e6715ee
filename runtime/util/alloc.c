/* alloc.c -- malloc and friends for the C core (alloc.h). */
#include <stdlib.h>
#include <string.h>
#include "util/alloc.h"

void *rb_malloc(size_t size) { return malloc(size); }
void *rb_calloc(size_t n, size_t size) { return calloc(n, size); }
void *rb_realloc(void *p, size_t size) { return realloc(p, size); }
char *rb_strdup(const char *s) { return strdup(s); }
char *rb_strndup(const char *s, size_t n) { return strndup(s, n); }
