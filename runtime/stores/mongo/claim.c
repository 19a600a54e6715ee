/* claim.c -- the MongoDB store's claim. On MongoDB: one find of the due deliveries (by run_at),
 * then their claims through tickets (tickets.c). On FerretDB, where that find would decode
 * every document of the collection, from the head of the ready queue (readyq.c): read the
 * head, classify each entry by its delivery (due, not yet, settled, gone), claim the due. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/check.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/text.h"

typedef struct claim_job {
    mjob j;
    char **topics;
    size_t ntopics, limit;
    size_t nasked;          /* topics[ntopics..nasked): the paused ones (mg_split_paused) */
    double lease;
    rb_delivery **recs;
    size_t nrecs;
    char **buried;          /* the ids it buried out of attempts: their dependents (deps.c) */
    size_t nburied;
    mg_lims lims;           /* the limited ones among its topics (limits.c) */
    size_t *cap;            /* per topic: how many more it may start (SIZE_MAX: unlimited) */
} claim_job;

/* Notes a delivery this claim buried (out of attempts), for the deliveries after it. */
static void note_buried(claim_job *q, const bson_t *d, size_t most)
{
    char hex[25];
    if (!mg_doc_oid(d, hex)) return;
    if (!q->buried && !(q->buried = rb_calloc(most ? most : 1, sizeof *q->buried))) return;
    RB_ASSERT(q->nburied < most);
    if ((q->buried[q->nburied] = rb_strdup(hex))) q->nburied++;
}

static bson_t *upd_claim(const bson_t *cur, const char *token, double now, double lease)
{
    bson_t *u = bson_new(), set;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    BSON_APPEND_UTF8(&set, "status", "processing");
    BSON_APPEND_UTF8(&set, "lease_token", token);
    BSON_APPEND_DOUBLE(&set, "lease_expires_at", now + lease);
    BSON_APPEND_INT32(&set, "attempts", (int32_t)mg_doc_int(cur, "attempts") + 1);
    BSON_APPEND_INT64(&set, "fence", mg_doc_int(cur, "fence") + 1);
    BSON_APPEND_INT64(&set, "v", mg_doc_int(cur, "v") + 1);
    bson_append_document_end(u, &set);
    return u;
}

static int claim_exceeds(const bson_t *d)
{
    return mg_doc_int(d, "attempts") + 1 > mg_doc_int(d, "max_attempts");
}

static rb_delivery *claimed_record(const bson_t *d, const char *token, double now, double lease)
{
    rb_delivery *r = mg_record_from(d, token);
    if (!r) return NULL;
    r->status = RB_PROCESSING;
    r->attempts++;
    r->fence++;
    r->lease_expires_at = now + lease;
    return r;
}

/* The due deliveries of topics[0..nt), at most `limit`, appended to *docs. */
static int claim_candidates(claim_job *q, mongoc_collection_t *cl, char **topics, size_t nt,
                            size_t limit, double now, bson_t ***docs, size_t *n)
{
    if (!nt || !limit) return 0;
    bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER, sort;
    mg_append_in(&f, "topic", topics, nt);
    mg_append_due(&f, now);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, "run_at", 1);
    BSON_APPEND_INT32(&sort, "_id", 1);
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT64(&opts, "limit", (int64_t)limit);
    bson_t **got = NULL;
    size_t ng = 0;
    int r = mg_find_docs(&q->j, cl, &f, &opts, NULL, &got, &ng);
    bson_destroy(&f);
    bson_destroy(&opts);
    if (r < 0) return -1;
    bson_t **all = rb_realloc(*docs, (*n + ng + 1) * sizeof *all);
    if (!all) {
        mg_docs_free(got, ng);
        mg_fail(&q->j, MG_OOM);
        return -1;
    }
    for (size_t i = 0; i < ng; i++) all[(*n)++] = got[i];
    free(got);
    *docs = all;
    return 0;
}

/* ---- limits (limits.c): reserved before the claim, given back when it lost ---- */
/* The limited topic of a candidate that would start (not one buried out of attempts). */
static mg_lim *limited_of(claim_job *q, const bson_t *d)
{
    const char *t = mg_doc_str(d, "topic");
    return t && !claim_exceeds(d) ? mg_lims_find(&q->lims, t) : NULL;
}

/* Reserves the starts of the limited candidates docs[0..n) under tokens[i], one write per
 * topic; keep[i] = 0 for those whose reservation lost (not claimed now: the next claim reads
 * the document again). -1: j failed. */
static int limits_reserve(claim_job *q, mongoc_client_t *c, bson_t *const *docs, size_t n,
                          char (*tokens)[33], char *keep, double now)
{
    for (size_t i = 0; i < n; i++) keep[i] = 1;
    if (!q->lims.n) return 0;
    for (size_t i = 0; i < n; i++) keep[i] = limited_of(q, docs[i]) == NULL;   /* until reserved */
    mg_slot *add = rb_calloc(n ? n : 1, sizeof *add);
    if (!add) { mg_fail(&q->j, MG_OOM); return -1; }
    int r = 0;
    for (size_t li = 0; r == 0 && li < q->lims.n; li++) {
        mg_lim *l = &q->lims.v[li];
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if (limited_of(q, docs[i]) == l && mg_doc_oid(docs[i], add[m].d)) {
                snprintf(add[m].k, sizeof add[m].k, "%s", tokens[i]);
                add[m++].exp = now + q->lease;
            }
        if (!m) continue;
        RB_ASSERT(m <= l->allow);       /* the candidates were capped by it */
        /* this process's jobs write one limit document at a time: only other processes'
         * writes make a reservation lose; a lost one is judged again and tried again */
        mg_busy key = {.key = l->topic};
        mg_busy_take(q->j.s, &key, 1);
        int won = 0;
        for (int round = 0; r == 0 && m && round < MG_RESERVE_ROUNDS; round++) {
            if ((won = mg_limits_reserve(&q->j, c, l, add, m, now)) != 0) break;
            if (mg_limits_reload(&q->j, c, l, now) < 0) r = -1;
            else if (m > l->allow) m = l->allow;    /* the first of them, as many as may start */
        }
        mg_busy_give(q->j.s, &key, 1);
        if (won < 0) r = -1;
        size_t seen = 0;
        for (size_t i = 0; i < n; i++) {
            char hex[25];
            if (limited_of(q, docs[i]) != l) continue;
            /* (one whose id is no ObjectId had no slot reserved: not claimed either) */
            keep[i] = won > 0 && mg_doc_oid(docs[i], hex) && seen++ < m;
        }
    }
    free(add);
    return r;
}

/* The claim failed after its reservations (keep[i] for those reserved): their slots and starts
 * go now rather than with their leases. */
static void limits_undo(claim_job *q, mongoc_client_t *c, bson_t *const *docs, size_t n,
                        char (*tokens)[33], const char *keep, double at)
{
    char **mine = q->lims.n ? rb_calloc(n ? n : 1, sizeof *mine) : NULL;
    for (size_t li = 0; mine && li < q->lims.n; li++) {
        mg_lim *l = &q->lims.v[li];
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if (keep[i] && limited_of(q, docs[i]) == l) mine[m++] = tokens[i];
        if (!m) continue;
        char kept[ERRLEN];
        memcpy(kept, q->j.err, sizeof kept);
        q->j.err[0] = 0;
        if (mg_limits_finish(&q->j, c, l->topic, mine, m, 0, at, at) < 0)
            rb_log(RB_LOG_WARN, "mongodb: limits: %s (the slots end with their leases)", q->j.err);
        memcpy(q->j.err, kept, sizeof kept);
    }
    free(mine);
}

/* After the claim's writes: each won run of a limited topic is noted (its settle gives its
 * slot back); the slots of those lost are given back now. */
static void limits_after(claim_job *q, mongoc_client_t *c, bson_t *const *docs, size_t n,
                         const cas_op *ops, char (*tokens)[33], double at)
{
    if (!q->lims.n) return;
    char **lost = rb_calloc(n ? n : 1, sizeof *lost);
    double done = fmax(mg_now(q->j.s), at);     /* (a clock refresh may step back) */
    for (size_t li = 0; lost && li < q->lims.n; li++) {
        mg_lim *l = &q->lims.v[li];
        size_t m = 0, won = 0;
        for (size_t i = 0; i < n; i++) {
            if (limited_of(q, docs[i]) != l) continue;
            if (!ops[i].won) {
                lost[m++] = tokens[i];
                continue;
            }
            won++;
            /* (a run that could not be noted keeps its slot until its lease ends) */
            if (mg_limits_started(q->j.s, l->topic, tokens[i]) < 0)
                rb_log(RB_LOG_WARN, "mongodb: limits: out of memory (a slot ends with its lease)");
        }
        if (m || (won && l->rate > 0)) {
            /* (the claim stands: a failure here only keeps the slots until their leases end) */
            char kept[ERRLEN];
            memcpy(kept, q->j.err, sizeof kept);
            if (mg_limits_finish(&q->j, c, l->topic, lost, m, l->rate > 0 ? won : 0, at, done) < 0)
                rb_log(RB_LOG_WARN, "mongodb: limits: %s (the slots end with their leases)", q->j.err);
            memcpy(q->j.err, kept, sizeof kept);
        }
    }
    if (!lost) rb_log(RB_LOG_WARN, "mongodb: limits: out of memory (the slots end with their leases)");
    free(lost);
}

/* The writes that claim docs[0..n) (or bury those out of attempts), each under its token
 * tokens[i]; NULL with j->err set when out of memory. */
static cas_op *claim_ops(claim_job *q, bson_t *const *docs, size_t n, double now,
                         char (*tokens)[33])
{
    cas_op *ops = rb_calloc(n ? n : 1, sizeof *ops);
    if (!q->recs) q->recs = rb_calloc(q->limit ? q->limit : 1, sizeof *q->recs);
    if (!ops || !q->recs) {
        mg_fail(&q->j, "out of memory");
        free(ops);
        return NULL;
    }
    RB_ASSERT(q->nrecs + n <= q->limit);
    for (size_t i = 0; i < n; i++) {
        const bson_t *d = docs[i];
        bson_t *u = claim_exceeds(d)
                        ? mg_upd_bury(d, mg_doc_str(d, "last_error") ? NULL : "max attempts exceeded", now)
                        : upd_claim(d, tokens[i], now, q->lease);
        mg_cas_init(q->j.s, &ops[i], d, "d", u);
    }
    return ops;
}

static char (*new_tokens(claim_job *q, size_t n))[33]
{
    char (*t)[33] = rb_calloc(n ? n : 1, sizeof *t);
    if (!t) mg_fail(&q->j, MG_OOM);
    for (size_t i = 0; t && i < n; i++) rb_random_token(t[i]);
    return t;
}

/* MongoDB: the due deliveries, found by their index: those of the unlimited topics, then of
 * each limited one as many as it may start. */
static void claim_scan(claim_job *q, mongoc_client_t *c)
{
    mjob *j = &q->j;
    double now = mg_now(j->s);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t **docs = NULL;
    size_t n = 0, nfree = 0;
    char **free_topics = rb_calloc(q->ntopics + 1, sizeof *free_topics);
    int r = free_topics ? 0 : -1;
    if (r < 0) mg_fail(j, MG_OOM);
    for (size_t i = 0; r == 0 && i < q->ntopics; i++)
        if (q->cap[i] == SIZE_MAX) free_topics[nfree++] = q->topics[i];
    if (r == 0) r = claim_candidates(q, cl, free_topics, nfree, q->limit, now, &docs, &n);
    for (size_t i = 0; r == 0 && i < q->ntopics && n < q->limit; i++) {
        if (q->cap[i] == SIZE_MAX) continue;
        size_t want = q->limit - n < q->cap[i] ? q->limit - n : q->cap[i];
        r = claim_candidates(q, cl, &q->topics[i], 1, want, now, &docs, &n);
    }
    free(free_topics);
    mongoc_collection_destroy(cl);
    char (*tokens)[33] = r == 0 && n ? new_tokens(q, n) : NULL;
    char *keep = tokens ? rb_calloc(n, 1) : NULL;
    if (tokens && !keep) mg_fail(j, MG_OOM);
    int reserved = keep ? limits_reserve(q, c, docs, n, tokens, keep, now) : -1;
    if (keep && reserved < 0) limits_undo(q, c, docs, n, tokens, keep, now);
    if (reserved == 0) {
        /* those whose reservation lost stay as they are */
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            if (!keep[i]) { bson_destroy(docs[i]); continue; }
            docs[m] = docs[i];
            if (m != i) memcpy(tokens[m], tokens[i], sizeof tokens[i]);
            keep[m++] = 1;
        }
        n = m;
        cas_op *ops = claim_ops(q, docs, n, now, tokens);
        if (ops && mg_cas_run(j, c, j->s->base.table, ops, n, now) == 0) {
            for (size_t i = 0; i < n; i++)
                if (ops[i].won && !claim_exceeds(docs[i])) {
                    rb_delivery *rec = claimed_record(docs[i], tokens[i], now, q->lease);
                    if (rec) q->recs[q->nrecs++] = rec;
                } else if (ops[i].won) {
                    note_buried(q, docs[i], n);
                }
            limits_after(q, c, docs, n, ops, tokens, now);
        } else {
            limits_undo(q, c, docs, n, tokens, keep, now);
        }
        if (ops) mg_cas_free(ops, n);
    }
    free(keep);
    free(tokens);
    mg_docs_free(docs, n);
}

/* ---- claim on FerretDB: from the head of the queue (see readyq.c) ----------------------- */
/* The index of topic t among the claim's, -1 when it is not one or may start no more now. */
static long topic_wanted(const claim_job *q, const char *t)
{
    for (size_t i = 0; t && i < q->ntopics; i++)
        if (strcmp(q->topics[i], t) == 0) return q->cap[i] ? (long)i : -1;
    return -1;
}

typedef struct qcand {
    bson_t *doc;
    const bson_t *entry;
} qcand;

static int qcand_cmp(const void *a, const void *b)
{
    const qcand *x = a, *y = b;
    double ra = mg_doc_num(x->doc, "run_at"), rb = mg_doc_num(y->doc, "run_at");
    if (ra != rb) return ra < rb ? -1 : 1;
    char hx[25] = "", hy[25] = "";
    mg_doc_oid(x->doc, hx);
    mg_doc_oid(y->doc, hy);
    return strcmp(hx, hy);
}

/* Of several entries of one delivery in a read, the newest (highest generation) stands and
 * the others go. A move inserts the successor before it deletes the entry it moves, so the
 * newest is the one no concurrent move deletes. Keeping the first one read and deleting the
 * newer raced with that move: process B read both entries between A's insert of E(g+1) and
 * A's delete of E(g), kept E(g), deleted E(g+1), then A deleted E(g), and the delivery had no
 * entry left, never to be claimed again (two processes releasing a few deliveries lost all
 * of them within seconds). Marks stale[i] for the others; -1 when out of memory. */
typedef struct qref {
    const char *d;
    int64_t g;
    size_t i;
} qref;

static int qref_cmp(const void *a, const void *b)
{
    const qref *x = a, *y = b;
    int c = strcmp(x->d, y->d);
    if (c) return c;
    return x->g > y->g ? -1 : x->g < y->g;
}

static int mark_stale(bson_t **ents, size_t n, char *stale)
{
    qref *refs = rb_calloc(n ? n : 1, sizeof *refs);
    if (!refs) return -1;
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        const char *d = mg_doc_str(ents[i], "d");
        if (d) refs[m++] = (qref){d, mg_doc_int(ents[i], "g"), i};
    }
    if (m) qsort(refs, m, sizeof *refs, qref_cmp);
    for (size_t k = 1; k < m; k++)
        if (strcmp(refs[k].d, refs[k - 1].d) == 0) stale[refs[k].i] = 1;
    free(refs);
    return 0;
}

/* What one read of the queue's head found. */
typedef struct qhead {
    bson_t **ents;              /* the entries read */
    size_t n;
    char *stale;                /* stale[i]: a newer entry of the same delivery was read */
    int full;                   /* the read hit its limit: more may wait behind */
    qcand *cands;               /* the due deliveries, each with its entry */
    size_t nc;
} qhead;

/* Read: the head of the queue, with no filter and no sort (a SQL LIMIT), in one round trip. */
static int queue_read(claim_job *q, mongoc_collection_t *qc, qhead *h)
{
    size_t want = q->limit * 2 + 16;
    if (want > QUEUE_READ_MAX) want = QUEUE_READ_MAX;
    bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER;
    BSON_APPEND_INT64(&opts, "limit", (int64_t)want);
    BSON_APPEND_INT64(&opts, "batchSize", (int64_t)want);   /* no getMore */
    int r = mg_find_docs(&q->j, qc, &f, &opts, NULL, &h->ents, &h->n);
    bson_destroy(&f);
    bson_destroy(&opts);
    if (r < 0) return -1;
    h->full = h->n >= want;     /* what cannot be used now moves back */
    h->cands = rb_calloc(h->n ? h->n : 1, sizeof *h->cands);
    h->stale = rb_calloc(h->n ? h->n : 1, 1);
    if (!h->cands || !h->stale || mark_stale(h->ents, h->n, h->stale) != 0) {
        mg_fail(&q->j, "out of memory");
        return -1;
    }
    return 0;
}

/* A candidate of topic ti counts against what its topic may start (one buried out of
 * attempts starts nothing). */
static bson_t *take_cap(claim_job *q, long ti, bson_t *d)
{
    if (q->cap[ti] != SIZE_MAX && !claim_exceeds(d)) q->cap[ti]--;
    return d;
}

/* Classify one entry: its delivery when due (a candidate), else NULL after noting in qb what
 * becomes of the entry; *failed when the store could not be asked. */
static bson_t *classify_entry(claim_job *q, mongoc_collection_t *cl, const bson_t *e, int stale,
                              int full, qbatch *qb, double now, int *failed)
{
    const char *hex = mg_doc_str(e, "d");
    double at = mg_doc_num(e, "at");
    bson_oid_t oid;
    if (!hex || !mg_parse_oid(hex, &oid) || stale) {    /* stale: a newer entry stands */
        mg_qb_del(qb, e);
        return NULL;
    }
    long ti = topic_wanted(q, mg_doc_str(e, "t"));
    if (ti < 0 || at > now) {
        if (full) mg_qb_move(qb, e, at, now);
        return NULL;
    }
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_OID(&sel, "_id", &oid);
    bson_t *d = mg_find_one(&q->j, cl, &sel, NULL, failed);
    bson_destroy(&sel);
    if (!d) {       /* not inserted yet, or its enqueue failed, or purged */
        if (!*failed && mg_doc_num(e, "c") < now - QUEUE_ORPHAN_S) mg_qb_del(qb, e);
        return NULL;
    }
    const char *st = mg_doc_str(d, "status");
    if (st && strcmp(st, "pending") == 0) {
        double run_at = mg_doc_num(d, "run_at");
        if (run_at <= now) return take_cap(q, ti, d);
        mg_qb_move(qb, e, run_at, now);     /* fixed until it is due: later reads skip it */
    } else if (st && strcmp(st, "processing") == 0) {
        if (mg_doc_num(d, "lease_expires_at") <= now) return take_cap(q, ti, d);
        if (full) mg_qb_move(qb, e, 0, now);
    } else {
        mg_qb_del(qb, e);       /* settled: a kick writes a new entry */
    }
    bson_destroy(d);
    return NULL;
}

static int queue_classify(claim_job *q, mongoc_collection_t *cl, qhead *h, qbatch *qb, double now)
{
    for (size_t i = 0; i < h->n && h->nc < q->limit; i++) {
        int failed = 0;
        bson_t *d = classify_entry(q, cl, h->ents[i], h->stale[i], h->full, qb, now, &failed);
        if (failed) return -1;
        if (d) h->cands[h->nc++] = (qcand){d, h->ents[i]};
    }
    return 0;
}

/* A claim (or burial) that won: the entry moves to the tail, where an expired lease will be
 * found again (a buried one's goes), the version is cached, the record returned. */
static void queue_claimed(claim_job *q, const qcand *cand, const char *token, int64_t old_v,
                          qbatch *qb, double now)
{
    if (claim_exceeds(cand->doc)) {
        mg_qb_del(qb, cand->entry);
        note_buried(q, cand->doc, q->limit);
        return;
    }
    mg_qb_move(qb, cand->entry, 0, now);
    char hex[25];
    if (mg_doc_oid(cand->doc, hex))
        mg_vc_put(q->j.s, hex, token, old_v + 1, mg_doc_int(cand->doc, "attempts") + 1,
                  mg_doc_int(cand->entry, "g") + 1, now + q->lease);
    rb_delivery *rec = claimed_record(cand->doc, token, now, q->lease);
    if (rec) q->recs[q->nrecs++] = rec;
}

/* Claim the candidates, oldest first (those of limited topics once their starts are
 * reserved); only the winner of each moves its entry. */
static void queue_claim(claim_job *q, mongoc_client_t *c, qhead *h, qbatch *qb, double now)
{
    size_t nc = h->nc;
    qsort(h->cands, nc, sizeof *h->cands, qcand_cmp);
    bson_t **docs = rb_calloc(nc, sizeof *docs);
    char (*tokens)[33] = new_tokens(q, nc);
    char *keep = rb_calloc(nc, 1);
    if (!docs || !tokens || !keep) {
        free(docs); free(tokens); free(keep);
        mg_fail(&q->j, "out of memory");
        return;
    }
    for (size_t i = 0; i < nc; i++) docs[i] = h->cands[i].doc;
    int reserved = limits_reserve(q, c, docs, nc, tokens, keep, now);
    if (reserved < 0) limits_undo(q, c, docs, nc, tokens, keep, now);
    qcand *use = reserved == 0 ? rb_calloc(nc ? nc : 1, sizeof *use) : NULL;
    if (reserved == 0 && !use) {
        mg_fail(&q->j, MG_OOM);
        limits_undo(q, c, docs, nc, tokens, keep, now);
    }
    if (use) {
        size_t m = 0;       /* (the dropped stay in h->cands: freed with them) */
        for (size_t i = 0; i < nc; i++) {
            if (!keep[i]) continue;
            use[m] = h->cands[i];
            docs[m] = docs[i];
            if (m != i) memcpy(tokens[m], tokens[i], sizeof tokens[i]);
            keep[m++] = 1;
        }
        cas_op *ops = claim_ops(q, docs, m, now, tokens);
        if (ops && mg_cas_run(&q->j, c, q->j.s->base.table, ops, m, now) == 0) {
            for (size_t i = 0; i < m; i++)
                if (ops[i].won) queue_claimed(q, &use[i], tokens[i], ops[i].old_v, qb, now);
            limits_after(q, c, docs, m, ops, tokens, now);
        } else {
            limits_undo(q, c, docs, m, tokens, keep, now);
        }
        if (ops) mg_cas_free(ops, m);
        free(use);
    }
    free(keep);
    free(tokens);
    free(docs);
}

static void claim_from_queue(claim_job *q, mongoc_client_t *c)
{
    mstore *s = q->j.s;
    double now = mg_now(s);
    mongoc_collection_t *qc = mg_coll(s, c, s->queue), *cl = mg_coll(s, c, s->base.table);
    qhead h;
    memset(&h, 0, sizeof h);
    if (queue_read(q, qc, &h) == 0) {
        qbatch qb;
        mg_qb_init(&qb, qc);
        if (queue_classify(q, cl, &h, &qb, now) == 0 && h.nc) queue_claim(q, c, &h, &qb, now);
        mg_qb_run(&q->j, &qb, 0);   /* an entry not moved stays where it was: nothing is lost */
    }
    for (size_t i = 0; i < h.nc; i++) bson_destroy(h.cands[i].doc);
    free(h.cands);
    free(h.stale);
    mg_docs_free(h.ents, h.n);
    mongoc_collection_destroy(qc);
    mongoc_collection_destroy(cl);
}

static void claim_work(mjob *j, mongoc_client_t *c)
{
    claim_job *q = (claim_job *)j;
    size_t npaused = 0;
    /* the markers' sweep (deps.c), every DEPS_SWEEP_S from each process */
    double mono = rb_monotonic();
    pthread_mutex_lock(&j->s->mu);
    int sweep = mono - j->s->deps_swept >= DEPS_SWEEP_S;
    if (sweep) j->s->deps_swept = mono;
    pthread_mutex_unlock(&j->s->mu);
    if (sweep) mg_deps_after_write(j, c, MG_DEPS_SWEEP, NULL, 0);
    if (mg_split_paused(j, c, q->topics, &q->ntopics, &npaused) != 0 || !q->ntopics) return;
    if (mg_limits_load(j, c, q->topics, q->ntopics, mg_now(j->s), &q->lims) < 0) return;
    if (!(q->cap = rb_calloc(q->ntopics, sizeof *q->cap))) {
        mg_fail(j, MG_OOM);
        return;
    }
    for (size_t i = 0; i < q->ntopics; i++) {
        mg_lim *l = mg_lims_find(&q->lims, q->topics[i]);
        q->cap[i] = l ? l->allow : SIZE_MAX;
    }
    if (j->s->ferret) claim_from_queue(q, c);
    else claim_scan(q, c);
    if (!j->err[0] && q->nburied) mg_deps_after_write(j, c, MG_DEPS_SETTLED, q->buried, q->nburied);
}

/* MongoDB wakes no dispatcher for what falls due later: a claim says nothing of when to claim
 * next (quiet_until 0) and never waits for a claim slot. */
static void claim_done(mjob *j, const char *err)
{
    claim_job *q = (claim_job *)j;
    if (err) {
        rb_delivery_list_free(q->recs, q->nrecs);
        j->cb.claim(j->ud, err, NULL);
    } else {
        rb_claim_result res = {.recs = q->recs, .n = q->nrecs};
        j->cb.claim(j->ud, NULL, &res);
    }
    for (size_t i = 0; i < q->nasked; i++) free(q->topics[i]);
    free(q->topics);
    for (size_t i = 0; i < q->nburied; i++) free(q->buried[i]);
    free(q->buried);
    mg_lims_free(&q->lims);
    free(q->cap);
    free(q);
}

void mg_claim(rb_store *st, const rb_claim_req *req, rb_claim_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    if (req->limit == 0 || req->ntopics == 0) {
        rb_claim_result none = {0};
        cb(ud, NULL, &none);
        return;
    }
    claim_job *q = mg_job_new(s, sizeof *q, claim_work, claim_done, (rb_store_cb){.claim = cb}, ud);
    if (!q || !(q->topics = rb_calloc(req->ntopics, sizeof *q->topics))) {
        free(q);
        cb(ud, MG_OOM, NULL);
        return;
    }
    /* each topic once: a limited one asked twice would be capped twice */
    for (size_t i = 0; i < req->ntopics; i++) {
        int again = 0;
        for (size_t k = 0; k < q->ntopics && !again; k++) again = !strcmp(q->topics[k], req->topics[i]);
        if (again) continue;
        if (!(q->topics[q->ntopics] = rb_strdup(req->topics[i]))) {
            q->nasked = q->ntopics;
            claim_done(&q->j, MG_OOM);
            return;
        }
        q->ntopics++;
    }
    q->nasked = q->ntopics;
    q->limit = req->limit;
    q->lease = req->lease_duration;
    mg_submit(s, &q->j);
}
