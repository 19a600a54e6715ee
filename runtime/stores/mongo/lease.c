/* lease.c -- the MongoDB store's named leases: one document per name in <table>_leases,
 * changed through tickets like a delivery. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"


typedef struct lease_job {
    mjob j;
    rb_lease_op kind;
    char *name, *token;
    double duration;
    int acquired;
    double expires;
} lease_job;

static bson_t *upd_lease(const bson_t *cur, const char *token, double expires)
{
    bson_t *u = bson_new(), set;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    if (token) BSON_APPEND_UTF8(&set, "token", token);
    else BSON_APPEND_NULL(&set, "token");
    BSON_APPEND_DOUBLE(&set, "expires_at", expires);
    BSON_APPEND_INT64(&set, "v", mg_doc_int(cur, "v") + 1);
    bson_append_document_end(u, &set);
    return u;
}

/* A name never held: insert it (atomic through the _id index). */
static void lease_insert(lease_job *q, mongoc_collection_t *cl, double now)
{
    bson_t d = BSON_INITIALIZER;
    bson_error_t e;
    BSON_APPEND_UTF8(&d, "_id", q->name);
    BSON_APPEND_UTF8(&d, "token", q->token);
    BSON_APPEND_DOUBLE(&d, "expires_at", now + q->duration);
    BSON_APPEND_INT64(&d, "v", 0);
    if (mongoc_collection_insert_one(cl, &d, NULL, NULL, &e)) {
        q->acquired = 1;
        q->expires = now + q->duration;
    } else if (e.code != 11000) {
        mg_fail_bson(&q->j, "lease", &e);
    }
    bson_destroy(&d);
}

/* Which change the request makes to the current lease document; NULL: none (not held). */
static bson_t *lease_change(lease_job *q, const bson_t *cur, double now, double *expires)
{
    const char *holder = mg_doc_str(cur, "token");
    double exp = mg_doc_num(cur, "expires_at");
    int mine = holder && strcmp(holder, q->token) == 0;
    switch (q->kind) {
    case RB_LEASE_ACQUIRE:
        if (holder && exp > now && !mine) return NULL;
        *expires = now + q->duration;
        return upd_lease(cur, q->token, *expires);
    case RB_LEASE_EXTEND:
        if (!mine || exp <= now) return NULL;
        *expires = mg_extended(cur, "expires_at", now, q->duration);   /* never shortens */
        return upd_lease(cur, q->token, *expires);
    case RB_LEASE_RELEASE:
    default:
        /* Kept, not deleted: its version must keep growing for the tickets. */
        if (!mine) return NULL;
        *expires = 0;
        return upd_lease(cur, NULL, 0);
    }
}

static void lease_work(mjob *j, mongoc_client_t *c)
{
    lease_job *q = (lease_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->leases);
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_UTF8(&sel, "_id", q->name);
    int failed = 0;
    /* held from the read to the write, as a delivery (busy.c): the holder's own extend and
     * release in flight at once then wait for each other instead of taking one ticket */
    char key[300];
    snprintf(key, sizeof key, "lease:%s", q->name);
    mg_busy held = {.key = key};
    mg_busy_take(j->s, &held, 1);
    double now = mg_now(j->s);      /* after any wait for another job's write */
    bson_t *cur = mg_find_one(j, cl, &sel, NULL, &failed);
    double expires = 0;
    bson_t *u = (cur && !failed) ? lease_change(q, cur, now, &expires) : NULL;
    if (!failed && !cur && q->kind == RB_LEASE_ACQUIRE) {
        lease_insert(q, cl, now);
    } else if (u) {
        cas_op op;
        mg_cas_init(j->s, &op, cur, "l", u);
        if (mg_cas_run(j, c, j->s->leases, &op, 1, now) == 0 && op.won) {
            q->acquired = 1;
            q->expires = expires;
        }
        mg_cas_clear(&op);      /* u with it */
    }
    mg_busy_give(j->s, &held, 1);
    if (cur) bson_destroy(cur);
    bson_destroy(&sel);
    mongoc_collection_destroy(cl);
}

static void lease_done(mjob *j, const char *err)
{
    lease_job *q = (lease_job *)j;
    j->cb.lease(j->ud, err, err ? 0 : q->acquired, q->expires);
    free(q->name);
    free(q->token);
    free(q);
}

void mg_lease(rb_store *st, rb_lease_op kind, const char *name, const char *token,
              double duration, rb_lease_cb cb, void *ud)
{
    if (!name || !token) {
        cb(ud, "mongodb: lease: name and token are required", 0, 0);
        return;
    }
    lease_job *q = mg_job_new((mstore *)st, sizeof *q, lease_work, lease_done,
                              (rb_store_cb){.lease = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, 0, 0);
        return;
    }
    q->kind = kind;
    q->name = rb_strdup(name);
    q->token = rb_strdup(token);
    q->duration = duration;
    if (!q->name || !q->token) {
        lease_done(&q->j, MG_OOM);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}
