/* module.c -- the `relaybus` Lua module: its per-state data, the helpers now, time and run
 * (sleep and spawn are task.c's), the module table, and the embedded Lua chunks built on top
 * of the C primitives: the prelude (store:transaction, tx:collection, d:every) and
 * relaybus.webhook. relaybus.json is json.c, relaybus.http lua_http.c. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dispatch/metrics.h"
#include "internal.h"
#include "util/log.h"
#include "relaybus.h"
#include "util/text.h"
#include "prelude_lua.h"
#include "webhook_lua.h"
#include "util/check.h"

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

void rb_module_on_cut(rb_module *m, void (*fn)(void *ud), void *ud)
{
    cut_hook *h = rb_malloc(sizeof *h);
    if (!h) return;
    *h = (cut_hook){fn, ud, m->cut_hooks};
    m->cut_hooks = h;
}

void rb_module_run_cut_hooks(rb_module *m)
{
    for (cut_hook *h = m->cut_hooks; h; h = h->next) h->fn(h->ud);
}

/* Misuse raises "relaybus: ..." exactly (no position prefix: docs/lua.md's mark of misuse
 * is the message's start; a traceback still shows where). */
int rb_misuse(lua_State *L, const char *fmt, ...)
{
    char msg[512], line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* one line whatever the caller's names and values hold (a topic, an option's name) */
    lua_pushfstring(L, "relaybus: %s", rb_one_line(line, sizeof line, msg));
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

int rb_push_method(lua_State *L, int idx, const char *k)
{
    lua_getmetatable(L, idx);
    lua_getfield(L, -1, "methods");
    lua_getfield(L, -1, k);
    lua_replace(L, -3);
    lua_pop(L, 1);
    return 1;
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
        if (lua_type(L, -1) != LUA_TNUMBER) rb_misuse(L, "option '%s' must be a number", key);
        v = lua_tonumber(L, -1);
    }
    lua_pop(L, 1);
    return v;
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
    static _Atomic int warned;   /* once per process, whichever state runs first */
    if (m->ndispatchers_running == 0 && m->ntasks == 0 && m->nservers == 0 && !warned) {
        warned = 1;
        if (rb_lua_unstarted(m) > 0)
            rb_log(RB_LOG_WARN, "relaybus.run(): a dispatcher has handlers but was never started "
                                "(call d:start()); nothing to run");
        else
            rb_log(RB_LOG_WARN, "relaybus.run(): nothing to run (no dispatcher started, no task "
                                "spawned)");
    }
    int saw_dispatcher = 0;
    m->run_depth++;
    for (;;) {
        if (m->ndispatchers_running > 0) saw_dispatcher = 1;
        /* servers keep it running only while no dispatcher ran (relaybus dashboard) */
        else if (saw_dispatcher || (m->ntasks == 0 && m->nservers == 0)) break;
        ev_run(m->loop, EVRUN_ONCE);
    }
    RB_ASSERT(m->run_depth > 0);
    m->run_depth--;
    return 0;
}

void rb_module_wake_run(rb_module *m)
{
    /* An ev_break with no run() in progress would end whatever ev_run the host has going on
     * this loop (the loop is the host's when it called rb_lua_set_loop). */
    if (m->run_depth > 0) ev_break(m->loop, EVBREAK_ONE);
}


/* relaybus._redact_url(url): the URL with its password and secret parameters as "***"; and
 * relaybus._redact_secrets(text, url): text with every secret of url taken out. Internal:
 * for the command, which shows store URLs and the messages of stores that failed. */
static int l_redact_url(lua_State *L)
{
    size_t len;
    const char *url = luaL_checklstring(L, 1, &len);
    /* Each "***" adds at most 3 bytes, and there are fewer of them than bytes. */
    size_t cap = len * 4 + 4;
    char *out = lua_newuserdatauv(L, cap, 0);    /* collected even if a push fails */
    rb_redact_url(out, cap, url);
    lua_pushstring(L, out);
    return 1;
}

static int l_redact_secrets(lua_State *L)
{
    size_t len;
    const char *text = luaL_checklstring(L, 1, &len);
    const char *url = luaL_checkstring(L, 2);
    /* A secret is at least 3 bytes long, so "***" never makes the text longer. Text after a
     * NUL is redacted piece by piece. */
    char *out = lua_newuserdatauv(L, len + 1, 0);
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (size_t at = 0; at <= len; at += strlen(text + at) + 1) {
        if (at > 0) luaL_addchar(&b, '\0');
        rb_redact_secrets(out, len + 1, text + at, url);
        luaL_addstring(&b, out);
    }
    luaL_pushresult(&b);
    return 1;
}

static int l_gc_module(lua_State *L)
{
    rb_module *m = lua_touserdata(L, 1);
    m->closing = 1;
    rb_watchdog_free(m->watchdog);
    m->watchdog = NULL;
    m->deferred.head = m->deferred.tail = NULL;
    rb_module_run_cut_hooks(m);
    for (cut_hook *h = m->cut_hooks, *next; h; h = next) {
        next = h->next;
        free(h);
    }
    m->cut_hooks = NULL;
    /* The pooled tasks' coroutines go with the state; their C structs are ours to free. */
    for (rb_task *t = m->task_pool, *next; t; t = next) {
        next = t->queue_next;
        free(t);
    }
    m->task_pool = NULL;
    m->task_pool_n = 0;
    rb_task_close_live(m);
    rb_lua_stop_servers(m);
    rb_metrics_free(m->metrics);    /* the dispatchers went before the module */
    m->metrics = NULL;
    /* the counts of lines the log left out would be lost with the process */
    rb_log_flush();
    /* the module is collected last of relaybus's objects: nothing watches its loop now */
    if (m->own_loop && m->loop) {
        rb_loop_disown(m->loop);
        ev_loop_destroy(m->loop);
        m->loop = NULL;
    }
    return 0;
}

/* relaybus._unstarted(): how many dispatchers have handlers but were never started. */
static int l_unstarted(lua_State *L)
{
    lua_pushinteger(L, rb_lua_unstarted(rb_module_get(L)));
    return 1;
}

/* ---- the pollable runtime: a loop of the module's own, stepped by the host ----------------- */
/* The descriptor of an epoll loop: libev keeps it to itself, but an ev_embed watcher of it
 * watches exactly that descriptor (its io member), so a short-lived one tells. */
static int backend_fd_of(struct ev_loop *loop)
{
    if (ev_backend(loop) != EVBACKEND_EPOLL) return -1;
    struct ev_loop *outer = ev_loop_new(EVBACKEND_SELECT | EVFLAG_NOENV);
    if (!outer) return -1;
    ev_embed e;
    ev_embed_init(&e, NULL, loop);
    ev_embed_start(outer, &e);
    int fd = e.io.fd;
    ev_embed_stop(outer, &e);
    ev_loop_destroy(outer);
    return fd;
}

/* No loop was given: the module keeps its own. relaybus.run() runs it for a script; a host
 * without libev polls its descriptor and steps it (rb_lua_pollfd, rb_lua_timeout, rb_lua_step). */
static void open_own_loop(lua_State *L, rb_module *m)
{
    m->loop = ev_loop_new(EVBACKEND_EPOLL | EVFLAG_NOENV);
    if (!m->loop) m->loop = ev_loop_new(EVFLAG_AUTO);
    if (!m->loop) luaL_error(L, "relaybus: cannot make an event loop");
    m->own_loop = 1;
    m->backend_fd = backend_fd_of(m->loop);
    if (rb_loop_own(m->loop) != 0)
        rb_log(RB_LOG_WARN, "too many relaybus runtimes on this thread: rb_lua_timeout will not "
                            "see this one's timers");
}

/* Everything a step of the pollable runtime does, in order: runs whose deadline passed while
 * the host did not step are aborted first; then the resumes the last step's budget put off;
 * then one turn of the loop, which never blocks. */
static void step(rb_module *m, double budget)
{
    m->step_deadline = budget > 0 ? rb_monotonic() + budget : 0;
    ev_now_update(m->loop);
    rb_lua_check_deadlines(m);
    rb_task_run_deferred(m);
    ev_run(m->loop, EVRUN_NOWAIT);
    m->step_deadline = 0;
}

int rb_lua_pollfd(lua_State *L)
{
    rb_module *m = rb_module_get(L);
    return m->own_loop ? m->backend_fd : -1;
}

double rb_lua_timeout(lua_State *L)
{
    rb_module *m = rb_module_get(L);
    if (!m->own_loop) return -1;
    if (!RB_FIFO_EMPTY(&m->deferred)) return 0;
    return rb_loop_timeout(m->loop);
}

int rb_lua_step(lua_State *L, double budget)
{
    rb_module *m = rb_module_get(L);
    const char *why = NULL;
    if (!m->own_loop) why = "relaybus: step: this runtime runs on the host's loop (rb_lua_set_loop)";
    else if (ev_depth(m->loop) > 0 || rb_task_current(L))
        why = "relaybus: step: called from inside the runtime (a handler, a task or a callback)";
    else if (!(budget >= 0 && budget <= RB_MAX_SECONDS))
        why = "relaybus: step: budget must be a number of seconds >= 0";
    if (why) {
        lua_pushstring(L, why);
        return -1;
    }
    step(m, budget);
    return 0;
}

static int l_pollfd(lua_State *L)
{
    int fd = rb_lua_pollfd(L);
    if (fd < 0) lua_pushnil(L);
    else lua_pushinteger(L, fd);
    return 1;
}

static int l_timeout(lua_State *L)
{
    lua_pushnumber(L, rb_lua_timeout(L));
    return 1;
}

static int l_step(lua_State *L)
{
    double budget = luaL_optnumber(L, 1, 0);
    if (rb_lua_step(L, budget) != 0) {
        lua_pushnil(L);
        lua_insert(L, -2);
        return 2;
    }
    lua_pushboolean(L, 1);
    return 1;
}

static int l_busy(lua_State *L)
{
    lua_pushinteger(L, rb_lua_busy(L));
    return 1;
}

static const luaL_Reg module_fns[] = {
    {"open", rb_lua_open_store},
    {"dispatcher", rb_lua_dispatcher_new},
    {"now", l_now},
    {"time", l_time},
    {"sleep", rb_lua_sleep},
    {"spawn", rb_lua_spawn},
    {"_unstarted", l_unstarted},
    {"run", l_run},
    {"pollfd", l_pollfd},
    {"timeout", l_timeout},
    {"step", l_step},
    {"busy", l_busy},
    {"serve", rb_lua_serve},
    {"local_leases", rb_lua_local_leases},
    {"_redact_url", l_redact_url},
    {"_redact_secrets", l_redact_secrets},
    {NULL, NULL}
};

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
        if (!m->loop) open_own_loop(L, m);
        rb_task_init_module(m);
        m->watchdog = rb_watchdog_new(rb_task_hook);
        lua_createtable(L, 0, 1);
        lua_pushcfunction(L, l_gc_module);
        lua_setfield(L, -2, "__gc");
        lua_setmetatable(L, -2);
        lua_rawsetp(L, LUA_REGISTRYINDEX, &MODULE_KEY);
        rb_lua_store_register(L);
        rb_lua_dispatcher_register(L);
        rb_lua_leases_register(L);
        rb_lua_serve_register(L);
    }
    luaL_newlib(L, module_fns);
    int mod = lua_gettop(L);
    lua_pushliteral(L, RB_VERSION);
    lua_setfield(L, mod, "_VERSION");
    rb_lua_open_json(L);
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
    return m->ndispatchers_running + m->ntasks + m->nservers;
}
