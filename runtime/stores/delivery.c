/* delivery.c -- building and freeing delivery records (one allocation per record). */
#include <stdlib.h>
#include <string.h>
#include "stores/delivery.h"
#include "util/alloc.h"
#include "util/check.h"

static size_t len0(const char *s) { return s ? strlen(s) + 1 : 0; }

static char *place(char **cursor, const char *s)
{
    if (!s) return NULL;
    size_t n = strlen(s) + 1;
    char *dst = *cursor;
    memcpy(dst, s, n);
    *cursor += n;
    return dst;
}

rb_delivery *rb_delivery_make(const rb_delivery_texts *t)
{
    size_t extra = len0(t->id) + len0(t->topic) + len0(t->payload) + len0(t->key) +
                   len0(t->group) + len0(t->last_error) + len0(t->lease_token) +
                   len0(t->progress) + len0(t->errors);
    rb_delivery *d = rb_calloc(1, sizeof *d + extra);
    if (!d) return NULL;
    char *cur = (char *)(d + 1);
    d->id = place(&cur, t->id);
    d->topic = place(&cur, t->topic);
    d->payload = place(&cur, t->payload);
    d->key = place(&cur, t->key);
    d->group = place(&cur, t->group);
    d->last_error = place(&cur, t->last_error);
    d->lease_token = place(&cur, t->lease_token);
    d->progress = place(&cur, t->progress);
    d->errors = place(&cur, t->errors);
    RB_ASSERT(cur == (char *)(d + 1) + extra);
    return d;
}

rb_delivery *rb_delivery_new(const char *id, const char *topic, const char *payload,
                             const char *key, const char *last_error, const char *lease_token)
{
    rb_delivery_texts t = {.id = id, .topic = topic, .payload = payload, .key = key,
                           .last_error = last_error, .lease_token = lease_token};
    return rb_delivery_make(&t);
}

void rb_delivery_free(rb_delivery *d) { free(d); }

void rb_delivery_list_free(rb_delivery **list, size_t n)
{
    if (!list) return;
    for (size_t i = 0; i < n; i++) free(list[i]);
    free(list);
}

static const char *const status_names[RB_STATUS_COUNT] = {"pending", "processing", "completed",
                                                          "buried", "cancelled"};

const char *rb_status_name(rb_status s)
{
    return (unsigned)s < RB_STATUS_COUNT ? status_names[s] : "unknown";
}

int rb_status_parse(const char *name)
{
    for (int i = 0; i < RB_STATUS_COUNT; i++)
        if (name && strcmp(name, status_names[i]) == 0) return i;
    return -1;
}
