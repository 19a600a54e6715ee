/* delivery.h -- the delivery record, as every store returns it.
 *
 * One record is one allocation: the strings live in the same block after the struct, so a
 * record is freed with one free() (rb_delivery_free). There is no copy function: to keep a
 * record past a callback that lends it, build a new one with rb_delivery_new and copy the
 * scalar fields. */
#ifndef RB_DELIVERY_H
#define RB_DELIVERY_H

#include <stddef.h>
#include <stdint.h>

typedef enum { RB_PENDING = 0, RB_PROCESSING, RB_COMPLETED, RB_BURIED, RB_CANCELLED, RB_STATUS_COUNT } rb_status;

typedef struct rb_delivery {
    char *id;               /* unique in the store */
    char *topic;
    char *payload;          /* JSON text as stored (may be invalid if written by hand) */
    char *key;              /* dedupe key or NULL */
    char *group;            /* ordered group or NULL: one of a group runs at a time, in id order */
    char *last_error;       /* or NULL */
    char *lease_token;      /* or NULL when not processing */
    /* get and list only (claims leave them NULL and 0): */
    char *progress;         /* JSON text a run stored with its progress, or NULL */
    char *errors;           /* JSON array of the last attempts' errors, oldest first, or NULL */
    rb_status status;
    int attempts;
    int max_attempts;
    int64_t fence;
    double run_at;          /* epoch s */
    double created_at;      /* epoch s */
    double lease_expires_at;/* epoch s, 0 when none */
    double settled_at;      /* epoch s of completion, burial or cancel; 0 while live (get, list) */
    /* Claims only: monotonic s at which the store began this lease, when it knows it (a store
     * on this host, after waiting for a lock); 0 otherwise. */
    double claimed_at;
    /* get and list only: how many of its dependencies (after) have not completed yet; it is
     * held until none is left. 0 when it waits for none. */
    int waiting;
} rb_delivery;

/* How many of the last attempts' errors a delivery keeps (rb_delivery.errors). */
#define RB_ERRORS_KEPT 10

/* Builds a record; string arguments are copied (NULL stays NULL), the rest is zero. */
rb_delivery *rb_delivery_new(const char *id, const char *topic, const char *payload,
                             const char *key, const char *last_error, const char *lease_token);

/* A record's texts by name, for rb_delivery_make. */
typedef struct rb_delivery_texts {
    const char *id, *topic, *payload, *key, *group, *last_error, *lease_token;
    const char *progress, *errors;
} rb_delivery_texts;
/* As rb_delivery_new, with every text of the record. */
rb_delivery *rb_delivery_make(const rb_delivery_texts *t);
void rb_delivery_free(rb_delivery *d);
void rb_delivery_list_free(rb_delivery **list, size_t n);

const char *rb_status_name(rb_status s);
/* Returns -1 for an unknown name. */
int rb_status_parse(const char *name);

#endif
