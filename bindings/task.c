/* task.c -- the coroutines relaybus runs (handler runs and spawned tasks) and the wait that
 * lets a C function yield to the loop until its I/O completes (await.h).
 *
 * A task's coroutine keeps a pointer to its rb_task in lua_getextraspace, so any C function
 * can tell whether it runs inside a relaybus coroutine (then it yields) or in the main chunk
 * (then it runs the loop until the result arrives). An abort ends the pending wait at once;
 * a count hook reads the clock itself so that Lua code that never yields is still stopped. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "log.h"

struct rb_await {
    rb_task *task;          /* NULL when the caller blocks (main chunk) */
    lua_State *L;           /* where the results go */
    int done, nres;
    int yielded;            /* the task is suspended in this wait */
    int abandoned;          /* the waiter gave up (abort); results are dropped */
    void (*cancel)(void *ud);
    void *cancel_ud;
};

static void task_resume(rb_task *t, int nargs);

rb_task *rb_task_current(lua_State *L)
{
    rb_task *t = *(rb_task **)lua_getextraspace(L);
    return (t && t->co == L) ? t : NULL;
}

/* Aborts a task guarded by a named lease whose deadline has passed. */
static void guard_check(rb_task *t, double now)
{
    if (t->deadline > 0 && !t->abort_at && now >= t->deadline) {
        t->abort_at = now;
        if (t->signal) rb_signal_fire(t->signal, RB_ABORT_LEASE);
    }
}

int rb_task_is_aborted(rb_task *t)
{
    if (!t) return 0;
    /* Reading the clock here is what makes a frozen process notice its deadline. */
    if (t->run) return rb_run_check(t->run) != RB_ABORT_NONE || (t->signal && t->signal->reason);
    guard_check(t, rb_monotonic());
    return t->abort_at > 0;
}

/* ---- await ---------------------------------------------------------------------------------- */
rb_await *rb_await_begin(lua_State *L)
{
    rb_task *t = rb_task_current(L);
    if (t && rb_task_is_aborted(t)) {
        lua_pushnil(L);
        lua_pushliteral(L, "aborted");
        return NULL;
    }
    rb_await *w = calloc(1, sizeof *w);
    if (!w) luaL_error(L, "relaybus: out of memory");
    w->task = t;
    w->L = L;
    return w;
}

int rb_await_finish(lua_State *L, rb_await *w)
{
    if (w->done) {                  /* completed before we got here */
        int n = w->nres;
        free(w);
        return n;
    }
    if (w->task) {
        w->task->wait = w;
        w->yielded = 1;
        return lua_yield(L, 0);     /* the completion resumes us with the results */
    }
    /* Main chunk: block by running the loop until this result arrives. */
    rb_module *m = rb_module_get(L);
    while (!w->done) ev_run(m->loop, EVRUN_ONCE);
    int n = w->nres;
    free(w);
    return n;
}

lua_State *rb_await_target(rb_await *w) { return w->abandoned ? NULL : w->L; }

void rb_await_on_cancel(rb_await *w, void (*cancel)(void *ud), void *ud)
{
    w->cancel = cancel;
    w->cancel_ud = ud;
}

void rb_await_resolve(rb_await *w, int nresults)
{
    if (w->abandoned) {
        free(w);
        return;
    }
    if (w->yielded) {
        rb_task *t = w->task;
        t->wait = NULL;
        free(w);
        task_resume(t, nresults);
        return;
    }
    w->done = 1;
    w->nres = nresults;
    /* A blocked main chunk runs the loop one iteration at a time; this may be called from a
     * prepare watcher, so make sure that iteration does not go on to block in the poll. */
    if (!w->task) ev_break(rb_module_get(w->L)->loop, EVBREAK_ONE);
}

/* Ends the task's pending wait with nil, "aborted". */
void rb_task_abort(rb_task *t)
{
    rb_await *w = t->wait;
    if (!w || !w->yielded) return;
    t->wait = NULL;
    if (w->cancel) {
        w->cancel(w->cancel_ud);
        free(w);
    } else {
        w->abandoned = 1;           /* freed by the late rb_await_resolve */
    }
    if (t->running) return;         /* cannot happen for a yielded wait; defensive */
    lua_pushnil(t->co);
    lua_pushliteral(t->co, "aborted");
    task_resume(t, 2);
}

/* ---- running tasks ----------------------------------------------------------------------- */
static void on_yield_idle(struct ev_loop *loop, ev_idle *w, int revents)
{
    (void)revents;
    rb_task *t = w->data;
    ev_idle_stop(loop, w);
    t->extra_yield = 0;
    task_resume(t, 0);
}

static void task_end(rb_task *t, int ok, const char *err)
{
    t->done = 1;
    rb_module *m = t->m;
    ev_idle_stop(m->loop, &t->yield_watcher);
    /* on_end owns what follows (it may free t) */
    if (t->on_end) t->on_end(t, ok, err);
}

static void task_resume(rb_task *t, int nargs)
{
    if (t->done || t->running || t->m->closing) return;
    int nres = 0;
    t->running = 1;
    int st = lua_resume(t->co, NULL, nargs, &nres);
    t->running = 0;
    if (st == LUA_YIELD) {
        if (t->wait) return;        /* suspended in one of our waits */
        /* A bare coroutine.yield(): treat it as sleep(0) and go on next iteration. */
        lua_pop(t->co, nres);
        t->extra_yield = 1;
        ev_idle_start(t->m->loop, &t->yield_watcher);
        return;
    }
    if (st == LUA_OK) {
        task_end(t, 1, NULL);
        return;
    }
    /* An error: turn any error value (a table, nil) into a one-line message. */
    const char *msg;
    if (lua_isstring(t->co, -1)) msg = lua_tostring(t->co, -1);
    else if (lua_isnil(t->co, -1)) msg = "error (nil)";
    else msg = luaL_tolstring(t->co, -1, NULL);
    task_end(t, 0, msg);
}

/* Finished coroutines are kept for the next task: a run costs no new lua_State. */
#define TASK_POOL_MAX 256

rb_task *rb_task_new(rb_module *m, lua_State *L, int nargs)
{
    (void)nargs;
    rb_task *t = m->task_pool;
    if (t) {
        m->task_pool = t->pool_next;
        m->task_pool_n--;
        lua_State *co = t->co;
        int ref = t->co_ref;
        memset(t, 0, sizeof *t);
        t->co = co;
        t->co_ref = ref;
    } else {
        t = calloc(1, sizeof *t);
        if (!t) luaL_error(L, "relaybus: out of memory");
        t->co = lua_newthread(L);
        t->co_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    }
    t->m = m;
    *(rb_task **)lua_getextraspace(t->co) = t;
    ev_idle_init(&t->yield_watcher, on_yield_idle);
    t->yield_watcher.data = t;
    return t;
}

void rb_task_free(rb_task *t)
{
    rb_module *m = t->m;
    if (m->closing) {
        free(t);
        return;
    }
    /* Only a coroutine that returned normally is clean enough to run another function. */
    if (m->task_pool_n < TASK_POOL_MAX && lua_status(t->co) == LUA_OK && lua_gettop(t->co) == 0) {
        lua_sethook(t->co, NULL, 0, 0);
        *(rb_task **)lua_getextraspace(t->co) = NULL;
        t->pool_next = m->task_pool;
        m->task_pool = t;
        m->task_pool_n++;
        return;
    }
    luaL_unref(m->L, LUA_REGISTRYINDEX, t->co_ref);
    free(t);
}

/* The function and its nargs arguments must already be on t->co's stack. */
void rb_task_start(rb_task *t, int nargs) { task_resume(t, nargs); }

/* ---- interrupting Lua code that does not yield ------------------------------------------- */
static void count_hook(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    rb_task *t = rb_task_current(L);
    if (!t || !t->running) return;
    double now = rb_monotonic();
    if (t->run) {
        if (!t->abort_at && now >= rb_run_deadline(t->run)) rb_run_check(t->run);
    } else {
        guard_check(t, now);
    }
    if (t->abort_at && now >= t->abort_at + RB_ABORT_GRACE) {
        const char *why = t->signal && t->signal->reason_name ? t->signal->reason_name : "abort";
        char msg[256];
        snprintf(msg, sizeof msg, "relaybus: interrupted %.2fs after its %s abort (it did not "
                 "yield: long computations must yield now and then, e.g. ctx:sleep(0))",
                 now - t->abort_at, why);
        luaL_error(L, "%s", msg);
    }
}

void rb_task_install_hook(rb_task *t)
{
    lua_sethook(t->co, count_hook, LUA_MASKCOUNT, 1000);
}

/* ---- relaybus.sleep and relaybus.spawn ------------------------------------------------------ */
typedef struct sleep_wait {
    ev_timer timer;
    rb_await *w;
    struct ev_loop *loop;
} sleep_wait;

static void on_sleep_done(struct ev_loop *loop, ev_timer *timer, int revents)
{
    (void)loop; (void)revents;
    sleep_wait *s = timer->data;
    rb_await *w = s->w;
    free(s);
    lua_State *T = rb_await_target(w);
    if (T) lua_pushboolean(T, 1);
    rb_await_resolve(w, T ? 1 : 0);
}

static void cancel_sleep(void *ud)
{
    sleep_wait *s = ud;
    ev_timer_stop(s->loop, &s->timer);
    free(s);
}

int rb_lua_sleep(lua_State *L)
{
    double secs = luaL_checknumber(L, lua_gettop(L) >= 2 && lua_isuserdata(L, 1) ? 2 : 1);
    if (!(secs >= 0)) secs = 0;
    rb_module *m = rb_module_get(L);
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    sleep_wait *s = calloc(1, sizeof *s);
    if (!s) {
        free(w);
        return luaL_error(L, "relaybus: out of memory");
    }
    s->w = w;
    s->loop = m->loop;
    ev_timer_init(&s->timer, on_sleep_done, secs, 0);
    s->timer.data = s;
    ev_timer_start(m->loop, &s->timer);
    rb_await_on_cancel(w, cancel_sleep, s);
    return rb_await_finish(L, w);
}

static void on_spawned_end(rb_task *t, int ok, const char *err)
{
    rb_module *m = t->m;
    if (!ok) rb_log(RB_LOG_ERROR, "task failed: %s", err);
    if (!t->daemon) m->ntasks--;
    ev_break(m->loop, EVBREAK_ONE);     /* relaybus.run() may be waiting for this */
    rb_task_free(t);
}

static int spawn(lua_State *L, int daemon)
{
    luaL_checktype(L, 1, LUA_TFUNCTION);
    rb_module *m = rb_module_get(L);
    int nargs = lua_gettop(L) - 1;
    rb_task *t = rb_task_new(m, m->L, nargs);
    t->on_end = on_spawned_end;
    t->daemon = daemon;
    if (!daemon) m->ntasks++;
    lua_xmove(L, t->co, nargs + 1);   /* the function and its arguments */
    rb_task_start(t, nargs);
    return 0;
}

int rb_lua_spawn(lua_State *L) { return spawn(L, 0); }

/* relaybus._daemon(fn, ...): a task of the runtime's own (every, retention) that run() does
 * not wait for. */
int rb_lua_spawn_daemon(lua_State *L) { return spawn(L, 1); }
