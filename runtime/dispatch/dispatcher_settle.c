/* dispatcher_settle.c -- settle writes: made during one loop iteration, coalesced into one
 * fenced store call flushed from an ev_prepare watcher just before the loop blocks; and the
 * settles a handler asks for itself (complete, reschedule, bury, release). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "dispatch/dispatcher_impl.h"
#include "util/alloc.h"
#include "util/timer.h"
#include "util/log.h"
#include "util/text.h"

/* ---- settle queue ------------------------------------------------------------------------ */
settle_req *disp_settle_new(rb_run *run, rb_settle_kind kind, double delay, const char *error,
                              settle_done_fn done)
{
    settle_req *r = disp_pool_get(POOL_SETTLES, sizeof *r);
    if (!r) return NULL;
    r->run = run;
    r->done = done;
    r->op.kind = kind;
    r->op.id = run->rec->id;
    r->op.token = run->rec->lease_token;
    r->op.delay = delay;
    if (error) {
        r->error_copy = rb_text_clean(error, strlen(error), ERROR_MAX);
        r->op.error = r->error_copy ? r->error_copy : "(out of memory)";
    }
    run->refs++;
    return r;
}

void disp_settle_free(settle_req *r)
{
    free(r->error_copy);
    disp_pool_put(POOL_SETTLES, r);
}

void disp_settle_enqueue(rb_dispatcher *d, settle_req *r)
{
    r->sent_at = rb_monotonic();
    RB_FIFO_PUSH(&d->queue, r);
    d->queued++;
    disp_request_flush(d);
}

typedef struct settle_batch {
    rb_dispatcher *d;
    size_t n;
    settle_req **reqs;
    rb_settle_op *ops;
} settle_batch;

void disp_run_release_ref(rb_run *run);

static void on_batch_settled(void *ud, const char *err)
{
    settle_batch *b = ud;
    for (size_t i = 0; i < b->n; i++) {
        settle_req *r = b->reqs[i];
        if (err && b->n > 1) r->solo = 1;   /* a retry of it goes alone */
        r->op.applied = err ? 0 : b->ops[i].applied;
        r->op.lease_expires_at = b->ops[i].lease_expires_at;
        rb_run *run = r->run;
        r->done(r, err);
        disp_settle_free(r);
        disp_run_release_ref(run);
    }
    free(b->reqs);
    free(b->ops);
    free(b);
}

static void on_explicit_written(settle_req *r, const char *err);
void disp_on_renewed(settle_req *r, const char *err);

/* A handler's settle or a renewal queued by a run that was aborted before it could go out is
 * not sent: the abort decides the run's outcome. Returns 1 when r was withdrawn (and freed). */
static int withdrawn(settle_req *r)
{
    rb_run *run = r->run;
    if (!run->aborted || (r->done != on_explicit_written && r->done != disp_on_renewed)) return 0;
    if (r->done == on_explicit_written) r->ucb(r->uud, "aborted", 0);
    else run->renewing = 0;
    disp_settle_free(r);
    disp_run_release_ref(run);
    return 1;
}

/* Sends the settle writes in reqs[0..n) as one store call (owns reqs); with claim non-NULL,
 * as the store call that also makes that claim. */
static void send_batch(rb_dispatcher *d, settle_req **reqs, size_t n, const rb_claim_req *claim,
                       rb_claim_cb claim_cb, void *claim_ud)
{
    settle_batch *b = rb_calloc(1, sizeof *b);
    rb_settle_op *ops = rb_malloc(n * sizeof *ops);
    if (!b || !ops) {
        /* out of memory: each write fails like a refused one and is tried again later */
        free(b);
        free(ops);
        for (size_t i = 0; i < n; i++) {
            settle_req *r = reqs[i];
            rb_run *run = r->run;
            r->op.applied = 0;
            r->done(r, "out of memory");
            disp_settle_free(r);
            disp_run_release_ref(run);
        }
        free(reqs);
        if (claim) d->store->vt->claim(d->store, claim, claim_cb, claim_ud);
        return;
    }
    for (size_t i = 0; i < n; i++) ops[i] = reqs[i]->op;
    *b = (settle_batch){d, n, reqs, ops};
    if (claim)
        d->store->vt->claim_settle(d->store, claim, claim_cb, claim_ud, ops, n, on_batch_settled, b);
    else
        d->store->vt->settle(d->store, ops, n, on_batch_settled, b);
}

int disp_claim_carrying(rb_dispatcher *d, const rb_claim_req *req, rb_claim_cb cb, void *ud)
{
    if (!d->carry) return 0;
    settle_req **reqs = d->carry;
    d->carry = NULL;
    send_batch(d, reqs, d->ncarry, req, cb, ud);
    return 1;
}

/* The writes queued this iteration go out as one store call; a write that was in a batch the
 * store refused goes alone, so one write the store cannot take fails only itself. When a claim
 * is to follow and the store can take both in one round trip, the batch waits in d->carry
 * for that claim (disp_on_flush sends it alone if no claim takes it). */
static void flush_settles(rb_dispatcher *d)
{
    if (!d->queued) return;
    settle_req **all = rb_malloc(d->queued * sizeof *all);
    if (!all) return;       /* out of memory: try again next iteration */
    settle_req *head;
    RB_FIFO_TAKE_ALL(&d->queue, &head);
    d->queued = 0;
    size_t k = 0;
    for (settle_req *r = head, *next; r; r = next) {
        next = r->next;
        if (withdrawn(r)) continue;
        settle_req **one = r->solo ? rb_malloc(sizeof *one) : NULL;
        if (one) {
            one[0] = r;
            send_batch(d, one, 1, NULL, NULL, NULL);
        } else {
            all[k++] = r;   /* (a solo write whose array could not be made joins the batch) */
        }
    }
    if (!k) { free(all); return; }
    if (d->want_claim && d->store->vt->claim_settle && disp_live(d)) {
        d->carry = all;
        d->ncarry = k;
    } else {
        send_batch(d, all, k, NULL, NULL, NULL);
    }
}

void disp_on_flush(struct ev_loop *loop, ev_prepare *w, int revents)
{
    (void)loop; (void)revents;
    rb_dispatcher *d = w->data;
    d->flushing = 1;
    /* Runs claimed ahead take the slots freed since the last flush first: the settles of
     * those that end at once then go out with this flush. */
    disp_start_ahead(d);
    flush_settles(d);
    if (d->want_claim) {
        d->want_claim = 0;
        disp_maybe_claim(d);
    }
    if (d->carry) {     /* no claim went out to carry it */
        settle_req **reqs = d->carry;
        d->carry = NULL;
        send_batch(d, reqs, d->ncarry, NULL, NULL, NULL);
    }
    d->flushing = 0;
    /* Work queued by the callbacks above is flushed next iteration, without blocking. */
    if (d->queued || d->want_claim) rb_idle_start(d->loop, &d->spin_watcher);
    else rb_idle_stop(d->loop, &d->spin_watcher);
}

void disp_on_spin(struct ev_loop *loop, ev_idle *w, int revents)
{
    (void)loop; (void)w; (void)revents;
}

void disp_request_flush(rb_dispatcher *d)
{
    if (!d->flushing) rb_idle_start(d->loop, &d->spin_watcher);
}


/* ---- explicit settles from the handler --------------------------------------------------- */
/* A burial or a retry the handler asked for (ctx:bury, a webhook's 4xx or 5xx) is a failure
 * an operator wants to see, as a raise is (the binding logs those). */
static void log_explicit(const rb_run *run, const rb_settle_op *op)
{
    static rb_log_limit buried, rescheduled;
    const char *id = run->rec->id, *topic = run->rec->topic;
    if (op->kind == RB_OP_BURY)
        rb_log_limited_d(&buried, RB_LOG_INFO, id, topic, "delivery %s (%s) buried: %s", id,
                         topic, op->error ? op->error : "buried");
    else if (op->kind == RB_OP_RESCHEDULE)
        rb_log_limited_d(&rescheduled, RB_LOG_INFO, id, topic, "delivery %s (%s) rescheduled in "
                         "%g s: %s", id, topic, op->delay, op->error ? op->error : "rescheduled");
}

static void on_explicit_written(settle_req *r, const char *err)
{
    rb_run *run = r->run;
    if (err) {
        if (r->op.kind != RB_OP_EXTEND && !run->settle_error) {
            static const char *const names[] = {"complete", "reschedule", "bury", "release"};
            char msg[512];
            snprintf(msg, sizeof msg, "ctx:%s() could not be written: %s", names[r->op.kind], err);
            run->settle_error = rb_strdup(msg);
        }
        r->ucb(r->uud, err, 0);
        return;
    }
    if (!r->op.applied) {
        if (run->state == RUN_RUNNING) disp_run_lost(run);
        r->ucb(r->uud, "lease lost", 0);
        return;
    }
    if (r->op.kind == RB_OP_EXTEND) {
        /* An extension never shortens the lease (the store keeps the later expiry too), and
         * its margin is the one for the length asked for. */
        run->lease_deadline = fmax(run->lease_deadline,
                                   r->sent_at + r->op.delay - rb_lease_margin(r->op.delay));
        if (run->state == RUN_RUNNING && !run->aborted) disp_arm_deadline(run);
    } else {
        run->settled_explicitly = 1;
        disp_set_outcome(run, disp_outcome_of(run, r->op.kind), r->op.error);
        log_explicit(run, &r->op);
        /* a run that rb_dispatcher_free detached has no dispatcher (nor timers) any more */
        if (run->state != RUN_SETTLED) disp_stop_renewals(run);
        /* Handed back (release, reschedule): another worker may run it now, so this run's
         * waits end and its code stops after the grace, as at the end of a lease. */
        if ((r->op.kind == RB_OP_RELEASE || r->op.kind == RB_OP_RESCHEDULE) &&
            run->state == RUN_RUNNING)
            disp_run_abort(run, RB_ABORT_LEASE);
    }
    r->ucb(r->uud, NULL, 1);
}

typedef struct progress_req {
    rb_run *run;
    rb_run_settle_cb cb;
    void *ud;
} progress_req;

static void on_progress_written(void *ud, const char *err, int64_t count)
{
    progress_req *p = ud;
    rb_run *run = p->run;
    if (!err && count == 0) {
        err = "lease lost";
        if (run->state == RUN_RUNNING) disp_run_lost(run);
    }
    p->cb(p->ud, err, !err);
    free(p);
    disp_run_release_ref(run);
}

void rb_run_progress(rb_run *run, const char *json, rb_run_settle_cb cb, void *ud)
{
    RB_ASSERT(json);
    if (run->state != RUN_RUNNING || rb_run_check(run)) {
        cb(ud, "aborted", 0);
        return;
    }
    rb_store *s = run->store;
    if (!s->vt->progress) {
        cb(ud, "progress is not supported by this store", 0);
        return;
    }
    progress_req *p = rb_malloc(sizeof *p);
    if (!p) {
        cb(ud, "out of memory", 0);
        return;
    }
    *p = (progress_req){.run = run, .cb = cb, .ud = ud};
    run->refs++;
    s->vt->progress(s, run->tx, run->rec->id, run->rec->lease_token, json, on_progress_written, p);
}

void rb_run_settle(rb_run *run, rb_settle_kind kind, double delay, const char *reason,
                   rb_run_settle_cb cb, void *ud)
{
    if (run->state != RUN_RUNNING || rb_run_check(run)) {
        cb(ud, "aborted", 0);
        return;
    }
    if (run->settled_explicitly) {
        cb(ud, "already settled", 0);
        return;
    }
    if (run->tx && kind != RB_OP_EXTEND) {
        cb(ud, "a transactional handler settles by returning (complete) or raising (retry)", 0);
        return;
    }
    if (run->tx && run->d->store->vt->tx_exclusive) {
        /* The write would wait behind the handler's own transaction. While that holds the
         * store nobody can take the lease, so the extension is the run's own deadline (a
         * transaction that no longer holds it aborted the run in rb_run_check above). */
        if (delay <= 0) delay = run->d->opt.lease_duration;
        disp_lease_held_from(run, rb_monotonic(), delay, rb_lease_margin(delay));
        cb(ud, NULL, 1);
        return;
    }
    if (kind == RB_OP_EXTEND && delay <= 0) delay = run->d->opt.lease_duration;
    if (kind == RB_OP_RESCHEDULE && !reason) reason = "rescheduled";
    if (kind == RB_OP_BURY && !reason) reason = "buried";
    settle_req *r = disp_settle_new(run, kind, delay < 0 ? 0 : delay, reason, on_explicit_written);
    if (!r) {
        cb(ud, "out of memory", 0);
        return;
    }
    r->ucb = cb;
    r->uud = ud;
    disp_settle_enqueue(run->d, r);
}

