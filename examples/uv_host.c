/* uv_host.c -- a libuv host: relaybus's descriptor in a uv_poll_t, its timeout in a uv_timer_t.
 * libuv runs the loop (uv_run); relaybus runs only inside rb_lua_step, called from those two
 * callbacks. After each step the timer is set again to the runtime's next timeout, and the
 * host leaves the loop once nothing runs (rb_lua_busy is 0).
 *
 *   build/uv_host [--budget 0] key=value...   (examples/workload.lua's options) */
#include <math.h>
#include <string.h>
#include <uv.h>
#include "workload_host.h"

typedef struct host {
    lua_State *L;
    double budget;
    uv_poll_t poll;
    uv_timer_t timer;
    int failed, closed;
    long steps;
} host;

static void on_timer(uv_timer_t *t);

static void close_all(host *h)
{
    if (h->closed) return;
    h->closed = 1;
    uv_close((uv_handle_t *)&h->poll, NULL);
    uv_close((uv_handle_t *)&h->timer, NULL);
}

/* One step, then the timer is armed for the next timeout (in whole milliseconds, rounded up:
 * never early, so a step at the timer finds its timer due). */
static void step(host *h)
{
    h->steps++;
    if (rb_lua_step(h->L, h->budget) != 0) {
        fprintf(stderr, "uv_host: %s\n", lua_tostring(h->L, -1));
        lua_pop(h->L, 1);
        h->failed = 1;
        close_all(h);
        return;
    }
    if (rb_lua_busy(h->L) == 0) {
        close_all(h);
        return;
    }
    double t = rb_lua_timeout(h->L);
    if (t < 0) uv_timer_stop(&h->timer);
    else uv_timer_start(&h->timer, on_timer, (uint64_t)ceil(t * 1e3), 0);
}

static void on_timer(uv_timer_t *t) { step(t->data); }

static void on_readable(uv_poll_t *p, int status, int events)
{
    (void)events;
    host *h = p->data;
    if (status < 0) {
        fprintf(stderr, "uv_host: poll: %s\n", uv_strerror(status));
        h->failed = 1;
        close_all(h);
        return;
    }
    step(h);
}

int main(int argc, char **argv)
{
    host h = {0};
    int i = 1;
    if (i + 1 < argc && strcmp(argv[i], "--budget") == 0) {
        h.budget = atof(argv[i + 1]);
        i += 2;
    }
    if (i >= argc) {
        fprintf(stderr, "usage: uv_host [--budget S] url=STORE [key=value...]\n");
        return 2;
    }
    h.L = workload_open(argc - i, argv + i);
    if (!h.L) return 1;
    uv_loop_t *loop = uv_default_loop();
    uv_poll_init(loop, &h.poll, rb_lua_pollfd(h.L));
    uv_timer_init(loop, &h.timer);
    h.poll.data = h.timer.data = &h;
    uv_poll_start(&h.poll, UV_READABLE, on_readable);
    double t0 = workload_now();
    step(&h);                   /* the first step arms the timer */
    uv_run(loop, UV_RUN_DEFAULT);
    double elapsed = workload_now() - t0;
    int rc = h.failed ? 1 : workload_report(h.L, "");
    printf("steps=%ld secs=%.2f\n", h.steps, elapsed);
    uv_loop_close(loop);
    lua_close(h.L);
    return rc;
}
