/* internal.h -- what the files of the Lua binding share: the module state, tasks (the
 * coroutines relaybus runs), and the helpers that turn C results into Lua values. */
#ifndef RB_BINDING_INTERNAL_H
#define RB_BINDING_INTERNAL_H

#include <lua.h>
#include <lauxlib.h>
#include "module.h"
#include "await.h"
#include "store.h"
#include "dispatcher.h"

#define RB_STORE_MT "relaybus.store"
#define RB_TX_MT "relaybus.tx"
#define RB_DISPATCHER_MT "relaybus.dispatcher"
#define RB_CTX_MT "relaybus.ctx"
#define RB_SIGNAL_MT "relaybus.signal"
#define RB_STOPWAIT_MT "relaybus.stop_waitable"
#define RB_LEASE_MT "relaybus.lease"

typedef struct cut_hook {
    void (*fn)(void *ud);
    void *ud;
    struct cut_hook *next;
} cut_hook;

typedef struct rb_task rb_task;
typedef struct rb_signal rb_signal;

struct rb_module {
    lua_State *L;               /* the main thread */
    struct ev_loop *loop;
    int json_encode_ref, json_decode_ref, json_null_ref;
    int ntasks;                 /* spawned tasks still alive */
    int ndispatchers_running;
    cut_hook *cut_hooks;
    struct lua_dispatcher *dispatchers;  /* every dispatcher of this state */
    int closing;                /* lua_close is collecting: no callbacks into Lua */
    rb_task *task_pool;         /* finished tasks whose coroutines can run again */
    int task_pool_n;
};

/* An abort flag shared by a run's ctx.signal (and named leases' handle.signal). */
struct rb_signal {
    rb_abort_reason reason;     /* RB_ABORT_NONE while not aborted */
    const char *reason_name;    /* "lease", "timeout", "shutdown" */
    int callbacks_ref;          /* registry ref to a table of on_abort functions, or LUA_NOREF */
    rb_module *m;
};

/* A coroutine run by relaybus: a spawned task or a handler run. */
struct rb_task {
    lua_State *co;
    int co_ref;                 /* registry ref keeping the coroutine alive */
    rb_module *m;
    rb_await *wait;             /* the wait it is suspended in, or NULL */
    int running;                /* inside lua_resume now */
    int done;
    /* Handler runs: the abort machinery. */
    rb_run *run;                /* NULL for plain tasks */
    rb_signal *signal;          /* the run's signal, or NULL */
    double abort_at;            /* monotonic time of the abort, for the interrupt grace */
    double deadline;            /* tasks guarded by a named lease: its deadline, else 0 */
    int daemon;                 /* the runtime's own task: relaybus.run() does not wait for it */
    int extra_yield;            /* resumed from a bare coroutine.yield: resume next iteration */
    ev_idle yield_watcher;
    /* Called when the coroutine ends: ok, or the error message. */
    void (*on_end)(rb_task *t, int ok, const char *err);
    void *ud;
    rb_task *pool_next;         /* in the module's pool of finished tasks */
};

/* module.c */
rb_module *rb_module_get(lua_State *L);
void rb_module_run_cut_hooks(rb_module *m);
/* JSON through lua-cjson. Each returns 1 with the result pushed (the JSON text; the decoded
 * value, JSON null at the top as nil), or 0 with the error message pushed. */
int rb_json_encode(lua_State *L, int idx);
int rb_json_decode(lua_State *L, const char *s, size_t len);

/* task.c */
rb_task *rb_task_current(lua_State *L);          /* the relaybus task L runs in, or NULL */
/* A new (or pooled) task; push the function and its arguments on t->co, then start it with
 * rb_task_start(t, nargs). L is used to create the coroutine. */
rb_task *rb_task_new(rb_module *m, lua_State *L, int nargs);
void rb_task_free(rb_task *t);                   /* pools its coroutine when it can */
void rb_task_start(rb_task *t, int nargs);
void rb_task_abort(rb_task *t);                  /* wakes the pending wait with nil, "aborted" */
void rb_task_install_hook(rb_task *t);
int rb_lua_sleep(lua_State *L);                  /* relaybus.sleep(s) */
int rb_lua_spawn(lua_State *L);
int rb_lua_spawn_daemon(lua_State *L);
int rb_task_is_aborted(rb_task *t);

/* signal (lua_dispatcher.c) */
rb_signal *rb_signal_push(lua_State *L, rb_module *m);
void rb_signal_fire(rb_signal *s, rb_abort_reason reason);

/* lua_store.c */
int rb_lua_open_store(lua_State *L);             /* relaybus.open */
void rb_lua_store_register(lua_State *L);
rb_store *rb_lua_check_store(lua_State *L, int idx);
void rb_push_record(lua_State *L, rb_module *m, const rb_delivery *d);
void rb_push_tx(lua_State *L, rb_store *s, rb_tx *tx, int owned);
void rb_tx_invalidate(lua_State *L, int idx);

/* lua_dispatcher.c */
void rb_lua_dispatcher_register(lua_State *L);
int rb_lua_dispatcher_new(lua_State *L);

/* lua_leases.c */
void rb_lua_leases_register(lua_State *L);
int rb_lua_try_acquire(lua_State *L);
int rb_lua_local_leases(lua_State *L);

/* Argument checks whose errors start with "relaybus:", as the contract wants for misuse.
 * The luaL_ names are redirected here so every file of the binding gets them. */
const char *rb_checklstring(lua_State *L, int arg, size_t *len);
lua_Number rb_checknumber(lua_State *L, int arg);
lua_Integer rb_checkinteger(lua_State *L, int arg);
void rb_checktype(lua_State *L, int arg, int t);
void *rb_checkudata(lua_State *L, int arg, const char *tname);
lua_Number rb_optnumber(lua_State *L, int arg, lua_Number def);
lua_Integer rb_optinteger(lua_State *L, int arg, lua_Integer def);
const char *rb_optlstring(lua_State *L, int arg, const char *def, size_t *len);
int rb_checkoption(lua_State *L, int arg, const char *def, const char *const lst[]);
#undef luaL_checkstring
#undef luaL_optstring
#define luaL_checklstring rb_checklstring
#define luaL_checkstring(L, n) rb_checklstring(L, (n), NULL)
#define luaL_checknumber rb_checknumber
#define luaL_checkinteger rb_checkinteger
#define luaL_checktype rb_checktype
#define luaL_checkudata rb_checkudata
#define luaL_optnumber rb_optnumber
#define luaL_optinteger rb_optinteger
#define luaL_optlstring rb_optlstring
#define luaL_optstring(L, n, d) rb_optlstring(L, (n), (d), NULL)
#define luaL_checkoption rb_checkoption

/* Raises "relaybus: <msg>" (misuse). */
int rb_misuse(lua_State *L, const char *fmt, ...);
/* Creates the metatable `name`: methods are reached through __index, either directly or,
 * when index is given (objects with fields), through that function's fallback to
 * metatable.methods. gc may be NULL. */
void rb_register_class(lua_State *L, const char *name, const luaL_Reg *methods,
                       lua_CFunction index, lua_CFunction gc);
/* Checks that the table at idx has only the given keys (NULL-terminated). */
void rb_check_options(lua_State *L, int idx, const char *what, const char *const *allowed);
double rb_opt_number(lua_State *L, int idx, const char *key, double dflt);

#endif
