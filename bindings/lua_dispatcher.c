/* lua_dispatcher.c -- relaybus.dispatcher in Lua: handlers as coroutines, their ctx and
 * ctx.signal, stop and its waitable.
 *
 * Each run of a delivery is a task (task.c) whose coroutine calls the handler with the
 * delivery table and a ctx. The dispatcher (runtime/dispatch/dispatcher.c) tells us when to start,
 * when the run is aborted and when it has settled; we tell it when the handler ended. */
#include <math.h>
#include <stdlib.h>
#include <limits.h>
#include <string.h>
#include "internal.h"
#include "util/list.h"
#include "util/log.h"
#include "dispatch/metrics.h"
#include "util/check.h"

/* A wait for the dispatcher's stop: d:stop() inside a coroutine, and the waitable's wait(). */
typedef struct stop_wait {
    rb_await *w;
    struct lua_dispatcher *ld;
    struct stop_wait *next;
} stop_wait;

typedef struct lua_dispatcher {
    rb_dispatcher *d;
    rb_module *m;
    int store_ref;          /* keeps the store userdata alive */
    lua_store *st;          /* that store, told while we use it */
    int backoff_ref;        /* Lua backoff function, or LUA_NOREF */
    int self_ref;           /* keeps us alive from start until quiet (stopped, nothing left) */
    int started, stopped;
    int nhandlers;
    int events_ref;         /* d:on listeners: {claimed = {fn...}, ...}, or LUA_NOREF */
    stop_wait *waits;
    struct lua_dispatcher *prev, *next;     /* on the module's dispatchers (list.h) */
} lua_dispatcher;

typedef struct lua_handler {
    lua_dispatcher *ld;
    int fn_ref;
} lua_handler;

/* A run's ctx is also its data on the C side (rb_run_set_data): everything a run of a Lua
 * handler keeps is in this userdata and its task. From the handler's start until the run
 * settles, the registry slot of the task's coroutine holds the ctx instead, and the ctx holds
 * the coroutine (CTX_CO): one slot keeps both, whatever the handler's code does with either
 * (coroutine.close on it included). The handler's code may keep the ctx longer. */
typedef struct lua_ctx {
    rb_task *task;          /* NULL once the run settled */
    rb_run *run;            /* NULL once the run settled */
    void *tx;               /* transactional: the ctx.transaction object (a user value;
                             * once the run has ended it is closed, and raises) */
    rb_signal signal;       /* the run's abort flag; the ctx.signal object, made on first
                             * read, shows it */
} lua_ctx;

/* The ctx's user values. */
enum { CTX_SIGNAL = 1, CTX_TX, CTX_DELIVERY, CTX_CO, CTX_NUV = CTX_CO };

/* ---- signal -------------------------------------------------------------------------------
 * A signal object shows an rb_signal: its own (a named lease's handle.signal), or one kept in
 * another object, which its user value keeps alive (a run's ctx: most handlers never read
 * ctx.signal, so the object is made only when one does). */
typedef struct signal_obj {
    rb_signal *s;
    rb_signal own;          /* only in an object that owns its flag */
} signal_obj;

void rb_signal_init(rb_signal *s, rb_module *m)
{
    memset(s, 0, sizeof *s);
    s->m = m;
    s->callbacks_ref = LUA_NOREF;
}

rb_signal *rb_signal_push(lua_State *L, rb_module *m)
{
    signal_obj *o = lua_newuserdatauv(L, sizeof *o, 1);
    o->s = &o->own;
    rb_signal_init(&o->own, m);
    luaL_setmetatable(L, RB_SIGNAL_MT);
    return o->s;
}

/* A signal object showing s, which lives in the object at owner_idx. */
static void signal_push_view(lua_State *L, rb_signal *s, int owner_idx)
{
    owner_idx = lua_absindex(L, owner_idx);
    signal_obj *o = lua_newuserdatauv(L, sizeof o->s, 1);
    o->s = s;
    luaL_setmetatable(L, RB_SIGNAL_MT);
    lua_pushvalue(L, owner_idx);
    lua_setiuservalue(L, -2, 1);
}

static rb_signal *check_signal(lua_State *L)
{
    return ((signal_obj *)luaL_checkudata(L, 1, RB_SIGNAL_MT))->s;
}

/* Runs fn(reason) as a task of its own: it may yield, and an error in it is only logged. */
static void call_on_abort(rb_module *m, int fn_ref, const char *reason)
{
    lua_State *L = m->L;
    lua_pushcfunction(L, rb_lua_spawn);
    lua_rawgeti(L, LUA_REGISTRYINDEX, fn_ref);
    lua_pushstring(L, reason);
    if (lua_pcall(L, 2, 0, 0) != LUA_OK) {
        static rb_log_limit lim;
        rb_log_limited(&lim, RB_LOG_ERROR, "on_abort callback failed: %s", lua_tostring(L, -1));
        lua_pop(L, 1);
    }
}

void rb_signal_fire(rb_signal *s, rb_abort_reason reason)
{
    if (s->reason) return;
    s->reason = reason;
    if (s->callbacks_ref == LUA_NOREF || s->m->closing) return;
    lua_State *L = s->m->L;
    int ref = s->callbacks_ref;
    s->callbacks_ref = LUA_NOREF;
    lua_rawgeti(L, LUA_REGISTRYINDEX, ref);
    luaL_unref(L, LUA_REGISTRYINDEX, ref);
    int list = lua_gettop(L);
    int n = (int)lua_rawlen(L, list);
    for (int i = 1; i <= n; i++) {
        lua_rawgeti(L, list, i);
        int fn = luaL_ref(L, LUA_REGISTRYINDEX);
        call_on_abort(s->m, fn, rb_abort_reason_name(s->reason));
        luaL_unref(L, LUA_REGISTRYINDEX, fn);
    }
    lua_pop(L, 1);
}

static int l_signal_index(lua_State *L)
{
    rb_signal *s = check_signal(L);
    const char *k = luaL_checkstring(L, 2);
    if (strcmp(k, "aborted") == 0) {
        lua_pushboolean(L, s->reason != RB_ABORT_NONE);
        return 1;
    }
    if (strcmp(k, "reason") == 0) {
        if (s->reason) lua_pushstring(L, rb_abort_reason_name(s->reason));
        else lua_pushnil(L);
        return 1;
    }
    return rb_push_method(L, 1, k);
}

/* The signal of a run also checks the clock when read through check(). */
static int l_signal_check(lua_State *L)
{
    rb_signal *s = check_signal(L);
    rb_task *t = rb_task_current(L);
    if (t && t->signal == s) rb_task_is_aborted(t);
    if (s->reason) return luaL_error(L, "relaybus: aborted (%s)", rb_abort_reason_name(s->reason));
    return 0;
}

static int l_signal_on_abort(lua_State *L)
{
    rb_signal *s = check_signal(L);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    if (s->reason) {
        lua_pushvalue(L, 2);
        int fn = luaL_ref(L, LUA_REGISTRYINDEX);
        call_on_abort(s->m, fn, rb_abort_reason_name(s->reason));
        luaL_unref(L, LUA_REGISTRYINDEX, fn);
        return 0;
    }
    if (s->callbacks_ref == LUA_NOREF) {
        lua_newtable(L);
        s->callbacks_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    }
    lua_rawgeti(L, LUA_REGISTRYINDEX, s->callbacks_ref);
    lua_pushvalue(L, 2);
    lua_rawseti(L, -2, (lua_Integer)lua_rawlen(L, -2) + 1);
    return 0;
}

/* The callbacks go with the signal object: a view lives as long as the ctx that keeps it (its
 * user value), and no callback can be added to a flag before its object exists. */
static int l_signal_gc(lua_State *L)
{
    rb_signal *s = check_signal(L);
    if (s->callbacks_ref != LUA_NOREF && !s->m->closing)
        luaL_unref(L, LUA_REGISTRYINDEX, s->callbacks_ref);
    s->callbacks_ref = LUA_NOREF;
    return 0;
}

/* ---- ctx ---------------------------------------------------------------------------------- */
static lua_ctx *check_ctx(lua_State *L)
{
    return luaL_checkudata(L, 1, RB_CTX_MT);
}

static void on_settle_result(void *ud, const char *err, int applied)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T) {
        if (applied) {
            lua_pushboolean(T, 1);
            nres = 1;
        } else {
            lua_pushnil(T);
            lua_pushstring(T, err ? err : "lease lost");
            nres = 2;
        }
    }
    rb_await_resolve(w, nres);
}

/* What a ctx call answers once its run is over: nil, "aborted". */
static int run_over(lua_State *L)
{
    lua_pushnil(L);
    lua_pushliteral(L, "aborted");
    return 2;
}

static int ctx_settle(lua_State *L, rb_settle_kind kind, double delay, const char *reason)
{
    lua_ctx *c = check_ctx(L);
    if (!c->run) return run_over(L);
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    /* Once sent, a settle's answer is the truth, abort or not: true means it was written. Not
     * an extension's: past the deadline the run is over whatever it answers, and its code
     * must stop then, not when a store held up (a lock, a slow server) gets to answer. */
    if (kind != RB_OP_EXTEND) rb_await_truthful(w);
    rb_run_settle(c->run, kind, delay, reason, on_settle_result, w);
    return rb_await_finish(L, w);
}

static int l_ctx_complete(lua_State *L) { return ctx_settle(L, RB_OP_COMPLETE, 0, NULL); }

static int l_ctx_reschedule(lua_State *L)
{
    double delay = luaL_checknumber(L, 2);
    const char *reason = luaL_optstring(L, 3, NULL);
    if (!rb_valid_seconds(delay))
        return rb_misuse(L, "reschedule: delay must be a number of seconds from 0 to 100 years");
    return ctx_settle(L, RB_OP_RESCHEDULE, delay, reason);
}

static int l_ctx_bury(lua_State *L)
{
    const char *reason = luaL_optstring(L, 2, NULL);
    return ctx_settle(L, RB_OP_BURY, 0, reason);
}

static int l_ctx_release(lua_State *L)
{
    double delay = luaL_optnumber(L, 2, 0);
    if (!rb_valid_seconds(delay))
        return rb_misuse(L, "release: delay must be a number of seconds from 0 to 100 years");
    return ctx_settle(L, RB_OP_RELEASE, delay, NULL);
}

static int l_ctx_extend_lease(lua_State *L)
{
    double secs = luaL_optnumber(L, 2, 0);
    if (!rb_valid_seconds(secs))
        return rb_misuse(L, "extend_lease: duration must be a number of seconds from 0 (the "
                            "lease_duration) to 100 years");
    return ctx_settle(L, RB_OP_EXTEND, secs, NULL);
}

/* ctx:progress(value): a number or a table, stored as JSON on the delivery (its `progress`),
 * fenced by the run's lease. true, or nil and "lease lost" / "aborted". */
#define PROGRESS_MAX 65536
static int l_ctx_progress(lua_State *L)
{
    lua_ctx *c = check_ctx(L);
    int t = lua_type(L, 2);
    if (t != LUA_TNUMBER && t != LUA_TTABLE)
        return rb_misuse(L, "progress: expected a number or a table");
    lua_settop(L, 2);
    if (!rb_json_encode_as(L, 2, "progress"))
        return rb_misuse(L, "progress: not JSON-encodable (%s)", lua_tostring(L, -1));
    size_t n;
    const char *json = lua_tolstring(L, -1, &n);
    if (n > PROGRESS_MAX)
        return rb_misuse(L, "progress: its JSON is %d bytes, more than %d", (int)(n > INT_MAX ? INT_MAX : n),
                         PROGRESS_MAX);
    if (!c->run) return run_over(L);
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    rb_run_progress(c->run, json, on_settle_result, w);
    return rb_await_finish(L, w);
}

/* ctx:sleep(s): as relaybus.sleep, and nil, "aborted" once the run is over. */
static int l_ctx_sleep(lua_State *L)
{
    lua_ctx *c = check_ctx(L);
    if (!c->run) return run_over(L);
    lua_remove(L, 1);       /* the seconds become relaybus.sleep's first argument */
    return rb_lua_sleep(L);
}

/* ctx:backoff() -> the seconds a retry of this attempt waits under the dispatcher's backoff */
static int l_ctx_backoff(lua_State *L)
{
    lua_ctx *c = check_ctx(L);
    if (!c->run) return run_over(L);
    lua_pushnumber(L, rb_run_backoff(c->run));
    return 1;
}

static int l_ctx_index(lua_State *L)
{
    lua_ctx *c = check_ctx(L);
    const char *k = luaL_checkstring(L, 2);
    if (strcmp(k, "signal") == 0) {
        if (lua_getiuservalue(L, 1, CTX_SIGNAL) == LUA_TNIL) {
            lua_pop(L, 1);
            signal_push_view(L, &c->signal, 1);
            lua_pushvalue(L, -1);
            lua_setiuservalue(L, 1, CTX_SIGNAL);
        }
        return 1;
    }
    if (strcmp(k, "transaction") == 0) {
        if (lua_getiuservalue(L, 1, CTX_TX) == LUA_TNIL)
            return rb_misuse(L, "ctx.transaction: this handler is not transactional (declare "
                                "it with d:handle(topic, fn, {transactional = true}))");
        return 1;
    }
    if (strcmp(k, "delivery") == 0) {
        lua_getiuservalue(L, 1, CTX_DELIVERY);
        return 1;
    }
    if (strcmp(k, "deadline") == 0) {
        if (c->run) lua_pushnumber(L, rb_run_deadline(c->run));
        else lua_pushnumber(L, rb_monotonic());
        return 1;
    }
    return rb_push_method(L, 1, k);
}

/* ---- handler callbacks from the dispatcher ------------------------------------------------- */
/* The run has settled: the ctx keeps nothing of it, and the task (whose coroutine has ended)
 * goes back to the pool or away, and with it the hold on the ctx. */
static void ctx_release(lua_ctx *c)
{
    rb_task *t = c->task;
    lua_State *L = t->m->L;
    c->run = NULL;
    c->task = NULL;
    t->run = NULL;
    t->signal = NULL;
    t->ud = NULL;
    if (!t->m->closing) {
        /* the coroutine's registry slot holds the coroutine again, not the ctx */
        lua_rawgeti(L, LUA_REGISTRYINDEX, t->co_ref);
        lua_getiuservalue(L, -1, CTX_CO);
        lua_rawseti(L, LUA_REGISTRYINDEX, t->co_ref);
        lua_pop(L, 1);
        /* a coroutine that returned values can run again without them */
        if (t->done && !t->running && lua_status(t->co) == LUA_OK) lua_settop(t->co, 0);
    }
    rb_task_free(t);
}

/* The state closes with the handler still suspended: the ctx goes with the state. */
static void on_handler_closed(rb_task *t)
{
    t->ud = NULL;
}

static void on_handler_end(rb_task *t, int ok, const char *err)
{
    lua_ctx *c = t->ud;
    rb_run *run = t->run;
    /* The handler's transaction object is unusable from here on. */
    if (c->tx && !t->m->closing) rb_tx_invalidate_object(c->tx);
    static rb_log_limit raised;
    if (!ok && !rb_run_aborted(run))
        rb_log_limited_d(&raised, RB_LOG_INFO, rb_run_delivery(run)->id, rb_run_delivery(run)->topic,
                         "handler of %s (%s) raised: %s", rb_run_delivery(run)->id,
                         rb_run_delivery(run)->topic, err);
    rb_run_finish(run, ok, err);    /* may settle (and release c) before it returns */
}

static void on_bad_payload_buried(void *ud, const char *err, int applied)
{
    rb_run *run = ud;
    rb_run_finish(run, applied, applied ? NULL : err);
}

static void handler_start(rb_run *run, void *ud)
{
    lua_handler *h = ud;
    rb_module *m = h->ld->m;
    lua_State *L = m->L;
    const rb_delivery *del = rb_run_delivery(run);

    /* A payload that is not JSON (a row written by hand) can never succeed: bury it. */
    rb_push_record(L, m, del);
    lua_getfield(L, -1, "payload_error");
    if (!lua_isnil(L, -1)) {
        const char *why = lua_tostring(L, -1);
        rb_run_set_data(run, NULL);
        rb_run_settle(run, RB_OP_BURY, 0, why, on_bad_payload_buried, run);
        lua_pop(L, 2);
        return;
    }
    lua_pop(L, 1);
    int rec = lua_gettop(L);

    rb_task *t = rb_task_new(m, L, 2);
    if (!t) {
        lua_pop(L, 1);
        rb_run_finish(run, 0, "out of memory");
        return;
    }
    lua_ctx *c = lua_newuserdatauv(L, sizeof *c, CTX_NUV);
    memset(c, 0, sizeof *c);
    c->task = t;
    c->run = run;
    rb_signal_init(&c->signal, m);
    luaL_setmetatable(L, RB_CTX_MT);
    t->run = run;
    t->ud = c;
    t->on_end = on_handler_end;
    t->on_close = on_handler_closed;
    t->signal = &c->signal;
    if (rb_run_tx(run)) {
        lua_rawgeti(L, LUA_REGISTRYINDEX, h->ld->store_ref);
        rb_push_tx(L, rb_dispatcher_store(rb_run_dispatcher(run)), rb_run_tx(run), 0, -1);
        lua_remove(L, -2);
        c->tx = lua_touserdata(L, -1);
        lua_setiuservalue(L, -2, CTX_TX);
    }
    lua_pushvalue(L, rec);
    lua_setiuservalue(L, -2, CTX_DELIVERY);
    lua_rawgeti(L, LUA_REGISTRYINDEX, t->co_ref);
    lua_setiuservalue(L, -2, CTX_CO);
    lua_pushvalue(L, -1);
    lua_rawseti(L, LUA_REGISTRYINDEX, t->co_ref);     /* see lua_ctx */
    rb_run_set_data(run, c);

    /* the coroutine's stack: the handler, the delivery and the ctx */
    lua_rawgeti(L, LUA_REGISTRYINDEX, h->fn_ref);
    lua_pushvalue(L, rec);
    lua_pushvalue(L, -3);
    lua_xmove(L, t->co, 3);
    lua_pop(L, 2);          /* the ctx and the record */
    rb_task_install_hook(t);
    rb_task_start(t, 2);
}

static void handler_abort(rb_run *run, rb_abort_reason reason, void *ud)
{
    (void)ud;
    lua_ctx *c = rb_run_get_data(run);
    if (!c || !c->task || c->task->done) return;
    rb_task *t = c->task;
    rb_task_mark_aborted(t);
    if (t->signal) rb_signal_fire(t->signal, reason);
    rb_task_abort(t);
}

static void handler_settled(rb_run *run, void *ud)
{
    (void)ud;
    lua_ctx *c = rb_run_get_data(run);
    if (!c) return;
    rb_run_set_data(run, NULL);
    /* The coroutine has ended (finish comes before settle), so the task can go. */
    ctx_release(c);
}

static void handler_free(void *ud)
{
    lua_handler *h = ud;
    if (!h->ld->m->closing) luaL_unref(h->ld->m->L, LUA_REGISTRYINDEX, h->fn_ref);
    free(h);
}

/* ---- the dispatcher object ------------------------------------------------------------------- */
static lua_dispatcher *check_dispatcher(lua_State *L, int idx)
{
    lua_dispatcher *ld = luaL_checkudata(L, idx, RB_DISPATCHER_MT);
    if (!ld->d) rb_misuse(L, "dispatcher is closed");
    return ld;
}

/* The dispatcher keeps its store's C struct, which a store:close() frees: every call that
 * reaches the store through the dispatcher checks first that it is still open. */
static void check_store_open(lua_State *L, lua_dispatcher *ld, const char *what)
{
    lua_rawgeti(L, LUA_REGISTRYINDEX, ld->store_ref);
    if (luaL_checkudata(L, -1, RB_STORE_MT) && !rb_lua_store_open(L, -1))
        rb_misuse(L, "%s: the dispatcher's store is closed", what);
    lua_pop(L, 1);
}

static double lua_backoff(int attempts, void *ud)
{
    lua_dispatcher *ld = ud;
    lua_State *L = ld->m->L;
    if (ld->m->closing) return 1;
    lua_rawgeti(L, LUA_REGISTRYINDEX, ld->backoff_ref);
    lua_pushinteger(L, attempts);
    double s = pow(2.0, attempts);
    if (lua_pcall(L, 1, 1, 0) != LUA_OK) {
        static rb_log_limit lim;
        rb_log_limited(&lim, RB_LOG_ERROR, "backoff function failed: %s", lua_tostring(L, -1));
    } else if (lua_isnumber(L, -1)) {
        s = lua_tonumber(L, -1);
    } else {
        static rb_log_limit lim;
        rb_log_limited(&lim, RB_LOG_ERROR, "backoff function returned %s, not a number", luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    return s;       /* the dispatcher clamps it into range */
}

static void on_stopped(rb_dispatcher *d, void *ud)
{
    (void)d;
    lua_dispatcher *ld = ud;
    rb_module *m = ld->m;
    ld->stopped = 1;
    RB_ASSERT(m->ndispatchers_running > 0);
    m->ndispatchers_running--;
    rb_module_wake_run(m);
    if (m->closing) return;
    rb_lua_store_use(ld->st, -1, 0);
    /* Runs still unsettled at the stop's end were aborted, which cut their own transfers;
     * other transfers of the state are not this dispatcher's to cut. */
    stop_wait *sw = ld->waits;
    ld->waits = NULL;
    while (sw) {
        stop_wait *next = sw->next;
        rb_await *w = sw->w;
        free(sw);
        lua_State *T = rb_await_target(w);
        if (T) lua_pushboolean(T, 1);
        rb_await_resolve(w, T ? 1 : 0);
        sw = next;
    }
}

/* Stopped with nothing left in flight: the dispatcher no longer keeps itself (or its store's
 * close) back; once unreachable, the collector frees it. */
static void on_quiet(rb_dispatcher *d, void *ud)
{
    (void)d;
    lua_dispatcher *ld = ud;
    if (ld->m->closing || ld->self_ref == LUA_NOREF) return;
    rb_lua_store_use(ld->st, 0, -1);    /* may close the store: nothing of ours uses it now */
    luaL_unref(ld->m->L, LUA_REGISTRYINDEX, ld->self_ref);
    ld->self_ref = LUA_NOREF;
}

static const char *const dispatcher_opts[] = {
    "lease_duration", "shutdown_timeout", "concurrency", "poll_interval", "backoff",
    "retention", "claim_ahead", "listen_poll_interval", NULL};

int rb_lua_dispatcher_new(lua_State *L)
{
    lua_store *st = rb_lua_store_object(L, 1);
    rb_check_options(L, 2, "dispatcher", dispatcher_opts);
    rb_module *m = rb_module_get(L);
    rb_dispatcher_options o;
    rb_dispatcher_options_init(&o);
    o.lease_duration = rb_opt_number(L, 2, "lease_duration", o.lease_duration);
    o.shutdown_timeout = rb_opt_number(L, 2, "shutdown_timeout", o.shutdown_timeout);
    o.poll_interval = rb_opt_number(L, 2, "poll_interval", o.poll_interval);
    o.listen_poll_interval = rb_opt_number(L, 2, "listen_poll_interval", o.listen_poll_interval);
    o.retention = rb_opt_number(L, 2, "retention", o.retention);
    double conc = rb_opt_number(L, 2, "concurrency", o.concurrency);
    if (!(conc >= 1) || conc != floor(conc) || conc > RB_MAX_CONCURRENCY)
        rb_misuse(L, "dispatcher: concurrency must be an integer from 1 to 1000000");
    o.concurrency = (int)conc;
    double ahead = rb_opt_number(L, 2, "claim_ahead", o.claim_ahead);
    if (!(ahead >= 0) || ahead != floor(ahead) || ahead > RB_MAX_CLAIM_AHEAD)
        rb_misuse(L, "dispatcher: claim_ahead must be an integer from 0 to 100");
    o.claim_ahead = (int)ahead;
    char why[160];
    if (rb_dispatcher_options_check(&o, why, sizeof why) != 0) rb_misuse(L, "dispatcher: %s", why);
    lua_dispatcher *ld = lua_newuserdatauv(L, sizeof *ld, 1);
    memset(ld, 0, sizeof *ld);
    ld->m = m;
    ld->backoff_ref = LUA_NOREF;
    ld->self_ref = LUA_NOREF;
    ld->events_ref = LUA_NOREF;
    luaL_setmetatable(L, RB_DISPATCHER_MT);
    if (lua_istable(L, 2)) {
        lua_getfield(L, 2, "backoff");
        if (lua_isfunction(L, -1)) {
            ld->backoff_ref = luaL_ref(L, LUA_REGISTRYINDEX);
            o.backoff = lua_backoff;
            o.backoff_ud = ld;
        } else if (!lua_isnil(L, -1)) {
            rb_misuse(L, "dispatcher: backoff must be a function");
        } else {
            lua_pop(L, 1);
        }
    }
    o.on_stopped = on_stopped;
    o.on_stopped_ud = ld;
    o.on_quiet = on_quiet;
    o.on_quiet_ud = ld;
    lua_pushvalue(L, 1);
    ld->store_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    ld->st = st;
    ld->d = rb_dispatcher_new(rb_lua_check_store(L, 1), &o);
    if (!ld->d) return luaL_error(L, "relaybus: out of memory");
    if (m->metrics && rb_metrics_attach(m->metrics, ld->d) != 0)
        return luaL_error(L, "relaybus: out of memory");
    RB_LIST_PUSH(&m->dispatchers, ld);
    return 1;
}

static const char *const handle_opts[] = {"transactional", "timeout", "concurrency", "priority", NULL};

static int l_handle(lua_State *L)
{
    lua_dispatcher *ld = check_dispatcher(L, 1);
    const char *topic = rb_check_topic(L, 2, "handle");
    if (!lua_isfunction(L, 3)) return rb_misuse(L, "handle: expected a function");
    rb_check_options(L, 4, "handle", handle_opts);
    if (ld->started) return rb_misuse(L, "handle: the dispatcher has already started");
    rb_handler_def def = {0};
    if (lua_istable(L, 4)) {
        lua_getfield(L, 4, "transactional");
        def.transactional = lua_toboolean(L, -1);
        lua_pop(L, 1);
        double conc = rb_opt_number(L, 4, "concurrency", 0);
        int given = lua_getfield(L, 4, "concurrency") != LUA_TNIL;
        lua_pop(L, 1);
        if (!((conc >= 1 || (!given && conc == 0)) && conc <= RB_MAX_CONCURRENCY) || conc != floor(conc))
            return rb_misuse(L, "handle: concurrency must be an integer from 1 to 1000000");
        def.concurrency = (int)conc;
        double prio = rb_opt_number(L, 4, "priority", 0);
        if (!(prio >= -1000000 && prio <= 1000000) || prio != floor(prio))
            return rb_misuse(L, "handle: priority must be an integer from -1000000 to 1000000 (higher claims first)");
        def.priority = (int)prio;
        def.timeout = rb_opt_number(L, 4, "timeout", 0);
        if (!rb_valid_seconds(def.timeout))
            return rb_misuse(L, "handle: timeout must be a number of seconds from 0 (none) to "
                                "100 years");
    }
    lua_handler *h = rb_calloc(1, sizeof *h);
    if (!h) return luaL_error(L, "relaybus: out of memory");
    h->ld = ld;
    lua_pushvalue(L, 3);
    h->fn_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    def.start = handler_start;
    def.abort = handler_abort;
    def.settled = handler_settled;
    def.free = handler_free;
    def.ud = h;
    ld->nhandlers++;
    if (rb_dispatcher_handle(ld->d, topic, &def) != 0) {
        RB_ASSERT(ld->nhandlers > 0);
        ld->nhandlers--;
        luaL_unref(L, LUA_REGISTRYINDEX, h->fn_ref);
        free(h);
        return rb_misuse(L, "handle: topic '%s' already has a handler", topic);
    }
    lua_settop(L, 1);
    return 1;
}

static int l_start(lua_State *L)
{
    lua_dispatcher *ld = check_dispatcher(L, 1);
    if (ld->stopped) return rb_misuse(L, "start: this dispatcher was stopped; make a new one");
    if (ld->started) return 0;
    check_store_open(L, ld, "start");
    if (rb_dispatcher_start(ld->d) != 0) return luaL_error(L, "relaybus: out of memory");
    ld->started = 1;
    ld->m->ndispatchers_running++;
    lua_pushvalue(L, 1);
    ld->self_ref = luaL_ref(L, LUA_REGISTRYINDEX);   /* alive until quiet */
    rb_lua_store_use(ld->st, 1, 1);
    lua_settop(L, 1);
    return 1;
}

static void unlink_wait(stop_wait *sw)
{
    for (stop_wait **pp = &sw->ld->waits; *pp; pp = &(*pp)->next)
        if (*pp == sw) {
            *pp = sw->next;
            break;
        }
}

/* The waiter was aborted (its run's deadline): it gives up; the stop goes on. */
static void cancel_wait(void *ud)
{
    stop_wait *sw = ud;
    unlink_wait(sw);
    free(sw);
}

/* Waits until the dispatcher has stopped: true. */
static int wait_stopped(lua_State *L, lua_dispatcher *ld)
{
    if (ld->stopped || !ld->started) {
        lua_pushboolean(L, 1);
        return 1;
    }
    /* even an aborted caller gets its stop: it just does not wait for it */
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    stop_wait *sw = rb_calloc(1, sizeof *sw);
    if (!sw) {
        free(w);
        return luaL_error(L, "relaybus: out of memory");
    }
    sw->w = w;
    sw->ld = ld;
    sw->next = ld->waits;
    ld->waits = sw;
    rb_await_on_cancel(w, cancel_wait, sw);
    return rb_await_finish(L, w);
}

static const char *const stop_opts[] = {"timeout", NULL};

/* d:stop{timeout=T}: inside a coroutine it waits; outside it returns a waitable. */
static int l_stop(lua_State *L)
{
    lua_dispatcher *ld = check_dispatcher(L, 1);
    /* docs/lua.md: the number T is the same as {timeout = T} */
    if (lua_type(L, 2) != LUA_TNUMBER) rb_check_options(L, 2, "stop", stop_opts);
    double timeout = -1;
    if (lua_istable(L, 2)) timeout = rb_opt_number(L, 2, "timeout", -1);
    else if (lua_isnumber(L, 2)) timeout = lua_tonumber(L, 2);
    if (timeout != -1 && !rb_valid_seconds(timeout))
        return rb_misuse(L, "stop: timeout must be a number of seconds from 0 to 100 years");
    if (ld->started && !ld->stopped) rb_dispatcher_stop(ld->d, timeout, NULL, NULL);
    else if (!ld->started) ld->stopped = 1;
    if (rb_task_current(L)) return wait_stopped(L, ld);
    lua_newuserdatauv(L, 0, 1);
    lua_pushvalue(L, 1);
    lua_setiuservalue(L, -2, 1);
    luaL_setmetatable(L, RB_STOPWAIT_MT);
    return 1;
}

static int l_stopwait_wait(lua_State *L)
{
    luaL_checkudata(L, 1, RB_STOPWAIT_MT);
    lua_getiuservalue(L, 1, 1);
    lua_dispatcher *ld = luaL_checkudata(L, -1, RB_DISPATCHER_MT);
    return wait_stopped(L, ld);
}

static int l_stopwait_done(lua_State *L)
{
    luaL_checkudata(L, 1, RB_STOPWAIT_MT);
    lua_getiuservalue(L, 1, 1);
    lua_dispatcher *ld = luaL_checkudata(L, -1, RB_DISPATCHER_MT);
    lua_pushboolean(L, ld->stopped || !ld->started);
    return 1;
}

static int l_dispatcher_stats(lua_State *L)
{
    lua_dispatcher *ld = check_dispatcher(L, 1);
    lua_createtable(L, 0, 4);
    lua_pushinteger(L, (lua_Integer)rb_dispatcher_active(ld->d));
    lua_setfield(L, -2, "active");
    lua_pushinteger(L, (lua_Integer)rb_dispatcher_ahead(ld->d));
    lua_setfield(L, -2, "ahead");
    lua_pushboolean(L, rb_dispatcher_running(ld->d));
    lua_setfield(L, -2, "running");
    lua_pushboolean(L, rb_dispatcher_stopping(ld->d));
    lua_setfield(L, -2, "stopping");
    return 1;
}

static void unlink_dispatcher(lua_dispatcher *ld)
{
    RB_LIST_REMOVE(&ld->m->dispatchers, ld);
}

static int l_dispatcher_gc(lua_State *L)
{
    lua_dispatcher *ld = luaL_checkudata(L, 1, RB_DISPATCHER_MT);
    if (!ld->d) return 0;
    /* A started dispatcher keeps itself alive until it is quiet, so collecting one that is
     * not means lua_close: from here no callback may touch Lua any more. */
    if (ld->self_ref != LUA_NOREF) ld->m->closing = 1;
    unlink_dispatcher(ld);
    if (ld->events_ref != LUA_NOREF && !ld->m->closing) luaL_unref(L, LUA_REGISTRYINDEX, ld->events_ref);
    ld->events_ref = LUA_NOREF;
    if (ld->started && !ld->stopped) {
        RB_ASSERT(ld->m->ndispatchers_running > 0);
        ld->m->ndispatchers_running--;
    }
    ld->stopped = 1;
    rb_dispatcher_free(ld->d);
    ld->d = NULL;
    return 0;
}

/* ---- d:on(event, fn): lifecycle events to Lua ------------------------------------------------ */
static const char *const lua_events[] = {"claimed", "started", "settled", NULL};

/* Each listener runs as a task of its own with the event's table; an error in it is logged
 * (by the task) and never touches the delivery. */
static void on_lua_event(rb_dispatcher *d, const rb_event *ev, void *ud)
{
    (void)d;
    lua_dispatcher *ld = ud;
    rb_module *m = ld->m;
    const char *name = ev->kind == RB_EV_CLAIMED ? "claimed" : ev->kind == RB_EV_STARTED ? "started"
                     : ev->kind == RB_EV_SETTLED ? "settled" : NULL;
    if (!name || m->closing || ld->events_ref == LUA_NOREF) return;
    lua_State *L = m->L;
    if (!lua_checkstack(L, 8)) return;
    lua_rawgeti(L, LUA_REGISTRYINDEX, ld->events_ref);
    if (lua_getfield(L, -1, name) != LUA_TTABLE) {
        lua_pop(L, 2);
        return;
    }
    int fns = lua_gettop(L);
    lua_Integer n = (lua_Integer)lua_rawlen(L, fns);
    for (lua_Integer i = 1; i <= n; i++) {
        lua_pushcfunction(L, rb_lua_spawn);
        lua_rawgeti(L, fns, i);
        lua_createtable(L, 0, 8);
        lua_pushstring(L, name);
        lua_setfield(L, -2, "event");
        lua_pushstring(L, ev->delivery->id);
        lua_setfield(L, -2, "id");
        lua_pushstring(L, ev->delivery->topic);
        lua_setfield(L, -2, "topic");
        lua_pushinteger(L, ev->delivery->attempts);
        lua_setfield(L, -2, "attempt");
        if (ev->kind == RB_EV_STARTED) {
            lua_pushnumber(L, ev->start_delay);
            lua_setfield(L, -2, "start_delay");
        } else if (ev->kind == RB_EV_SETTLED) {
            lua_pushstring(L, rb_outcome_name(ev->outcome));
            lua_setfield(L, -2, "outcome");
            lua_pushnumber(L, ev->duration);
            lua_setfield(L, -2, "duration");
            if (ev->error) {
                lua_pushstring(L, ev->error);
                lua_setfield(L, -2, "error");
            }
        }
        if (lua_pcall(L, 2, 0, 0) != LUA_OK) {
            static rb_log_limit lim;
            rb_log_limited(&lim, RB_LOG_ERROR, "d:on(\"%s\") listener could not run: %s", name,
                           lua_tostring(L, -1));
            lua_pop(L, 1);
        }
    }
    lua_pop(L, 2);
}

static int l_on(lua_State *L)
{
    lua_dispatcher *ld = check_dispatcher(L, 1);
    int which = luaL_checkoption(L, 2, NULL, lua_events);
    luaL_checktype(L, 3, LUA_TFUNCTION);
    if (ld->events_ref == LUA_NOREF) {
        if (rb_dispatcher_on_event(ld->d, on_lua_event, ld) != 0)
            return luaL_error(L, "relaybus: out of memory");
        lua_newtable(L);
        ld->events_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    }
    lua_rawgeti(L, LUA_REGISTRYINDEX, ld->events_ref);
    if (lua_getfield(L, -1, lua_events[which]) != LUA_TTABLE) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_pushvalue(L, -1);
        lua_setfield(L, -3, lua_events[which]);
    }
    lua_pushvalue(L, 3);
    lua_rawseti(L, -2, (lua_Integer)lua_rawlen(L, -2) + 1);
    lua_settop(L, 1);
    return 1;
}

/* d:every(name, interval, fn): fn(ctx) once per interval across every process whose
 * dispatcher on the same store has the same job (runtime/dispatch/every.c; the runs are
 * lua_leases.c's). Before start only. */
static int l_every(lua_State *L)
{
    lua_dispatcher *ld = check_dispatcher(L, 1);
    size_t n;
    const char *name = lua_type(L, 2) == LUA_TSTRING ? lua_tolstring(L, 2, &n) : NULL;
    if (!name || strlen(name) != n || !rb_every_valid_name(name))
        return rb_misuse(L, "every: name must be 1 to 249 bytes of UTF-8 without NUL");
    double interval = lua_type(L, 3) == LUA_TNUMBER ? lua_tonumber(L, 3) : NAN;
    if (!(interval > 0 && interval <= RB_MAX_SECONDS))
        return rb_misuse(L, "every: interval must be a number of seconds above 0, at most 100 years");
    if (lua_type(L, 4) != LUA_TFUNCTION) return rb_misuse(L, "every: expected a function");
    if (ld->started || ld->stopped)
        return rb_misuse(L, "every: the dispatcher has started; call every before start");
    check_store_open(L, ld, "every");
    rb_lua_every_register(L, ld->m, ld->d, ld->store_ref, name, interval, 4);
    lua_settop(L, 1);
    return 1;
}

static const luaL_Reg dispatcher_methods[] = {
    {"handle", l_handle},
    {"start", l_start},
    {"stop", l_stop},
    {"stats", l_dispatcher_stats},
    {"every", l_every},
    {"on", l_on},
    {NULL, NULL}
};

static const luaL_Reg ctx_methods[] = {
    {"sleep", l_ctx_sleep},
    {"extend_lease", l_ctx_extend_lease},
    {"progress", l_ctx_progress},
    {"reschedule", l_ctx_reschedule},
    {"bury", l_ctx_bury},
    {"release", l_ctx_release},
    {"complete", l_ctx_complete},
    {"backoff", l_ctx_backoff},
    {NULL, NULL}
};

static const luaL_Reg signal_methods[] = {
    {"check", l_signal_check},
    {"on_abort", l_signal_on_abort},
    {NULL, NULL}
};

static const luaL_Reg stopwait_methods[] = {
    {"wait", l_stopwait_wait},
    {"done", l_stopwait_done},
    {NULL, NULL}
};

/* Dispatchers of m with handlers that were never started (relaybus.run() says so). */
int rb_lua_unstarted(rb_module *m)
{
    int n = 0;
    for (lua_dispatcher *ld = m->dispatchers; ld; ld = ld->next)
        if (ld->d && !ld->started && !ld->stopped && ld->nhandlers > 0) n++;
    return n;
}

void rb_lua_check_deadlines(rb_module *m)
{
    for (lua_dispatcher *ld = m->dispatchers; ld; ld = ld->next)
        if (ld->d && ld->started && !ld->stopped) rb_dispatcher_check_deadlines(ld->d);
}

struct lua_dispatcher *rb_lua_dispatcher_next(struct lua_dispatcher *ld) { return ld->next; }

void rb_lua_dispatcher_attach_metrics(struct lua_dispatcher *ld, rb_metrics *mx)
{
    if (ld->d && rb_metrics_attach(mx, ld->d) != 0)
        rb_log(RB_LOG_WARN, "serve: out of memory: a dispatcher's runs are not counted");
}

int rb_lua_stop_all(lua_State *L)
{
    rb_module *m = rb_module_get(L);
    int n = rb_lua_stop_servers(m);
    for (lua_dispatcher *ld = m->dispatchers; ld; ld = ld->next) {
        if (ld->d && ld->started && !ld->stopped) {
            rb_dispatcher_stop(ld->d, -1, NULL, NULL);
            n++;
        }
    }
    return n;
}

void rb_lua_dispatcher_register(lua_State *L)
{
    rb_register_class(L, RB_DISPATCHER_MT, dispatcher_methods, NULL, l_dispatcher_gc);
    rb_register_class(L, RB_CTX_MT, ctx_methods, l_ctx_index, NULL);
    rb_register_class(L, RB_SIGNAL_MT, signal_methods, l_signal_index, l_signal_gc);
    rb_register_class(L, RB_STOPWAIT_MT, stopwait_methods, NULL, NULL);
}
