/* task.c -- the coroutines relaybus runs (handler runs and spawned tasks) and the wait that
 * lets a C function yield to the loop until its I/O completes (await.h).
 *
 * A task's coroutine keeps a pointer to its rb_task in lua_getextraspace, so any C function
 * can tell whether it runs inside a relaybus coroutine (then it yields) or in the main chunk
 * (then it runs the loop until the result arrives). An abort ends the pending wait at once,
 * and a wait that completes after its run's deadline returns nil, "aborted" all the same (the
 * process may have been frozen meanwhile); a truthful wait (rb_await_truthful: a settle that
 * was sent) is the exception, it always reports what the store answered.
 *
 * Lua code that keeps running past its deadline plus the grace is stopped for good: a count
 * hook reads the clock every thousand instructions (and at the next instruction once the
 * watchdog says the time has come, watchdog.c) and yields the coroutine from inside the hook.
 * A yield cannot be caught by pcall, and the coroutine is never resumed again, so none of the
 * run's Lua code runs after that, whatever it wraps itself in. Coroutines the handler creates
 * inherit the hook (lua_newthread copies it) and are stopped the same way. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "util/log.h"
#include "util/list.h"
#include "util/check.h"

struct rb_await {
    rb_task *task;          /* NULL when the caller blocks (main chunk) */
    lua_State *L;           /* where the results go */
    int done, nres;
    int yielded;            /* the task is suspended in this wait */
    int abandoned;          /* the waiter gave up (abort); results are dropped */
    int truthful;           /* not ended by an abort (rb_await_truthful) */
    void (*cancel)(void *ud);
    void *cancel_ud;
    /* A sleep: its place in the module's heap of sleepers (NOT_ASLEEP when out of it), when
     * it ends, and the timer's round it began in (see on_sleepers_due). */
    unsigned slot, round;
    double wake_at;
};

#define NOT_ASLEEP UINT_MAX

static void task_resume_with(rb_task *t, int nargs, int truthful);
static void task_resume(rb_task *t, int nargs) { task_resume_with(t, nargs, 0); }

/* The innermost task whose lua_resume is on this thread's stack: the owner of a coroutine of
 * the handler's own, which has no task of its own. */
static _Thread_local rb_task *running_task;

rb_task *rb_task_current(lua_State *L)
{
    rb_task *t = *(rb_task **)lua_getextraspace(L);
    return (t && t->co == L) ? t : NULL;
}

/* Aborts a task guarded by a named lease whose deadline has passed. */
static void guard_check(rb_task *t, double now)
{
    if (t->deadline > 0 && !t->abort_at && now >= t->deadline) {
        rb_task_mark_aborted(t);
        if (t->signal) rb_signal_fire(t->signal, RB_ABORT_LEASE);
    }
}

void rb_task_mark_aborted(rb_task *t)
{
    if (t->abort_at > 0) return;
    t->abort_at = rb_monotonic();
    t->abort_seen = t->running;
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
    /* Outside a relaybus coroutine a wait runs the loop until its result comes. Inside the
     * loop (a coroutine of a handler's own, a callback of the host's) that would be a nested
     * loop waiting on operations queued behind the very callback it runs in: refuse. */
    if (!t && ev_depth(rb_module_get(L)->loop) > 0)
        rb_misuse(L, "this call waits for I/O and cannot here: inside the event loop it must "
                     "run in a relaybus coroutine (a handler or a relaybus.spawn task), not in "
                     "a coroutine of your own or in a callback");
    /* Inside a C function that cannot yield (a table.sort comparator, a string.gsub
     * replacement) a wait could not yield back: refused before anything is asked. */
    if (t && !lua_isyieldable(L))
        rb_misuse(L, "this call waits for I/O and cannot here: inside a function that Lua "
                     "calls from C without letting it yield (a table.sort comparator, a "
                     "string.gsub replacement...)");
    if (t && rb_task_is_aborted(t)) {
        lua_pushnil(L);
        lua_pushliteral(L, "aborted");
        return NULL;
    }
    rb_await *w = rb_calloc(1, sizeof *w);
    if (!w) luaL_error(L, "relaybus: out of memory");
    w->task = t;
    w->L = L;
    w->slot = NOT_ASLEEP;
    return w;
}

/* A wait that completed before it could yield (an SQLite store answers at once) lets the
 * loop have its turn now and then all the same: a task calling the store in a loop would
 * otherwise never give it back, and timers (sleeps, renewals, deadlines), I/O and the other
 * tasks would wait for it. Every INLINE_MAX such answers in a row, the task yields with its
 * results kept on its stack and goes on at the next loop iteration, as a bare
 * coroutine.yield() does; keep_results hands them back then. */
#define INLINE_MAX 64

static int keep_results(lua_State *L, int status, lua_KContext at)
{
    (void)status;
    lua_settop(L, (int)(at >> 8));  /* what a resume passed (anyone's but ours) goes */
    return (int)(at & 0xff);
}

/* A coroutine goes on after its wait: rb_await_resolve and an abort take the wait off it
 * first. Found still on, it was resumed by someone else (coroutine.resume in the handler's
 * own code): what was passed is dropped and it waits on, so that resume does nothing (it
 * returns true and no values) and the wait's own answer resumes it as ever. */
static int after_wait(lua_State *L, int status, lua_KContext top)
{
    (void)status;
    rb_task *t = rb_task_current(L);
    if (t && t->wait) {
        lua_settop(L, (int)top);
        return lua_yieldk(L, 0, top, after_wait);
    }
    return lua_gettop(L) - (int)top;
}

int rb_await_finish(lua_State *L, rb_await *w)
{
    if (w->done) {                  /* completed before we got here */
        int n = w->nres;
        rb_task *t = w->task;
        free(w);
        if (t && n < 256 && ++t->inline_waits >= INLINE_MAX) {
            t->inline_waits = 0;
            return lua_yieldk(L, 0, ((lua_KContext)lua_gettop(L) << 8) | n, keep_results);
        }
        return n;
    }
    if (w->task) {
        w->task->inline_waits = 0;
        w->task->wait = w;
        w->yielded = 1;
        /* the completion resumes us with the results */
        return lua_yieldk(L, 0, (lua_KContext)lua_gettop(L), after_wait);
    }
    /* Main chunk: block by running the loop until this result arrives. */
    rb_module *m = rb_module_get(L);
    while (!w->done) ev_run(m->loop, EVRUN_ONCE);
    int n = w->nres;
    free(w);
    return n;
}

lua_State *rb_await_target(rb_await *w) { return w->abandoned ? NULL : w->L; }

void rb_await_truthful(rb_await *w) { w->truthful = 1; }

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
        int truthful = w->truthful;
        t->wait = NULL;
        free(w);
        /* A result that comes after the run's deadline (a frozen process, a loop held by a
         * sibling) must not tell the run to go on: another worker may own the delivery now.
         * A truthful one is kept, but the deadline is noticed all the same (the answer may be
         * handled before the deadline's timer), so the abort is delivered now and the grace
         * counts from this resume instead of from a deadline long past. */
        int aborted = rb_task_is_aborted(t);
        if (!truthful && aborted && !t->done) {
            lua_pop(t->co, nresults);
            lua_pushnil(t->co);
            lua_pushliteral(t->co, "aborted");
            nresults = 2;
        }
        task_resume_with(t, nresults, truthful);
        return;
    }
    w->done = 1;
    w->nres = nresults;
    /* A blocked main chunk runs the loop one iteration at a time; this may be called from a
     * prepare watcher, so make sure that iteration does not go on to block in the poll. */
    if (!w->task) ev_break(rb_module_get(w->L)->loop, EVBREAK_ONE);
}

/* Takes the pending wait off t: cancelled, or left for its late completion to free. */
static void drop_wait(rb_task *t)
{
    rb_await *w = t->wait;
    t->wait = NULL;
    if (w->cancel) {
        w->cancel(w->cancel_ud);
        free(w);
    } else {
        w->abandoned = 1;           /* freed by the late rb_await_resolve */
    }
}

/* Ends the task's pending wait with nil, "aborted". */
void rb_task_abort(rb_task *t)
{
    rb_await *w = t->wait;
    if (!w || !w->yielded || w->truthful) return;
    drop_wait(t);
    if (t->running) return;         /* cannot happen for a yielded wait; defensive */
    lua_pushnil(t->co);
    lua_pushliteral(t->co, "aborted");
    task_resume(t, 2);
}

/* ---- running tasks ----------------------------------------------------------------------- */
/* The tasks that yielded before this iteration go on; one that yields again waits for the
 * next. A queued task is suspended with no wait of ours, so nothing else resumes or frees it
 * meanwhile (but the state's closing, which empties the queue). */
static void on_yielded_due(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_module *m = w->data;
    rb_task *t;
    RB_FIFO_TAKE_ALL(&m->yielded, &t);
    while (t && !m->closing) {
        rb_task *next = t->queue_next;
        t->queue_next = NULL;
        t->extra_yield = 0;
        task_resume(t, 0);
        t = next;
    }
}

static void on_sleepers_due(struct ev_loop *loop, ev_timer *timer, int revents);

void rb_task_init_module(rb_module *m)
{
    rb_timer_init(&m->yield_timer, on_yielded_due, 0, 0);
    m->yield_timer.w.data = m;
    rb_timer_init(&m->sleep_timer, on_sleepers_due, 0, 0);
    m->sleep_timer.w.data = m;
}

static void task_end(rb_task *t, int ok, const char *err)
{
    t->done = 1;
    /* on_end owns what follows (it may free t) */
    if (t->on_end) t->on_end(t, ok, err);
}

static int tolstring(lua_State *L)
{
    luaL_tolstring(L, 1, NULL);
    return 1;
}

/* The error value on top of L as text for a C string: any value (a table, nil) is described,
 * under protection (a __tostring that raises is described too), and a NUL inside, which
 * would cut the text short, becomes U+FFFD. L must be able to call (not a dead coroutine). */
static const char *error_text(lua_State *L)
{
    if (lua_isnil(L, -1)) return "error (nil)";
    if (!lua_isstring(L, -1)) {
        lua_pushcfunction(L, tolstring);
        lua_pushvalue(L, -2);
        if (lua_pcall(L, 1, 1, 0) != LUA_OK) return "error (a value whose __tostring raised)";
    }
    size_t len;
    const char *msg = lua_tolstring(L, -1, &len);
    if (!memchr(msg, 0, len)) return msg;
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (size_t i = 0; i < len; i++) {
        if (msg[i]) luaL_addchar(&b, msg[i]);
        else luaL_addstring(&b, "\xef\xbf\xbd");
    }
    luaL_pushresult(&b);
    return lua_tostring(L, -1);
}

/* When t's Lua code must have stopped: the grace after its abort, or after its deadline while
 * the abort has not been delivered. A run that was waiting when its deadline passed (a frozen
 * process, a loop held by a sibling) learns of the abort when the wait ends, and has the grace
 * from then to return (every wait it makes fails); a run busy past its deadline has it from
 * the deadline (rb_task_hook). INFINITY for a task nothing limits. */
static double kill_time(const rb_task *t)
{
    if (t->abort_at > 0) return t->abort_at + RB_ABORT_GRACE;
    if (t->run) return rb_run_deadline(t->run) + RB_ABORT_GRACE;
    if (t->deadline > 0) return t->deadline + RB_ABORT_GRACE;
    return INFINITY;
}

/* Puts a resume off to the next step: this step's budget is spent. */
static void defer(rb_task *t, int nargs, int truthful)
{
    rb_module *m = t->m;
    t->deferred = 1;
    t->deferred_nargs = nargs;
    t->deferred_truthful = truthful;
    RB_FIFO_PUSH_ON(&m->deferred, t, queue_next);
}

static int over_budget(const rb_module *m)
{
    return m->step_deadline > 0 && rb_monotonic() > m->step_deadline;
}

void rb_task_run_deferred(rb_module *m)
{
    while (!RB_FIFO_EMPTY(&m->deferred) && !over_budget(m) && !m->closing) {
        rb_task *t;
        RB_FIFO_POP_ON(&m->deferred, &t, queue_next);
        t->deferred = 0;
        int nargs = t->deferred_nargs, truthful = t->deferred_truthful;
        /* it waited for this step: a deadline that passed meanwhile still decides (and is
         * noticed before a truthful answer too, as in rb_await_resolve) */
        int aborted = rb_task_is_aborted(t);
        if (!truthful && aborted && !t->done) {
            lua_pop(t->co, nargs);
            lua_pushnil(t->co);
            lua_pushliteral(t->co, "aborted");
            nargs = 2;
        }
        task_resume_with(t, nargs, truthful);
    }
}

/* Resumes t with nargs values on its stack; truthful: they are a settle's answer, which a
 * deadline never replaces (see rb_await_truthful). */
static void task_resume_with(rb_task *t, int nargs, int truthful)
{
    if (t->done || t->running || t->killed || t->deferred || t->m->closing) return;
    if (over_budget(t->m)) {
        defer(t, nargs, truthful);
        return;
    }
    if (t->abort_at > 0 && !t->abort_seen) {
        /* Aborted while it waited: its code learns of it only now (a settle's answer may come
         * long after the abort, a loop held elsewhere may resume it late), so the grace to
         * return counts from this resume, once. */
        t->abort_seen = 1;
        double now = rb_monotonic();
        if (now > t->abort_at) t->abort_at = now;
    }
    int nres = 0;
    rb_task *outer = running_task;
    running_task = t;
    t->running = 1;
    rb_watch outer_watch = rb_watchdog_enter(t->m->watchdog, t->co, kill_time(t));
    t->resume_mono = rb_monotonic();
    t->resume_cpu = rb_thread_cpu_time();
    int st = lua_resume(t->co, NULL, nargs, &nres);
    rb_watchdog_leave(t->m->watchdog, outer_watch);
    t->running = 0;
    running_task = outer;
    if (t->killed) {
        /* Stopped in the hook (a yield, or an error where a yield was not possible). The
         * coroutine is left as it is and never resumed. */
        task_end(t, 0, "interrupted");
        return;
    }
    if (st == LUA_YIELD) {
        if (t->wait) return;        /* suspended in one of our waits */
        /* A bare coroutine.yield(): treat it as sleep(0) and go on next iteration. */
        lua_pop(t->co, nres);
        t->extra_yield = 1;
        RB_FIFO_PUSH_ON(&t->m->yielded, t, queue_next);
        if (!rb_timer_active(&t->m->yield_timer)) {
            rb_timer_set(&t->m->yield_timer, 0, 0);
            rb_timer_start(t->m->loop, &t->m->yield_timer);
        }
        return;
    }
    if (st == LUA_OK) {
        task_end(t, 1, NULL);
        return;
    }
    /* the error value is described on the main thread: the coroutine is dead, and a value's
     * __tostring is a call */
    lua_State *ML = t->m->L;
    int top = lua_gettop(ML);
    lua_xmove(t->co, ML, 1);
    task_end(t, 0, error_text(ML));
    lua_settop(ML, top);
}

/* Finished coroutines are kept for the next task: a run costs no new lua_State. */
#define TASK_POOL_MAX 256

rb_task *rb_task_new(rb_module *m, lua_State *L, int nargs)
{
    (void)nargs;
    rb_task *t = m->task_pool;
    if (t) {
        m->task_pool = t->queue_next;
        RB_ASSERT(m->task_pool_n > 0);
        m->task_pool_n--;
        lua_State *co = t->co;
        int ref = t->co_ref;
        memset(t, 0, sizeof *t);
        t->co = co;
        t->co_ref = ref;
    } else {
        t = rb_calloc(1, sizeof *t);
        if (!t) return NULL;        /* callers may be loop callbacks: never raise here */
        t->co = lua_newthread(L);
        t->co_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    }
    t->m = m;
    RB_LIST_PUSH_ON(&m->live, t, live_prev, live_next);
    *(rb_task **)lua_getextraspace(t->co) = t;
    return t;
}

static void unlink_live(rb_task *t)
{
    rb_module *m = t->m;
    RB_LIST_REMOVE_ON(&m->live, t, live_prev, live_next);
}

void rb_task_free(rb_task *t)
{
    rb_module *m = t->m;
    unlink_live(t);
    if (m->closing) {
        free(t);
        return;
    }
    /* Only a coroutine that returned normally is clean enough to run another function. */
    if (m->task_pool_n < TASK_POOL_MAX && lua_status(t->co) == LUA_OK && lua_gettop(t->co) == 0) {
        lua_sethook(t->co, NULL, 0, 0);
        *(rb_task **)lua_getextraspace(t->co) = NULL;
        t->queue_next = m->task_pool;
        m->task_pool = t;
        m->task_pool_n++;
        return;
    }
    luaL_unref(m->L, LUA_REGISTRYINDEX, t->co_ref);
    free(t);
}

/* The function and its nargs arguments must already be on t->co's stack. */
void rb_task_start(rb_task *t, int nargs) { task_resume(t, nargs); }

/* ---- stopping Lua code that does not yield ----------------------------------------------- */
/* Stops t for good from inside the hook running on L (t's coroutine or one of its own). */
static void kill_task(lua_State *L, rb_task *t, double now)
{
    if (!t->killed) {
        t->killed = 1;
        const char *why = t->signal && t->signal->reason ? rb_abort_reason_name(t->signal->reason) : "abort";
        static rb_log_limit lim;
        rb_log_limited(&lim, RB_LOG_WARN, "%s %s stopped %.2fs after its %s abort: it did "
                       "not return (long computations must yield now and then, e.g. "
                       "ctx:sleep(0))", t->run ? "handler of" : "task",
                       t->run ? rb_run_delivery(t->run)->id : "guarded by a lease",
                       now - (kill_time(t) - RB_ABORT_GRACE), why);
    }
    /* From here every instruction of this coroutine and of the task's comes back here. */
    lua_sethook(L, rb_task_hook, LUA_MASKCOUNT, 1);
    if (L != t->co) lua_sethook(t->co, rb_task_hook, LUA_MASKCOUNT, 1);
    if (lua_isyieldable(L)) {
        lua_yield(L, 0);        /* inside a hook: takes effect when the hook returns */
        return;
    }
    /* Inside a C call that cannot yield (a table.sort comparator...): unwind it; the next
     * instruction outside it yields. */
    luaL_error(L, "relaybus: interrupted: the run is past its deadline");
}

/* A run past its deadline counts as frozen there when at least FROZEN_WALL_MIN s passed since
 * it and it used less than FROZEN_CPU_MAX s of CPU meanwhile (the hook comes within a
 * thousand instructions; a scheduler's tick). A thread a busy machine gave little CPU for a
 * moment is not taken for frozen: it did little, but what it did may have been an effect. */
#define FROZEN_WALL_MIN 0.5
#define FROZEN_CPU_MAX 0.02

void rb_task_hook(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    rb_task *t = rb_task_current(L);
    if (!t) t = running_task;           /* a coroutine the task created */
    if (!t || !t->running || t->done) return;
    double now = rb_monotonic();
    if (now < kill_time(t) - RB_ABORT_GRACE) return;
    if (!t->abort_at) {
        /* The deadline passed while this code ran (not while it waited): the abort counts from
         * the deadline, so code kept busy in C past it gets no grace anew. Unless it used
         * almost no CPU since the deadline: then the process was frozen, not the code busy,
         * and the code learns of the abort now, with the grace from now to return, as a
         * frozen run that was waiting does. (This thread ran at most the wall time before the
         * deadline; what CPU it used beyond that it used after.) */
        double deadline = kill_time(t) - RB_ABORT_GRACE;
        double before = fmax(0, deadline - t->resume_mono);
        int frozen = now - deadline >= FROZEN_WALL_MIN &&
                     rb_thread_cpu_time() - t->resume_cpu - before < FROZEN_CPU_MAX;
        rb_task_is_aborted(t);          /* delivers the abort (signal, waits) */
        if (!frozen && t->abort_at > deadline) t->abort_at = deadline;
    }
    if (t->killed || now >= kill_time(t)) kill_task(L, t, now);
    else lua_sethook(L, rb_task_hook, LUA_MASKCOUNT, 1);   /* within the grace: watch closely */
}

void rb_task_install_hook(rb_task *t)
{
    lua_sethook(t->co, rb_task_hook, LUA_MASKCOUNT, 1000);
}

/* ---- relaybus.sleep and ctx:sleep -------------------------------------------------------------
 * A module keeps its sleeping waits in one binary heap, earliest first, under one timer: a
 * sleep costs its wait and a slot, not a libev timer of its own (ten thousand handlers asleep
 * at once keep one timer, not ten thousand, and about a megabyte less). */
static int wakes_before(const rb_await *a, const rb_await *b) { return a->wake_at < b->wake_at; }

static void heap_put(rb_module *m, rb_await *w, unsigned i)
{
    m->sleepers[i] = w;
    w->slot = i;
}

static void sift_up(rb_module *m, unsigned i)
{
    rb_await *w = m->sleepers[i];
    while (i > 0 && wakes_before(w, m->sleepers[(i - 1) / 2])) {
        heap_put(m, m->sleepers[(i - 1) / 2], i);
        i = (i - 1) / 2;
    }
    heap_put(m, w, i);
}

static void sift_down(rb_module *m, unsigned i)
{
    rb_await *w = m->sleepers[i];
    for (;;) {
        unsigned c = 2 * i + 1;
        if (c >= m->nsleepers) break;
        if (c + 1 < m->nsleepers && wakes_before(m->sleepers[c + 1], m->sleepers[c])) c++;
        if (!wakes_before(m->sleepers[c], w)) break;
        heap_put(m, m->sleepers[c], i);
        i = c;
    }
    heap_put(m, w, i);
}

/* The timer is set for the earliest sleeper. */
static void arm_sleep_timer(rb_module *m)
{
    rb_timer_stop(m->loop, &m->sleep_timer);
    if (m->nsleepers == 0) return;
    double wait = m->sleepers[0]->wake_at - rb_monotonic();
    rb_timer_set(&m->sleep_timer, wait > 0 ? wait : 0, 0);
    rb_timer_start(m->loop, &m->sleep_timer);
}

/* 0, or -1 when the heap cannot grow. */
static int sleep_add(rb_module *m, rb_await *w, double secs)
{
    if (m->nsleepers == m->sleepers_cap) {
        unsigned cap = m->sleepers_cap ? m->sleepers_cap * 2 : 64;
        rb_await **grown = cap > m->sleepers_cap ? rb_realloc(m->sleepers, cap * sizeof *grown) : NULL;
        if (!grown) return -1;
        m->sleepers = grown;
        m->sleepers_cap = cap;
    }
    w->wake_at = rb_monotonic() + secs;
    w->round = m->sleep_round;
    heap_put(m, w, m->nsleepers++);
    sift_up(m, w->slot);
    if (w->slot == 0) arm_sleep_timer(m);
    return 0;
}

/* Takes w out of the heap; 1 when it was the earliest (the timer must be set anew). */
static int heap_remove(rb_module *m, rb_await *w)
{
    unsigned i = w->slot;
    RB_ASSERT(m->nsleepers > 0);
    rb_await *last = m->sleepers[--m->nsleepers];
    w->slot = NOT_ASLEEP;
    if (last != w) {
        heap_put(m, last, i);
        sift_down(m, i);
        sift_up(m, last->slot);
    }
    return i == 0;
}

static void sleep_remove(rb_module *m, rb_await *w)
{
    if (heap_remove(m, w)) arm_sleep_timer(m);
}

/* Wakes the sleepers that are due, earliest first. Only those that began before this firing:
 * a sleep(0) begun by a woken one waits for the next loop iteration, as the loop's other
 * work (I/O, other timers) must have its turn. */
static void on_sleepers_due(struct ev_loop *loop, ev_timer *timer, int revents)
{
    (void)loop; (void)revents;
    rb_module *m = timer->data;
    double now = rb_monotonic();
    unsigned round = m->sleep_round++;
    while (m->nsleepers > 0 && !m->closing) {
        rb_await *w = m->sleepers[0];
        if (w->wake_at > now || (int)(w->round - round) > 0) break;
        heap_remove(m, w);      /* the timer is set once, below, not for each sleeper woken */
        lua_State *T = rb_await_target(w);
        if (T) lua_pushboolean(T, 1);
        rb_await_resolve(w, T ? 1 : 0);
    }
    if (!m->closing) arm_sleep_timer(m);
}

/* The sleeper was aborted: it leaves the heap (rb_task_abort frees it). */
static void cancel_sleep(void *ud)
{
    rb_await *w = ud;
    if (w->slot != NOT_ASLEEP) sleep_remove(w->task ? w->task->m : rb_module_get(w->L), w);
}

int rb_lua_sleep(lua_State *L)
{
    /* checked here, not by luaL_checknumber: its message names the function '?' when it is
     * called through pcall or a local */
    if (!lua_isnumber(L, 1))
        return rb_misuse(L, "sleep: seconds must be a number up to 100 years (got %s)",
                         luaL_typename(L, 1));
    double secs = lua_tonumber(L, 1);
    if (isnan(secs) || secs > RB_MAX_SECONDS)
        return rb_misuse(L, "sleep: seconds must be a number up to 100 years");
    if (secs < 0) secs = 0;
    rb_module *m = rb_module_get(L);
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    if (sleep_add(m, w, secs) != 0) {
        free(w);
        return luaL_error(L, "relaybus: out of memory");
    }
    rb_await_on_cancel(w, cancel_sleep, w);
    return rb_await_finish(L, w);
}

static void on_spawned_end(rb_task *t, int ok, const char *err)
{
    rb_module *m = t->m;
    static rb_log_limit lim;
    if (!ok) rb_log_limited(&lim, RB_LOG_ERROR, "task failed: %s", err);
    RB_ASSERT(m->ntasks > 0);
    m->ntasks--;
    rb_module_wake_run(m);
    rb_task_free(t);
}

int rb_lua_spawn(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TFUNCTION);
    rb_module *m = rb_module_get(L);
    int nargs = lua_gettop(L) - 1;
    rb_task *t = rb_task_new(m, m->L, nargs);
    if (!t) return luaL_error(L, "relaybus: out of memory");
    t->on_end = on_spawned_end;
    m->ntasks++;
    lua_xmove(L, t->co, nargs + 1);   /* the function and its arguments */
    rb_task_start(t, nargs);
    return 0;
}

/* A task still alive when its state closes waits for something that will never come: its C
 * structs go with it. Its wait is only freed: a sleep's heap and timer go as a whole, other
 * waits belong to objects already collected. */
void rb_task_close_live(rb_module *m)
{
    rb_timer_stop(m->loop, &m->yield_timer);
    m->yielded.head = m->yielded.tail = NULL;
    /* (only tasks sleep once the state closes: the main chunk is not waiting) */
    rb_timer_stop(m->loop, &m->sleep_timer);
    free(m->sleepers);
    m->sleepers = NULL;
    m->nsleepers = m->sleepers_cap = 0;
    while (m->live) {
        rb_task *t = m->live;
        unlink_live(t);
        rb_await *w = t->wait;
        t->wait = NULL;
        if (w && w->yielded) free(w);
        if (t->on_close) t->on_close(t);
        free(t);
    }
}
