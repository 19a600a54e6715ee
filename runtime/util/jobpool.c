/* jobpool.c -- worker threads for blocking calls, results handed back through an ev_async
 * (see jobpool.h). Two lists under one mutex: jobs waiting for a worker, jobs done waiting
 * for the loop. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include "util/jobpool.h"
#include "util/alloc.h"
#include "util/fifo.h"
#include "util/check.h"

#define MAX_THREADS 16

typedef RB_FIFO(rb_job) jlist;

struct rb_jobpool {
    struct ev_loop *loop;
    rb_jobpool_conf conf;
    pthread_t threads[MAX_THREADS];
    int nthreads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    jlist queued, finished;     /* (mu) */
    int stopping;               /* workers exit (mu) */
    ev_async async;
    size_t pending;             /* jobs whose done is still due (loop thread) */
    int closing;                /* loop thread */
};

/* The next queued job, or NULL when the pool stops. */
static rb_job *next_job(rb_jobpool *p)
{
    pthread_mutex_lock(&p->mu);
    while (!p->stopping && RB_FIFO_EMPTY(&p->queued)) pthread_cond_wait(&p->cv, &p->mu);
    rb_job *j = NULL;
    if (!p->stopping) {
        RB_FIFO_POP(&p->queued, &j);
    }
    pthread_mutex_unlock(&p->mu);
    return j;
}

static void *worker_main(void *arg)
{
    rb_jobpool *p = arg;
    void *ctx = p->conf.thread_start ? p->conf.thread_start(p->conf.ud) : NULL;
    for (rb_job *j; (j = next_job(p));) {
        j->work(j, ctx);
        pthread_mutex_lock(&p->mu);
        RB_FIFO_PUSH(&p->finished, j);
        pthread_mutex_unlock(&p->mu);
        ev_async_send(p->loop, &p->async);
    }
    if (p->conf.thread_stop) p->conf.thread_stop(p->conf.ud, ctx);
    return NULL;
}

static void job_finish(rb_jobpool *p, rb_job *j, int ran)
{
    if (--p->pending == 0) ev_unref(p->loop);   /* idle: do not keep the loop alive */
    j->done(j, ran);
}

static void finish_list(rb_jobpool *p, rb_job *j, int ran)
{
    for (rb_job *next; j; j = next) {
        next = j->next;
        job_finish(p, j, ran);
    }
}

static void on_async(struct ev_loop *loop, ev_async *w, int revents)
{
    (void)loop; (void)revents;
    rb_jobpool *p = w->data;
    pthread_mutex_lock(&p->mu);
    rb_job *j;
    RB_FIFO_TAKE_ALL(&p->finished, &j);
    pthread_mutex_unlock(&p->mu);
    finish_list(p, j, 1);
}

void rb_jobpool_submit(rb_jobpool *p, rb_job *j)
{
    if (p->pending++ == 0) ev_ref(p->loop);     /* a result is due: keep the loop running */
    if (p->closing) {
        job_finish(p, j, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    RB_FIFO_PUSH(&p->queued, j);
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void stop_threads(rb_jobpool *p)
{
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    p->nthreads = 0;
}

static void pool_free(rb_jobpool *p)
{
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

rb_jobpool *rb_jobpool_new(struct ev_loop *loop, const rb_jobpool_conf *conf, char *err,
                           size_t errlen)
{
    rb_jobpool *p = rb_calloc(1, sizeof *p);
    if (!p) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    p->loop = loop;
    p->conf = *conf;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    int n = conf->nthreads < 1 ? 1 : conf->nthreads > MAX_THREADS ? MAX_THREADS : conf->nthreads;
    for (int i = 0; i < n; i++) {
        int rc = pthread_create(&p->threads[i], NULL, worker_main, p);
        if (rc != 0) {
            snprintf(err, errlen, "cannot start a worker thread: %s", strerror(rc));
            stop_threads(p);
            pool_free(p);
            return NULL;
        }
        p->nthreads++;
    }
    ev_async_init(&p->async, on_async);
    p->async.data = p;
    ev_async_start(loop, &p->async);
    ev_unref(loop);     /* an idle pool does not keep the loop running */
    return p;
}

void rb_jobpool_close(rb_jobpool *p)
{
    if (!p) return;
    p->closing = 1;
    stop_threads(p);
    pthread_mutex_lock(&p->mu);
    rb_job *finished, *queued;
    RB_FIFO_TAKE_ALL(&p->finished, &finished);
    RB_FIFO_TAKE_ALL(&p->queued, &queued);
    pthread_mutex_unlock(&p->mu);
    finish_list(p, finished, 1);    /* ran: their results stand */
    finish_list(p, queued, 0);      /* never ran */
    ev_ref(p->loop);                /* undo the unref made when the watcher started */
    ev_async_stop(p->loop, &p->async);
    pool_free(p);
}
