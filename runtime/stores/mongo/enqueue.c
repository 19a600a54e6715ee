/* enqueue.c -- the MongoDB store's enqueue: one unordered insert of the batch. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/log.h"
#include "util/text.h"

/* What an item's dependencies make of its document: due as usual (none live), held behind
 * the live ones, or cancelled (one was buried or cancelled). */
typedef enum { AFTER_DUE, AFTER_HELD, AFTER_CANCELLED } held_kind;

static void enq_free(enq_job *q)
{
    for (size_t i = 0; i < q->n; i++) {
        free((char *)q->items[i].topic);
        free((char *)q->items[i].payload);
        free((char *)q->items[i].key);
        free((char *)q->items[i].group);
        for (size_t k = 0; q->items[i].after && k < q->items[i].nafter; k++)
            free((char *)q->items[i].after[k]);
        free((void *)q->items[i].after);
        if (q->ids) free(q->ids[i]);
    }
    free(q->items);
    free(q->ids);
    free(q->kept);
    free(q);
}

/* Whether the payload can be stored: converted once here to say why not, and again when the
 * document is made (a pass over the text; the insert costs more). */
static int payload_check(const mstore *s, const char *json, char *why, size_t whylen)
{
    bson_t tmp = BSON_INITIALIZER;
    int ok = mg_payload_append(&tmp, json, s->ferretdb, why, whylen);
    bson_destroy(&tmp);
    return ok;
}

bson_t *mg_delivery_doc(const mstore *s, const rb_enqueue_item *it, double now, char hex[25])
{
    bson_t *d = bson_new();
    bson_oid_t oid;
    bson_oid_init(&oid, NULL);
    bson_oid_to_string(&oid, hex);
    BSON_APPEND_OID(d, "_id", &oid);
    BSON_APPEND_UTF8(d, "topic", it->topic);
    char why[200];
    mg_payload_append(d, it->payload ? it->payload : "null", s->ferretdb, why, sizeof why);  /* checked */
    if (it->key) {
        BSON_APPEND_UTF8(d, "key", it->key);
        char *dd = mg_dedupe_value(it->topic, it->key);
        if (dd) BSON_APPEND_UTF8(d, "dedupe", dd);
        free(dd);
    }
    if (it->group) BSON_APPEND_UTF8(d, "group", it->group);
    BSON_APPEND_UTF8(d, "status", "pending");
    BSON_APPEND_INT32(d, "attempts", 0);
    BSON_APPEND_INT32(d, "max_attempts", it->max_attempts > 0 ? it->max_attempts : 25);
    BSON_APPEND_INT64(d, "fence", 0);
    BSON_APPEND_INT64(d, "v", 0);
    BSON_APPEND_DOUBLE(d, "run_at", it->run_at > 0 ? it->run_at : now + it->delay);
    BSON_APPEND_DOUBLE(d, "created_at", now);
    BSON_APPEND_DOUBLE(d, "lease_expires_at", 0);
    BSON_APPEND_NULL(d, "lease_token");
    return d;
}

/* The id of the live delivery holding this topic and key, or NULL. */
char *mg_dedupe_holder(mjob *j, mongoc_collection_t *cl, const rb_enqueue_item *it,
                       mongoc_client_session_t *cs, int *failed)
{
    bson_t f = BSON_INITIALIZER;
    char *dd = mg_dedupe_value(it->topic, it->key);
    BSON_APPEND_UTF8(&f, "dedupe", dd ? dd : "");
    free(dd);
    bson_t *d = mg_find_one(j, cl, &f, cs, failed);
    bson_destroy(&f);
    char hex[25], *id = NULL;
    if (d && mg_doc_oid(d, hex) && !(id = rb_strdup(hex))) {
        mg_fail(j, "out of memory");
        *failed = 1;
    }
    if (d) bson_destroy(d);
    return id;
}

/* An earlier item of the same batch with this topic and key, or -1. */
long mg_same_key_before(const rb_enqueue_item *items, size_t i)
{
    if (!items[i].key) return -1;
    for (size_t k = 0; k < i; k++)
        if (items[k].key && strcmp(items[k].key, items[i].key) == 0 &&
            strcmp(items[k].topic, items[i].topic) == 0)
            return (long)k;
    return -1;
}

/* Undo for "all or none": deletes what this batch inserted. */
static void enq_undo(mongoc_collection_t *cl, bson_t **docs, int *inserted, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!inserted[i] || !docs[i]) continue;
        bson_t sel = BSON_INITIALIZER;
        bson_iter_t it;
        if (bson_iter_init_find(&it, docs[i], "_id")) bson_append_iter(&sel, "_id", -1, &it);
        mongoc_collection_delete_one(cl, &sel, NULL, NULL, NULL);
        bson_destroy(&sel);
        inserted[i] = 0;
    }
}

/* Inserts docs[i] for every i with want[i]; inserted[i] tells which landed, dup[i] which hit
 * the dedupe index. -1: the bulk failed as a whole. */
static int enq_insert(mjob *j, mongoc_collection_t *cl, bson_t **docs, const int *want,
                      int *inserted, int *dup, size_t n)
{
    size_t *map = rb_malloc(n * sizeof *map), m = 0;
    int *codes = rb_malloc(n * sizeof *codes);
    if (!map || !codes) {
        free(map); free(codes);
        mg_fail(j, "out of memory");
        return -1;
    }
    mongoc_bulk_operation_t *b = mg_unordered_bulk(cl);
    for (size_t i = 0; i < n; i++)
        if (want[i]) {
            map[m++] = i;
            mongoc_bulk_operation_insert(b, docs[i]);
        }
    int r = m ? mg_bulk_run(j, b, codes, m, "enqueue") : 1;
    if (!m) mongoc_bulk_operation_destroy(b);
    for (size_t k = 0; r >= 0 && k < m; k++) {
        inserted[map[k]] = codes[k] == 0;
        dup[map[k]] = codes[k] == 11000;
        if (codes[k] && codes[k] != 11000) {
            mg_fail(j, "enqueue: the server refused a delivery (code %d)", codes[k]);
            r = -1;
        }
    }
    free(map);
    free(codes);
    return r < 0 ? -1 : 0;
}

/* FerretDB: the ready queue's entry of one delivery to insert, written before it. */
int mg_enq_entry(mjob *j, mongoc_client_t *c, const char *hex, const rb_enqueue_item *it,
                 double now)
{
    mongoc_collection_t *qc = mg_coll(j->s, c, j->s->queue);
    qbatch qb;
    mg_qb_init(&qb, qc);
    mg_qb_put(&qb, hex, it->topic, 0, it->run_at > 0 ? it->run_at : now + it->delay, now);
    int r = mg_qb_run(j, &qb, 1);
    mongoc_collection_destroy(qc);
    return r;
}

/* FerretDB: the ready queue's entries of the deliveries to insert, written before them so
 * that a delivery never lacks one while it may be due. A held one gets none: its release
 * writes one at its time before it makes it due (deps.c), and an entry never due would be
 * read and moved on by every claim that reads the queue's head. */
static int enq_entries(enq_job *q, mongoc_client_t *c, const int *want, const held_kind *holds,
                       double now)
{
    mongoc_collection_t *qc = mg_coll(q->j.s, c, q->j.s->queue);
    qbatch qb;
    mg_qb_init(&qb, qc);
    for (size_t i = 0; i < q->n; i++)
        if (want[i] && holds[i] != AFTER_HELD) {
            const rb_enqueue_item *it = &q->items[i];
            mg_qb_put(&qb, q->ids[i], it->topic, 0, it->run_at > 0 ? it->run_at : now + it->delay, now);
        }
    int r = mg_qb_run(&q->j, &qb, 1);
    mongoc_collection_destroy(qc);
    return r;
}

/* ---- replace by key ---- */
#define REPLACE_ROUNDS 10
enum { REPLACE_DONE, REPLACE_KEPT, REPLACE_GONE };

/* The update of a replace: the item's payload, run_at and max_attempts; attempts from 0 (a
 * payload that never ran is not buried for the old one's failures). */
static bson_t *upd_replace(const mstore *s, const bson_t *cur, const rb_enqueue_item *it,
                           double run_at)
{
    bson_t *u = bson_new(), set;
    char why[200];
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    /* (payload_check passed for it in mg_enq_prepare: this cannot fail) */
    mg_payload_append(&set, it->payload, s->ferretdb, why, sizeof why);
    /* one held behind its dependencies (deps.c) stays held: its own due time changes */
    BSON_APPEND_DOUBLE(&set, bson_has_field(cur, "held_run_at") ? "held_run_at" : "run_at", run_at);
    BSON_APPEND_INT32(&set, "max_attempts", it->max_attempts > 0 ? it->max_attempts : 25);
    BSON_APPEND_INT32(&set, "attempts", 0);
    BSON_APPEND_INT64(&set, "v", mg_doc_int(cur, "v") + 1);
    bson_append_document_end(u, &set);
    return u;
}

/* Replaces the live delivery `id` that holds the item's topic and key: when it is pending it
 * gets the item's payload, run_at and max_attempts through the versioned write every change
 * takes (tickets.c), so a claim beside it either won with the old document (the replace reads
 * it again and finds it running) or reads the new one. REPLACE_DONE; REPLACE_KEPT when it is
 * running (left as it is); REPLACE_GONE when it settled meanwhile (the key is free: insert);
 * -1 when the store failed (j failed). */
static int replace_one(mjob *j, mongoc_client_t *c, mongoc_collection_t *cl,
                       const rb_enqueue_item *it, const char *id)
{
    for (int round = 0; round < REPLACE_ROUNDS; round++) {
        int failed;
        bson_t *d = mg_find_by_id(j, cl, id, &failed);
        if (failed) return -1;
        const char *st = d ? mg_doc_str(d, "status") : NULL;
        int pending = st && !strcmp(st, "pending");
        if (!pending) {
            int running = st && !strcmp(st, "processing");
            if (d) bson_destroy(d);
            return running ? REPLACE_KEPT : REPLACE_GONE;
        }
        double now = mg_now(j->s);
        double run_at = it->run_at > 0 ? it->run_at : now + it->delay;
        /* (an entry at its new due time: one earlier than the old entry's must be found; a
         * held one gets its entry when it is released) */
        int requeue = j->s->ferret && !bson_has_field(d, "held_run_at");
        if (requeue && mg_requeue(j, c, id, it->topic, run_at, now, 0) < 0) {
            bson_destroy(d);
            return -1;
        }
        cas_op op;
        memset(&op, 0, sizeof op);
        mg_cas_init(j->s, &op, d, "d", upd_replace(j->s, d, it, run_at));
        int r = mg_cas_run(j, c, j->s->base.table, &op, 1, now);
        int won = op.won;
        mg_cas_clear(&op);
        bson_destroy(d);
        if (r == 0 && won && requeue) r = mg_requeue(j, c, id, it->topic, run_at, now, 1);
        if (r < 0) return -1;
        if (won) return REPLACE_DONE;
        mg_lost_wait(round);
    }
    mg_fail(j, "enqueue: a replace lost to other writes of the delivery %d times in a row",
            REPLACE_ROUNDS);
    return -1;
}

/* ---- dependencies (deps.c has the rest) ---- */
/* An id as an error message may quote it: as it is when it could be one (letters and digits,
 * not too long), else a stand-in, so no id can break the line or carry bad bytes. */
static const char *quotable_id(const char *id)
{
    size_t n = strlen(id);
    if (n == 0 || n > 64) return "(not an id)";
    for (size_t i = 0; i < n; i++)
        if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'z') ||
              (id[i] >= 'A' && id[i] <= 'Z') || id[i] == '-'))
            return "(not an id)";
    return id;
}

/* What an item's dependencies make of its document. */
typedef struct held {
    held_kind kind;
    char why[120];              /* cancelled: the reason */
    char **live;                /* held: the live dependencies' ids (owned) */
    size_t nlive;
    int depth;                  /* held: its place in a chain */
} held;

static void held_clear(held *h)
{
    for (size_t i = 0; i < h->nlive; i++) free(h->live[i]);
    free(h->live);
    memset(h, 0, sizeof *h);
}

/* Reads the item's dependencies: every one must be a delivery (the ones given twice count
 * once); a buried or cancelled one cancels it, live ones hold it. -1: j failed (an id that is
 * no delivery, a chain too deep, the store). */
static int deps_resolve(mjob *j, mongoc_collection_t *cl, const rb_enqueue_item *it, held *h)
{
    memset(h, 0, sizeof *h);
    size_t n = 0;
    char **ids = rb_calloc(it->nafter, sizeof *ids);
    bson_t **deps = rb_calloc(it->nafter, sizeof *deps);
    int r = ids && deps ? 0 : -1;
    if (r < 0) mg_fail(j, MG_OOM);
    for (size_t k = 0; r == 0 && k < it->nafter; k++) {
        bson_oid_t oid;
        const char *id = it->after[k];
        if (!mg_parse_oid(id, &oid)) {
            mg_fail(j, "enqueue: after: no delivery %s", quotable_id(id));
            r = -1;
            break;
        }
        char hex[25];
        bson_oid_to_string(&oid, hex);      /* as the store writes ids: lower-case */
        int seen = 0;
        for (size_t m = 0; m < n && !seen; m++) seen = !strcmp(ids[m], hex);
        if (!seen && !(ids[n++] = rb_strdup(hex))) { mg_fail(j, MG_OOM); r = -1; }
    }
    if (r == 0) r = mg_read_by_ids(j, cl, ids, n, deps);
    for (size_t k = 0; r == 0 && k < n; k++)
        if (!deps[k]) {
            mg_fail(j, "enqueue: after: no delivery %s", ids[k]);
            r = -1;
        }
    if (r == 0 && (h->live = rb_calloc(n ? n : 1, sizeof *h->live)) == NULL) {
        mg_fail(j, MG_OOM);
        r = -1;
    }
    for (size_t k = 0; r == 0 && k < n && h->kind != AFTER_CANCELLED; k++) {
        const char *st = mg_doc_str(deps[k], "status");
        if (st && (!strcmp(st, "buried") || !strcmp(st, "cancelled"))) {
            h->kind = AFTER_CANCELLED;
            snprintf(h->why, sizeof h->why, "dependency %s was %s", ids[k], st);
        } else if (st && (!strcmp(st, "pending") || !strcmp(st, "processing"))) {
            int d = (int)mg_doc_int(deps[k], "after_depth") + 1;
            if (d > h->depth) h->depth = d;
            h->live[h->nlive++] = ids[k];
            ids[k] = NULL;
            h->kind = AFTER_HELD;
        }
    }
    if (r == 0 && h->kind == AFTER_HELD && h->depth > RB_AFTER_DEPTH_MAX) {
        mg_fail(j, "enqueue: after: a chain of more than %d dependencies", RB_AFTER_DEPTH_MAX);
        r = -1;
    }
    for (size_t k = 0; k < n; k++) {
        free(ids[k]);
        if (deps[k]) bson_destroy(deps[k]);
    }
    free(ids);
    free(deps);
    if (r < 0) held_clear(h);
    return r;
}

/* The document d as its dependencies make it: held (run_at never due, its own kept) or
 * cancelled with the reason (not live: no dedupe). Replaces *d. */
static int doc_with_deps(bson_t **d, const held *h, double now)
{
    static const char *const replaced_fields[] = {"status", "run_at", "dedupe", NULL};
    bson_t *n = bson_new();
    bson_iter_t it;
    double run_at = mg_doc_num(*d, "run_at");
    bson_iter_init(&it, *d);
    while (bson_iter_next(&it)) {
        int skip = 0;
        for (int f = 0; replaced_fields[f] && !skip; f++)
            skip = !strcmp(bson_iter_key(&it), replaced_fields[f]);
        if (!skip) bson_append_iter(n, NULL, 0, &it);
    }
    if (h->kind == AFTER_CANCELLED) {
        BSON_APPEND_UTF8(n, "status", "cancelled");
        BSON_APPEND_DOUBLE(n, "run_at", run_at);
        BSON_APPEND_DOUBLE(n, "settled_at", now);
        BSON_APPEND_UTF8(n, "last_error", h->why);
    } else {
        bson_t arr;
        BSON_APPEND_UTF8(n, "status", "pending");
        BSON_APPEND_DOUBLE(n, "run_at", MG_HELD_RUN_AT);
        BSON_APPEND_DOUBLE(n, "held_run_at", run_at);
        BSON_APPEND_INT32(n, "waiting", (int32_t)h->nlive);
        BSON_APPEND_INT32(n, "after_depth", h->depth);
        BSON_APPEND_ARRAY_BEGIN(n, "after", &arr);
        for (size_t k = 0; k < h->nlive; k++) {
            char key[24];
            snprintf(key, sizeof key, "%zu", k);
            BSON_APPEND_UTF8(&arr, key, h->live[k]);
        }
        bson_append_array_end(n, &arr);
        bson_iter_t dd;
        if (bson_iter_init_find(&dd, *d, "dedupe")) bson_append_iter(n, NULL, 0, &dd);
    }
    bson_destroy(*d);
    *d = n;
    return 1;
}

/* ---- ordered groups (groups.c has the rest) ---- */
/* The document d held behind the live delivery `live` of its group. Replaces *d. */
static void doc_grouped(bson_t **d, const char *live)
{
    bson_t *n = bson_new();
    bson_iter_t it;
    bson_iter_init(&it, *d);
    while (bson_iter_next(&it))
        if (strcmp(bson_iter_key(&it), "run_at")) bson_append_iter(n, NULL, 0, &it);
    BSON_APPEND_DOUBLE(n, "run_at", MG_HELD_RUN_AT);
    BSON_APPEND_DOUBLE(n, "held_run_at", mg_doc_num(*d, "run_at"));
    BSON_APPEND_UTF8(n, "gprev", live);
    bson_destroy(*d);
    *d = n;
}

/* The grouped items to insert join their groups' tails; each whose predecessor is live (one
 * of this batch is) is held behind it, with the predecessor's marker written first. */
static int group_items(enq_job *q, mongoc_client_t *c, bson_t **docs, const int *want,
                       held_kind *holds, long *prev_item, double now)
{
    mjob *j = &q->j;
    size_t n = q->n, ng = 0;
    for (size_t i = 0; i < n; i++) ng += want[i] && q->items[i].group;
    if (!ng) return 0;
    const char **groups = rb_calloc(n, sizeof *groups);
    char **prev = rb_calloc(n, sizeof *prev);
    int r = groups && prev ? 0 : -1;
    if (r < 0) mg_fail(j, MG_OOM);
    for (size_t i = 0; r == 0 && i < n; i++) groups[i] = want[i] ? q->items[i].group : NULL;
    if (r == 0) r = mg_groups_link(j, c, groups, q->ids, n, prev, prev_item);
    for (size_t i = 0; r == 0 && i < n; i++) {
        if (!prev[i]) continue;
        char *live = NULL;
        int ours = prev_item[i] >= 0;   /* an earlier item of this batch: live once inserted */
        if (ours) live = rb_strdup(prev[i]);
        else r = mg_group_live_prev(j, c, q->items[i].group, q->ids[i], prev[i], &live);
        if (ours && !live) { mg_fail(j, MG_OOM); r = -1; }
        if (r == 0 && live) r = mg_deps_mark(j, c, &live, 1, q->ids[i], now);
        if (r == 0 && live) {
            doc_grouped(&docs[i], live);
            holds[i] = AFTER_HELD;
        }
        free(live);
    }
    for (size_t i = 0; prev && i < n; i++) free(prev[i]);
    free(prev);
    free(groups);
    return r;
}

/* The items linked into their groups that are not in (a dedupe found their key's holder,
 * the enqueue failed) are marked gone, and the deliveries after them looked at: they need not
 * wait for them (groups.c). j's outcome stays what it was. */
static void forget_linked(enq_job *q, mongoc_client_t *c, bson_t **docs, const int *linked,
                          const int *ins)
{
    mjob *j = &q->j;
    char kept[ERRLEN];
    memcpy(kept, j->err, sizeof kept);
    j->err[0] = 0;
    char **gone = rb_calloc(q->n ? q->n : 1, sizeof *gone);
    size_t ng = 0;
    for (size_t i = 0; gone && i < q->n; i++) {
        char hex[25];
        if (linked[i] && !ins[i] && docs[i] && mg_doc_oid(docs[i], hex) && (gone[ng] = rb_strdup(hex)))
            ng++;
    }
    if (ng && mg_groups_gone(j, c, gone, ng) == 0)
        mg_deps_after_write(j, c, MG_DEPS_SETTLED, gone, ng);
    else if (ng || !gone)
        rb_log(RB_LOG_WARN, "mongodb: groups: %s (the ones after wait %.0f s)",
               j->err[0] ? j->err : "out of memory", GROUP_GRACE_S);
    for (size_t i = 0; i < ng; i++) free(gone[i]);
    free(gone);
    memcpy(j->err, kept, sizeof kept);
}

/* Plain (non-transactional) enqueue: one unordered insert; dedupe conflicts resolve to the
 * holder's id, retried when the holder settled in between. An item with replace whose key a
 * live delivery holds (one found so, or an earlier item of the batch) replaces it instead, in
 * the batch's order, so the last item of a key is what runs. */
static void enq_work(mjob *j, mongoc_client_t *c)
{
    enq_job *q = (enq_job *)j;
    size_t n = q->n;
    double now = mg_now(j->s);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t **docs = rb_calloc(n, sizeof *docs);
    int *want = rb_calloc(n, sizeof *want), *ins = rb_calloc(n, sizeof *ins), *dup = rb_calloc(n, sizeof *dup);
    int *replaced = rb_calloc(n, sizeof *replaced);
    int *linked = rb_calloc(n, sizeof *linked);     /* linked into its group (groups.c) */
    long *prev_item = rb_calloc(n, sizeof *prev_item);  /* its group's previous item here */
    held_kind *holds = rb_calloc(n, sizeof *holds);     /* (calloc: AFTER_DUE) */
    q->ids = rb_calloc(n, sizeof *q->ids);
    q->kept = rb_calloc(n, sizeof *q->kept);
    if (!docs || !want || !ins || !dup || !replaced || !linked || !prev_item || !holds || !q->ids || !q->kept) {
        mg_fail(j, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        char hex[25];
        if (mg_same_key_before(q->items, i) >= 0) continue;
        docs[i] = mg_delivery_doc(q->j.s, &q->items[i], now, hex);
        want[i] = 1;
        if (!(q->ids[i] = rb_strdup(hex))) {
            mg_fail(j, "out of memory");
            goto out;
        }
        if (q->items[i].nafter) {
            held h;
            if (deps_resolve(j, cl, &q->items[i], &h) < 0) goto out;
            holds[i] = h.kind;
            if (h.kind != AFTER_DUE) doc_with_deps(&docs[i], &h, now);
            /* the markers before the delivery (deps.c) */
            int r = h.kind == AFTER_HELD ? mg_deps_mark(j, c, h.live, h.nlive, NULL, now) : 0;
            held_clear(&h);
            if (r < 0) goto out;
        }
    }
    for (size_t i = 0; i < n; i++) linked[i] = want[i] && q->items[i].group;
    if (group_items(q, c, docs, want, holds, prev_item, now) < 0) goto out;
    if (j->s->ferret && enq_entries(q, c, want, holds, now) < 0) goto out;
    int again = 0;
    for (int round = 0; round < 5; round++) {
        int *got = rb_calloc(n, sizeof *got);
        if (!got || enq_insert(j, cl, docs, want, got, dup, n) < 0) {
            free(got);
            enq_undo(cl, docs, ins, n);
            goto out;
        }
        again = 0;
        for (size_t i = 0; i < n; i++) {
            if (got[i]) ins[i] = 1;
            want[i] = 0;
            if (!dup[i]) continue;
            int failed = 0;
            char *holder = mg_dedupe_holder(j, cl, &q->items[i], NULL, &failed);
            if (failed) {
                free(got);
                enq_undo(cl, docs, ins, n);
                goto out;
            }
            if (holder) {
                free(q->ids[i]);
                q->ids[i] = holder;
                replaced[i] = q->items[i].replace;    /* replaced below, in the batch's order */
                q->kept[i] = !q->items[i].replace;    /* a dedupe: found and left as it was */
            } else {
                want[i] = again = 1;   /* the holder settled meanwhile: insert after all */
            }
        }
        free(got);
        if (!again) break;
    }
    if (again) {
        /* neither in nor held by another: its id would name nothing */
        mg_fail(j, "enqueue: a key's delivery settled and came back 5 times while it was added");
        enq_undo(cl, docs, ins, n);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        long k = mg_same_key_before(q->items, i);
        if (k >= 0 && !(q->ids[i] = rb_strdup(q->ids[k]))) {
            mg_fail(j, "out of memory");
            enq_undo(cl, docs, ins, n);
            goto out;
        }
        if (k >= 0) {
            replaced[i] = q->items[i].replace;
            q->kept[i] = !q->items[i].replace;
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (!replaced[i]) continue;
        int r = replace_one(j, c, cl, &q->items[i], q->ids[i]);
        if (r < 0) goto out;     /* (what it replaced stays: a replace is not undone) */
        if (r == REPLACE_KEPT) q->kept[i] = 1;
        if (r == REPLACE_GONE) {
            /* settled since it was found: the key is free again, as if none had been. Its own
             * document goes in (made, linked into its group and queued above), or, for a
             * later item of a key the batch had, a new one */
            char hex[25];
            int own = docs[i] != NULL, one = 1, got = 0, isdup = 0;
            if (!own) {
                docs[i] = mg_delivery_doc(q->j.s, &q->items[i], mg_now(j->s), hex);
            } else if (!mg_doc_oid(docs[i], hex)) {
                mg_fail(j, "enqueue: a document without its id");
                goto out;
            }
            free(q->ids[i]);
            if (!(q->ids[i] = rb_strdup(hex))) {
                mg_fail(j, "out of memory");
                goto out;
            }
            if (!own && q->items[i].group) {
                int *only = rb_calloc(n, sizeof *only);
                if (only) only[i] = linked[i] = 1;
                int gr = only ? group_items(q, c, docs, only, holds, prev_item, mg_now(j->s)) : -1;
                free(only);
                if (gr < 0) {
                    if (!j->err[0]) mg_fail(j, "out of memory");
                    goto out;
                }
            }
            int bad = (j->s->ferret && !own && holds[i] != AFTER_HELD &&
                       mg_enq_entry(j, c, hex, &q->items[i], mg_now(j->s)) < 0) ||
                      enq_insert(j, cl, &docs[i], &one, &got, &isdup, 1) < 0;
            if (got) ins[i] = 1;
            if (bad) goto out;
            if (isdup) {
                mg_fail(j, "enqueue: a replace found its delivery settled and another then took the key");
                goto out;
            }
        }
    }
    /* what it held, looked at again now that it is in: a dependency that settled meanwhile
     * may have looked for it before it was there (deps.c) */
    for (size_t i = 0; i < n; i++)
        if (holds[i] == AFTER_HELD && ins[i]) mg_deps_after_write(j, c, MG_DEPS_EVAL, &q->ids[i], 1);
out:
    if (linked) forget_linked(q, c, docs, linked, ins);
    for (size_t i = 0; docs && i < n; i++)
        if (docs[i]) bson_destroy(docs[i]);
    free(docs); free(want); free(ins); free(dup); free(replaced); free(linked); free(prev_item); free(holds);
    mongoc_collection_destroy(cl);
}

static void enq_done(mjob *j, const char *err)
{
    enq_job *q = (enq_job *)j;
    if (!err && j->tx) j->tx->enqueued = 1;     /* not visible before the commit */
    else if (!err) rb_store_notify_local(&j->s->base);
    j->cb.ids(j->ud, err, err ? NULL : q->ids, err ? NULL : q->kept, err ? 0 : q->n);
    enq_free(q);
}

enq_job *mg_enq_prepare(mstore *s, const rb_enqueue_item *items, size_t n,
                        void (*work)(mjob *, mongoc_client_t *), rb_ids_cb cb, void *ud,
                        char *err, size_t errlen)
{
    enq_job *q = mg_job_new(s, sizeof *q, work, enq_done, (rb_store_cb){.ids = cb}, ud);
    if (!q || !(q->items = rb_calloc(n ? n : 1, sizeof *q->items))) {
        free(q);
        snprintf(err, errlen, MG_OOM);
        return NULL;
    }
    q->n = n;
    for (size_t i = 0; i < n; i++) {
        char why[200];
        const char *payload = items[i].payload ? items[i].payload : "null";
        if (!items[i].topic) {
            snprintf(err, errlen, "mongodb: enqueue: delivery %zu has no topic", i + 1);
        } else if (items[i].group && items[i].nafter) {
            /* (the Lua binding says so too; a release for its group would drop its after) */
            snprintf(err, errlen, "mongodb: enqueue: delivery %zu: after and group do not go together", i + 1);
        } else if (items[i].key && !rb_utf8_valid(items[i].key, strlen(items[i].key))) {
            /* (BSON strings are UTF-8: the server keeps such a key, then finds it by no query) */
            snprintf(err, errlen, "mongodb: enqueue: delivery %zu's key is not UTF-8", i + 1);
        } else if (items[i].nafter > RB_AFTER_MAX) {
            snprintf(err, errlen, "mongodb: enqueue: after: more than %d dependencies", RB_AFTER_MAX);
        } else if (!payload_check(s, payload, why, sizeof why)) {
            snprintf(err, errlen, "mongodb: payload cannot be stored: %s", why);
            mg_one_line(err, errlen);
        } else {
            q->items[i] = items[i];
            q->items[i].topic = rb_strdup(items[i].topic);
            q->items[i].payload = rb_strdup(payload);
            q->items[i].key = mg_dupstr(items[i].key);
            q->items[i].group = mg_dupstr(items[i].group);
            q->items[i].after = NULL;
            q->items[i].nafter = 0;
            int after_ok = 1;
            if (items[i].nafter) {
                const char **a = rb_calloc(items[i].nafter, sizeof *a);
                q->items[i].after = a;
                after_ok = a != NULL;
                for (size_t k = 0; a && k < items[i].nafter; k++, q->items[i].nafter++)
                    if (!(a[k] = rb_strdup(items[i].after[k]))) { after_ok = 0; break; }
            }
            if (q->items[i].topic && q->items[i].payload && (q->items[i].key || !items[i].key) &&
                (q->items[i].group || !items[i].group) && after_ok)
                continue;
            snprintf(err, errlen, MG_OOM);
            i++;                /* its copies are freed with the others */
        }
        q->n = i;
        enq_free(q);
        return NULL;
    }
    return q;
}

void mg_enqueue(rb_store *st, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    char err[ERRLEN];
    if (n == 0) {
        cb(ud, NULL, NULL, NULL, 0);
        return;
    }
    enq_job *q = mg_enq_prepare(s, items, n, enq_work, cb, ud, err, sizeof err);
    if (q) mg_submit(s, &q->j);
    else cb(ud, err, NULL, NULL, 0);
}
