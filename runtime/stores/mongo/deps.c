/* deps.c -- the MongoDB store's dependencies (`after`). Without transactions across documents
 * (FerretDB has none; a standalone MongoDB neither) a dependency's settle cannot move the
 * deliveries after it in the same write, as the SQL stores' triggers do. So:
 *
 *  - A delivery enqueued after live ones is held: run_at HELD_RUN_AT (never due), its own in
 *    held_run_at, `after` the ids of its live dependencies, `waiting` their count, after_depth
 *    its place in a chain. Before it is inserted, each live dependency gets a marker in
 *    <table>_deps ({_id: its id, at}), a collection of its own: writing to the dependency's
 *    document would take its version and cost its lease holder a write.
 *  - Whoever settles a delivery (a run's settle, a claim that buries it, an operator's bury or
 *    cancel) then looks for its marker, and when there is one evaluates the deliveries after
 *    it (mg_deps_eval): released when every dependency completed, cancelled with the reason
 *    when one was buried or cancelled (and, in turn, those after it).
 *  - The enqueue evaluates what it held once more after its insert. A settle writes before it
 *    looks for the marker, and the enqueue writes the marker and the delivery before it looks
 *    at the dependencies again, so a dependency that settles meanwhile is seen by one of the
 *    two at least (both may act: every change is a versioned write, which one wins).
 *  - A process killed between a settle and its look leaves the marker: the sweep of each
 *    process's claims (every DEPS_SWEEP_S, a page of markers in _id order each) evaluates the deliveries after the settled
 *    dependencies of the markers, and removes a marker DEPS_MARKER_KEEP_S after its
 *    dependency settled (an enqueue that wrote it and was stopped longer than that before its
 *    insert leaves its delivery held: see docs/stores.md).
 * A dependency that is no longer there (deleted, purged) counts as completed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/check.h"
#include "util/clock.h"
#include "util/log.h"

#define EVAL_ROUNDS 10          /* versioned writes lost in a row before giving up on one */

/* One find by _id each on a FerretDB server (which pushes down nothing else), one find with
 * $in elsewhere. */
int mg_read_by_ids(mjob *j, mongoc_collection_t *cl, char *const *ids, size_t n, bson_t **out)
{
    for (size_t i = 0; i < n; i++) out[i] = NULL;
    if (!n) return 0;
    if (j->s->ferretdb) {
        for (size_t i = 0; i < n; i++) {
            int failed;
            out[i] = mg_find_by_id(j, cl, ids[i], &failed);
            if (failed) return -1;
        }
        return 0;
    }
    bson_t f = BSON_INITIALIZER, in, arr;
    BSON_APPEND_DOCUMENT_BEGIN(&f, "_id", &in);
    BSON_APPEND_ARRAY_BEGIN(&in, "$in", &arr);
    for (size_t i = 0; i < n; i++) {
        bson_oid_t oid;
        char key[24];
        if (!mg_parse_oid(ids[i], &oid)) continue;
        snprintf(key, sizeof key, "%zu", i);
        BSON_APPEND_OID(&arr, key, &oid);
    }
    bson_append_array_end(&in, &arr);
    bson_append_document_end(&f, &in);
    bson_t **docs = NULL;
    size_t nd = 0;
    int r = mg_find_docs(j, cl, &f, NULL, NULL, &docs, &nd);
    bson_destroy(&f);
    if (r < 0) return -1;
    for (size_t d = 0; d < nd; d++) {
        char hex[25];
        int used = 0;
        /* (an id given twice gets the document twice: a copy) */
        if (mg_doc_oid(docs[d], hex))
            for (size_t i = 0; i < n; i++)
                if (!out[i] && strcmp(ids[i], hex) == 0) {
                    out[i] = used ? bson_copy(docs[d]) : docs[d];
                    used = 1;
                    if (!out[i]) r = -1;
                }
        if (!used) bson_destroy(docs[d]);
    }
    free(docs);
    if (r < 0) mg_fail(j, MG_OOM);
    return r;
}

static void free_docs(bson_t **v, size_t n)
{
    for (size_t i = 0; i < n; i++) if (v[i]) bson_destroy(v[i]);
}

/* The ids of the array field `after` of d (malloc'd strings), NULL with *n 0 when none. */
static char **after_of(const bson_t *d, size_t *n)
{
    bson_iter_t it, sub;
    *n = 0;
    if (!bson_iter_init_find(&it, d, "after") || !BSON_ITER_HOLDS_ARRAY(&it) ||
        !bson_iter_recurse(&it, &sub))
        return NULL;
    size_t cap = 0;
    char **v = NULL;
    while (bson_iter_next(&sub)) {
        if (!BSON_ITER_HOLDS_UTF8(&sub)) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 8;
            char **g = rb_realloc(v, cap * sizeof *g);
            if (!g) goto oom;
            v = g;
        }
        if (!(v[*n] = rb_strdup(bson_iter_utf8(&sub, NULL)))) goto oom;
        ++*n;
    }
    return v;
oom:        /* a part of the list would be judged as the whole: none */
    for (size_t i = 0; i < *n; i++) free(v[i]);
    free(v);
    *n = 1;         /* (the caller sees ids NULL with n set: out of memory) */
    return NULL;
}

static void free_ids(char **v, size_t n)
{
    for (size_t i = 0; v && i < n; i++) free(v[i]);
    free(v);
}

/* What the dependencies deps[0..n) (NULL: gone, counted as completed) say of the delivery
 * after them: DEP_FAILED with *why the first buried or cancelled one, DEP_LIVE with *live the
 * count of those pending or processing, or DEP_DONE. */
enum { DEP_DONE, DEP_LIVE, DEP_FAILED };
static int verdict(bson_t **deps, char *const *ids, size_t n, size_t *live, char *why,
                   size_t whylen)
{
    *live = 0;
    for (size_t i = 0; i < n; i++) {
        const char *st = deps[i] ? mg_doc_str(deps[i], "status") : NULL;
        if (st && (!strcmp(st, "buried") || !strcmp(st, "cancelled"))) {
            snprintf(why, whylen, "dependency %s was %s", ids[i], st);
            return DEP_FAILED;
        }
        if (st && (!strcmp(st, "pending") || !strcmp(st, "processing"))) ++*live;
    }
    return *live ? DEP_LIVE : DEP_DONE;
}

/* The change of a held delivery cur: released (why NULL, live 0: due at its own run_at),
 * cancelled (why), or its count of live dependencies and their ids updated. */
static bson_t *upd_held(const bson_t *cur, const char *why, size_t live, char *const *ids,
                        bson_t **deps, size_t n, double now)
{
    bson_t *u = bson_new(), set, un;
    double own = mg_doc_num(cur, "held_run_at");
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    BSON_APPEND_INT64(&set, "v", mg_doc_int(cur, "v") + 1);
    if (why) {
        BSON_APPEND_UTF8(&set, "status", "cancelled");
        BSON_APPEND_DOUBLE(&set, "settled_at", now);
        BSON_APPEND_UTF8(&set, "last_error", why);
    }
    if (why || !live) {
        BSON_APPEND_DOUBLE(&set, "run_at", own);
    } else {
        bson_t arr;
        BSON_APPEND_INT32(&set, "waiting", (int32_t)live);
        BSON_APPEND_ARRAY_BEGIN(&set, "after", &arr);
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            const char *st = deps[i] ? mg_doc_str(deps[i], "status") : NULL;
            if (!st || (strcmp(st, "pending") && strcmp(st, "processing"))) continue;
            char key[24];
            snprintf(key, sizeof key, "%zu", k++);
            BSON_APPEND_UTF8(&arr, key, ids[i]);
        }
        bson_append_array_end(&set, &arr);
    }
    bson_append_document_end(u, &set);
    if (why || !live) {
        BSON_APPEND_DOCUMENT_BEGIN(u, "$unset", &un);
        BSON_APPEND_UTF8(&un, "waiting", "");
        BSON_APPEND_UTF8(&un, "after", "");
        BSON_APPEND_UTF8(&un, "held_run_at", "");
        BSON_APPEND_UTF8(&un, "gprev", "");     /* released: nothing before it is live */
        if (why) BSON_APPEND_UTF8(&un, "dedupe", "");
        bson_append_document_end(u, &un);
    }
    return u;
}

/* A held delivery's release: due at its own run_at (an entry there first and after on
 * FerretDB, mg_requeue; a held one has none before). 1 won, 0 lost, -1 j failed. */
static int release_held(mjob *j, mongoc_client_t *c, const bson_t *d, const char *id, bson_t *upd,
                        double now)
{
    int requeue = j->s->ferret, r = 0, won = 0;
    double own = mg_doc_num(d, "held_run_at");
    if (requeue) r = mg_requeue(j, c, id, mg_doc_str(d, "topic"), own, now, 0);
    cas_op op;
    memset(&op, 0, sizeof op);
    if (r == 0) {
        mg_cas_init(j->s, &op, d, "d", upd);
        upd = NULL;
        r = mg_cas_run(j, c, j->s->base.table, &op, 1, now);
        won = op.won;
        mg_cas_clear(&op);
    }
    if (upd) bson_destroy(upd);
    if (r == 0 && won && requeue) r = mg_requeue(j, c, id, mg_doc_str(d, "topic"), own, now, 1);
    if (r == 0 && won) j->released = 1;
    return r < 0 ? -1 : won;
}

/* A delivery held behind the one before it in its group (groups.c): released when nothing
 * before it is live, else held behind the live one (a new one when the one it named settled
 * while held itself). 1 done (or nothing to do), 0 lost to another write, -1 j failed. */
static int eval_grouped(mjob *j, mongoc_client_t *c, const bson_t *d, const char *id)
{
    const char *prev = mg_doc_str(d, "gprev");
    char *live = NULL;
    if (mg_group_live_prev(j, c, mg_doc_str(d, "group"), id, prev, &live) < 0) return -1;
    if (live && prev && !strcmp(live, prev)) {
        free(live);
        return 1;                       /* still behind the live one it names */
    }
    double now = mg_now(j->s);
    int r;
    if (live) {
        /* its marker first: that one's settle must find this one */
        r = mg_deps_mark(j, c, &live, 1, id, now);
        if (r == 0) {
            cas_op op;
            memset(&op, 0, sizeof op);
            mg_cas_init(j->s, &op, d, "d", BCON_NEW("$set", "{", "gprev", BCON_UTF8(live), "v",
                                                    BCON_INT64(mg_doc_int(d, "v") + 1), "}"));
            r = mg_cas_run(j, c, j->s->base.table, &op, 1, now);
            if (r == 0) r = op.won;
            mg_cas_clear(&op);
        }
    } else {
        r = release_held(j, c, d, id, upd_held(d, NULL, 0, NULL, NULL, 0, now), now);
    }
    free(live);
    return r;
}

/* Evaluates the held delivery `id` against its dependencies now; 1 when it was cancelled (the
 * deliveries after it need a look in turn), 0 otherwise, -1 when j failed. */
static int eval_one(mjob *j, mongoc_client_t *c, mongoc_collection_t *cl, const char *id)
{
    for (int round = 0; round < EVAL_ROUNDS; round++) {
        int failed;
        bson_t *d = mg_find_by_id(j, cl, id, &failed);
        if (failed) return -1;
        const char *st = d ? mg_doc_str(d, "status") : NULL;
        if (st && !strcmp(st, "pending") && bson_has_field(d, "gprev")) {
            int won = eval_grouped(j, c, d, id);
            bson_destroy(d);
            if (won < 0) return -1;
            if (won) return 0;
            mg_lost_wait(round);
            continue;
        }
        bson_iter_t it;
        if (!st || strcmp(st, "pending") || !bson_iter_init_find(&it, d, "waiting")) {
            if (d) bson_destroy(d);
            return 0;           /* not held (any more) */
        }
        size_t n = 0, live = 0;
        char **ids = after_of(d, &n);
        bson_t **deps = rb_calloc(n ? n : 1, sizeof *deps);
        if (!deps || (n && !ids)) {
            free(deps);
            free_ids(ids, n);
            bson_destroy(d);
            mg_fail(j, MG_OOM);
            return -1;
        }
        if (mg_read_by_ids(j, cl, ids, n, deps) < 0) {
            free_docs(deps, n);
            free(deps);
            free_ids(ids, n);
            bson_destroy(d);
            return -1;
        }
        char why[120];
        int v = verdict(deps, ids, n, &live, why, sizeof why);
        int unchanged = v == DEP_LIVE && (int64_t)live == mg_doc_int(d, "waiting");
        int r = 0, won = 1;
        if (!unchanged) {
            double now = mg_now(j->s);
            bson_t *u = upd_held(d, v == DEP_FAILED ? why : NULL, v == DEP_LIVE ? live : 0, ids,
                                 deps, n, now);
            if (v == DEP_DONE) {
                r = release_held(j, c, d, id, u, now);
                won = r > 0;
            } else {
                cas_op op;
                memset(&op, 0, sizeof op);
                mg_cas_init(j->s, &op, d, "d", u);
                r = mg_cas_run(j, c, j->s->base.table, &op, 1, now);
                won = op.won;
                mg_cas_clear(&op);
            }
        }
        free_docs(deps, n);
        free(deps);
        free_ids(ids, n);
        bson_destroy(d);
        if (r < 0) return -1;
        if (won) return v == DEP_FAILED;
        mg_lost_wait(round);
    }
    mg_fail(j, "dependencies: a held delivery's write lost to others %d times in a row",
            EVAL_ROUNDS);
    return -1;
}

/* A worklist of ids (malloc'd), grown as cancels cascade. */
typedef struct idlist {
    char **v;
    size_t n, cap;
} idlist;

static int idlist_add(idlist *l, const char *id)
{
    for (size_t i = 0; i < l->n; i++) if (!strcmp(l->v[i], id)) return 1;   /* once each */
    if (l->n == l->cap) {
        size_t nc = l->cap ? 2 * l->cap : 16;
        char **g = rb_realloc(l->v, nc * sizeof *g);
        if (!g) return 0;
        l->v = g;
        l->cap = nc;
    }
    if (!(l->v[l->n] = rb_strdup(id))) return 0;
    l->n++;
    return 1;
}

int mg_deps_eval(mjob *j, mongoc_client_t *c, char *const *ids, size_t n)
{
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    int r = 0;
    for (size_t i = 0; r == 0 && i < n; i++) {
        int e = eval_one(j, c, cl, ids[i]);
        if (e < 0) r = -1;
        else if (e > 0) r = mg_deps_settled(j, c, &ids[i], 1);    /* cancelled: those after it */
    }
    mongoc_collection_destroy(cl);
    return r;
}

/* The deliveries held after `dep`, in *out (ids appended). */
static int dependents_of(mjob *j, mongoc_collection_t *cl, const char *dep, idlist *out)
{
    bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER, proj;
    BSON_APPEND_UTF8(&f, "after", dep);
    BSON_APPEND_UTF8(&f, "status", "pending");
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "projection", &proj);
    BSON_APPEND_INT32(&proj, "_id", 1);
    bson_append_document_end(&opts, &proj);
    bson_t **docs = NULL;
    size_t nd = 0;
    int r = mg_find_docs(j, cl, &f, &opts, NULL, &docs, &nd);
    bson_destroy(&f);
    bson_destroy(&opts);
    for (size_t d = 0; r == 0 && d < nd; d++) {
        char hex[25];
        if (mg_doc_oid(docs[d], hex) && !idlist_add(out, hex)) {
            mg_fail(j, MG_OOM);
            r = -1;
        }
    }
    mg_docs_free(docs, nd);
    return r;
}

/* Whether any marker is there: most stores have none, and then a settle costs one short read
 * (a find without a filter, which FerretDB too answers from the head). -1: j failed. */
static int any_marker(mjob *j, mongoc_collection_t *mk)
{
    bson_t f = BSON_INITIALIZER;
    int failed = 0;
    bson_t *d = mg_find_one(j, mk, &f, NULL, &failed);
    bson_destroy(&f);
    if (d) bson_destroy(d);
    return failed ? -1 : d != NULL;
}

static int deps_settled(mjob *j, mongoc_client_t *c, char *const *ids, size_t n, int force);

int mg_deps_settled(mjob *j, mongoc_client_t *c, char *const *ids, size_t n)
{
    return deps_settled(j, c, ids, n, 0);
}

/* force: the sweep's look, which the skip below must not spare */
static int deps_settled(mjob *j, mongoc_client_t *c, char *const *ids, size_t n, int force)
{
    if (!n) return 0;
    /* A store with no marker at all stays so for a while: settles then skip the look for
     * DEPS_NONE_KEEP_S (a marker another process writes meanwhile is found by the sweep;
     * this process's own markers end the while at once, mg_deps_mark). */
    double mono = rb_monotonic();
    pthread_mutex_lock(&j->s->mu);
    int skip = !force && j->s->deps_none_at > 0 && mono - j->s->deps_none_at < DEPS_NONE_KEEP_S;
    pthread_mutex_unlock(&j->s->mu);
    if (skip) return 0;
    mongoc_collection_t *mk = mg_coll(j->s, c, j->s->deps);
    int any = any_marker(j, mk);
    if (any <= 0) {
        if (any == 0) {
            pthread_mutex_lock(&j->s->mu);
            j->s->deps_none_at = mono;
            pthread_mutex_unlock(&j->s->mu);
        }
        mongoc_collection_destroy(mk);
        return any;
    }
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t **markers = rb_calloc(n, sizeof *markers);
    idlist after = {0};
    int r = markers ? 0 : -1;
    if (r < 0) mg_fail(j, MG_OOM);
    /* (the markers' ids are the deliveries' hex ids, strings: looked up one by one) */
    for (size_t i = 0; r == 0 && i < n; i++) {
        bson_t sel = BSON_INITIALIZER;
        int failed = 0;
        BSON_APPEND_UTF8(&sel, "_id", ids[i]);
        markers[i] = mg_find_one(j, mk, &sel, NULL, &failed);
        bson_destroy(&sel);
        if (failed || !markers[i]) {
            r = failed ? -1 : 0;
            continue;
        }
        const char *gnext = mg_doc_str(markers[i], "gnext");
        if (gnext && !idlist_add(&after, gnext)) {
            mg_fail(j, MG_OOM);
            r = -1;
        }
        /* (a marker from before groups has neither: searched too) */
        if (r == 0 && (!gnext || bson_has_field(markers[i], "deps")))
            r = dependents_of(j, cl, ids[i], &after);
    }
    mongoc_collection_destroy(cl);
    if (r == 0 && after.n) r = mg_deps_eval(j, c, after.v, after.n);
    /* looked at: the sweep spares them the look until their last (an enqueue after one of
     * them since looks at its dependency again itself, mg_deps_mark) */
    for (size_t i = 0; r == 0 && i < n; i++) {
        if (!markers[i]) continue;
        bson_t sel = BSON_INITIALIZER;
        BSON_APPEND_UTF8(&sel, "_id", ids[i]);
        bson_t *upd = BCON_NEW("$set", "{", "looked_at", BCON_DOUBLE(mg_now(j->s)), "}");
        mongoc_collection_update_one(mk, &sel, upd, NULL, NULL, NULL);
        bson_destroy(upd);
        bson_destroy(&sel);
    }
    if (markers) free_docs(markers, n);
    free(markers);
    mongoc_collection_destroy(mk);
    free_ids(after.v, after.n);
    return r;
}

int mg_deps_mark(mjob *j, mongoc_client_t *c, char *const *ids, size_t n, const char *gnext,
                 double now)
{
    if (!n) return 0;
    pthread_mutex_lock(&j->s->mu);
    j->s->deps_none_at = 0;         /* there are markers now: settles look again */
    pthread_mutex_unlock(&j->s->mu);
    mongoc_collection_t *mk = mg_coll(j->s, c, j->s->deps);
    int r = 0;
    for (size_t i = 0; r == 0 && i < n; i++) {
        /* an upsert that keeps an existing marker's `at` and clears its looked_at: a
         * delivery after it is added, which the sweep must look for */
        bson_t sel = BSON_INITIALIZER, upd = BSON_INITIALIZER, soi, un;
        bson_error_t e;
        BSON_APPEND_UTF8(&sel, "_id", ids[i]);
        BSON_APPEND_DOCUMENT_BEGIN(&upd, "$setOnInsert", &soi);
        BSON_APPEND_DOUBLE(&soi, "at", now);
        bson_append_document_end(&upd, &soi);
        BSON_APPEND_DOCUMENT_BEGIN(&upd, "$unset", &un);
        BSON_APPEND_UTF8(&un, "looked_at", "");
        bson_append_document_end(&upd, &un);
        /* who is after it: the one of its group (one writer: the group's tail moved through
         * a versioned write), or deliveries whose `after` names it, found by a search */
        BSON_APPEND_DOCUMENT_BEGIN(&upd, "$set", &soi);
        if (gnext) BSON_APPEND_UTF8(&soi, "gnext", gnext);
        else BSON_APPEND_BOOL(&soi, "deps", true);
        bson_append_document_end(&upd, &soi);
        bson_t *opts = BCON_NEW("upsert", BCON_BOOL(true));
        if (!mongoc_collection_update_one(mk, &sel, &upd, opts, NULL, &e) && e.code != 11000) {
            mg_fail_bson(j, "dependencies: marker", &e);
            r = -1;
        }
        bson_destroy(opts);
        bson_destroy(&sel);
        bson_destroy(&upd);
    }
    mongoc_collection_destroy(mk);
    return r;
}

/* The sweep: the markers (a small collection: one per dependency with deliveries after it)
 * whose dependency settled get their deliveries evaluated, and go DEPS_MARKER_KEEP_S after
 * that; a settle missed by a process killed in between is caught up so. */
int mg_deps_sweep(mjob *j, mongoc_client_t *c)
{
    mongoc_collection_t *mk = mg_coll(j->s, c, j->s->deps);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    /* a page of DEPS_SWEEP_MAX in _id order after the last one read, round and round, so
     * every marker has its turn however many there are */
    char from[sizeof j->s->deps_swept_to];
    pthread_mutex_lock(&j->s->mu);
    memcpy(from, j->s->deps_swept_to, sizeof from);
    pthread_mutex_unlock(&j->s->mu);
    bson_t *f = BCON_NEW("_id", "{", "$gt", BCON_UTF8(from), "}");
    bson_t *opts = BCON_NEW("sort", "{", "_id", BCON_INT32(1), "}", "limit", BCON_INT64(DEPS_SWEEP_MAX));
    bson_t **marks = NULL;
    size_t nm = 0;
    int r = mg_find_docs(j, mk, f, opts, NULL, &marks, &nm);
    bson_destroy(f);
    bson_destroy(opts);
    if (r == 0) {
        const char *last = nm == DEPS_SWEEP_MAX ? mg_doc_str(marks[nm - 1], "_id") : NULL;
        pthread_mutex_lock(&j->s->mu);
        snprintf(j->s->deps_swept_to, sizeof j->s->deps_swept_to, "%s",
                 last && strlen(last) < sizeof j->s->deps_swept_to ? last : "");
        pthread_mutex_unlock(&j->s->mu);
    }
    char **ids = rb_calloc(nm ? nm : 1, sizeof *ids);
    bson_t **deps = rb_calloc(nm ? nm : 1, sizeof *deps);
    char *looked = rb_calloc(nm ? nm : 1, 1);
    if (r == 0 && (!ids || !deps || !looked)) { mg_fail(j, MG_OOM); r = -1; }
    size_t n = 0;
    for (size_t i = 0; r == 0 && i < nm; i++) {
        const char *id = mg_doc_str(marks[i], "_id");
        if (!id) continue;
        looked[n] = bson_has_field(marks[i], "looked_at");
        if (!(ids[n++] = rb_strdup(id))) { mg_fail(j, MG_OOM); r = -1; }
    }
    if (r == 0) r = mg_read_by_ids(j, cl, ids, n, deps);
    double now = mg_now(j->s);
    idlist settled = {0}, old = {0};
    for (size_t i = 0; r == 0 && i < n; i++) {
        const char *st = deps[i] ? mg_doc_str(deps[i], "status") : NULL;
        if (st && (!strcmp(st, "pending") || !strcmp(st, "processing"))) continue;
        /* (one not there counts from its marker, and its group's grace on: a group's
         * predecessor may be inserted after the marker its successor wrote, groups.c) */
        double at = deps[i] ? mg_doc_num(deps[i], "settled_at")
                            : mg_doc_num(marks[i], "at") + GROUP_GRACE_S;
        int last = at < now - DEPS_MARKER_KEEP_S;
        if (!last && looked[i]) continue;       /* its settler looked: nothing missed */
        if (!idlist_add(last ? &old : &settled, ids[i])) {
            mg_fail(j, MG_OOM);
            r = -1;
        }
    }
    /* the old ones get a last look before their markers go */
    if (r == 0) r = deps_settled(j, c, settled.v, settled.n, 1);
    if (r == 0) r = deps_settled(j, c, old.v, old.n, 1);
    for (size_t i = 0; r == 0 && i < old.n; i++) {
        bson_t sel = BSON_INITIALIZER;
        BSON_APPEND_UTF8(&sel, "_id", old.v[i]);
        mongoc_collection_delete_one(mk, &sel, NULL, NULL, NULL);
        bson_destroy(&sel);
    }
    free_ids(settled.v, settled.n);
    free_ids(old.v, old.n);
    if (deps) free_docs(deps, n);
    free(deps);
    free(looked);
    if (ids) free_ids(ids, n);
    mg_docs_free(marks, nm);
    mongoc_collection_destroy(cl);
    mongoc_collection_destroy(mk);
    return r;
}

void mg_deps_after_write(mjob *j, mongoc_client_t *c, mg_deps_look look, char *const *ids,
                         size_t n)
{
    char kept[ERRLEN];
    memcpy(kept, j->err, sizeof kept);
    int r = look == MG_DEPS_SWEEP ? mg_deps_sweep(j, c)
          : look == MG_DEPS_EVAL ? mg_deps_eval(j, c, ids, n) : mg_deps_settled(j, c, ids, n);
    if (r < 0) rb_log(RB_LOG_WARN, "mongodb: dependencies: %s (the sweep tries again)", j->err);
    memcpy(j->err, kept, sizeof kept);
}
