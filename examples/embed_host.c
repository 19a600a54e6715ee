/* embed_host.c -- a C host that embeds relaybus beside its own work on its own libev loop.
 *
 * Think of a game server: a 20 Hz tick timer is the host's own watcher. relaybus attaches to
 * the same loop (rb_lua_set_loop before the module loads), its Lua handlers run as coroutines
 * between ticks, and the host decides when to leave the loop. Nothing blocks: the tick keeps
 * its rate while deliveries are claimed, run and settled.
 *
 *   build/embed_host STORE_URL [N]      enqueues N deliveries, runs them, prints a summary */
#include <stdio.h>
#include <stdlib.h>
#include <ev.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include "relaybus.h"

/* The Lua side: a dispatcher whose handler awards points, and a stop when all are done. */
static const char *const script =
    "local relaybus = require 'relaybus'\n"
    "local url, n = ...\n"
    "local store = assert(relaybus.open(url))\n"
    "local batch = {}\n"
    "for i = 1, n do batch[#batch + 1] = {'award', {player = i % 7, points = i}} end\n"
    "assert(store:enqueue_many(batch))\n"
    "local d = relaybus.dispatcher(store, {concurrency = 16, poll_interval = 0.05})\n"
    "done = 0\n"
    "d:handle('award', function(delivery, ctx)\n"
    "  ctx:sleep(0.01)   -- pretend to call a service: yields to the host's loop\n"
    "  done = done + 1\n"
    "  if done == n then relaybus.spawn(function() d:stop() end) end\n"
    "end)\n"
    "d:start()\n";

typedef struct host {
    lua_State *L;
    long ticks;
    ev_timer tick;
} host;

/* The host's own work: runs every 50 ms whatever relaybus is doing; leaves the loop when
 * relaybus has nothing running any more. */
static void on_tick(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    host *h = w->data;
    h->ticks++;
    if (rb_lua_busy(h->L) == 0) ev_break(loop, EVBREAK_ALL);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: embed_host STORE_URL [N]\n");
        return 2;
    }
    long n = argc > 2 ? strtol(argv[2], NULL, 10) : 200;
    struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
    host h = {0};
    h.L = luaL_newstate();
    luaL_openlibs(h.L);
    rb_lua_set_loop(h.L, loop);                      /* before the module loads */
    luaL_requiref(h.L, "relaybus", luaopen_relaybus, 0);
    lua_pop(h.L, 1);

    if (luaL_loadstring(h.L, script) != LUA_OK) goto lua_failed;
    lua_pushstring(h.L, argv[1]);
    lua_pushinteger(h.L, n);
    if (lua_pcall(h.L, 2, 0, 0) != LUA_OK) goto lua_failed;

    ev_timer_init(&h.tick, on_tick, 0.05, 0.05);
    h.tick.data = &h;
    ev_timer_start(loop, &h.tick);
    double t0 = ev_time();
    ev_run(loop, 0);
    double elapsed = ev_time() - t0;

    lua_getglobal(h.L, "done");
    long done = (long)lua_tointeger(h.L, -1);
    lua_pop(h.L, 1);
    printf("deliveries done: %ld of %ld\n", done, n);
    printf("host ticks: %ld in %.2f s (%.1f per second)\n", h.ticks, elapsed,
           h.ticks / (elapsed > 0 ? elapsed : 1));
    lua_close(h.L);
    ev_loop_destroy(loop);
    return done == n ? 0 : 1;

lua_failed:
    fprintf(stderr, "embed_host: %s\n", lua_tostring(h.L, -1));
    lua_close(h.L);
    ev_loop_destroy(loop);
    return 1;
}
