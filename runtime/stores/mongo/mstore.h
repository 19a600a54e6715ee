/* mstore.h -- inside the MongoDB store (runtime/stores/mongo/): the store struct and the calls its
 * files share. Not installed; nothing outside runtime/stores/mongo/ includes it.
 *
 * The store keeps deliveries in one collection, named leases in <table>_leases, write
 * tickets in <table>_tickets, what operators set per topic (a pause) in <table>_topics and,
 * on FerretDB, the ready queue in <table>_queue. libmongoc
 * blocks, so every operation is a job run by a small thread pool (runtime/util/jobpool.h) with a
 * pooled client per worker; results return to the loop thread.
 *
 * The files, one concept each:
 *   mstore.h    this: the struct, the job, the calls the files share (all prefixed mg_)
 *   jobs.c      a store job on the pool; the server's clock; the ticket prune
 *   doc.c       errors, reading documents, finds, bulk writes
 *   payload.c   payloads: JSON text to a BSON value and back
 *   update.c    the filters and update documents the operations share
 *   tickets.c   compare-and-set through write tickets (why: see there)
 *   vcache.c    versions our own claims wrote (FerretDB), so a settle need not read first
 *   readyq.c    the ready queue (FerretDB): the entries claims read instead of a search
 *   topics.c    what operators set per topic: pause and resume, and what claims skip
 *   schedules.c durable schedules: made, listed, and their ticks fired
 *   deps.c      dependencies (after): held deliveries, released or cancelled as theirs settle
 *   groups.c    ordered groups: each delivery held behind the one before it in its group
 *   limits.c    limits per topic: slots and starts reserved before a claim
 *   enqueue.c, claim.c, settle.c, lease.c (named leases), tx.c (transactions, replica sets),
 *   admin.c (get, list, stats, kick, purge): the operations
 *   schema.c    migrate's collections and indexes, and the check without migrate
 *   open.c      the URL, the probe of the server, open, close, the vtable
 *
 * Time: expiry and due-ness use the server's clock (hello's localTime, kept as an offset from
 * our monotonic clock, so a step of our wall clock changes nothing, and refreshed every
 * CLOCK_REFRESH_S); FerretDB has no $$NOW nor pipeline updates.
 * Payloads are stored as BSON values, exactly (payload.c), or as their JSON text where MongoDB
 * cannot hold them as they are. Dedupe keys live in a `dedupe` field (topic and key) that only pending and processing
 * deliveries carry, under a unique sparse index. */
#ifndef RB_MSTORE_H
#define RB_MSTORE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <mongoc/mongoc.h>
#include "stores/store.h"
#include "util/hmap.h"
#include "util/jobpool.h"

/* Internal to the library: not exported from librelaybus.so. */
#pragma GCC visibility push(hidden)

#define NWORKERS 3
#define CLOCK_REFRESH_S 30.0
#define STALE_TICKET_S 60.0
#define TICKET_TTL_S 3600.0
#define PRUNE_EVERY_S 300.0     /* a ticket outlives TICKET_TTL_S by this much at most */
#define BATCH_ROUND 500         /* kick/purge rows per round */
#define ERRLEN 320
#define QUEUE_ORPHAN_S 60.0
#define QUEUE_READ_MAX 600

typedef struct mstore mstore;
typedef struct mjob mjob;

/* A key a job holds while it writes a document (busy.c); the job owns the node. */
typedef struct mg_busy {
    const char *key;            /* NULL: nothing to hold */
    rb_hnode node;              /* in mstore.busy while held */
} mg_busy;

struct rb_tx {
    mstore *s;                  /* NULL once the store closed under it */
    mongoc_client_t *client;    /* popped from the pool for the transaction's lifetime */
    mongoc_client_session_t *cs;
    int enqueued;               /* wake local dispatchers once this commits */
    char doomed[ERRLEN];        /* the first operation of it that failed: the commit fails */
    rb_tx *prev, *next;
};

struct mjob {
    rb_job pj;                                  /* the pool's part; first */
    mstore *s;
    rb_tx *tx;                                  /* tx operations run on the tx's client */
    void (*work)(mjob *j, mongoc_client_t *c);  /* worker thread */
    void (*done)(mjob *j, const char *err);     /* loop thread; frees the job */
    rb_store_cb cb;                             /* the caller's callback, and its ud */
    void *ud;
    char err[ERRLEN];
    int released;       /* it made held deliveries due (deps.c) or gave a limit's slot back
                         * (limits.c): a dispatcher here claims at once */
};

struct mstore {
    rb_store base;
    mongoc_uri_t *uri;
    mongoc_client_pool_t *pool;
    char *db, *leases, *tickets, *queue, *topics, *schedules;
    char *deps;                 /* markers of dependencies (deps.c) */
    char *groups;               /* ordered groups' tails (groups.c) */
    char *limits;               /* limited topics' slots and starts (limits.c) */
    struct mg_run_lim *lim_runs;    /* our runs of limited topics (limits.c), under mu */
    double deps_swept;          /* monotonic s of the last sweep of them (mu) */
    double deps_none_at;        /* monotonic s when a look found no marker at all (mu) */
    char deps_swept_to[80];     /* the last marker _id the sweep read: it goes on after it (mu) */
    int ferret;                 /* the FerretDB dialect: ready queue, version cache, no v filter */
    int ferretdb;               /* the server is FerretDB, whatever the dialect */
    int replset;                /* transactions possible */
    rb_jobpool *jobs;
    pthread_mutex_t mu;
    double clock_offset;            /* server time - our monotonic time (mu) */
    double clock_checked;           /* monotonic s of the last refresh (mu) */
    double pruned_at;               /* monotonic s of the last ticket prune (mu) */
    int closing;                    /* loop thread */
    rb_tx *txs;                     /* open transactions (loop thread) */
    rb_hmap vc;                     /* FerretDB: versions our own claims wrote (mu; vcache.c) */
    pthread_mutex_t busy_mu;        /* busy.c: the documents jobs are writing now */
    pthread_cond_t busy_cv;
    rb_hmap busy;                   /* of mg_busy.node, made at open so adding never fails */
};

extern const char *const MG_STORE_CLOSED;
#define MG_OOM "mongodb: out of memory"

/* ---- jobs.c ---- */
/* A zeroed job of `size` bytes (a struct whose first member is the mjob) for the caller's
 * callback cb and ud; NULL when out of memory (the caller then answers cb itself). */
void *mg_job_new(mstore *s, size_t size, void (*work)(mjob *, mongoc_client_t *),
                 void (*done)(mjob *, const char *), rb_store_cb cb, void *ud);
void mg_submit(mstore *s, mjob *j);
/* Answers j's records callback: with err the records are freed, else they pass to the caller. */
void mg_answer_records(mjob *j, const char *err, rb_delivery **recs, size_t n);
int mg_jobs_start(mstore *s, char *err, size_t errlen);
double mg_now(mstore *s);               /* the server's clock, epoch s */
int mg_read_clock(mstore *s, mongoc_client_t *c, bson_t *reply, bson_error_t *e);

/* ---- doc.c ---- */
char *mg_dupstr(const char *s);         /* NULL stays NULL */
void mg_one_line(char *s, size_t cap);
void mg_fail(mjob *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void mg_fail_bson(mjob *j, const char *what, const bson_error_t *e);
mongoc_collection_t *mg_coll(mstore *s, mongoc_client_t *c, const char *name);
const char *mg_doc_str(const bson_t *d, const char *k);
double mg_doc_num(const bson_t *d, const char *k);
int64_t mg_doc_int(const bson_t *d, const char *k);
int mg_doc_oid(const bson_t *d, char hex[25]);
rb_delivery *mg_record_from(const bson_t *d, const char *token);
/* The payload into d as `payload` and `payload_format` (for a FerretDB server when ferretdb);
 * 0 with why when BSON cannot hold it. */
int mg_payload_append(bson_t *d, const char *json, int ferretdb, char *why, size_t whylen);
/* A stored payload as JSON text (free() it): "null" when d has none; NULL out of memory. */
char *mg_payload_json(const bson_t *d);
int mg_json_append(bson_t *d, const char *key, const char *format_key, const char *json,
                   int ferretdb);
char *mg_json_field(const bson_t *d, const char *key, const char *format_key);
int mg_parse_oid(const char *id, bson_oid_t *oid);
bson_t *mg_oid_sel(const char *id, int *ok);
char *mg_dedupe_value(const char *topic, const char *key);
int mg_bulk_write_errors(const bson_t *reply, int *codes, size_t n);
/* Appends {field: {$in: [vals...]}} (strings) to f. */
void mg_append_in(bson_t *f, const char *field, char *const *vals, size_t n);
int mg_bulk_run(mjob *j, mongoc_bulk_operation_t *b, int *codes, size_t n, const char *what);
mongoc_bulk_operation_t *mg_unordered_bulk(mongoc_collection_t *cl);
int mg_find_docs(mjob *j, mongoc_collection_t *cl, const bson_t *filter, const bson_t *opts,
                 mongoc_client_session_t *cs, bson_t ***out, size_t *nout);
void mg_docs_free(bson_t **v, size_t n);
bson_t *mg_find_one(mjob *j, mongoc_collection_t *cl, const bson_t *sel,
                    mongoc_client_session_t *cs, int *failed);
/* A worker's wait before it reads a document again after its write lost to another (round
 * 0, 1, ...: 1 ms doubling to 64): the winner's ticket may be taken while its write is still
 * on its way, and reading again at once would find the old version and lose again. */
void mg_lost_wait(int round);
/* The delivery of id (the store's hex form), or NULL: none, or *failed. */
bson_t *mg_find_by_id(mjob *j, mongoc_collection_t *cl, const char *id, int *failed);
void mg_append_range(bson_t *b, const char *field, const char *op, double v);
void mg_append_due(bson_t *f, double now);
bson_t *mg_upd_leave(const bson_t *cur, const char *status, double now);
bson_t *mg_upd_with(bson_t *u, const char *field, const char *str, double num, int isnum);
bson_t *mg_upd_unset_dedupe(bson_t *u);
bson_t *mg_upd_bury(const bson_t *cur, const char *error, double now);
bson_t *mg_upd_end_live(const bson_t *cur, const char *status, const char *error, double now);
double mg_extended(const bson_t *cur, const char *field, double now, double s);
int mg_holds_lease(const bson_t *d, const char *token);
bson_t *mg_upd_settle(const bson_t *cur, const rb_settle_op *op, double now);
int mg_settle_needs_doc(const rb_settle_op *op);   /* 1: mg_upd_settle needs the whole document */

/* ---- tickets.c ---- */
typedef struct cas_op {
    bson_t sel;             /* {_id: X} */
    bson_t filter;          /* sel, plus v on MongoDB (atomic there) */
    char ticket[200];       /* "<doc>:<v+1>" */
    char owner[140];        /* "<doc>", the ticket's `d` */
    int64_t old_v;
    bson_t *update;         /* owned; NULL deletes the document */
    int won;                /* out: the change was written */
    int code;               /* out: server error code of the ticket or the write, 0 if none */
} cas_op;

void mg_cas_init(mstore *s, cas_op *op, const bson_t *cur, const char *prefix, bson_t *update);
void mg_cas_clear(cas_op *op);          /* frees what one op holds */
void mg_cas_free(cas_op *ops, size_t n);
int mg_cas_run(mjob *j, mongoc_client_t *c, const char *docs_name, cas_op *ops, size_t n,
               double now);

/* ---- busy.c ---- */
/* Holds the keys of held[0..n) (waiting until no other job holds any of them), then gives
 * them back: a process writes one document at a time (see busy.c). */
void mg_busy_take(mstore *s, mg_busy *held, size_t n);
void mg_busy_give(mstore *s, mg_busy *held, size_t n);

/* ---- vcache.c ---- */
void mg_vc_put(mstore *s, const char *id, const char *token, int64_t v, int64_t attempts,
               int64_t qg, double expires);
bson_t *mg_vc_doc(mstore *s, const char *id, const char *token, int64_t *qg);
void mg_vc_drop(mstore *s, const char *id);
void mg_vc_clear(mstore *s);

/* ---- readyq.c ---- */
typedef char qid[64];

typedef struct qbatch {
    mongoc_bulk_operation_t *ins;
    mongoc_collection_t *qc;
    size_t nins, ndel, cap_ins, cap_del;
    qid *ins_ids, *del_ids;
    int oom;
} qbatch;

void mg_qb_init(qbatch *b, mongoc_collection_t *qc);
void mg_qb_put(qbatch *b, const char *hex, const char *topic, int64_t g, double at, double now);
void mg_qb_drop(qbatch *b, const char *hex, int64_t g);
void mg_qb_del(qbatch *b, const bson_t *entry);
void mg_qb_move(qbatch *b, const bson_t *entry, double at, double now);
int mg_qb_run(mjob *j, qbatch *b, int report);
int mg_queue_backfill(mstore *s, mongoc_client_t *c, char *err, size_t errlen);
/* A delivery whose due time a write moves (a kick, a replace, a release of a held one) gets an
 * entry at `at` before the write (after 0: so it never lacks one) and another after it (after
 * 1): a claim that read the first entry before the write landed saw the old document and
 * moved that entry to the old due time, or dropped it (a buried one). -1: j failed. */
int mg_requeue(mjob *j, mongoc_client_t *c, const char *hex, const char *topic, double at,
               double now, int after);
/* Generations: the time in microseconds, counted on by one by claims; the entry after the
 * write gets one of its own above the one before it. */
#define MG_REQUEUE_AFTER_G(now) ((int64_t)((now) * 1e6) + 1000)

/* ---- enqueue.c (tx.c enqueues too) ---- */
typedef struct enq_job {
    mjob j;
    rb_enqueue_item *items;
    size_t n;
    char **ids;
    unsigned char *kept;        /* the items that found a running delivery and left it */
} enq_job;

/* Copies and checks the items into a job for cb/ud; NULL with `err` filled when one cannot be
 * stored (cb is not called then). */
enq_job *mg_enq_prepare(mstore *s, const rb_enqueue_item *items, size_t n,
                        void (*work)(mjob *, mongoc_client_t *), rb_ids_cb cb, void *ud,
                        char *err, size_t errlen);
bson_t *mg_delivery_doc(const mstore *s, const rb_enqueue_item *it, double now, char hex[25]);
char *mg_dedupe_holder(mjob *j, mongoc_collection_t *cl, const rb_enqueue_item *it,
                       mongoc_client_session_t *cs, int *failed);
long mg_same_key_before(const rb_enqueue_item *items, size_t i);
/* FerretDB: the ready queue's entry of one delivery about to be inserted. -1: j failed. */
int mg_enq_entry(mjob *j, mongoc_client_t *c, const char *hex, const rb_enqueue_item *it,
                 double now);

/* ---- deps.c ---- */
#define MG_HELD_RUN_AT 1e300        /* a held delivery's run_at: never due (its own: held_run_at) */
#define DEPS_SWEEP_S 5.0            /* each process's claims look at the markers this often */
#define DEPS_SWEEP_MAX 500          /* markers per sweep */
#define DEPS_MARKER_KEEP_S 60.0     /* a marker outlives its dependency's settle this long */
#define DEPS_NONE_KEEP_S 1.0        /* "no marker at all" is believed this long (deps.c) */
/* The documents of ids[0..n) (the store's hex ids) into out[i], NULL where missing. -1: j
 * failed. */
int mg_read_by_ids(mjob *j, mongoc_collection_t *cl, char *const *ids, size_t n, bson_t **out);
/* Marks ids[0..n) as dependencies with deliveries after them (before those are inserted):
 * with gnext NULL deliveries whose `after` names them, else the one grouped delivery gnext
 * held behind them (groups.c). */
int mg_deps_mark(mjob *j, mongoc_client_t *c, char *const *ids, size_t n, const char *gnext,
                 double now);
/* The held deliveries ids[0..n) evaluated now: released, cancelled (and those after them in
 * turn), or their count of live dependencies updated. */
int mg_deps_eval(mjob *j, mongoc_client_t *c, char *const *ids, size_t n);
/* ids[0..n) settled (completed, buried, cancelled): the deliveries after those with markers
 * evaluated. Every writer that settles a delivery calls it after its write. */
int mg_deps_settled(mjob *j, mongoc_client_t *c, char *const *ids, size_t n);
/* The sweep of the markers (claims run it every DEPS_SWEEP_S). */
int mg_deps_sweep(mjob *j, mongoc_client_t *c);
/* For a write that has succeeded already: mg_deps_settled, mg_deps_sweep or mg_deps_eval of
 * ids[0..n); a failure is logged and left to the next sweep, and j's outcome stays what it
 * was. */
typedef enum { MG_DEPS_SETTLED, MG_DEPS_SWEEP, MG_DEPS_EVAL } mg_deps_look;
void mg_deps_after_write(mjob *j, mongoc_client_t *c, mg_deps_look look, char *const *ids,
                         size_t n);

/* ---- groups.c ---- */
/* Links the grouped items of a batch (groups[i] non-NULL, ids[i] their ids) into their groups,
 * in batch order: prev[i] (malloc'd) the id of the delivery before item i in its group, NULL
 * for a group's first; prev_item[i] (when not NULL) the index of that one when it is an item
 * of the batch, else -1. -1: j failed (no prev set). */
int mg_groups_link(mjob *j, mongoc_client_t *c, const char *const *groups, char *const *ids,
                   size_t n, char **prev, long *prev_item);
/* The live delivery (pending or processing) a grouped delivery `self` held behind `prev` must
 * wait for: prev, or the first live one before it through the settled ones held in turn (a
 * missing one counts as live for GROUP_GRACE_S unless marked gone); *out (malloc'd) NULL
 * when none. -1: j failed. */
#define GROUP_GRACE_S 300.0
int mg_group_live_prev(mjob *j, mongoc_client_t *c, const char *group, const char *self,
                       const char *prev, char **out);
/* Whether `x` comes before `from` in its group: reached going back from `from` through the
 * held ones' gprev. 1 yes, 0 no, -1 j failed. */
int mg_group_reaches(mjob *j, mongoc_client_t *c, const char *from, const char *x);
#define KICK_GRACE_S 60.0           /* a kick's flag (kick_at) counts this long at most */
/* Marks ids[0..n) as never to be live (again): grouped deliveries an enqueue linked and will
 * not insert, or deleted ones. -1: j failed. */
int mg_groups_gone(mjob *j, mongoc_client_t *c, char *const *ids, size_t n);
/* Removes the gone marks past their use (with the tickets' prune, jobs.c). */
void mg_groups_prune(mstore *s, mongoc_client_t *c);

/* ---- limits.c ---- */
#define MG_LIMIT_MAX 10000          /* rate and concurrency: the window lives in one document */
typedef struct mg_slot {
    char d[25];                     /* the delivery */
    char k[33];                     /* its run's lease token */
    double exp;                     /* the lease's expiry when claimed */
} mg_slot;
/* A limited topic as a claim read it: its slots that count, its starts in the window, and
 * how many may start now. */
typedef struct mg_lim {
    char *topic;
    bson_t *doc;                    /* as read: its version is the one the reservation needs */
    int64_t rate, conc;
    double per;
    mg_slot *slots;
    size_t nslots;
    double *starts;
    size_t nstarts;
    size_t allow;
} mg_lim;
typedef struct mg_lims {
    mg_lim *v;
    size_t n;
} mg_lims;
typedef struct mg_run_lim {
    char token[33];
    char *topic;
    struct mg_run_lim *next;
} mg_run_lim;
/* The limited ones among topics[0..n), judged at `now`. -1: j failed. */
int mg_limits_load(mjob *j, mongoc_client_t *c, char *const *topics, size_t n, double now,
                   mg_lims *out);
mg_lim *mg_lims_find(mg_lims *ls, const char *topic);
/* l read and judged again (after its reservation lost); a cleared limit leaves allow 0. */
int mg_limits_reload(mjob *j, mongoc_client_t *c, mg_lim *l, double now);
#define MG_RESERVE_ROUNDS 5         /* a claim's lost reservation is tried again, at most */
void mg_lims_free(mg_lims *ls);
/* Writes add[0..n) (n <= l->allow) into l's document, as slots and starts at now: 1 won, 0
 * lost to another writer (claim none of them), -1 j failed. */
int mg_limits_reserve(mjob *j, mongoc_client_t *c, mg_lim *l, const mg_slot *add, size_t n,
                      double now);
/* After a claim of topic's deliveries whose starts it reserved at `at`: the slots of
 * tokens[0..n) (lost, or ended runs) go with as many starts at `at`, and nwon starts at `at`
 * move to `done`. -1: j failed. */
int mg_limits_finish(mjob *j, mongoc_client_t *c, const char *topic, char *const *tokens,
                     size_t n, size_t nwon, double at, double done);
/* Removes the slots of the runs with these tokens from topic's document. -1: j failed. */
int mg_limits_give_back(mjob *j, mongoc_client_t *c, const char *topic, char *const *tokens,
                        size_t n);
/* Our runs of limited topics: noted when claimed; ended gives the topic (malloc'd) or NULL. */
int mg_limits_started(mstore *s, const char *topic, const char *token);
char *mg_limits_ended(mstore *s, const char *token);
void mg_limits_forget_all(mstore *s);
void mg_limit(rb_store *st, const char *topic, const rb_limit *lim, rb_count_cb cb, void *ud);
void mg_limits(rb_store *st, rb_rows_cb cb, void *ud);

/* ---- url.c ---- */
typedef enum { MG_DETECT, MG_MONGODB, MG_FERRETDB } mg_dialect;

/* Takes the store's own option dialect=mongodb|ferretdb out of the URL (libmongoc would warn
 * of it): 1 with *out the URL without it (free it) and *dialect; 0 with err filled. */
int mg_url_take_dialect(const char *url, char **out, mg_dialect *dialect, char *err,
                        size_t errlen);

/* ---- schema.c ---- */
int mg_migrate(mstore *s, mongoc_client_t *c, char *err, size_t errlen);
int mg_check_schema(mstore *s, mongoc_client_t *c, char *err, size_t errlen);

/* ---- tx.c ---- */
void mg_tx_close_all(mstore *s);        /* the store closes: each open rb_tx is left dead */

/* ---- the operations (the vtable, open.c) ---- */
void mg_enqueue(rb_store *st, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud);
void mg_schedule(rb_store *st, const rb_schedule *sch, rb_count_cb cb, void *ud);
void mg_unschedule(rb_store *st, const char *name, rb_count_cb cb, void *ud);
void mg_schedules(rb_store *st, rb_rows_cb cb, void *ud);
void mg_schedule_fire(rb_store *st, const char *name, double due, double next,
                      const rb_enqueue_item *tick, rb_count_cb cb, void *ud);
void mg_claim(rb_store *st, const rb_claim_req *req, rb_claim_cb cb, void *ud);
void mg_settle(rb_store *st, rb_settle_op *ops, size_t n, rb_done_cb cb, void *ud);
void mg_get(rb_store *st, const char *id, rb_records_cb cb, void *ud);
void mg_list(rb_store *st, const rb_list_req *req, rb_records_cb cb, void *ud);
void mg_stats(rb_store *st, rb_stats_cb cb, void *ud);
void mg_kick(rb_store *st, rb_kick_mode mode, const char *id, const char *topic,
             rb_count_cb cb, void *ud);
void mg_purge(rb_store *st, const char *status, const char *topic, double older_than,
              size_t limit, rb_count_cb cb, void *ud);
void mg_cancel_all(rb_store *st, const char *status, const char *topic, const char *reason,
                   rb_count_cb cb, void *ud);
/* operator.c, admin.c: for the dashboard */
void mg_topic_stats(rb_store *st, rb_rows_cb cb, void *ud);
void mg_pending_topics(rb_store *st, size_t scan_max, rb_rows_cb cb, void *ud);
void mg_bury(rb_store *st, const char *id, const char *reason, rb_count_cb cb, void *ud);
void mg_pause(rb_store *st, const char *topic, int paused, rb_count_cb cb, void *ud);
void mg_paused(rb_store *st, rb_rows_cb cb, void *ud);
/* Of topics[0..*n), moves the paused ones to the end and makes *n the count of the others;
 * their count in *npaused. -1 (j failed) when the read failed. Worker thread. */
int mg_split_paused(mjob *j, mongoc_client_t *c, char **topics, size_t *n, size_t *npaused);
void mg_remove(rb_store *st, const char *id, rb_count_cb cb, void *ud);
void mg_cancel(rb_store *st, const char *id, const char *reason, rb_count_cb cb, void *ud);
void mg_progress(rb_store *st, rb_tx *tx, const char *id, const char *token, const char *json,
                 rb_count_cb cb, void *ud);
void mg_lease(rb_store *s, rb_lease_op op, const char *name, const char *token, double duration,
              rb_lease_cb cb, void *ud);
void mg_begin(rb_store *st, rb_tx_cb cb, void *ud);
void mg_tx_doom(rb_tx *tx, const char *why);
void mg_tx_enqueue(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud);
void mg_tx_doc(rb_tx *tx, rb_doc_op op, const char *collection, const char *filter_json,
               const char *doc_json, rb_doc_cb cb, void *ud);
void mg_commit(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud);
void mg_rollback(rb_tx *tx, rb_done_cb cb, void *ud);

#pragma GCC visibility pop

#endif
