/* relaybus.h -- the public C interface of relaybus: durable delivery of work from a database
 * to code, on the host's libev loop.
 *
 * Three layers, each usable alone:
 *   store.h       open a store by URL and call its asynchronous operations (enqueue, claim...)
 *   dispatcher.h  claim, lease, run and settle deliveries with C handlers
 *   the Lua API   below: load the `relaybus` Lua module into a lua_State bound to your loop,
 *                 and let Lua handlers run in coroutines beside your own watchers.
 * Every callback runs on the loop thread; relaybus never starts or owns the loop itself
 * (relaybus.run() in Lua runs it for scripts, the host runs it when it embeds). */
#ifndef RELAYBUS_H
#define RELAYBUS_H

#include <ev.h>
#include "delivery.h"
#include "store.h"
#include "dispatcher.h"
#include "leases.h"
#include "http.h"

#ifdef __cplusplus
extern "C" {
#endif

struct lua_State;

/* Binds the Lua module of L to the host's loop. Call before `require "relaybus"` (or before
 * luaopen_relaybus); without it the module uses ev_default_loop(0). */
void rb_lua_set_loop(struct lua_State *L, struct ev_loop *loop);

/* The module's opener, for luaL_requiref(L, "relaybus", luaopen_relaybus, 0). */
int luaopen_relaybus(struct lua_State *L);

/* Asks every running dispatcher created in L to stop gracefully (as d:stop() with its
 * default timeout), e.g. from the host's SIGTERM handler. Returns at once, with the number
 * of dispatchers asked to stop. */
int rb_lua_stop_all(struct lua_State *L);

/* Number of dispatchers and tasks of L still running: a host may exit its loop at 0. */
int rb_lua_busy(struct lua_State *L);

#ifdef __cplusplus
}
#endif
#endif
