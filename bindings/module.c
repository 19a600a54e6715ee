/* module.c -- the `relaybus` Lua module: its per-state data, the helpers (now, time, sleep,
 * spawn, run, json) and the Lua prelude that builds the friendlier parts (transaction, every,
 * webhook) on top of the C primitives. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "relaybus.h"
#include "prelude_lua.h"
#include "webhook_lua.h"

static const char MODULE_KEY = 'm';     /* registry key: light userdata of this address */
static const char LOOP_KEY = 'l';

void rb_lua_set_loop(lua_State *L, struct ev_loop *loop)
{
    lua_pushlightuserdata(L, loop);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &LOOP_KEY);
}

rb_module *rb_module_get(lua_State *L)
{
    lua_rawgetp(L, LUA_REGISTRYINDEX, &MODULE_KEY);
    rb_module *m = lua_touserdata(L, -1);
    lua_pop(L, 1);
    if (!m) luaL_error(L, "relaybus: module not loaded");
    return m;
}

struct ev_loop *rb_module_loop(rb_module *m) { return m->loop; }
lua_State *rb_module_main(rb_module *m) { return m->L; }

void rb_module_on_cut(rb_module *m, void (*fn)(void *ud), void *ud)
{
    cut_hook *h = malloc(sizeof *h);
    if (!h) return;
    *h = (cut_hook){fn, ud, m->cut_hooks};
    m->cut_hooks = h;
}

void rb_module_run_cut_hooks(rb_module *m)
{
    for (cut_hook *h = m->cut_hooks; h; h = h->next) h->fn(h->ud);
}

/* Misuse raises "relaybus: ..." exactly (no position prefix: the contract's mark of misuse
 * is the message's start; a traceback still shows where). */
int rb_misuse(lua_State *L, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    lua_pushfstring(L, "relaybus: %s", msg);
    return lua_error(L);
}

void rb_register_class(lua_State *L, const char *name, const luaL_Reg *methods,
                       lua_CFunction index, lua_CFunction gc)
{
    luaL_newmetatable(L, name);
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    if (index) {
        lua_setfield(L, -2, "methods");     /* the __index function looks here after fields */
        lua_pushcfunction(L, index);
    }
    lua_setfield(L, -2, "__index");
    if (gc) {
        lua_pushcfunction(L, gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_pop(L, 1);
}

void rb_check_options(lua_State *L, int idx, const char *what, const char *const *allowed)
{
    if (lua_isnoneornil(L, idx)) return;
    if (!lua_istable(L, idx)) rb_misuse(L, "%s: options must be a table", what);
    idx = lua_absindex(L, idx);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        int ok = 0;
        if (lua_type(L, -1) == LUA_TSTRING) {
            const char *k = lua_tostring(L, -1);
            for (const char *const *a = allowed; *a; a++)
                if (strcmp(*a, k) == 0) ok = 1;
        }
        if (!ok) {
            const char *k = luaL_tolstring(L, -1, NULL);
            rb_misuse(L, "%s: unknown option '%s'", what, k);
        }
    }
}

double rb_opt_number(lua_State *L, int idx, const char *key, double dflt)
{
    if (lua_isnoneornil(L, idx)) return dflt;
    lua_getfield(L, idx, key);
    double v = dflt;
    if (!lua_isnil(L, -1)) {
        if (!lua_isnumber(L, -1)) rb_misuse(L, "option '%s' must be a number", key);
        v = lua_tonumber(L, -1);
    }
    lua_pop(L, 1);
    return v;
}

/* ---- JSON through lua-cjson ---------------------------------------------------------------- */
int rb_json_encode(lua_State *L, int idx)
{
    rb_module *m = rb_module_get(L);
    idx = lua_absindex(L, idx);
    lua_rawgeti(L, LUA_REGISTRYINDEX, m->json_encode_ref);
    lua_pushvalue(L, idx);
    if (lua_pcall(L, 1, 1, 0) != LUA_OK) return 0;
    return 1;
}

int rb_json_decode(lua_State *L, const char *s, size_t len)
{
    rb_module *m = rb_module_get(L);
    lua_rawgeti(L, LUA_REGISTRYINDEX, m->json_decode_ref);
    lua_pushlstring(L, s, len);
    if (lua_pcall(L, 1, 1, 0) != LUA_OK) return 0;
    /* JSON null at the top becomes nil, as an absent payload */
    lua_rawgeti(L, LUA_REGISTRYINDEX, m->json_null_ref);
    if (lua_rawequal(L, -1, -2)) {
        lua_pop(L, 2);
        lua_pushnil(L);
    } else {
        lua_pop(L, 1);
    }
    return 1;
}

static int l_json_encode(lua_State *L)
{
    lua_settop(L, 1);
    if (!rb_json_encode(L, 1)) return rb_misuse(L, "cannot encode as JSON: %s", lua_tostring(L, -1));
    return 1;
}

static int l_json_decode(lua_State *L)
{
    size_t len;
    const char *s = luaL_checklstring(L, 1, &len);
    if (!rb_json_decode(L, s, len)) {
        lua_pushnil(L);
        lua_insert(L, -2);
        return 2;
    }
    return 1;
}

/* ---- helpers --------------------------------------------------------------------------------- */
static int l_now(lua_State *L)
{
    lua_pushnumber(L, rb_monotonic());
    return 1;
}

static int l_time(lua_State *L)
{
    lua_pushnumber(L, rb_wall_time());
    return 1;
}

/* relaybus.run(): runs the loop until every dispatcher has stopped. Called while no
 * dispatcher runs, it runs until the spawned tasks have ended (or, if one starts meanwhile,
 * until the dispatchers have stopped). */
static int l_run(lua_State *L)
{
    rb_module *m = rb_module_get(L);
    if (rb_task_current(L)) return rb_misuse(L, "run() cannot be called inside a relaybus coroutine");
    int saw_dispatcher = 0;
    for (;;) {
        if (m->ndispatchers_running > 0) saw_dispatcher = 1;
        else if (saw_dispatcher || m->ntasks == 0) break;
        ev_run(m->loop, EVRUN_ONCE);
    }
    return 0;
}


static int l_gc_module(lua_State *L)
{
    rb_module *m = lua_touserdata(L, 1);
    m->closing = 1;
    rb_module_run_cut_hooks(m);
    for (cut_hook *h = m->cut_hooks, *next; h; h = next) {
        next = h->next;
        free(h);
    }
    m->cut_hooks = NULL;
    return 0;
}

static const luaL_Reg module_fns[] = {
    {"open", rb_lua_open_store},
    {"dispatcher", rb_lua_dispatcher_new},
    {"now", l_now},
    {"time", l_time},
    {"sleep", rb_lua_sleep},
    {"spawn", rb_lua_spawn},
    {"_daemon", rb_lua_spawn_daemon},
    {"run", l_run},
    {"local_leases", rb_lua_local_leases},
    {NULL, NULL}
};

static void load_json(lua_State *L, rb_module *m)
{
    lua_getglobal(L, "require");
    lua_pushliteral(L, "cjson");
    if (lua_pcall(L, 1, 1, 0) != LUA_OK)
        luaL_error(L, "relaybus: lua-cjson is required (%s)", lua_tostring(L, -1));
    /* A private instance, so the application's cjson settings do not change ours. */
    lua_getfield(L, -1, "new");
    if (lua_isfunction(L, -1)) {
        lua_call(L, 0, 1);
        lua_remove(L, -2);
    } else {
        lua_pop(L, 1);
    }
    lua_getfield(L, -1, "encode_empty_table_as_object");
    if (lua_isfunction(L, -1)) {
        lua_pushboolean(L, 1);
        lua_call(L, 1, 0);
    } else {
        lua_pop(L, 1);
    }
    lua_getfield(L, -1, "encode");
    m->json_encode_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_getfield(L, -1, "decode");
    m->json_decode_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_getfield(L, -1, "null");
    m->json_null_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_pop(L, 1);
}

/* Runs an embedded Lua chunk that returns function(relaybus); calls it with the module table
 * at index mod and leaves its result on the stack. */
static void run_embedded(lua_State *L, const char *src, const char *name, int mod)
{
    if (luaL_loadbuffer(L, src, strlen(src), name) != LUA_OK) lua_error(L);
    lua_call(L, 0, 1);
    lua_pushvalue(L, mod);
    lua_call(L, 1, 1);
}

int luaopen_relaybus(lua_State *L)
{
    lua_rawgetp(L, LUA_REGISTRYINDEX, &MODULE_KEY);
    int loaded = !lua_isnil(L, -1);
    lua_pop(L, 1);
    if (!loaded) {
        rb_module *m = lua_newuserdatauv(L, sizeof *m, 0);
        memset(m, 0, sizeof *m);
        lua_State *main;
        lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);
        main = lua_tothread(L, -1);
        lua_pop(L, 1);
        m->L = main;
        *(rb_task **)lua_getextraspace(main) = NULL;
        lua_rawgetp(L, LUA_REGISTRYINDEX, &LOOP_KEY);
        m->loop = lua_touserdata(L, -1);
        lua_pop(L, 1);
        if (!m->loop) m->loop = ev_default_loop(0);
        lua_createtable(L, 0, 1);
        lua_pushcfunction(L, l_gc_module);
        lua_setfield(L, -2, "__gc");
        lua_setmetatable(L, -2);
        lua_rawsetp(L, LUA_REGISTRYINDEX, &MODULE_KEY);
        load_json(L, m);
        rb_lua_store_register(L);
        rb_lua_dispatcher_register(L);
        rb_lua_leases_register(L);
    }
    luaL_newlib(L, module_fns);
    int mod = lua_gettop(L);
    lua_newtable(L);
    lua_pushcfunction(L, l_json_encode);
    lua_setfield(L, -2, "encode");
    lua_pushcfunction(L, l_json_decode);
    lua_setfield(L, -2, "decode");
    lua_setfield(L, mod, "json");
    rb_lua_open_http(L);
    lua_setfield(L, mod, "http");
    run_embedded(L, webhook_lua, "=relaybus.webhook", mod);
    lua_setfield(L, mod, "webhook");
    run_embedded(L, prelude_lua, "=relaybus.prelude", mod);
    lua_pop(L, 1);
    return 1;
}

/* ---- the host's view ------------------------------------------------------------------------ */
int rb_lua_busy(lua_State *L)
{
    rb_module *m = rb_module_get(L);
    return m->ndispatchers_running + m->ntasks;
}
