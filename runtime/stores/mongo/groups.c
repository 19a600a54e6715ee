/* groups.c -- ordered groups on the MongoDB store. The SQL stores' claim takes a grouped
 * delivery only when it is its group's head; a MongoDB claim cannot ask that of a document in
 * the write that claims it (no transactions here). So a group is a chain, built with the
 * held deliveries of deps.c:
 *
 *  - <table>_groups keeps one document per group ({_id: sha-256 of the name, tail: the id of
 *    the group's last delivery, recent: the last tails}). An enqueue moves the tail to its delivery through the
 *    versioned write every change takes (tickets.c), so two enqueues into one group at once
 *    line up: each delivery gets exactly one predecessor, `gprev`.
 *  - A delivery whose predecessor is live (pending or processing) is held behind it (run_at
 *    never due, its own in held_run_at, `gprev` its id) and the predecessor gets a marker
 *    with `gnext` (deps.c), before the delivery is inserted. Only the head of a group is due,
 *    so claims never see the others, and a group runs one at a time.
 *  - When the predecessor settles (completed, buried or cancelled: a buried head lets its
 *    group go on), whoever settled it evaluates the delivery after it (mg_group_live_prev):
 *    released when nothing before it is live. A predecessor that settled while it was held
 *    itself (cancelled) still has its own gprev: the look goes back through it, so the one
 *    after a cancelled middle waits for the head that still runs.
 *  - A kicked grouped delivery joins its group again at the tail, like a new one. It is
 *    flagged first (kick_at, on its own document through the versioned write): a look back
 *    takes a flagged one for live, so an enqueue that links behind it before the kick lands
 *    waits for it. Linked, it waits for the live one before the tail it went behind, unless
 *    that one was linked after it in the meantime (mg_group_reaches): then for what was before
 *    it.
 *  - The link comes before the insert, so a later enqueue may find its predecessor not there
 *    yet: for GROUP_GRACE_S after its id was made it counts as live, unless marked gone (an
 *    enqueue that will not insert it after all, a delete: mg_groups_gone). After that, or
 *    when gone, the look goes on to the one it was linked behind (the group document keeps
 *    its last RECENT_MAX tails in order).
 * The enqueue's look after its insert, the settles' looks and the sweep are deps.c's. */
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/check.h"

#define LINK_ROUNDS 40      /* versioned writes of one group's tail lost in a row, at most */
#define CHAIN_LOOK_MAX 100000   /* settled predecessors a look goes back through, at most */
#define RECENT_MAX 64       /* the tails a group document remembers */
#define REACH_MAX 1000      /* held ones a look for a kicked one goes back through, at most */

/* The group document's _id: the SHA-256 of the name in hex (a name is up to 512 bytes; a
 * ticket names its document's _id in at most 120). */
static int group_doc_id(const char *group, char out[65])
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned len = 0;
    if (!EVP_Digest(group, strlen(group), md, &len, EVP_sha256(), NULL) || len != 32) return 0;
    for (unsigned i = 0; i < len; i++) snprintf(out + 2 * i, 3, "%02x", md[i]);
    return 1;
}

/* The group's document, made when there is none (an insert that another's beat is fine). */
static bson_t *group_doc(mjob *j, mongoc_collection_t *gc, const char *gid, double now)
{
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_UTF8(&sel, "_id", gid);
    for (int pass = 0; pass < 2; pass++) {
        int failed = 0;
        bson_t *d = mg_find_one(j, gc, &sel, NULL, &failed);
        if (d || failed) {
            bson_destroy(&sel);
            return d;
        }
        if (pass) break;
        /* versions start at the time in microseconds: no ticket of a document of this _id
         * that went before can name them */
        bson_t doc = BSON_INITIALIZER;
        bson_error_t e;
        BSON_APPEND_UTF8(&doc, "_id", gid);
        BSON_APPEND_NULL(&doc, "tail");
        BSON_APPEND_INT64(&doc, "v", (int64_t)(now * 1e6));
        int ok = mongoc_collection_insert_one(gc, &doc, NULL, NULL, &e);
        bson_destroy(&doc);
        if (!ok && e.code != 11000) {
            mg_fail_bson(j, "groups: group document", &e);
            break;
        }
    }
    bson_destroy(&sel);
    if (!j->err[0]) mg_fail(j, "groups: a group document could not be made");
    return NULL;
}

typedef struct member { const char *group; size_t i; } member;

static int member_cmp(const void *a, const void *b)
{
    const member *x = a, *y = b;
    int c = strcmp(x->group, y->group);
    return c ? c : (x->i > y->i) - (x->i < y->i);
}

/* The group document's `recent`: its last RECENT_MAX tails, oldest first, so a look back
 * from one whose predecessor never came in finds the one before that (may_come). Into arr: the
 * document's, then ids of members m[from..to). */
static void recent_append(bson_t *arr, const bson_t *gdoc, char *const *ids, const member *m,
                          size_t from, size_t to)
{
    const char *old[RECENT_MAX];
    size_t nold = 0, nnew = to - from, k = 0;
    bson_iter_t it, sub;
    if (bson_iter_init_find(&it, gdoc, "recent") && BSON_ITER_HOLDS_ARRAY(&it) &&
        bson_iter_recurse(&it, &sub))
        while (bson_iter_next(&sub))
            if (BSON_ITER_HOLDS_UTF8(&sub)) {
                if (nold == RECENT_MAX) {
                    memmove(old, old + 1, (RECENT_MAX - 1) * sizeof *old);
                    nold--;
                }
                old[nold++] = bson_iter_utf8(&sub, NULL);
            }
    size_t skip_old = nold + nnew > RECENT_MAX ? nold + nnew - RECENT_MAX : 0;
    for (size_t i = skip_old; i < nold; i++) {
        char key[24];
        snprintf(key, sizeof key, "%zu", k++);
        BSON_APPEND_UTF8(arr, key, old[i]);
    }
    size_t skip_new = nnew > RECENT_MAX ? nnew - RECENT_MAX : 0;
    for (size_t x = from + skip_new; x < to; x++) {
        char key[24];
        snprintf(key, sizeof key, "%zu", k++);
        BSON_APPEND_UTF8(arr, key, ids[m[x].i]);
    }
}

int mg_groups_link(mjob *j, mongoc_client_t *c, const char *const *groups, char *const *ids,
                   size_t n, char **prev, long *prev_item)
{
    for (size_t i = 0; i < n; i++) {
        prev[i] = NULL;
        if (prev_item) prev_item[i] = -1;
    }
    member *m = rb_calloc(n ? n : 1, sizeof *m);
    size_t nm = 0;
    if (!m) { mg_fail(j, MG_OOM); return -1; }
    for (size_t i = 0; i < n; i++)
        if (groups[i]) m[nm++] = (member){groups[i], i};
    qsort(m, nm, sizeof *m, member_cmp);
    /* runs[k]: the members of one group, m[start..end) in batch order */
    size_t *start = rb_calloc(nm + 1, sizeof *start), nruns = 0;
    char (*gid)[65] = rb_calloc(nm + 1, sizeof *gid);
    int *done = rb_calloc(nm + 1, sizeof *done);
    cas_op *ops = rb_calloc(nm + 1, sizeof *ops);
    bson_t **docs = rb_calloc(nm + 1, sizeof *docs);
    size_t *opk = rb_calloc(nm + 1, sizeof *opk);
    int r = start && gid && done && ops && docs && opk ? 0 : -1;
    if (r < 0) mg_fail(j, MG_OOM);
    for (size_t k = 0; r == 0 && k < nm; k++)
        if (k == 0 || strcmp(m[k].group, m[k - 1].group)) {
            if (!group_doc_id(m[k].group, gid[nruns])) { mg_fail(j, "groups: sha-256 failed"); r = -1; }
            start[nruns++] = k;
        }
    if (start) start[nruns] = nm;
    /* this process's jobs link into one group one at a time (busy.c): only other processes'
     * enqueues can make a link lose */
    mg_busy *held = r == 0 ? rb_calloc(nruns + 1, sizeof *held) : NULL;
    if (r == 0 && !held) { mg_fail(j, MG_OOM); r = -1; }
    for (size_t k = 0; held && k < nruns; k++) held[k].key = gid[k];
    if (held) mg_busy_take(j->s, held, nruns);
    mongoc_collection_t *gc = mg_coll(j->s, c, j->s->groups);
    size_t left = nruns;
    for (int round = 0; r == 0 && left && round < LINK_ROUNDS; round++) {
        double now = mg_now(j->s);
        size_t nops = 0;
        for (size_t k = 0; r == 0 && k < nruns; k++) {
            if (done[k]) continue;
            if (!(docs[k] = group_doc(j, gc, gid[k], now))) { r = -1; break; }
            const char *tail = ids[m[start[k + 1] - 1].i];
            bson_t *u = bson_new(), set, arr;
            BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
            BSON_APPEND_UTF8(&set, "tail", tail);
            BSON_APPEND_INT64(&set, "v", mg_doc_int(docs[k], "v") + 1);
            BSON_APPEND_ARRAY_BEGIN(&set, "recent", &arr);
            recent_append(&arr, docs[k], ids, m, start[k], start[k + 1]);
            bson_append_array_end(&set, &arr);
            bson_append_document_end(u, &set);
            mg_cas_init(j->s, &ops[nops], docs[k], "g", u);
            opk[nops++] = k;
        }
        if (r == 0 && nops && mg_cas_run(j, c, j->s->groups, ops, nops, now) < 0) r = -1;
        for (size_t o = 0; o < nops; o++) {
            size_t k = opk[o];
            if (r == 0 && ops[o].won) {
                /* the first member follows the old tail; each other one the member before */
                const char *old = mg_doc_str(docs[k], "tail");
                if (old && !(prev[m[start[k]].i] = rb_strdup(old))) { mg_fail(j, MG_OOM); r = -1; }
                for (size_t x = start[k] + 1; r == 0 && x < start[k + 1]; x++) {
                    if (!(prev[m[x].i] = rb_strdup(ids[m[x - 1].i]))) { mg_fail(j, MG_OOM); r = -1; }
                    if (prev_item) prev_item[m[x].i] = (long)m[x - 1].i;
                }
                done[k] = 1;
                left--;
            }
            mg_cas_clear(&ops[o]);
            bson_destroy(docs[k]);
            docs[k] = NULL;
        }
        if (r == 0 && left) mg_lost_wait(round);
    }
    if (r == 0 && left) {
        mg_fail(j, "groups: a group's tail lost to other enqueues %d times in a row", LINK_ROUNDS);
        r = -1;
    }
    mongoc_collection_destroy(gc);
    if (held) {
        mg_busy_give(j->s, held, nruns);
        free(held);
    }
    for (size_t k = 0; docs && k < nruns; k++) if (docs[k]) bson_destroy(docs[k]);
    free(docs); free(ops); free(opk); free(done); free(gid); free(start); free(m);
    if (r < 0)
        for (size_t i = 0; i < n; i++) {
            free(prev[i]);
            prev[i] = NULL;
            if (prev_item) prev_item[i] = -1;
        }
    return r;
}

/* ---- the look back through a group ---- */
/* A worklist of ids, each taken once. */
typedef struct walk {
    char **v;
    size_t n, next, cap;
} walk;

static int walk_add(walk *w, const char *id)
{
    for (size_t i = 0; i < w->n; i++) if (!strcmp(w->v[i], id)) return 1;
    if (w->n == w->cap) {
        size_t nc = w->cap ? 2 * w->cap : 8;
        char **g = rb_realloc(w->v, nc * sizeof *g);
        if (!g) return 0;
        w->v = g;
        w->cap = nc;
    }
    if (!(w->v[w->n] = rb_strdup(id))) return 0;
    w->n++;
    return 1;
}

static void walk_free(walk *w)
{
    for (size_t i = 0; i < w->n; i++) free(w->v[i]);
    free(w->v);
}

/* Whether a missing delivery may still be inserted: its enqueue linked it into its group
 * before the insert, so for GROUP_GRACE_S after its id was made (ObjectIds carry their time)
 * it counts as live, unless it was marked gone (an enqueue that will not insert it, a delete).
 * 1 may come, 0 never, -1 j failed. */
static int may_come(mjob *j, mongoc_collection_t *gc, const char *id, double now)
{
    bson_oid_t oid;
    if (!mg_parse_oid(id, &oid) || (double)bson_oid_get_time_t(&oid) < now - GROUP_GRACE_S)
        return 0;
    char key[40];
    snprintf(key, sizeof key, "gone:%s", id);
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_UTF8(&sel, "_id", key);
    int failed = 0;
    bson_t *d = mg_find_one(j, gc, &sel, NULL, &failed);
    bson_destroy(&sel);
    if (d) bson_destroy(d);
    return failed ? -1 : d == NULL;
}

/* The one a missing delivery was linked behind: the tail before it in its group's `recent`
 * (none when it is the oldest there, or not there: RECENT_MAX links ago). */
static int linked_behind(mjob *j, mongoc_collection_t *gc, const char *group, const char *id,
                         walk *w)
{
    char gid[65];
    if (!group) return 0;
    if (!group_doc_id(group, gid)) { mg_fail(j, "groups: sha-256 failed"); return -1; }
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_UTF8(&sel, "_id", gid);
    int failed = 0;
    bson_t *d = mg_find_one(j, gc, &sel, NULL, &failed);
    bson_destroy(&sel);
    if (failed) return -1;
    bson_iter_t it, sub;
    const char *before = NULL, *found = NULL;
    if (d && bson_iter_init_find(&it, d, "recent") && BSON_ITER_HOLDS_ARRAY(&it) &&
        bson_iter_recurse(&it, &sub))
        while (!found && bson_iter_next(&sub)) {
            if (!BSON_ITER_HOLDS_UTF8(&sub)) continue;
            const char *t = bson_iter_utf8(&sub, NULL);
            if (!strcmp(t, id)) found = t;
            else before = t;
        }
    int r = 0;
    if (found && before && !walk_add(w, before)) { mg_fail(j, MG_OOM); r = -1; }
    if (d) bson_destroy(d);
    return r;
}

int mg_group_live_prev(mjob *j, mongoc_client_t *c, const char *group, const char *self,
                       const char *prev, char **out)
{
    *out = NULL;
    if (!prev) return 0;
    walk w = {0};
    if (!walk_add(&w, prev)) { mg_fail(j, MG_OOM); return -1; }
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    mongoc_collection_t *gc = NULL;
    int r = 0;
    double now = mg_now(j->s);
    while (r == 0 && w.next < w.n) {
        const char *at = w.v[w.next++];
        if (w.next > CHAIN_LOOK_MAX) {
            mg_fail(j, "groups: more than %d settled deliveries held in a row", CHAIN_LOOK_MAX);
            r = -1;
            break;
        }
        int itself = self && !strcmp(at, self);
        int failed = 0;
        bson_t *d = mg_find_by_id(j, cl, at, &failed);
        if (failed) { r = -1; break; }
        if (d && itself) {
            /* back to itself (a kick links it behind the tail it was): what was before it */
            const char *back = mg_doc_str(d, "gprev");
            if (back && !walk_add(&w, back)) { mg_fail(j, MG_OOM); r = -1; }
            bson_destroy(d);
            continue;
        }
        if (d) {
            const char *st = mg_doc_str(d, "status");
            /* one an operator is kicking (kick_groups) is live from its flag on */
            int kicking = mg_doc_num(d, "kick_at") > now - KICK_GRACE_S;
            if (kicking || (st && (!strcmp(st, "pending") || !strcmp(st, "processing")))) {
                if (!(*out = rb_strdup(at))) { mg_fail(j, MG_OOM); r = -1; }
                bson_destroy(d);
                break;      /* live: the one to wait for */
            }
            /* settled: one that settled while held still names its own predecessor */
            const char *back = mg_doc_str(d, "gprev");
            if (back && !walk_add(&w, back)) { mg_fail(j, MG_OOM); r = -1; }
            bson_destroy(d);
            continue;
        }
        if (!gc) gc = mg_coll(j->s, c, j->s->groups);
        int come = may_come(j, gc, at, now);
        if (come < 0) { r = -1; break; }
        if (come) {
            if (!(*out = rb_strdup(at))) { mg_fail(j, MG_OOM); r = -1; }
            break;          /* its enqueue may insert it yet: wait for it */
        }
        /* never to come: the one it was linked behind is before it */
        r = linked_behind(j, gc, group, at, &w);
    }
    if (gc) mongoc_collection_destroy(gc);
    mongoc_collection_destroy(cl);
    walk_free(&w);
    if (r < 0) { free(*out); *out = NULL; }
    return r;
}

int mg_groups_gone(mjob *j, mongoc_client_t *c, char *const *ids, size_t n)
{
    if (!n) return 0;
    double now = mg_now(j->s);
    mongoc_collection_t *gc = mg_coll(j->s, c, j->s->groups);
    mongoc_bulk_operation_t *b = mg_unordered_bulk(gc);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        bson_oid_t oid;
        /* (an older one is taken for gone without it: may_come) */
        if (!ids[i] || !mg_parse_oid(ids[i], &oid) ||
            (double)bson_oid_get_time_t(&oid) < now - GROUP_GRACE_S - 60)
            continue;
        char key[40];
        snprintf(key, sizeof key, "gone:%s", ids[i]);
        bson_t *doc = BCON_NEW("_id", BCON_UTF8(key), "gone", BCON_BOOL(true), "at", BCON_DOUBLE(now));
        mongoc_bulk_operation_insert(b, doc);
        bson_destroy(doc);
        m++;
    }
    int *codes = rb_calloc(m ? m : 1, sizeof *codes), r = 0;
    if (!codes) { mg_fail(j, MG_OOM); r = -1; }
    else if (m) r = mg_bulk_run(j, b, codes, m, "groups: gone");
    if (!m || !codes) mongoc_bulk_operation_destroy(b);
    for (size_t i = 0; r == 0 && i < m; i++)
        if (codes[i] && codes[i] != 11000) {
            mg_fail(j, "groups: the server refused a mark (code %d)", codes[i]);
            r = -1;
        }
    free(codes);
    mongoc_collection_destroy(gc);
    return r < 0 ? -1 : 0;
}

void mg_groups_prune(mstore *s, mongoc_client_t *c)
{
    mongoc_collection_t *gc = mg_coll(s, c, s->groups);
    bson_t *f = BCON_NEW("gone", BCON_BOOL(true), "at", "{", "$lt",
                         BCON_DOUBLE(mg_now(s) - GROUP_GRACE_S - 60), "}");
    mongoc_collection_delete_many(gc, f, NULL, NULL, NULL);
    bson_destroy(f);
    mongoc_collection_destroy(gc);
}

int mg_group_reaches(mjob *j, mongoc_client_t *c, const char *from, const char *x)
{
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    char *at = from ? rb_strdup(from) : NULL;
    int r = 0;
    if (from && !at) { mg_fail(j, MG_OOM); r = -1; }
    for (int step = 0; r == 0 && at && step < REACH_MAX; step++) {
        if (!strcmp(at, x)) { r = 1; break; }
        int failed = 0;
        bson_t *d = mg_find_by_id(j, cl, at, &failed);
        if (failed) { r = -1; break; }
        const char *back = d ? mg_doc_str(d, "gprev") : NULL;
        free(at);
        at = NULL;
        if (back && !(at = rb_strdup(back))) { mg_fail(j, MG_OOM); r = -1; }
        if (d) bson_destroy(d);
    }
    free(at);
    mongoc_collection_destroy(cl);
    return r;
}
