/* lua_serve.c -- relaybus.serve{store = s, listen = "HOST:PORT", token = T}: the dashboard
 * (runtime/serve/dashboard.h) on the module's loop. Its /metrics carries the metrics of every
 * dispatcher of this Lua state: the first serve makes the module's rb_metrics and attaches it
 * to the dispatchers there are, lua_dispatcher.c attaches it to those made later. The server
 * is the serve plugin (plugin.h), loaded by the first serve. A server
 * counts as busy (relaybus.run() goes on while one runs) and rb_lua_stop_all stops it. */
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "util/list.h"
#include "serve/dashboard.h"
#include "dispatch/metrics.h"
#include "util/log.h"
#include "plugin/plugin.h"
#include "util/check.h"

#define RB_SERVER_MT "relaybus.server"

struct lua_server {
    rb_dashboard *dash;         /* NULL once stopped */
    const rb_serve_plugin *p;   /* dash's plugin (plugin.h) */
    rb_module *m;
    lua_store *st;
    int store_ref;
    int self_ref;               /* keeps it alive while it runs */
    struct lua_server *prev, *next;     /* on the module's servers (list.h) */
};

rb_metrics *rb_lua_metrics(rb_module *m, int create)
{
    if (!m->metrics && create) {
        m->metrics = rb_metrics_new();
        if (!m->metrics) return NULL;
        for (struct lua_dispatcher *ld = m->dispatchers; ld; ld = rb_lua_dispatcher_next(ld))
            rb_lua_dispatcher_attach_metrics(ld, m->metrics);
    }
    return m->metrics;
}

/* L NULL: from the collector at lua_close, when the store may be gone already. */
static void server_stop(lua_State *L, lua_server *sv)
{
    if (!sv->dash) return;
    sv->p->free_server(sv->dash);
    sv->dash = NULL;
    rb_module *m = sv->m;
    RB_LIST_REMOVE(&m->servers, sv);
    RB_ASSERT(m->nservers > 0);
    m->nservers--;
    if (L && !m->closing) {
        rb_lua_store_use(sv->st, -1, -1);
        luaL_unref(L, LUA_REGISTRYINDEX, sv->store_ref);
        luaL_unref(L, LUA_REGISTRYINDEX, sv->self_ref);
    }
    sv->store_ref = sv->self_ref = LUA_NOREF;
}

int rb_lua_stop_servers(rb_module *m)
{
    int n = 0;
    while (m->servers) {
        server_stop(m->closing ? NULL : m->L, m->servers);
        n++;
    }
    return n;
}

static const char *const serve_opts[] = {"store", "listen", "token", NULL};

static const char *opt_string(lua_State *L, const char *name)
{
    lua_getfield(L, 1, name);
    if (lua_isnil(L, -1)) { lua_pop(L, 1); return NULL; }
    if (lua_type(L, -1) != LUA_TSTRING) rb_misuse(L, "serve: %s must be a string", name);
    size_t len;
    const char *s = lua_tolstring(L, -1, &len);
    /* The dashboard reads C strings: a token "secret\0x" would be compared as "secret". */
    if (strlen(s) != len) rb_misuse(L, "serve: %s must not contain a NUL byte", name);
    lua_pop(L, 1);      /* the options table keeps it alive */
    return s;
}

static int l_serve(lua_State *L)
{
    rb_module *m = rb_module_get(L);
    luaL_checktype(L, 1, LUA_TTABLE);
    rb_check_options(L, 1, "serve", serve_opts);
    lua_getfield(L, 1, "store");
    if (!luaL_testudata(L, -1, RB_STORE_MT)) rb_misuse(L, "serve: store must be a store");
    int store_idx = lua_gettop(L);
    lua_store *st = rb_lua_store_object(L, store_idx);
    rb_store *s = rb_lua_check_store(L, store_idx);
    char err[512];
    const rb_serve_plugin *p = rb_plugin_get(RB_PLUGIN_SERVE, err, sizeof err);
    if (!p) {
        lua_pushnil(L);
        lua_pushstring(L, err);
        return 2;
    }
    rb_dashboard_options o;
    p->options_init(&o);
    const char *listen = opt_string(L, "listen");
    if (listen) o.listen = listen;
    o.token = opt_string(L, "token");
    if (!o.token) o.token = getenv("RELAYBUS_DASHBOARD_TOKEN");
    if (o.token && !*o.token) o.token = NULL;
    if (o.token && strlen(o.token) < 8) rb_misuse(L, "serve: token must be at least 8 characters");
    o.metrics = rb_lua_metrics(m, 1);
    if (!o.metrics) return luaL_error(L, "relaybus: out of memory");
    lua_server *sv = lua_newuserdatauv(L, sizeof *sv, 0);
    memset(sv, 0, sizeof *sv);
    sv->m = m;
    sv->st = st;
    sv->store_ref = sv->self_ref = LUA_NOREF;
    luaL_setmetatable(L, RB_SERVER_MT);
    sv->p = p;
    sv->dash = p->new_server(m->loop, s, &o, err, sizeof err);
    if (!sv->dash) {
        lua_pushnil(L);
        lua_pushstring(L, err);
        return 2;
    }
    lua_pushvalue(L, store_idx);
    sv->store_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_pushvalue(L, -1);
    sv->self_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    rb_lua_store_use(st, 1, 1);
    RB_LIST_PUSH(&m->servers, sv);
    m->nservers++;
    rb_log(RB_LOG_INFO, "dashboard: serving %s%s", p->url(sv->dash),
           o.token ? "" : " (read-only: no token)");
    return 1;
}

static lua_server *check_server(lua_State *L)
{
    return luaL_checkudata(L, 1, RB_SERVER_MT);
}

static int l_url(lua_State *L)
{
    lua_server *sv = check_server(L);
    if (!sv->dash) return rb_misuse(L, "server is stopped");
    lua_pushstring(L, sv->p->url(sv->dash));
    return 1;
}

static int l_port(lua_State *L)
{
    lua_server *sv = check_server(L);
    if (!sv->dash) return rb_misuse(L, "server is stopped");
    lua_pushinteger(L, sv->p->port(sv->dash));
    return 1;
}

static int l_stop(lua_State *L)
{
    server_stop(L, check_server(L));
    return 0;
}

static int l_running(lua_State *L)
{
    lua_pushboolean(L, check_server(L)->dash != NULL);
    return 1;
}

static int l_server_gc(lua_State *L)
{
    lua_server *sv = lua_touserdata(L, 1);
    /* A running server is referenced from nowhere but its list: at lua_close only. */
    if (sv->dash) server_stop(NULL, sv);
    return 0;
}

static const luaL_Reg server_methods[] = {
    {"url", l_url},
    {"port", l_port},
    {"stop", l_stop},
    {"running", l_running},
    {NULL, NULL}
};

int rb_lua_serve(lua_State *L) { return l_serve(L); }

void rb_lua_serve_register(lua_State *L)
{
    rb_register_class(L, RB_SERVER_MT, server_methods, NULL, l_server_gc);
}
