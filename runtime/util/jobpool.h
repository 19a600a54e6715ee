/* jobpool.h -- a few worker threads for calls that block (a driver without an event loop),
 * whose results come back on the loop thread through an ev_async.
 *
 * The caller embeds an rb_job at the start of its own job struct and fills work and done.
 * work runs on a worker thread with that thread's context (what thread_start returned, e.g.
 * a connection of the driver's own pool); done runs later on the loop thread, once per
 * submitted job, and may free it. While any job's done is due the pool holds a reference on
 * the loop, so the loop keeps running for it; an idle pool does not keep the loop alive. */
#ifndef RB_JOBPOOL_H
#define RB_JOBPOOL_H

#include <stddef.h>
#include <ev.h>

typedef struct rb_job rb_job;
typedef struct rb_jobpool rb_jobpool;

struct rb_job {
    rb_job *next;                               /* the pool's */
    void (*work)(rb_job *j, void *thread_ctx);  /* worker thread */
    void (*done)(rb_job *j, int ran);           /* loop thread; ran = 0: closed before it ran */
};

typedef struct rb_jobpool_conf {
    int nthreads;
    void *(*thread_start)(void *ud);            /* worker thread, before its first job; may be NULL */
    void (*thread_stop)(void *ud, void *ctx);   /* worker thread, after its last; may be NULL */
    void *ud;
} rb_jobpool_conf;

/* Starts the threads; NULL with err filled when they cannot all be started. */
rb_jobpool *rb_jobpool_new(struct ev_loop *loop, const rb_jobpool_conf *conf, char *err,
                           size_t errlen);

/* Queues j for a worker. After rb_jobpool_close began (from a done callback), j's done runs
 * at once with ran = 0. */
void rb_jobpool_submit(rb_jobpool *p, rb_job *j);

/* Stops the workers (each finishes the job it runs), then calls done for every job left:
 * ran = 1 for those that ran, 0 for those still queued. Frees the pool. Loop thread. */
void rb_jobpool_close(rb_jobpool *p);

#endif
