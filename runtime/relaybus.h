/* relaybus.h -- the public C interface of relaybus: durable delivery of work from a database
 * to code, on the host's libev loop.
 *
 * Layers, each usable alone (docs/c.md describes every call):
 *   store.h       open a store by URL and call its asynchronous operations (enqueue, claim...)
 *   dispatcher.h  claim, lease, run and settle deliveries with C handlers
 *   leases.h      named leases over a store, or in-process
 *   http.h        the HTTP transport on the loop (libcurl's multi interface)
 *   metrics.h     the dispatchers' lifecycle events counted, as Prometheus text
 *   dashboard.h   the operator's page, /metrics and JSON API, served on the loop
 *   the Lua API   below: load the `relaybus` Lua module into a lua_State bound to your loop,
 *                 and let Lua handlers run in coroutines beside your own watchers.
 * delivery.h (the record) and clock.h (the clocks, time limits) come with them.
 * Every callback runs on the loop thread; relaybus never runs a host's loop itself
 * (relaybus.run() in Lua runs it for scripts, the host runs it when it embeds). A Lua state
 * loaded without a host loop keeps a private one that any host steps (below). */
#ifndef RELAYBUS_H
#define RELAYBUS_H

#include <ev.h>
#include "stores/delivery.h"
#include "stores/store.h"
#include "dispatch/dispatcher.h"
#include "stores/leases.h"
#include "http/http.h"
#include "dispatch/metrics.h"
#include "serve/dashboard.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RB_VERSION "0.3.0"

struct lua_State;

/* Binds the Lua module of L to the host's loop. Call before `require "relaybus"` (or before
 * luaopen_relaybus); without it the runtime keeps a private loop (the pollable runtime,
 * below). */
void rb_lua_set_loop(struct lua_State *L, struct ev_loop *loop);

/* The module's opener, for luaL_requiref(L, "relaybus", luaopen_relaybus, 0). */
int luaopen_relaybus(struct lua_State *L);

/* Asks every running dispatcher created in L to stop gracefully (as d:stop() with its
 * default timeout), e.g. from the host's SIGTERM handler. Returns at once, with the number
 * of dispatchers asked to stop. */
int rb_lua_stop_all(struct lua_State *L);

/* Number of dispatchers and tasks of L still running: a host may exit its loop at 0. */
int rb_lua_busy(struct lua_State *L);

/* ---- a host without libev: the pollable runtime ----
 * When no loop was set before the module loaded, the runtime keeps a loop of its own, which
 * any host drives with three calls (from the thread that loaded the module):
 *   rb_lua_pollfd    a descriptor that becomes readable when the runtime has I/O to handle
 *                    (-1 when the runtime runs on the host's loop);
 *   rb_lua_timeout   seconds until it needs a step even if the descriptor stays quiet (0: now;
 *                    negative: nothing scheduled), its timers (leases, renewals, deadlines,
 *                    sleeps, retries, libcurl's) included;
 *   rb_lua_step      runs what is ready and never blocks. budget > 0: once that many seconds
 *                    are spent it resumes no more handlers; the rest runs at the next step.
 *                    First it aborts runs whose deadline passed while the host did not step.
 *                    Returns 0 when it stepped, whatever the handlers did (their failures
 *                    settle as usual); -1, having run nothing, when it cannot step (called
 *                    from inside the runtime, on a runtime that runs on the host's loop, or a
 *                    budget that is not 0 to 100 years), with the error pushed on L's stack
 *                    for the caller to pop.
 * A host that sleeps until the descriptor is readable or the timeout passes, then steps,
 * keeps every lease. */
int rb_lua_pollfd(struct lua_State *L);
double rb_lua_timeout(struct lua_State *L);
int rb_lua_step(struct lua_State *L, double budget);

#ifdef __cplusplus
}
#endif
#endif
