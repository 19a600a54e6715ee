/* workload_host.h -- what the example C hosts share: a Lua state with the relaybus module on
 * its own (pollable) runtime, running examples/workload.lua. Header-only: each example is one
 * program built from one .c file. */
#ifndef WORKLOAD_HOST_H
#define WORKLOAD_HOST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include "relaybus.h"

/* The workload script: RELAYBUS_WORKLOAD names it, else examples/workload.lua (run from the
 * repository). */
static inline const char *workload_path(void)
{
    const char *p = getenv("RELAYBUS_WORKLOAD");
    return p && *p ? p : "examples/workload.lua";
}

/* A new state running the workload with args ("key=value"). No rb_lua_set_loop: the runtime
 * keeps its own loop, which the host drives with rb_lua_pollfd/rb_lua_timeout/rb_lua_step.
 * The workload's handle is kept as the global `workload`. NULL (error printed) on failure. */
static inline lua_State *workload_open(int nargs, char **args)
{
    lua_State *L = luaL_newstate();
    if (!L) return NULL;
    luaL_openlibs(L);
    luaL_requiref(L, "relaybus", luaopen_relaybus, 0);
    if (luaL_loadfile(L, workload_path()) != LUA_OK || lua_pcall(L, 0, 1, 0) != LUA_OK) goto failed;
    lua_getfield(L, -1, "start");
    lua_pushvalue(L, -3);                           /* the module */
    for (int i = 0; i < nargs; i++) lua_pushstring(L, args[i]);
    if (lua_pcall(L, nargs + 1, 1, 0) != LUA_OK) goto failed;
    lua_setglobal(L, "workload");
    lua_pop(L, 2);
    return L;
failed:
    fprintf(stderr, "workload: %s\n", lua_tostring(L, -1));
    lua_close(L);
    return NULL;
}

/* Calls workload.NAME() and returns its string result, copied (free it), or NULL. */
static inline char *workload_call(lua_State *L, const char *name)
{
    lua_getglobal(L, "workload");
    lua_getfield(L, -1, name);
    char *s = NULL;
    if (lua_pcall(L, 0, 1, 0) != LUA_OK) fprintf(stderr, "workload.%s: %s\n", name, lua_tostring(L, -1));
    else if (lua_isstring(L, -1)) {
        size_t n;
        const char *v = lua_tolstring(L, -1, &n);
        s = malloc(n + 1);
        if (s) { memcpy(s, v, n); s[n] = 0; }
    }
    lua_pop(L, 2);
    return s;
}

/* Prints workload.report() on stdout; 0 when it says ok=1. */
static inline int workload_report(lua_State *L, const char *prefix)
{
    char *line = workload_call(L, "report");
    if (!line) return 1;
    printf("%s%s\n", prefix ? prefix : "", line);
    int ok = strncmp(line, "result ok=1", 11) == 0;
    free(line);
    return ok ? 0 : 1;
}

static inline double workload_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

#endif
