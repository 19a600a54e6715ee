/* delivery.c -- building and freeing delivery records (one allocation per record). */
#include <stdlib.h>
#include <string.h>
#include "stores/delivery.h"
#include "util/alloc.h"

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

rb_delivery *rb_delivery_with_history(const char *id, const char *topic, const char *payload,
                                      const char *key, const char *last_error,
                                      const char *lease_token, const char *progress,
                                      const char *errors)
{
    size_t extra = len0(id) + len0(topic) + len0(payload) + len0(key) + len0(last_error) +
                   len0(lease_token) + len0(progress) + len0(errors);
    rb_delivery *d = rb_calloc(1, sizeof *d + extra);
    if (!d) return NULL;
    char *cur = (char *)(d + 1);
    d->id = place(&cur, id);
    d->topic = place(&cur, topic);
    d->payload = place(&cur, payload);
    d->key = place(&cur, key);
    d->last_error = place(&cur, last_error);
    d->lease_token = place(&cur, lease_token);
    d->progress = place(&cur, progress);
    d->errors = place(&cur, errors);
    return d;
}

rb_delivery *rb_delivery_new(const char *id, const char *topic, const char *payload,
                             const char *key, const char *last_error, const char *lease_token)
{
    return rb_delivery_with_history(id, topic, payload, key, last_error, lease_token, NULL, NULL);
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
