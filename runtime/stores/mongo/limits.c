/* limits.c -- a topic's limits on the MongoDB store (store.h, rb_limit): at most `concurrency`
 * running under live leases, at most `rate` starts in any `per` seconds, across every process.
 * A SQL store counts the running rows and the recorded starts in the claim's transaction; here
 * a claim cannot count and claim in one write. So each limited topic has a document in
 * <table>_limits that holds what counting needs:
 *
 *   {_id: topic, rate, per, concurrency, v,
 *    slots: [{d: delivery id, k: lease token, exp: lease expiry when claimed}],
 *    starts: [epoch s of each start in the window]}
 *
 * A claim reserves its starts in that document through the versioned write every change takes
 * (tickets.c) before it claims the deliveries: two claims that read the same document cannot
 * both write it, so none lets more through than the limit allows. A slot counts until its
 * expiry; after it, only while its delivery still runs under that token and a live lease (a
 * renewed run keeps its slot). A run's settle gives its slot back at once (its process keeps
 * the token and topic of each run it claimed of a limited topic: mg_limits_ended); a slot left
 * by a process that died ends with its lease. A claim that lost the delivery after reserving
 * gives the slot back too. Rates and concurrencies above MG_LIMIT_MAX are refused here: the
 * window's starts live in the one document. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/check.h"

#define GIVE_BACK_ROUNDS 10

/* ---- the document ---- */
static void slots_free(mg_lim *l)
{
    free(l->slots);
    free(l->starts);
    l->slots = NULL;
    l->starts = NULL;
    l->nslots = l->nstarts = 0;
}

void mg_lims_free(mg_lims *ls)
{
    for (size_t i = 0; i < ls->n; i++) {
        slots_free(&ls->v[i]);
        free(ls->v[i].topic);
        if (ls->v[i].doc) bson_destroy(ls->v[i].doc);
    }
    free(ls->v);
    memset(ls, 0, sizeof *ls);
}

/* The slots and starts of doc into l, as they are (not yet judged). */
static int read_slots(const bson_t *doc, mg_lim *l)
{
    bson_iter_t it, sub, f;
    size_t cap = 0;
    if (bson_iter_init_find(&it, doc, "slots") && BSON_ITER_HOLDS_ARRAY(&it) &&
        bson_iter_recurse(&it, &sub))
        while (bson_iter_next(&sub)) {
            if (!BSON_ITER_HOLDS_DOCUMENT(&sub) || !bson_iter_recurse(&sub, &f)) continue;
            mg_slot s = {0};
            while (bson_iter_next(&f)) {
                const char *k = bson_iter_key(&f);
                if (!strcmp(k, "d") && BSON_ITER_HOLDS_UTF8(&f))
                    snprintf(s.d, sizeof s.d, "%s", bson_iter_utf8(&f, NULL));
                else if (!strcmp(k, "k") && BSON_ITER_HOLDS_UTF8(&f))
                    snprintf(s.k, sizeof s.k, "%s", bson_iter_utf8(&f, NULL));
                else if (!strcmp(k, "exp") && BSON_ITER_HOLDS_NUMBER(&f))
                    s.exp = bson_iter_as_double(&f);
            }
            if (l->nslots == cap) {
                cap = cap ? 2 * cap : 8;
                mg_slot *g = rb_realloc(l->slots, cap * sizeof *g);
                if (!g) return -1;
                l->slots = g;
            }
            l->slots[l->nslots++] = s;
        }
    cap = 0;
    if (bson_iter_init_find(&it, doc, "starts") && BSON_ITER_HOLDS_ARRAY(&it) &&
        bson_iter_recurse(&it, &sub))
        while (bson_iter_next(&sub)) {
            if (!BSON_ITER_HOLDS_NUMBER(&sub)) continue;
            if (l->nstarts == cap) {
                cap = cap ? 2 * cap : 16;
                double *g = rb_realloc(l->starts, cap * sizeof *g);
                if (!g) return -1;
                l->starts = g;
            }
            l->starts[l->nstarts++] = bson_iter_as_double(&sub);
        }
    return 0;
}

/* Keeps the slots that still count and the starts inside the window, and what may start. A
 * slot past its expiry counts while its delivery runs under its token and a live lease. */
static int judge(mjob *j, mongoc_collection_t *cl, mg_lim *l, double now)
{
    char **ids = rb_calloc(l->nslots + 1, sizeof *ids);
    bson_t **docs = rb_calloc(l->nslots + 1, sizeof *docs);
    size_t *at = rb_calloc(l->nslots + 1, sizeof *at), m = 0;
    int r = ids && docs && at ? 0 : -1;
    if (r < 0) mg_fail(j, MG_OOM);
    for (size_t i = 0; r == 0 && i < l->nslots; i++)
        if (l->slots[i].exp <= now) {
            ids[m] = l->slots[i].d;
            at[m++] = i;
        }
    if (r == 0 && m) r = mg_read_by_ids(j, cl, ids, m, docs);
    char *dead = r == 0 ? rb_calloc(l->nslots + 1, 1) : NULL;
    if (r == 0 && !dead) { mg_fail(j, MG_OOM); r = -1; }
    for (size_t x = 0; r == 0 && x < m; x++) {
        const bson_t *d = docs[x];
        const char *st = d ? mg_doc_str(d, "status") : NULL, *tok = d ? mg_doc_str(d, "lease_token") : NULL;
        double lease = d ? mg_doc_num(d, "lease_expires_at") : 0;
        dead[at[x]] = !(st && !strcmp(st, "processing") && tok && !strcmp(tok, l->slots[at[x]].k) &&
                        lease > now);
        /* a renewed run: its slot counts without a read until the lease it renewed to */
        if (!dead[at[x]]) l->slots[at[x]].exp = lease;
    }
    if (r == 0) {
        size_t k = 0;
        for (size_t i = 0; i < l->nslots; i++) if (!dead[i]) l->slots[k++] = l->slots[i];
        l->nslots = k;
        k = 0;
        for (size_t i = 0; i < l->nstarts; i++) if (l->starts[i] > now - l->per) l->starts[k++] = l->starts[i];
        if (l->rate <= 0) k = 0;        /* (starts are kept only under a rate) */
        l->nstarts = k;
        int64_t left = INT64_MAX;
        if (l->conc > 0) left = l->conc - (int64_t)l->nslots;
        if (l->rate > 0 && l->rate - (int64_t)l->nstarts < left) left = l->rate - (int64_t)l->nstarts;
        l->allow = left > 0 ? (size_t)left : 0;
    }
    for (size_t x = 0; docs && x < m; x++) if (docs[x]) bson_destroy(docs[x]);
    free(dead); free(ids); free(docs); free(at);
    return r;
}

static int load_one(mjob *j, mongoc_collection_t *cl, bson_t *doc, mg_lim *l, double now)
{
    memset(l, 0, sizeof *l);
    const char *t = mg_doc_str(doc, "_id");
    l->doc = doc;
    if (!t || !(l->topic = rb_strdup(t))) return -1;
    l->rate = mg_doc_int(doc, "rate");
    l->per = mg_doc_num(doc, "per");
    l->conc = mg_doc_int(doc, "concurrency");
    if (read_slots(doc, l) < 0) return -1;
    return judge(j, cl, l, now);
}

int mg_limits_load(mjob *j, mongoc_client_t *c, char *const *topics, size_t n, double now,
                   mg_lims *out)
{
    memset(out, 0, sizeof *out);
    if (!n) return 0;
    mongoc_collection_t *lc = mg_coll(j->s, c, j->s->limits);
    bson_t f = BSON_INITIALIZER;
    mg_append_in(&f, "_id", topics, n);
    bson_t **docs = NULL;
    size_t nd = 0;
    int r = mg_find_docs(j, lc, &f, NULL, NULL, &docs, &nd);
    bson_destroy(&f);
    mongoc_collection_destroy(lc);
    if (r < 0) return -1;
    if (!nd) { free(docs); return 0; }
    out->v = rb_calloc(nd, sizeof *out->v);
    if (!out->v) {
        mg_docs_free(docs, nd);
        mg_fail(j, MG_OOM);
        return -1;
    }
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    for (size_t i = 0; i < nd; i++) {
        if (r < 0) { bson_destroy(docs[i]); continue; }
        r = load_one(j, cl, docs[i], &out->v[out->n++], now);     /* (owns docs[i]) */
        if (r < 0 && !j->err[0]) mg_fail(j, MG_OOM);
    }
    mongoc_collection_destroy(cl);
    free(docs);
    if (r < 0) mg_lims_free(out);
    return r < 0 ? -1 : 0;
}

int mg_limits_reload(mjob *j, mongoc_client_t *c, mg_lim *l, double now)
{
    mongoc_collection_t *lc = mg_coll(j->s, c, j->s->limits);
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_UTF8(&sel, "_id", l->topic);
    int failed = 0;
    bson_t *doc = mg_find_one(j, lc, &sel, NULL, &failed);
    bson_destroy(&sel);
    mongoc_collection_destroy(lc);
    if (failed) return -1;
    char *topic = l->topic;
    slots_free(l);
    if (l->doc) bson_destroy(l->doc);
    memset(l, 0, sizeof *l);
    l->topic = topic;
    if (!doc) return 0;         /* cleared meanwhile: nothing may start of it now (allow 0) */
    free(topic);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    int r = load_one(j, cl, doc, l, now);
    mongoc_collection_destroy(cl);
    if (r < 0 && !j->err[0]) mg_fail(j, MG_OOM);
    return r;
}

mg_lim *mg_lims_find(mg_lims *ls, const char *topic)
{
    for (size_t i = 0; i < ls->n; i++)
        if (!strcmp(ls->v[i].topic, topic)) return &ls->v[i];
    return NULL;
}

/* The update that writes l's slots and starts (judged, plus any added) and the next version. */
static bson_t *upd_slots(const mg_lim *l)
{
    bson_t *u = bson_new(), set, arr, one;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    BSON_APPEND_INT64(&set, "v", mg_doc_int(l->doc, "v") + 1);
    BSON_APPEND_ARRAY_BEGIN(&set, "slots", &arr);
    for (size_t i = 0; i < l->nslots; i++) {
        char key[24];
        snprintf(key, sizeof key, "%zu", i);
        BSON_APPEND_DOCUMENT_BEGIN(&arr, key, &one);
        BSON_APPEND_UTF8(&one, "d", l->slots[i].d);
        BSON_APPEND_UTF8(&one, "k", l->slots[i].k);
        BSON_APPEND_DOUBLE(&one, "exp", l->slots[i].exp);
        bson_append_document_end(&arr, &one);
    }
    bson_append_array_end(&set, &arr);
    BSON_APPEND_ARRAY_BEGIN(&set, "starts", &arr);
    for (size_t i = 0; i < l->nstarts; i++) {
        char key[24];
        snprintf(key, sizeof key, "%zu", i);
        BSON_APPEND_DOUBLE(&arr, key, l->starts[i]);
    }
    bson_append_array_end(&set, &arr);
    bson_append_document_end(u, &set);
    return u;
}

int mg_limits_reserve(mjob *j, mongoc_client_t *c, mg_lim *l, const mg_slot *add, size_t n,
                      double now)
{
    RB_ASSERT(n <= l->allow);
    if (!n) return 1;
    mg_slot *g = rb_realloc(l->slots, (l->nslots + n) * sizeof *g);
    double *st = rb_realloc(l->starts, (l->nstarts + n + 1) * sizeof *st);
    if (g) l->slots = g;
    if (st) l->starts = st;
    if (!g || !st) { mg_fail(j, MG_OOM); return -1; }
    for (size_t i = 0; i < n; i++) {
        l->slots[l->nslots++] = add[i];
        if (l->rate > 0) l->starts[l->nstarts++] = now;
    }
    cas_op op;
    memset(&op, 0, sizeof op);
    mg_cas_init(j->s, &op, l->doc, "l", upd_slots(l));
    int r = mg_cas_run(j, c, j->s->limits, &op, 1, now);
    int won = op.won;
    mg_cas_clear(&op);
    return r < 0 ? -1 : won;
}

/* ---- after the claim: slots given back, starts moved to when they happened ---- */
int mg_limits_finish(mjob *j, mongoc_client_t *c, const char *topic, char *const *tokens,
                     size_t n, size_t nwon, double at, double done)
{
    if (!n && !nwon) return 0;
    mg_busy key = {.key = topic};       /* one write of ours at a time (claim.c's reserve) */
    mg_busy_take(j->s, &key, 1);
    mongoc_collection_t *lc = mg_coll(j->s, c, j->s->limits);
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_UTF8(&sel, "_id", topic);
    int r = 0;
    for (int round = 0; round < GIVE_BACK_ROUNDS; round++) {
        int failed = 0;
        bson_t *doc = mg_find_one(j, lc, &sel, NULL, &failed);
        if (failed) { r = -1; break; }
        if (!doc) break;        /* the limit was cleared */
        mg_lim l;
        memset(&l, 0, sizeof l);
        l.doc = doc;
        l.rate = mg_doc_int(doc, "rate");
        if (read_slots(doc, &l) < 0) {
            slots_free(&l);
            bson_destroy(doc);
            mg_fail(j, MG_OOM);
            r = -1;
            break;
        }
        size_t k = 0, changed = 0;
        for (size_t i = 0; i < l.nslots; i++) {
            int ours = 0;
            for (size_t x = 0; x < n && !ours; x++) ours = !strcmp(l.slots[i].k, tokens[x]);
            if (!ours) l.slots[k++] = l.slots[i];
        }
        changed += l.nslots - k;
        l.nslots = k;
        /* the starts written at `at`: those that did not happen go (as many as were given
         * back), those that did are moved to when the claim's write landed, so a window
         * counts from the start a handler sees */
        size_t drop = n, move = nwon;
        k = 0;
        for (size_t i = 0; i < l.nstarts; i++) {
            if (l.starts[i] == at && drop) { drop--; changed++; continue; }
            if (l.starts[i] == at && move) { move--; changed++; l.starts[i] = done; }
            l.starts[k++] = l.starts[i];
        }
        l.nstarts = k;
        int won = 1;
        if (changed) {
            cas_op op;
            memset(&op, 0, sizeof op);
            mg_cas_init(j->s, &op, doc, "l", upd_slots(&l));
            r = mg_cas_run(j, c, j->s->limits, &op, 1, mg_now(j->s));
            won = op.won;
            mg_cas_clear(&op);
        }
        slots_free(&l);
        bson_destroy(doc);
        if (r < 0 || won) break;
        mg_lost_wait(round);
    }
    bson_destroy(&sel);
    mongoc_collection_destroy(lc);
    mg_busy_give(j->s, &key, 1);
    return r;       /* (lost every round: the slots end with their leases) */
}

int mg_limits_give_back(mjob *j, mongoc_client_t *c, const char *topic, char *const *tokens,
                        size_t n)
{
    return mg_limits_finish(j, c, topic, tokens, n, 0, -1, -1);
}

/* The runs this process claimed of limited topics, by lease token: their settles give their
 * slots back. A short list: at most the process's runs of limited topics. */
int mg_limits_started(mstore *s, const char *topic, const char *token)
{
    mg_run_lim *e = rb_malloc(sizeof *e);
    if (!e) return -1;
    snprintf(e->token, sizeof e->token, "%s", token);
    if (!(e->topic = rb_strdup(topic))) { free(e); return -1; }
    pthread_mutex_lock(&s->mu);
    e->next = s->lim_runs;
    s->lim_runs = e;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

char *mg_limits_ended(mstore *s, const char *token)
{
    char *topic = NULL;
    pthread_mutex_lock(&s->mu);
    for (mg_run_lim **p = &s->lim_runs; *p; p = &(*p)->next)
        if (!strcmp((*p)->token, token)) {
            mg_run_lim *e = *p;
            *p = e->next;
            topic = e->topic;
            free(e);
            break;
        }
    pthread_mutex_unlock(&s->mu);
    return topic;
}

void mg_limits_forget_all(mstore *s)
{
    while (s->lim_runs) {
        mg_run_lim *e = s->lim_runs;
        s->lim_runs = e->next;
        free(e->topic);
        free(e);
    }
}

/* ---- the operations: limit (set or clear) and limits (list) ---- */
typedef struct limit_job {
    mjob j;
    char *topic;
    rb_limit lim;
    int clear;
    rb_rowset *rs;
} limit_job;

/* A topic's new document: its limits, and a slot for each of its deliveries running under a
 * live lease now (they count, as the SQL stores count them). NULL: j failed. */
static bson_t *new_limit_doc(mjob *j, mongoc_client_t *c, const limit_job *q, double now)
{
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t *f = BCON_NEW("topic", BCON_UTF8(q->topic), "status", "processing", "lease_expires_at",
                         "{", "$gt", BCON_DOUBLE(now), "}");
    bson_t *opts = BCON_NEW("projection", "{", "lease_token", BCON_INT32(1), "lease_expires_at",
                            BCON_INT32(1), "}", "limit", BCON_INT64(MG_LIMIT_MAX));
    bson_t **docs = NULL;
    size_t n = 0;
    int r = mg_find_docs(j, cl, f, opts, NULL, &docs, &n);
    bson_destroy(f);
    bson_destroy(opts);
    mongoc_collection_destroy(cl);
    if (r < 0) return NULL;
    bson_t *d = BCON_NEW("_id", BCON_UTF8(q->topic), "rate", BCON_INT64(q->lim.rate),
                         "per", BCON_DOUBLE(q->lim.per), "concurrency",
                         BCON_INT64(q->lim.concurrency), "v", BCON_INT64((int64_t)(now * 1e6)),
                         "starts", "[", "]");
    bson_t arr, one;
    BSON_APPEND_ARRAY_BEGIN(d, "slots", &arr);
    for (size_t i = 0, k = 0; i < n; i++) {
        char hex[25], key[24];
        const char *tok = mg_doc_str(docs[i], "lease_token");
        if (!tok || !mg_doc_oid(docs[i], hex)) continue;
        snprintf(key, sizeof key, "%zu", k++);
        BSON_APPEND_DOCUMENT_BEGIN(&arr, key, &one);
        BSON_APPEND_UTF8(&one, "d", hex);
        BSON_APPEND_UTF8(&one, "k", tok);
        BSON_APPEND_DOUBLE(&one, "exp", mg_doc_num(docs[i], "lease_expires_at"));
        bson_append_document_end(&arr, &one);
    }
    bson_append_array_end(d, &arr);
    mg_docs_free(docs, n);
    return d;
}

/* Set: the limits change, the slots and starts stay (a lower concurrency lets no more start
 * until enough end). Clear: the document goes. Both through the versioned write; a document
 * made anew starts its versions at the time in microseconds, so no old ticket names them. */
static void limit_work(mjob *j, mongoc_client_t *c)
{
    limit_job *q = (limit_job *)j;
    mongoc_collection_t *lc = mg_coll(j->s, c, j->s->limits);
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_UTF8(&sel, "_id", q->topic);
    int wrote = 0;
    for (int round = 0; round < GIVE_BACK_ROUNDS; round++) {
        int failed = 0;
        double now = mg_now(j->s);
        bson_t *doc = mg_find_one(j, lc, &sel, NULL, &failed);
        if (failed) break;
        if (!doc && q->clear) { wrote = 1; break; }
        if (!doc) {
            bson_t *d = new_limit_doc(j, c, q, now);
            if (!d) break;
            bson_error_t e;
            int ok = mongoc_collection_insert_one(lc, d, NULL, NULL, &e);
            bson_destroy(d);
            if (ok) { wrote = 1; break; }
            if (e.code != 11000) { mg_fail_bson(j, "limit", &e); break; }
            mg_lost_wait(round);
            continue;       /* another made it meanwhile: set it */
        }
        cas_op op;
        memset(&op, 0, sizeof op);
        bson_t *u = q->clear ? NULL
                             : BCON_NEW("$set", "{", "rate", BCON_INT64(q->lim.rate), "per",
                                        BCON_DOUBLE(q->lim.per), "concurrency",
                                        BCON_INT64(q->lim.concurrency), "v",
                                        BCON_INT64(mg_doc_int(doc, "v") + 1), "}");
        mg_cas_init(j->s, &op, doc, "l", u);
        int r = mg_cas_run(j, c, j->s->limits, &op, 1, now);
        int won = op.won;
        mg_cas_clear(&op);
        bson_destroy(doc);
        if (r < 0) break;
        if (won) { wrote = 1; break; }
        mg_lost_wait(round);
    }
    if (!wrote && !j->err[0] && !q->clear)
        mg_fail(j, "limit: lost to the claims' writes %d times in a row", GIVE_BACK_ROUNDS);
    bson_destroy(&sel);
    mongoc_collection_destroy(lc);
}

static void limit_done(mjob *j, const char *err)
{
    limit_job *q = (limit_job *)j;
    /* a raised or cleared limit may let a waiting delivery start: a dispatcher here claims */
    if (!err && !j->s->closing) rb_store_notify_local(&j->s->base);
    j->cb.count(j->ud, err, err ? 0 : 1);
    free(q->topic);
    free(q);
}

void mg_limit(rb_store *st, const char *topic, const rb_limit *lim, rb_count_cb cb, void *ud)
{
    if (lim && !rb_limit_valid(lim)) {
        cb(ud, "mongodb: limit: the limits are not valid (rb_limit_valid)", 0);
        return;
    }
    if (lim && (lim->rate > MG_LIMIT_MAX || lim->concurrency > MG_LIMIT_MAX)) {
        char err[160];
        snprintf(err, sizeof err, "mongodb: limit: rate and concurrency above %d are not supported on this store",
                 MG_LIMIT_MAX);
        cb(ud, err, 0);
        return;
    }
    limit_job *q = mg_job_new((mstore *)st, sizeof *q, limit_work, limit_done,
                              (rb_store_cb){.count = cb}, ud);
    if (!q || !(q->topic = rb_strdup(topic ? topic : ""))) {
        free(q);
        cb(ud, MG_OOM, 0);
        return;
    }
    q->clear = lim == NULL;
    if (lim) q->lim = *lim;
    mg_submit((mstore *)st, &q->j);
}

static rb_rowset *limits_rowset(bson_t *const *docs, size_t n)
{
    static const char *const cols[] = {"topic", "rate", "per", "concurrency"};
    rb_rowset *rs = rb_calloc(1, sizeof *rs);
    if (!rs) return NULL;
    rs->names = rb_calloc(5, sizeof *rs->names);
    rs->vals = rb_calloc(4 * n + 1, sizeof *rs->vals);
    if (!rs->names || !rs->vals) { rb_rowset_free(rs); return NULL; }
    rs->ncols = 4;
    for (int i = 0; i < 4; i++)
        if (!(rs->names[i] = rb_strdup(cols[i]))) { rb_rowset_free(rs); return NULL; }
    for (size_t i = 0; i < n; i++) {
        const char *t = mg_doc_str(docs[i], "_id");
        if (!t) continue;
        rb_value *v = &rs->vals[rs->nrows * 4];
        if (!(v[0].s = rb_strdup(t))) { rb_rowset_free(rs); return NULL; }
        v[0].type = RB_VTEXT;
        v[0].len = strlen(t);
        int64_t rate = mg_doc_int(docs[i], "rate"), conc = mg_doc_int(docs[i], "concurrency");
        if (rate > 0) {
            v[1] = (rb_value){.type = RB_VINT, .i = rate};
            v[2] = (rb_value){.type = RB_VFLOAT, .f = mg_doc_num(docs[i], "per")};
        }
        if (conc > 0) v[3] = (rb_value){.type = RB_VINT, .i = conc};
        rs->nrows++;
    }
    return rs;
}

static void limits_work(mjob *j, mongoc_client_t *c)
{
    limit_job *q = (limit_job *)j;
    mongoc_collection_t *lc = mg_coll(j->s, c, j->s->limits);
    bson_t f = BSON_INITIALIZER;
    bson_t *opts = BCON_NEW("sort", "{", "_id", BCON_INT32(1), "}",
                            "limit", BCON_INT64(RB_TOPIC_STATS_MAX),
                            "projection", "{", "slots", BCON_INT32(0), "starts", BCON_INT32(0), "}");
    bson_t **docs = NULL;
    size_t n = 0;
    if (mg_find_docs(j, lc, &f, opts, NULL, &docs, &n) == 0 && !(q->rs = limits_rowset(docs, n)))
        mg_fail(j, MG_OOM);
    mg_docs_free(docs, n);
    bson_destroy(opts);
    mongoc_collection_destroy(lc);
}

static void limits_done(mjob *j, const char *err)
{
    limit_job *q = (limit_job *)j;
    rb_rowset *rs = err ? NULL : q->rs;
    if (err) rb_rowset_free(q->rs);
    rb_rows_cb cb = j->cb.rows;
    void *ud = j->ud;
    free(q);
    cb(ud, err, rs);
}

void mg_limits(rb_store *st, rb_rows_cb cb, void *ud)
{
    limit_job *q = mg_job_new((mstore *)st, sizeof *q, limits_work, limits_done,
                              (rb_store_cb){.rows = cb}, ud);
    if (!q) { cb(ud, MG_OOM, NULL); return; }
    mg_submit((mstore *)st, &q->j);
}
