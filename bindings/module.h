/* module.h -- the state the relaybus Lua module keeps per lua_State, shared by the binding's
 * files (stores, dispatcher, ctx, http). One rb_module per main Lua state. */
#ifndef RB_MODULE_H
#define RB_MODULE_H

#include <ev.h>
#include <lua.h>

typedef struct rb_module rb_module;

/* The module state of L (any thread of it). Raises if the module is not loaded. */
rb_module *rb_module_get(lua_State *L);
struct ev_loop *rb_module_loop(rb_module *m);

/* Transports register here: fn(ud) is called when the Lua state closes, to drop their open
 * transfers without calling back into Lua. */
void rb_module_on_cut(rb_module *m, void (*fn)(void *ud), void *ud);

/* Sub-modules: each pushes one table or function. */
int rb_lua_open_http(lua_State *L);     /* pushes the `relaybus.http` table */

#endif
