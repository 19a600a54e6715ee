/* lua_leases.c -- named leases in Lua: store:try_acquire(name, duration) and
 * relaybus.local_leases(), both returning handles with name, deadline, signal, extend and
 * release.
 *
 * The handle's deadline is on the monotonic clock, measured from just before the claim was
 * sent, so it ends before the store's expiry; an ev_timer aborts handle.signal there. The
 * local variant keeps its table of holders in the process (for tests and single-process use). */
#include <stdlib.h>
#include <string.h>
#include "internal.h"

#define RB_LOCAL_LEASES_MT "relaybus.local_leases"

typedef struct lua_lease {
    rb_module *m;
    rb_store *s;            /* NULL for a local lease */
    int local_ref;          /* local: registry ref to the holders table */
    char name[256];
    char token[33];
    double deadline;
    int released;
    ev_timer timer;
    rb_signal *signal;
} lua_lease;

static void on_lease_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    lua_lease *l = w->data;
    if (l->signal) rb_signal_fire(l->signal, RB_ABORT_LEASE);
}

static void arm(lua_lease *l)
{
    ev_timer_stop(l->m->loop, &l->timer);
    double wait = l->deadline - rb_monotonic();
    ev_timer_set(&l->timer, wait > 0 ? wait : 0, 0);
    ev_timer_start(l->m->loop, &l->timer);
}

/* Pushes a new handle (with its signal in user value 1). */
static lua_lease *push_handle(lua_State *L, rb_module *m, const char *name, const char *token,
                              double deadline)
{
    lua_lease *l = lua_newuserdatauv(L, sizeof *l, 2);
    memset(l, 0, sizeof *l);
    l->m = m;
    l->local_ref = LUA_NOREF;
    snprintf(l->name, sizeof l->name, "%s", name);
    memcpy(l->token, token, 33);
    l->deadline = deadline;
    luaL_setmetatable(L, RB_LEASE_MT);
    l->signal = rb_signal_push(L, m);
    lua_setiuservalue(L, -2, 1);
    ev_timer_init(&l->timer, on_lease_deadline, 0, 0);
    l->timer.data = l;
    arm(l);
    return l;
}

/* The margin keeps our deadline ahead of the store's expiry (clock rates, the round trip). */
static double margin_for(double duration)
{
    double m = duration * 0.1;
    if (m < 0.05) m = 0.05;
    if (m > 5) m = 5;
    return m;
}

typedef struct acquire_wait {
    rb_await *w;
    double sent_at, duration;
} acquire_wait;

static void on_acquired(void *ud, const char *err, int acquired, double expires_at)
{
    (void)expires_at;
    acquire_wait *a = ud;
    rb_await *w = a->w;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T) {
        if (err) {
            lua_pushnil(T);
            lua_pushstring(T, err);
            nres = 2;
        } else if (acquired) {
            lua_pushnumber(T, a->sent_at + a->duration - margin_for(a->duration));
            nres = 1;
        } else {
            lua_pushnil(T);
            nres = 1;
        }
    }
    free(a);
    rb_await_resolve(w, nres);
}

static void check_name(lua_State *L, int idx)
{
    size_t len;
    luaL_checklstring(L, idx, &len);
    if (len == 0 || len >= 256) rb_misuse(L, "lease name must be 1 to 255 bytes");
}

int rb_lua_try_acquire(lua_State *L)
{
    rb_store *s = rb_lua_check_store(L, 1);
    check_name(L, 2);
    const char *name = lua_tostring(L, 2);
    double duration = luaL_checknumber(L, 3);
    if (!(duration > 0)) return rb_misuse(L, "try_acquire: duration must be > 0");
    if (!s->vt->lease_acquire) return rb_misuse(L, "named leases are not supported by this store");
    char token[33];
    rb_random_token(token);
    acquire_wait *a = malloc(sizeof *a);
    if (!a) return luaL_error(L, "relaybus: out of memory");
    rb_await *w = rb_await_begin(L);
    if (!w) {
        free(a);
        return 2;
    }
    a->w = w;
    a->sent_at = rb_monotonic();
    a->duration = duration;
    s->vt->lease_acquire(s, name, token, duration, on_acquired, a);
    int n = rb_await_finish(L, w);
    if (n == 1 && lua_isnumber(L, -1)) {
        double deadline = lua_tonumber(L, -1);
        lua_pop(L, 1);
        lua_lease *l = push_handle(L, rb_module_get(L), name, token, deadline);
        l->s = s;
        lua_pushvalue(L, 1);
        lua_setiuservalue(L, -2, 2);    /* keep the store alive with the handle */
        return 1;
    }
    return n;
}

/* ---- local leases: holders kept in a Lua table {name = {token, expires}} --------------------- */
static int local_try_acquire(lua_State *L)
{
    luaL_checkudata(L, 1, RB_LOCAL_LEASES_MT);
    check_name(L, 2);
    double duration = luaL_checknumber(L, 3);
    if (!(duration > 0)) return rb_misuse(L, "try_acquire: duration must be > 0");
    double now = rb_monotonic();
    lua_getiuservalue(L, 1, 1);
    int holders = lua_gettop(L);
    lua_getfield(L, holders, lua_tostring(L, 2));
    if (lua_istable(L, -1)) {
        lua_getfield(L, -1, "expires");
        double expires = lua_tonumber(L, -1);
        if (expires > now) {
            lua_pushnil(L);
            return 1;
        }
    }
    char token[33];
    rb_random_token(token);
    lua_createtable(L, 0, 2);
    lua_pushstring(L, token);
    lua_setfield(L, -2, "token");
    lua_pushnumber(L, now + duration);
    lua_setfield(L, -2, "expires");
    lua_setfield(L, holders, lua_tostring(L, 2));
    lua_lease *l = push_handle(L, rb_module_get(L), lua_tostring(L, 2), token, now + duration);
    lua_pushvalue(L, holders);
    l->local_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    return 1;
}

/* Returns 1 and leaves the holder entry on the stack when l still holds its name. */
static int local_holds(lua_State *L, lua_lease *l)
{
    lua_rawgeti(L, LUA_REGISTRYINDEX, l->local_ref);
    lua_getfield(L, -1, l->name);
    if (!lua_istable(L, -1)) return 0;
    lua_getfield(L, -1, "token");
    lua_getfield(L, -2, "expires");
    int ok = strcmp(lua_tostring(L, -2) ? lua_tostring(L, -2) : "", l->token) == 0 &&
             lua_tonumber(L, -1) > rb_monotonic();
    lua_pop(L, 2);
    return ok;
}

int rb_lua_local_leases(lua_State *L)
{
    lua_newuserdatauv(L, 0, 1);
    lua_newtable(L);
    lua_setiuservalue(L, -2, 1);
    luaL_setmetatable(L, RB_LOCAL_LEASES_MT);
    return 1;
}

/* ---- handle methods ------------------------------------------------------------------------- */
typedef struct extend_wait {
    rb_await *w;
    lua_lease *l;
    double sent_at, duration;
    int release;
} extend_wait;

static void on_extended(void *ud, const char *err, int ok, double expires_at)
{
    (void)expires_at;
    extend_wait *e = ud;
    rb_await *w = e->w;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T) {
        if (err) {
            lua_pushnil(T);
            lua_pushstring(T, err);
            nres = 2;
        } else if (ok) {
            if (!e->release) {
                e->l->deadline = e->sent_at + e->duration - margin_for(e->duration);
                arm(e->l);
            } else {
                e->l->released = 1;
                ev_timer_stop(e->l->m->loop, &e->l->timer);
            }
            lua_pushboolean(T, 1);
            nres = 1;
        } else {
            lua_pushnil(T);
            lua_pushliteral(T, "lease lost");
            nres = 2;
        }
    }
    free(e);
    rb_await_resolve(w, nres);
}

static int lease_op(lua_State *L, int release)
{
    lua_lease *l = luaL_checkudata(L, 1, RB_LEASE_MT);
    double duration = 0;
    if (!release) {
        lua_getiuservalue(L, 1, 1);
        duration = luaL_optnumber(L, 2, l->deadline > 0 ? 0 : 0);
        lua_pop(L, 1);
        if (duration < 0) return rb_misuse(L, "extend: duration must be > 0");
    }
    if (l->released) {
        lua_pushnil(L);
        lua_pushliteral(L, "lease released");
        return 2;
    }
    /* Past our own deadline the claim is no longer ours, whatever the store would say. */
    if (rb_monotonic() >= l->deadline) {
        if (l->signal) rb_signal_fire(l->signal, RB_ABORT_LEASE);
        lua_pushnil(L);
        lua_pushliteral(L, "lease lost");
        return 2;
    }
    if (!l->s) {
        int holds = local_holds(L, l);
        if (!holds) {
            lua_pushnil(L);
            lua_pushliteral(L, "lease lost");
            return 2;
        }
        int holders = lua_gettop(L) - 1;
        if (release) {
            lua_pushnil(L);
            lua_setfield(L, holders, l->name);
            l->released = 1;
            ev_timer_stop(l->m->loop, &l->timer);
        } else {
            if (duration <= 0) duration = 30;
            double now = rb_monotonic();
            lua_pushnumber(L, now + duration);
            lua_setfield(L, -2, "expires");
            l->deadline = now + duration;
            arm(l);
        }
        lua_pushboolean(L, 1);
        return 1;
    }
    extend_wait *e = calloc(1, sizeof *e);
    if (!e) return luaL_error(L, "relaybus: out of memory");
    rb_await *w = rb_await_begin(L);
    if (!w) {
        free(e);
        return 2;
    }
    if (duration <= 0) duration = 30;
    e->w = w;
    e->l = l;
    e->sent_at = rb_monotonic();
    e->duration = duration;
    e->release = release;
    lua_pushvalue(L, 1);    /* keeps the handle alive while we wait */
    if (release) l->s->vt->lease_release(l->s, l->name, l->token, on_extended, e);
    else l->s->vt->lease_extend(l->s, l->name, l->token, duration, on_extended, e);
    return rb_await_finish(L, w);
}

static int l_lease_extend(lua_State *L) { return lease_op(L, 0); }
static int l_lease_release(lua_State *L) { return lease_op(L, 1); }

static int l_lease_index(lua_State *L)
{
    lua_lease *l = luaL_checkudata(L, 1, RB_LEASE_MT);
    const char *k = luaL_checkstring(L, 2);
    if (strcmp(k, "name") == 0) lua_pushstring(L, l->name);
    else if (strcmp(k, "deadline") == 0) lua_pushnumber(L, l->deadline);
    else if (strcmp(k, "signal") == 0) lua_getiuservalue(L, 1, 1);
    else if (strcmp(k, "token") == 0) lua_pushstring(L, l->token);
    else {
        lua_getmetatable(L, 1);
        lua_getfield(L, -1, "methods");
        lua_getfield(L, -1, k);
    }
    return 1;
}

static int l_lease_gc(lua_State *L)
{
    lua_lease *l = luaL_checkudata(L, 1, RB_LEASE_MT);
    ev_timer_stop(l->m->loop, &l->timer);
    if (l->local_ref != LUA_NOREF && !l->m->closing) luaL_unref(L, LUA_REGISTRYINDEX, l->local_ref);
    l->local_ref = LUA_NOREF;
    return 0;
}

static const luaL_Reg lease_methods[] = {
    {"extend", l_lease_extend},
    {"release", l_lease_release},
    {NULL, NULL}
};

void rb_lua_leases_register(lua_State *L)
{
    luaL_newmetatable(L, RB_LEASE_MT);
    luaL_newlib(L, lease_methods);
    lua_setfield(L, -2, "methods");
    lua_pushcfunction(L, l_lease_index);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_lease_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    luaL_newmetatable(L, RB_LOCAL_LEASES_MT);
    lua_newtable(L);
    lua_pushcfunction(L, local_try_acquire);
    lua_setfield(L, -2, "try_acquire");
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
}
