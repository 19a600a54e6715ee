/* groups.c -- ordered groups on the MongoDB store. The SQL stores' claim takes a grouped
 * delivery only when it is its group's head; a MongoDB claim cannot ask that of a document in
 * the write that claims it (no transactions here). So a group is a chain, built with the
 * held deliveries of deps.c:
 *
 *  - <table>_groups keeps one document per group ({_id: sha-256 of the name, tail: the id of
 *    the group's last delivery}). An enqueue moves the tail to its delivery through the
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
 *  - A kicked grouped delivery joins its group again at the tail, like a new one.
 * The enqueue's look after its insert, the settles' looks and the sweep are deps.c's. */
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/check.h"

#define LINK_ROUNDS 10      /* versioned writes of one group's tail lost in a row, at most */
#define CHAIN_LOOK_MAX 100000   /* settled predecessors a look goes back through, at most */

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

int mg_groups_link(mjob *j, mongoc_client_t *c, const char *const *groups, char *const *ids,
                   size_t n, char **prev)
{
    for (size_t i = 0; i < n; i++) prev[i] = NULL;
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
    mongoc_collection_t *gc = mg_coll(j->s, c, j->s->groups);
    size_t left = nruns;
    for (int round = 0; r == 0 && left && round < LINK_ROUNDS; round++) {
        double now = mg_now(j->s);
        size_t nops = 0;
        for (size_t k = 0; r == 0 && k < nruns; k++) {
            if (done[k]) continue;
            if (!(docs[k] = group_doc(j, gc, gid[k], now))) { r = -1; break; }
            const char *tail = ids[m[start[k + 1] - 1].i];
            bson_t *u = BCON_NEW("$set", "{", "tail", BCON_UTF8(tail), "v",
                                 BCON_INT64(mg_doc_int(docs[k], "v") + 1), "}");
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
                for (size_t x = start[k] + 1; r == 0 && x < start[k + 1]; x++)
                    if (!(prev[m[x].i] = rb_strdup(ids[m[x - 1].i]))) { mg_fail(j, MG_OOM); r = -1; }
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
    for (size_t k = 0; docs && k < nruns; k++) if (docs[k]) bson_destroy(docs[k]);
    free(docs); free(ops); free(opk); free(done); free(gid); free(start); free(m);
    if (r < 0)
        for (size_t i = 0; i < n; i++) { free(prev[i]); prev[i] = NULL; }
    return r;
}

int mg_group_live_prev(mjob *j, mongoc_collection_t *cl, const char *self, const char *prev,
                       char **out)
{
    *out = NULL;
    char *at = prev ? rb_strdup(prev) : NULL;
    if (prev && !at) { mg_fail(j, MG_OOM); return -1; }
    for (int step = 0; at; step++) {
        if (step == CHAIN_LOOK_MAX) {
            mg_fail(j, "groups: more than %d settled deliveries held in a row", CHAIN_LOOK_MAX);
            free(at);
            return -1;
        }
        if (self && !strcmp(at, self)) break;   /* back to itself: kicked, it came after */
        int failed = 0;
        bson_t *d = mg_find_by_id(j, cl, at, &failed);
        if (failed) { free(at); return -1; }
        const char *st = d ? mg_doc_str(d, "status") : NULL;
        if (st && (!strcmp(st, "pending") || !strcmp(st, "processing"))) {
            *out = at;      /* live: the one to wait for */
            bson_destroy(d);
            return 0;
        }
        /* settled (or gone): one that settled while held still names its own predecessor */
        const char *back = d ? mg_doc_str(d, "gprev") : NULL;
        free(at);
        at = NULL;
        if (back && !(at = rb_strdup(back))) { bson_destroy(d); mg_fail(j, MG_OOM); return -1; }
        if (d) bson_destroy(d);
    }
    free(at);
    return 0;
}
