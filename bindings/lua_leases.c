/* lua_leases.c -- named leases in Lua: store:try_acquire(name, duration) and
 * relaybus.local_leases(), both returning handles with name, deadline, signal, extend and
 * release (runtime/leases.c does the work).
 *
 * A handle can also run a function as a task it guards (handle:_run, used by d:every): at the
 * deadline the task's pending wait ends with nil, "aborted", and Lua code that keeps running
 * is stopped for good after the grace, exactly as for a handler whose lease ran out. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "leases.h"
#include "text.h"

#define RB_LOCAL_LEASES_MT "relaybus.local_leases"

typedef struct lua_lease {
    rb_lease *l;
    rb_module *m;
    rb_signal *signal;
    rb_task *guarded;       /* the task this lease guards, or NULL */
} lua_lease;

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

static void push_handle(lua_State *L, rb_module *m, rb_lease *l, int store_idx)
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
    rb_lease_on_expire(l, on_expire, h);
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
        push_handle(T, a->m, l, lua_gettop(T));
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

typedef struct done_wait {
    rb_await *w;
    lua_lease *h;
} done_wait;

static void on_done(void *ud, const char *err, int ok)
{
    done_wait *dw = ud;
    rb_await *w = dw->w;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T) {
        if (ok) {
            lua_pushboolean(T, 1);
            nres = 1;
            if (dw->h->guarded) dw->h->guarded->deadline = rb_lease_deadline(dw->h->l);
        } else {
            lua_pushnil(T);
            lua_pushstring(T, err ? err : "lease lost");
            nres = 2;
        }
    }
    free(dw);
    rb_await_resolve(w, nres);
}

static int lease_op(lua_State *L, int release)
{
    lua_lease *h = check_handle(L);
    double duration = 0;
    if (!release) {
        duration = luaL_optnumber(L, 2, 0);
        if (!rb_valid_seconds(duration))
            return rb_misuse(L, "extend: duration must be a number of seconds from 0 (the acquire's) to 100 years");
    }
    lua_settop(L, 1);       /* the handle stays on the stack while we wait */
    lua_getiuservalue(L, 1, 2);
    if (luaL_testudata(L, -1, RB_STORE_MT)) rb_lua_check_store(L, -1);  /* raises if closed */
    lua_pop(L, 1);
    done_wait *dw = rb_malloc(sizeof *dw);
    if (!dw) return luaL_error(L, "relaybus: out of memory");
    rb_await *w = rb_await_begin(L);
    if (!w) {
        free(dw);
        return 2;
    }
    dw->w = w;
    dw->h = h;
    if (release) rb_lease_release(h->l, on_done, dw);
    else rb_lease_extend(h->l, duration, on_done, dw);
    if (rb_lease_over(h->l) && h->signal && !release) rb_signal_fire(h->signal, RB_ABORT_LEASE);
    return rb_await_finish(L, w);
}

static int l_lease_extend(lua_State *L) { return lease_op(L, 0); }
static int l_lease_release(lua_State *L) { return lease_op(L, 1); }

/* handle:_run(fn, ...): runs fn(...) as a task of its own, stopped at this lease's deadline
 * like a handler at its own (waits end with nil, "aborted"; Lua code still running after the
 * grace is stopped for good), and waits for it: true, or nil and fn's error; nil, "aborted"
 * without running fn when the lease is over already. */
typedef struct guarded_run {
    rb_await *w;
    lua_lease *h;
} guarded_run;

static void on_guarded_end(rb_task *t, int ok, const char *err)
{
    guarded_run *g = t->ud;
    rb_await *w = g->w;
    if (g->h->guarded == t) g->h->guarded = NULL;
    free(g);
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && ok) {
        lua_pushboolean(T, 1);
        nres = 1;
    } else if (T) {
        lua_pushnil(T);
        lua_pushstring(T, err ? err : "error");
        nres = 2;
    }
    t->signal = NULL;
    rb_task_free(t);
    rb_await_resolve(w, nres);
}

/* The state closes with the guarded run still waiting: only its record is ours to free (the
 * caller's wait goes with the caller's task). */
static void on_guarded_closed(rb_task *t)
{
    free(t->ud);
    t->ud = NULL;
}

static int l_lease_run(lua_State *L)
{
    lua_lease *h = check_handle(L);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    if (h->guarded) return rb_misuse(L, "_run: this lease already guards a run");
    if (!h->l || rb_lease_over(h->l)) {
        /* Over already (a process frozen between the acquire and here): fn must not start,
         * another process may hold the name by now. */
        if (h->l && h->signal) rb_signal_fire(h->signal, RB_ABORT_LEASE);
        lua_pushnil(L);
        lua_pushliteral(L, "aborted");
        return 2;
    }
    rb_module *m = h->m;
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    guarded_run *g = rb_malloc(sizeof *g);
    if (!g) {
        free(w);
        return luaL_error(L, "relaybus: out of memory");
    }
    int nargs = lua_gettop(L) - 2;
    rb_task *t = rb_task_new(m, m->L, nargs);
    if (!t) {
        free(g);
        free(w);
        return luaL_error(L, "relaybus: out of memory");
    }
    g->w = w;
    g->h = h;
    t->ud = g;
    t->on_end = on_guarded_end;
    t->on_close = on_guarded_closed;
    t->signal = h->signal;
    t->deadline = rb_lease_deadline(h->l);
    h->guarded = t;
    lua_xmove(L, t->co, nargs + 1);     /* fn and its arguments */
    rb_task_install_hook(t);
    rb_task_start(t, nargs);
    return rb_await_finish(L, w);
}

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
    if (h->l) rb_lease_free(h->l);
    h->l = NULL;
    return 0;
}

static const luaL_Reg lease_methods[] = {
    {"extend", l_lease_extend},
    {"release", l_lease_release},
    {"_run", l_lease_run},
    {NULL, NULL}
};

static const luaL_Reg local_leases_methods[] = {
    {"try_acquire", l_local_try_acquire},
    {NULL, NULL}
};

void rb_lua_leases_register(lua_State *L)
{
    rb_register_class(L, RB_LEASE_MT, lease_methods, l_lease_index, l_lease_gc);
    rb_register_class(L, RB_LOCAL_LEASES_MT, local_leases_methods, NULL, l_local_gc);
}
