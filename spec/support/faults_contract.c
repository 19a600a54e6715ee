/* faults_contract.c -- checks the contract checks of testing/store_faults.c: a store that breaks
 * store.h's callback contract on purpose, wrapped by rb_faults_wrap. Built by `make examples`
 * as build/faults_contract; store_faults_spec runs it and reads its "name value" lines.
 *
 * The broken store: get answers twice, list never answers, stats answers from another thread,
 * kick answers a two-line error, claim answers an error with records; enqueue behaves. The
 * program counts what reaches the callers (each must be answered exactly once, list only at
 * close, with "store closed") and prints the wrapper's counts. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ev.h>
#include "store_faults.h"

typedef struct broken { rb_store base; int closed; } broken;

static void b_enqueue(rb_store *s, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud)
{
    (void)s; (void)items;
    char id[] = "1", *ids[] = {id};
    cb(ud, NULL, ids, NULL, n ? 1 : 0);
}

static void b_get(rb_store *s, const char *id, rb_records_cb cb, void *ud)
{
    (void)s; (void)id;
    cb(ud, NULL, NULL, 0);
    cb(ud, NULL, NULL, 0);      /* twice */
}

static void b_list(rb_store *s, const rb_list_req *req, rb_records_cb cb, void *ud)
{
    (void)s; (void)req; (void)cb; (void)ud;     /* never */
}

typedef struct thread_answer { rb_stats_cb cb; void *ud; } thread_answer;

static void *answer_stats(void *p)
{
    thread_answer *a = p;
    rb_stats st = {.pending = 1, .due = 1};
    a->cb(a->ud, NULL, &st);
    free(a);
    return NULL;
}

static pthread_t stats_thread;

static void b_stats(rb_store *s, rb_stats_cb cb, void *ud)
{
    (void)s;
    thread_answer *a = malloc(sizeof *a);
    a->cb = cb;
    a->ud = ud;
    pthread_create(&stats_thread, NULL, answer_stats, a);     /* another thread */
}

static void b_kick(rb_store *s, rb_kick_mode mode, const char *id, const char *topic,
                   rb_count_cb cb, void *ud)
{
    (void)s; (void)mode; (void)id; (void)topic;
    cb(ud, "first line\nsecond line", 0);
}

static void b_claim(rb_store *s, const rb_claim_req *req, rb_claim_cb cb, void *ud)
{
    (void)s; (void)req;
    rb_claim_result res = {.recs = malloc(sizeof *res.recs), .n = 1};
    res.recs[0] = rb_delivery_new("1", "t", "{}", NULL, NULL, "tok");
    cb(ud, "an error, yet records", &res);
}

static void b_close(rb_store *s) { ((broken *)s)->closed = 1; }

static const rb_store_vtable broken_vt = {
    .name = "broken", .enqueue = b_enqueue, .claim = b_claim, .get = b_get, .list = b_list,
    .stats = b_stats, .kick = b_kick, .close = b_close,
};

/* ---- the callers' side: count the answers ---- */
static int answers[8];
static char list_err[64];
enum { A_ENQUEUE, A_GET, A_LIST, A_STATS, A_KICK, A_CLAIM };

static void on_ids(void *ud, const char *err, char **ids, const unsigned char *kept, size_t n)
{
    (void)ud; (void)ids; (void)kept;
    if (!err && n == 1) answers[A_ENQUEUE]++;
}

static void on_records(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    int which = (int)(intptr_t)ud;
    answers[which]++;
    if (which == A_LIST && err) snprintf(list_err, sizeof list_err, "%s", err);
    rb_delivery_list_free(recs, n);
}

static void on_claim(void *ud, const char *err, rb_claim_result *res)
{
    (void)ud;
    answers[A_CLAIM]++;
    if (!err || res) answers[A_CLAIM] += 100;     /* records leaked through */
    if (res) rb_delivery_list_free(res->recs, res->n);
}

static void on_stats(void *ud, const char *err, const rb_stats *st)
{
    (void)ud;
    if (!err && st && st->pending == 1) answers[A_STATS]++;
}

static void on_count(void *ud, const char *err, int64_t count)
{
    (void)ud; (void)count;
    if (err) answers[A_KICK]++;
}

static void on_tick(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)w; (void)revents;
    ev_break(loop, EVBREAK_ALL);
}

int main(void)
{
    struct ev_loop *loop = ev_default_loop(0);
    broken *b = calloc(1, sizeof *b);
    b->base.vt = &broken_vt;
    b->base.loop = loop;
    b->base.table = strdup("t");
    rb_faults_options o;
    rb_faults_options_init(&o, 1);
    o.stuck_after = 0.05;
    o.own_inner = 1;
    char err[256];
    rb_store *f = rb_faults_wrap(&b->base, &o, err, sizeof err);
    if (!f) {
        fprintf(stderr, "faults_contract: %s\n", err);
        return 1;
    }
    rb_enqueue_item it = {.topic = "t", .payload = "{}", .max_attempts = 1};
    f->vt->enqueue(f, &it, 1, on_ids, NULL);
    f->vt->get(f, "1", on_records, (void *)(intptr_t)A_GET);
    f->vt->list(f, &(rb_list_req){.limit = 10}, on_records, (void *)(intptr_t)A_LIST);
    f->vt->stats(f, on_stats, NULL);
    f->vt->kick(f, RB_KICK_ONE, "1", NULL, on_count, NULL);
    rb_claim_req req = {NULL, 0, 1, 1};
    f->vt->claim(f, &req, on_claim, NULL);
    ev_timer t;
    ev_timer_init(&t, on_tick, 0.2, 0);
    ev_timer_start(loop, &t);
    ev_run(loop, 0);
    pthread_join(stats_thread, NULL);
    ev_run(loop, EVRUN_NOWAIT);     /* the hand-over from the other thread */
    rb_fault_stats st;
    rb_faults_stats(f, &st);
    printf("twice %ld\nwrong_thread %ld\nmultiline %ld\nerr_with_result %ld\nstuck %ld\n",
           st.twice, st.wrong_thread, st.multiline, st.err_with_result, st.stuck);
    printf("waiting_before_close %ld\n", st.waiting);
    int list_before = answers[A_LIST];
    f->vt->close(f);
    printf("answers_enqueue %d\nanswers_get %d\nanswers_stats %d\nanswers_kick %d\nanswers_claim %d\n",
           answers[A_ENQUEUE], answers[A_GET], answers[A_STATS], answers[A_KICK], answers[A_CLAIM]);
    printf("answers_list_before_close %d\nanswers_list %d\nlist_err %s\n", list_before,
           answers[A_LIST], list_err[0] ? list_err : "-");
    printf("inner_closed %d\n", b->closed);
    /* Read after close on purpose: the wrapper stays allocated while an operation the inner
     * store never answered refers to it, and close counted that one as unanswered. */
    rb_faults_stats(f, &st);
    printf("unanswered %ld\n", st.unanswered);
    return 0;
}
