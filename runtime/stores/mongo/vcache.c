/* vcache.c -- the MongoDB store: versions our claims wrote (FerretDB).
 * A settle must know the version it changes; a claim just wrote it. Kept per delivery and
 * lease token, a settle takes the ticket "<doc>:<v+1>" without reading the document first.
 * That stays safe when the cache is stale: whoever changed the delivery since took that very
 * ticket (versions grow by one per write, each through its ticket), so ours fails and the
 * settle is not applied, as with a read. Entries expire well before tickets are pruned.
 * The claim also notes the generation of the queue entry it left for the delivery (readyq.c),
 * so that a settle which ends the delivery removes that entry at once instead of leaving it
 * for a later claim to read, look up and remove. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/clock.h"
#include "util/check.h"

#define VC_MAX 200000           /* cached versions kept at most (then the cache starts over) */
#define VC_TTL_S 600.0          /* well inside TICKET_TTL_S: an older one is read again */

typedef struct vce {
    rb_hnode node;              /* in mstore.vc, by id */
    char id[25], token[33];
    int64_t v, attempts;
    int64_t qg;                 /* generation of the delivery's queue entry, or -1 */
    double expires;             /* lease_expires_at written (store clock) */
    double at;                  /* monotonic s of the write */
} vce;

static vce *vc_find_locked(mstore *s, const char *id)
{
    for (rb_hnode *n = rb_hmap_first(&s->vc, rb_hash_text(id)); n; n = rb_hmap_next(n)) {
        vce *e = RB_HMAP_ENTRY(n, vce, node);
        if (strcmp(e->id, id) == 0) return e;
    }
    return NULL;
}

static void vc_drop_locked(mstore *s, const char *id)
{
    vce *e = vc_find_locked(s, id);
    if (!e) return;
    rb_hmap_remove(&s->vc, &e->node);
    free(e);
}

static void vc_clear_locked(mstore *s)
{
    for (size_t b = 0; b < s->vc.nbuckets; b++)
        while (s->vc.buckets[b]) {
            vce *e = RB_HMAP_ENTRY(s->vc.buckets[b], vce, node);
            rb_hmap_remove(&s->vc, &e->node);
            free(e);
        }
    RB_ASSERT(s->vc.count == 0);
}

void mg_vc_drop(mstore *s, const char *id)
{
    if (!s->ferret || !id) return;
    pthread_mutex_lock(&s->mu);
    vc_drop_locked(s, id);
    pthread_mutex_unlock(&s->mu);
}

void mg_vc_put(mstore *s, const char *id, const char *token, int64_t v, int64_t attempts,
               int64_t qg, double expires)
{
    if (!s->ferret || !id || !token || strlen(id) != 24 || strlen(token) > 32) return;
    vce *e = rb_calloc(1, sizeof *e);
    pthread_mutex_lock(&s->mu);
    vc_drop_locked(s, id);
    if (s->vc.count >= VC_MAX) vc_clear_locked(s);
    if (e) {
        memcpy(e->id, id, 25);
        snprintf(e->token, sizeof e->token, "%s", token);
        e->v = v;
        e->attempts = attempts;
        e->qg = qg;
        e->expires = expires;
        e->at = rb_monotonic();
        if (rb_hmap_add(&s->vc, &e->node, rb_hash_text(id)) != 0) free(e);  /* not kept: read again */
    }
    pthread_mutex_unlock(&s->mu);
}

/* The document as our last write left it (the fields a settle needs), or NULL; *qg: the
 * generation of its queue entry, or -1. */
bson_t *mg_vc_doc(mstore *s, const char *id, const char *token, int64_t *qg)
{
    bson_t *d = NULL;
    bson_oid_t oid;
    *qg = -1;
    if (!s->ferret || !id || !token || strlen(id) != 24 || !bson_oid_is_valid(id, 24)) return NULL;
    pthread_mutex_lock(&s->mu);
    vce *e = vc_find_locked(s, id);
    if (e && strcmp(e->token, token) == 0 && rb_monotonic() - e->at < VC_TTL_S) {
        d = bson_new();
        bson_oid_init_from_string(&oid, id);
        BSON_APPEND_OID(d, "_id", &oid);
        BSON_APPEND_UTF8(d, "status", "processing");
        BSON_APPEND_UTF8(d, "lease_token", token);
        BSON_APPEND_INT64(d, "v", e->v);
        BSON_APPEND_INT64(d, "attempts", e->attempts);
        BSON_APPEND_DOUBLE(d, "lease_expires_at", e->expires);
        *qg = e->qg;
    }
    pthread_mutex_unlock(&s->mu);
    return d;
}

void mg_vc_clear(mstore *s)
{
    pthread_mutex_lock(&s->mu);
    vc_clear_locked(s);
    pthread_mutex_unlock(&s->mu);
}
