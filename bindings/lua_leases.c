/* lua_leases.c -- named leases in Lua: store:try_acquire(name, duration) and
 * relaybus.local_leases(), both returning handles with name, deadline, signal, extend and
 * release (runtime/stores/leases.c does the work).
 *
 * A handle can also run a function as a task it guards (handle:_run, used by d:every): at the
 * deadline the task's pending wait ends with nil, "aborted", and Lua code that keeps running
 * is stopped for good after the grace, exactly as for a handler whose lease ran out. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "stores/leases.h"
#include "util/list.h"
#include "util/text.h"

#define RB_LOCAL_LEASES_MT "relaybus.local_leases"

typedef struct done_wait done_wait;
struct lua_every;

typedef struct lua_lease {
    rb_lease *l;
    rb_module *m;
    rb_signal *signal;
    rb_task *guarded;       /* the task this lease guards, or NULL */
    /* Extends and releases in flight. A freed lease never answers them, so whoever frees
     * the lease frees their records: the handle's collection (own_ops), or for a borrowed
     * lease (a d:every run's: the job owns it and its expiry) the job's end. */
    done_wait *own_ops;
    struct lua_every *every;    /* a borrowed lease's job (kept alive by the handle), or NULL */
} lua_lease;

/* d:every's job on the Lua side (below); a run's borrowed handle keeps it alive. */
typedef struct lua_every {
    rb_module *m;
    int fn_ref;
    int store_ref;          /* the dispatcher's store (userdata), for the runs' handles */
    int refs;               /* the job's own, and one per borrowed handle alive */
    rb_every_run *run;      /* the run now, or NULL */
    lua_lease *h;           /* the running run's handle, or NULL */
    done_wait *ops;         /* the runs' extends and releases in flight */
} lua_every;

static void every_unref(lua_every *e);

typedef struct lua_local_leases {
    rb_local_leases *ls;
} lua_local_leases;

static void on_expire(rb_lease *l, void *ud)
{
    (void)l;
    lua_lease *h = ud;
    if (h->signal) rb_signal_fire(h->signal, RB_ABORT_LEASE);
    rb_task *t = h->guarded;
    if (t && !t->done && !t->abort_at) {
        rb_task_mark_aborted(t);
        rb_task_abort(t);
    }
}

/* With every: a borrowed lease (d:every's), whose job frees it and watches its expiry. */
static lua_lease *push_handle(lua_State *L, rb_module *m, rb_lease *l, int store_idx,
                              struct lua_every *every)
{
    lua_lease *h = lua_newuserdatauv(L, sizeof *h, 2);
    memset(h, 0, sizeof *h);
    h->l = l;
    h->m = m;
    luaL_setmetatable(L, RB_LEASE_MT);
    h->signal = rb_signal_push(L, m);
    lua_setiuservalue(L, -2, 1);
    lua_pushvalue(L, store_idx);
    lua_setiuservalue(L, -2, 2);    /* the store outlives its handles */
    h->every = every;
    if (!every) rb_lease_on_expire(l, on_expire, h);
    return h;
}

typedef struct acquire_wait {
    rb_await *w;
    int store_ref;          /* the store (or local leases) userdata, for the handle */
    rb_module *m;
} acquire_wait;

/* Builds the handle here, in the callback: a waiting coroutine resumes straight into its
 * caller with these results, so nothing can run after rb_await_finish. */
static void on_acquired(void *ud, const char *err, rb_lease *l)
{
    acquire_wait *a = ud;
    rb_await *w = a->w;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (!T) {
        if (l) rb_lease_free(l);    /* the waiter was aborted; the claim runs out */
    } else if (err) {
        lua_pushnil(T);
        lua_pushstring(T, err);
        nres = 2;
    } else if (l) {
        lua_rawgeti(T, LUA_REGISTRYINDEX, a->store_ref);
        push_handle(T, a->m, l, lua_gettop(T), NULL);
        lua_remove(T, -2);
        nres = 1;
    } else {
        lua_pushnil(T);
        nres = 1;
    }
    if (!a->m->closing) luaL_unref(a->m->L, LUA_REGISTRYINDEX, a->store_ref);
    free(a);
    rb_await_resolve(w, nres);
}

/* store:try_acquire or local:try_acquire (local non-NULL). */
static int try_acquire(lua_State *L, rb_store *s, rb_local_leases *local)
{
    size_t len;
    const char *name = luaL_checklstring(L, 2, &len);
    /* The name goes on as a C string and into text columns: a NUL would cut it (two names
     * would share one lease) and bytes that are not UTF-8 would fail at the store only. */
    if (len == 0 || len > 255 || strlen(name) != len || !rb_utf8_valid(name, len))
        return rb_misuse(L, "try_acquire: name must be 1 to 255 bytes of UTF-8 without NUL");
    double duration = luaL_checknumber(L, 3);
    if (!(duration > 0) || !rb_valid_seconds(duration))
        return rb_misuse(L, "try_acquire: duration must be a number of seconds above 0, at most 100 years");
    lua_settop(L, 3);
    acquire_wait *a = rb_malloc(sizeof *a);
    if (!a) return luaL_error(L, "relaybus: out of memory");
    rb_await *w = rb_await_begin(L);
    if (!w) {
        free(a);
        return 2;
    }
    a->w = w;
    a->m = rb_module_get(L);
    lua_pushvalue(L, 1);
    a->store_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    if (local) rb_local_lease_try_acquire(local, lua_tostring(L, 2), duration, on_acquired, a);
    else rb_lease_try_acquire(s, lua_tostring(L, 2), duration, on_acquired, a);
    return rb_await_finish(L, w);
}

int rb_lua_try_acquire(lua_State *L) { return try_acquire(L, rb_lua_check_store(L, 1), NULL); }

static int l_local_try_acquire(lua_State *L)
{
    lua_local_leases *ll = luaL_checkudata(L, 1, RB_LOCAL_LEASES_MT);
    return try_acquire(L, NULL, ll->ls);
}

int rb_lua_local_leases(lua_State *L)
{
    rb_module *m = rb_module_get(L);
    lua_local_leases *ll = lua_newuserdatauv(L, sizeof *ll, 0);
    ll->ls = rb_local_leases_new(m->loop);
    if (!ll->ls) return luaL_error(L, "relaybus: out of memory");
    luaL_setmetatable(L, RB_LOCAL_LEASES_MT);
    return 1;
}

static int l_local_gc(lua_State *L)
{
    lua_local_leases *ll = luaL_checkudata(L, 1, RB_LOCAL_LEASES_MT);
    rb_local_leases_free(ll->ls);
    ll->ls = NULL;
    return 0;
}

/* ---- handle methods ------------------------------------------------------------------------- */
static lua_lease *check_handle(lua_State *L)
{
    lua_lease *h = luaL_checkudata(L, 1, RB_LEASE_MT);
    if (!h->l) rb_misuse(L, "lease handle is closed");
    return h;
}

struct done_wait {
    rb_await *w;
    lua_lease *h;
    done_wait **list;           /* the list it is on (h->ops) */
    done_wait *prev, *next;
};

static void on_done(void *ud, const char *err, int ok)
{
    done_wait *dw = ud;
    rb_await *w = dw->w;
    RB_LIST_REMOVE(dw->list, dw);
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T) {
        if (ok) {
            lua_pushboolean(T, 1);
            nres = 1;
            if (dw->h && dw->h->guarded) dw->h->guarded->deadline = rb_lease_deadline(dw->h->l);
        } else {
            lua_pushnil(T);
            lua_pushstring(T, err ? err : "lease lost");
            nres = 2;
        }
    }
    free(dw);
    rb_await_resolve(w, nres);
}

enum { OP_EXTEND, OP_RELEASE };

static int lease_op(lua_State *L, int kind)
{
    lua_lease *h = check_handle(L);
    int release = kind == OP_RELEASE;
    double duration = 0;
    if (kind == OP_EXTEND) {
        duration = luaL_optnumber(L, 2, 0);
        if (!rb_valid_seconds(duration))
            return rb_misuse(L, "extend: duration must be a number of seconds from 0 (the acquire's) to 100 years");
    }
    lua_settop(L, 1);       /* the handle stays on the stack while we wait */
    lua_getiuservalue(L, 1, 2);
    if (luaL_testudata(L, -1, RB_STORE_MT)) rb_lua_check_store(L, -1);  /* raises if closed */
    lua_pop(L, 1);
    done_wait *dw = rb_calloc(1, sizeof *dw);
    if (!dw) return luaL_error(L, "relaybus: out of memory");
    rb_await *w = rb_await_begin(L);
    if (!w) {
        free(dw);
        return 2;
    }
    dw->w = w;
    dw->h = h;
    dw->list = h->every ? &h->every->ops : &h->own_ops;
    RB_LIST_PUSH(dw->list, dw);
    if (release) rb_lease_release(h->l, on_done, dw);
    else rb_lease_extend(h->l, duration, on_done, dw);
    if (rb_lease_over(h->l) && h->signal && !release) rb_signal_fire(h->signal, RB_ABORT_LEASE);
    return rb_await_finish(L, w);
}

static int l_lease_extend(lua_State *L) { return lease_op(L, OP_EXTEND); }
static int l_lease_release(lua_State *L) { return lease_op(L, OP_RELEASE); }
static int l_lease_index(lua_State *L)
{
    lua_lease *h = luaL_checkudata(L, 1, RB_LEASE_MT);
    const char *k = luaL_checkstring(L, 2);
    if (h->l && strcmp(k, "name") == 0) lua_pushstring(L, rb_lease_name(h->l));
    else if (h->l && strcmp(k, "deadline") == 0) lua_pushnumber(L, rb_lease_deadline(h->l));
    else if (strcmp(k, "signal") == 0) lua_getiuservalue(L, 1, 1);
    else return rb_push_method(L, 1, k);
    return 1;
}

static int l_lease_gc(lua_State *L)
{
    lua_lease *h = luaL_checkudata(L, 1, RB_LEASE_MT);
    if (h->l && !h->every) rb_lease_free(h->l);
    h->l = NULL;
    /* A handle collected with operations in flight: at the state's closing (a waiting task
     * keeps its handle on its stack), or after its task's wait was abandoned (an abort).
     * Their waits go with their tasks; their records here, or with the borrowed lease. */
    while (h->own_ops) {
        done_wait *dw = h->own_ops;
        RB_LIST_REMOVE(&h->own_ops, dw);
        free(dw);
    }
    if (h->every) {
        for (done_wait *dw = h->every->ops; dw; dw = dw->next)
            if (dw->h == h) dw->h = NULL;
        every_unref(h->every);
        h->every = NULL;
    }
    return 0;
}

static const luaL_Reg lease_methods[] = {
    {"extend", l_lease_extend},
    {"release", l_lease_release},
    {NULL, NULL}
};

static const luaL_Reg local_leases_methods[] = {
    {"try_acquire", l_local_try_acquire},
    {NULL, NULL}
};

/* ---- d:every's runs ------------------------------------------------------------------------ */
/* The job is the runtime's (rb_dispatcher_every); each run is a task guarded by the job's lease
 * like handle:_run's, given ctx {name, lease, signal, deadline, sleep}. ctx.lease is a borrowed
 * handle: detached when the run ends (later calls are misuse), and its operations still in
 * flight then are answered, or freed with the job. */

static void every_run_over(rb_task *t, lua_every *e)
{
    if (e->h) {
        if (e->h->guarded == t) e->h->guarded = NULL;
        e->h->l = NULL;
        e->h = NULL;
    }
}

static void on_every_end(rb_task *t, int ok, const char *err)
{
    lua_every *e = t->ud;
    rb_every_run *run = e->run;
    e->run = NULL;
    every_run_over(t, e);
    t->signal = NULL;
    t->ud = NULL;
    rb_task_free(t);
    rb_every_finish(run, ok, err);
}

/* The state closes with the run still suspended: it ends, unreported. */
static void on_every_closed(rb_task *t)
{
    lua_every *e = t->ud;
    rb_every_run *run = e->run;
    e->run = NULL;
    every_run_over(t, e);
    t->ud = NULL;
    rb_every_finish(run, 1, NULL);
}

static void every_abort(rb_every_run *run, void *ud)
{
    (void)run;
    lua_every *e = ud;
    if (e->h) on_expire(NULL, e->h);
}

/* ctx:sleep(s): as relaybus.sleep(s) */
static int l_every_sleep(lua_State *L)
{
    lua_remove(L, 1);
    return rb_lua_sleep(L);
}

static void every_start(rb_every_run *run, void *ud)
{
    lua_every *e = ud;
    rb_module *m = e->m;
    lua_State *L = m->L;
    if (m->closing) {
        rb_every_finish(run, 1, NULL);
        return;
    }
    rb_task *t = rb_task_new(m, L, 1);
    if (!t) {
        rb_every_finish(run, 0, "out of memory");
        return;
    }
    lua_rawgeti(L, LUA_REGISTRYINDEX, e->fn_ref);
    lua_createtable(L, 0, 5);
    lua_pushstring(L, rb_every_name(run));
    lua_setfield(L, -2, "name");
    lua_rawgeti(L, LUA_REGISTRYINDEX, e->store_ref);
    lua_lease *h = push_handle(L, m, rb_every_lease(run), lua_gettop(L), e);
    lua_remove(L, -2);
    e->refs++;
    lua_getiuservalue(L, -1, 1);
    lua_setfield(L, -3, "signal");
    lua_setfield(L, -2, "lease");
    lua_pushnumber(L, rb_every_deadline(run));
    lua_setfield(L, -2, "deadline");
    lua_pushcfunction(L, l_every_sleep);
    lua_setfield(L, -2, "sleep");
    e->h = h;
    e->run = run;
    t->ud = e;
    t->on_end = on_every_end;
    t->on_close = on_every_closed;
    t->signal = h->signal;
    t->deadline = rb_every_deadline(run);
    h->guarded = t;
    lua_xmove(L, t->co, 2);     /* fn and ctx */
    rb_task_install_hook(t);
    rb_task_start(t, 1);
}

static void every_unref(lua_every *e)
{
    RB_ASSERT(e->refs > 0);
    if (--e->refs > 0) return;
    RB_ASSERT(!e->ops && !e->run);
    free(e);
}

/* The job is freed, its lease with it: what was in flight on the lease is never answered. */
static void every_free(void *ud)
{
    lua_every *e = ud;
    while (e->ops) {
        done_wait *dw = e->ops;
        RB_LIST_REMOVE(&e->ops, dw);
        free(dw);
    }
    if (!e->m->closing) {
        luaL_unref(e->m->L, LUA_REGISTRYINDEX, e->fn_ref);
        luaL_unref(e->m->L, LUA_REGISTRYINDEX, e->store_ref);
    }
    e->fn_ref = e->store_ref = LUA_NOREF;
    every_unref(e);
}

void rb_lua_every_register(lua_State *L, rb_module *m, rb_dispatcher *d, int store_ref,
                           const char *name, double interval, int fn_idx)
{
    lua_every *e = rb_calloc(1, sizeof *e);
    if (!e) luaL_error(L, "relaybus: out of memory");
    e->m = m;
    e->refs = 1;
    lua_pushvalue(L, fn_idx);
    e->fn_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_rawgeti(L, LUA_REGISTRYINDEX, store_ref);
    e->store_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    rb_every_def def = {.start = every_start, .abort = every_abort, .free = every_free, .ud = e};
    if (rb_dispatcher_every(d, name, interval, &def) != 0) {
        luaL_unref(L, LUA_REGISTRYINDEX, e->fn_ref);
        luaL_unref(L, LUA_REGISTRYINDEX, e->store_ref);
        free(e);
        luaL_error(L, "relaybus: every: out of memory");
    }
}

void rb_lua_leases_register(lua_State *L)
{
    rb_register_class(L, RB_LEASE_MT, lease_methods, l_lease_index, l_lease_gc);
    rb_register_class(L, RB_LOCAL_LEASES_MT, local_leases_methods, NULL, l_local_gc);
}
