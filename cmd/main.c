/* main.c -- the `relaybus` command: a Lua 5.4 host on the libev default loop that preloads the
 * relaybus module and runs the command-line interface compiled in from cmd/cli.lua.
 * SIGINT/SIGTERM: the first stops every dispatcher gracefully (with none running, it exits at
 * once with 128 + the signal), a second exits at once with 128 + the signal. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ev.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>

#include "relaybus.h"
#include "util/log.h"
#include "cli_lua.h"

static lua_State *host_L;
static ev_signal sig_int, sig_term;

/* libev's own handlers for SIGINT and SIGTERM. Ours runs first: it counts the signals and
 * ends the process at the second one, even while Lua code runs without returning to the loop
 * (when the ev_signal watchers cannot run); the first is passed on to libev. */
static struct sigaction libev_int, libev_term;
static volatile sig_atomic_t signals_seen;

static void counting_handler(int signo)
{
    if (++signals_seen >= 2)
        _exit(128 + signo);
    const struct sigaction *sa = signo == SIGINT ? &libev_int : &libev_term;
    if (sa->sa_flags & SA_SIGINFO) {
        if (sa->sa_sigaction)
            sa->sa_sigaction(signo, NULL, NULL);
    } else if (sa->sa_handler != SIG_DFL && sa->sa_handler != SIG_IGN) {
        sa->sa_handler(signo);
    }
}

static void chain_signal(int signo, struct sigaction *libev)
{
    struct sigaction sa;
    sigaction(signo, NULL, libev);
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = counting_handler;
    sa.sa_flags = SA_RESTART;
    sigfillset(&sa.sa_mask);
    sigaction(signo, &sa, NULL);
}

static void on_signal(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop;
    (void)revents;
    /* Only dispatchers stop gracefully; with none running (a script of plain tasks, a
     * blocking command) end like an interrupted program. */
    if (!host_L || rb_lua_stop_all(host_L) == 0) {
        fflush(NULL);
        _exit(128 + w->signum);
    }
}

/* The private helpers the CLI chunk gets as its first argument. */
static int h_setenv(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    if (lua_isnoneornil(L, 2)) {
        unsetenv(name);
    } else if (setenv(name, luaL_checkstring(L, 2), 1) != 0) {
        return luaL_error(L, "setenv %s: %s", name, strerror(errno));
    }
    return 0;
}

static int h_stop_all(lua_State *L)
{
    rb_lua_stop_all(L);
    return 0;
}

static int h_busy(lua_State *L)
{
    lua_pushinteger(L, rb_lua_busy(L));
    return 1;
}

static int h_isatty(lua_State *L)
{
    lua_pushboolean(L, isatty((int)luaL_checkinteger(L, 1)));
    return 1;
}

/* Error handler: keeps the message (one line, no traceback); non-string errors are described. */
static int msgh(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    if (msg == NULL) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
            return 1;
        lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    return 1;
}

static void print_error(const char *msg)
{
    /* One line: the message's newlines become spaces. */
    fputs("relaybus: ", stderr);
    for (const char *p = msg; *p; p++)
        fputc(*p == '\n' || *p == '\r' ? ' ' : *p, stderr);
    fputc('\n', stderr);
    fflush(stderr);
}

/* libmongoc keeps counters in /dev/shm/mongoc-PID from the moment it loads; a file left by a
 * killed process whose PID we now reuse makes it print a warning, which would break the
 * one-line stderr promise. Without shared-memory counters nothing is left behind. The
 * MongoDB plugin (runtime/plugin/plugin.h) loads libmongoc on first use, after this. */
static void without_mongoc_shm(void)
{
    setenv("MONGOC_DISABLE_SHM", "1", 0);
}

/* require "relaybus" finds the built-in module; arg is set as lua5.4 sets it: arg[0] the
 * program, arg[1..] its arguments. */
static void preload_module_and_arg(lua_State *L, int argc, char **argv)
{
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    lua_pushcfunction(L, luaopen_relaybus);
    lua_setfield(L, -2, "relaybus");
    lua_pop(L, 1);
    lua_createtable(L, argc, 1);
    for (int i = 0; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i);
    }
    lua_setglobal(L, "arg");
}

static void install_signals(struct ev_loop *loop)
{
    ev_signal_init(&sig_int, on_signal, SIGINT);
    ev_signal_init(&sig_term, on_signal, SIGTERM);
    ev_signal_start(loop, &sig_int);
    ev_signal_start(loop, &sig_term);
    chain_signal(SIGINT, &libev_int);
    chain_signal(SIGTERM, &libev_term);
    /* The signal watchers alone must not keep relaybus.run()'s loop alive. */
    ev_unref(loop);
    ev_unref(loop);
}

/* The table of host functions cmd/cli.lua gets as its first argument. */
static void push_host_helpers(lua_State *L)
{
    lua_createtable(L, 0, 4);
    lua_pushcfunction(L, h_setenv);
    lua_setfield(L, -2, "setenv");
    lua_pushcfunction(L, h_stop_all);
    lua_setfield(L, -2, "stop_all");
    lua_pushcfunction(L, h_busy);
    lua_setfield(L, -2, "busy");
    lua_pushcfunction(L, h_isatty);
    lua_setfield(L, -2, "isatty");
}

int main(int argc, char **argv)
{
    without_mongoc_shm();
    struct ev_loop *loop = ev_default_loop(0);
    if (!loop) {
        fputs("relaybus: cannot initialise the event loop\n", stderr);
        return 1;
    }
    lua_State *L = luaL_newstate();
    if (!L) {
        fputs("relaybus: cannot create the Lua state (out of memory)\n", stderr);
        return 1;
    }
    luaL_openlibs(L);
    rb_lua_set_loop(L, loop);
    /* The command says what goes wrong with runs (raises, burials, lost leases: info) unless
     * RELAYBUS_LOG says otherwise; the library alone stays at warn. */
    const char *lv = getenv("RELAYBUS_LOG");
    /* "json" alone picks the format, not a level: info here too */
    if (!lv || !strcmp(lv, "json")) rb_log_set_level(RB_LOG_INFO);
    rb_tune_malloc();      /* the command is the whole process: SQLite drains want it */

    preload_module_and_arg(L, argc, argv);

    host_L = L;
    install_signals(loop);

    int status = 1;
    lua_pushcfunction(L, msgh);
    int base = lua_gettop(L);
    if (luaL_loadbufferx(L, cli_lua, sizeof cli_lua - 1, "=relaybus", "t") != LUA_OK) {
        print_error(lua_tostring(L, -1));
        lua_close(L);
        return 1;
    }
    /* First argument: the host helpers; then the command-line arguments. */
    push_host_helpers(L);
    if (!lua_checkstack(L, argc + 1)) {
        fputs("relaybus: too many arguments\n", stderr);
        return 2;
    }
    for (int i = 1; i < argc; i++)
        lua_pushstring(L, argv[i]);
    if (lua_pcall(L, argc, 1, base) != LUA_OK) {
        print_error(lua_tostring(L, -1));
        status = 1;
    } else if (lua_isinteger(L, -1)) {
        status = (int)lua_tointeger(L, -1);
    } else {
        status = lua_toboolean(L, -1) || lua_isnil(L, -1) ? 0 : 1;
    }
    fflush(stdout);

    /* Close Lua last: its stores and dispatchers may still own watchers on the loop. From here
     * on a signal ends the process at once. */
    signals_seen = 1;
    host_L = NULL;
    lua_close(L);
    return status;
}
