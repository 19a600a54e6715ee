/* internal.h -- what the files of the Lua binding share: the module state, tasks (the
 * coroutines relaybus runs), and the helpers that turn C results into Lua values. */
#ifndef RB_BINDING_INTERNAL_H
#define RB_BINDING_INTERNAL_H

#include <lua.h>
#include <lauxlib.h>
#include "module.h"
#include "await.h"
#include "stores/store.h"
#include "dispatch/dispatcher.h"
#include "util/alloc.h"
#include "util/timer.h"
#include "util/fifo.h"

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

/* watchdog.c: stops Lua code that runs past its time while the loop thread is held by C code. */
typedef struct rb_watchdog rb_watchdog;
typedef struct rb_watch { lua_State *co; double kill_at; } rb_watch;
rb_watchdog *rb_watchdog_new(lua_Hook hook);
void rb_watchdog_free(rb_watchdog *w);
/* Around lua_resume(co): kill_at is when co must stop (INFINITY: not watched). enter returns
 * the watch of an outer resume in progress, which leave puts back. */
rb_watch rb_watchdog_enter(rb_watchdog *w, lua_State *co, double kill_at);
void rb_watchdog_leave(rb_watchdog *w, rb_watch outer);

struct rb_module {
    lua_State *L;               /* the main thread */
    struct ev_loop *loop;
    int ntasks;                 /* spawned tasks still alive */
    int ndispatchers_running;
    cut_hook *cut_hooks;
    struct lua_dispatcher *dispatchers;  /* every dispatcher of this state */
    int closing;                /* lua_close is collecting: no callbacks into Lua */
    rb_task *task_pool;         /* finished tasks whose coroutines can run again */
    rb_task *live;              /* tasks not yet freed: those left when the state closes are */
    int task_pool_n;
    rb_watchdog *watchdog;      /* NULL when it could not be made */
    int run_depth;              /* relaybus.run() loops in progress (rb_module_wake_run) */
    /* The pollable runtime (no loop given by the host): the loop is the module's own, driven
     * by rb_lua_step. A step with a budget defers resumes past it to the next step. */
    int own_loop;
    int backend_fd;             /* the loop's epoll descriptor: the host polls it */
    double step_deadline;       /* monotonic; 0 outside a step with a budget */
    RB_FIFO(rb_task) deferred;
    /* Tasks that yielded with a bare coroutine.yield() (or after many waits answered at
     * once): one timer of 0 s resumes them at the next loop iteration, with the sleepers due
     * then (an idle watcher would wait while any timer is pending: behind a loop of sleep(0),
     * for ever) (task.c). */
    RB_FIFO(rb_task) yielded;
    rb_timer yield_timer;
    /* Sleeping waits (relaybus.sleep, ctx:sleep): a heap, earliest first, under one timer
     * (task.c). */
    rb_await **sleepers;
    unsigned nsleepers, sleepers_cap, sleep_round;
    rb_timer sleep_timer;
    /* relaybus.serve (lua_serve.c): the dispatchers' metrics, made by the first serve, and
     * the servers running */
    struct rb_metrics *metrics;
    struct lua_server *servers;
    int nservers;
};

/* An abort flag shared by a run's ctx.signal (and named leases' handle.signal). */
struct rb_signal {
    rb_abort_reason reason;     /* RB_ABORT_NONE while not aborted (rb_abort_reason_name) */
    int callbacks_ref;          /* registry ref to a table of on_abort functions, or LUA_NOREF */
    rb_module *m;
};

/* A coroutine run by relaybus: a spawned task or a handler run. */
struct rb_task {
    lua_State *co;
    rb_module *m;
    rb_await *wait;             /* the wait it is suspended in, or NULL */
    /* Handler runs: the abort machinery. */
    rb_run *run;                /* NULL for plain tasks */
    rb_signal *signal;          /* the run's signal, or NULL */
    double abort_at;            /* monotonic time of the abort, for the interrupt grace */
    /* the resume in progress began at this monotonic time, and this thread's CPU time: past
     * its deadline the hook tells a run that was busy (CPU spent after the deadline) from one
     * whose process was frozen (SIGSTOP, a paused VM: wall time passed, CPU time did not) */
    double resume_mono, resume_cpu;
    double deadline;            /* tasks guarded by a named lease: its deadline, else 0 */
    /* Called when the coroutine ends: ok, or the error message. */
    void (*on_end)(rb_task *t, int ok, const char *err);
    void *ud;
    void (*on_close)(rb_task *t);       /* the state closes with t still alive: ud goes */
    rb_task *live_prev, *live_next;     /* on m->live until freed or pooled */
    /* On one queue at a time: m->deferred, m->yielded, or m->task_pool once finished. */
    rb_task *queue_next;
    int co_ref;                 /* registry ref keeping the coroutine alive */
    int deferred_nargs;         /* a resume a step's budget put off: its nargs results wait on
                                 * the coroutine's stack */
    unsigned char deferred, deferred_truthful;
    unsigned char running;      /* inside lua_resume now */
    unsigned char done;
    unsigned char abort_seen;   /* its code has run since the abort (the grace has begun) */
    unsigned char extra_yield;  /* yielded with a bare coroutine.yield: on m->yielded */
    unsigned char killed;       /* stopped for good past its time: never resumed again */
    unsigned char inline_waits; /* waits answered at once since it last yielded (task.c) */
};

/* module.c */
rb_module *rb_module_get(lua_State *L);
/* A task ended or a dispatcher stopped: relaybus.run() may be waiting for it. Breaks only
 * run()'s own ev_run, never the host's (a host loop that shares m->loop keeps running). */
void rb_module_wake_run(rb_module *m);
void rb_module_run_cut_hooks(rb_module *m);

/* json.c: relaybus's JSON codec (docs/lua.md, "relaybus.json"). rb_json_encode and
 * rb_json_decode return 1 with the result pushed (the JSON text; the decoded value, JSON null
 * at the top as nil), or 0 with a one-line message pushed: an encode error names the part
 * ("payload.items[3].price: cannot encode a function"; rb_json_encode_as names the root), a
 * decode error the line and column. rb_json_check says whether s[0..len) decodes (1), else
 * writes why into msg (0). */
int rb_json_encode(lua_State *L, int idx);
int rb_json_encode_as(lua_State *L, int idx, const char *root);
int rb_json_decode(lua_State *L, const char *s, size_t len);
int rb_json_check(const char *s, size_t len, char *msg, size_t cap);
void rb_lua_open_json(lua_State *L);             /* pushes the relaybus.json table */

/* task.c */
rb_task *rb_task_current(lua_State *L);          /* the relaybus task L runs in, or NULL */
/* A new (or pooled) task; push the function and its arguments on t->co, then start it with
 * rb_task_start(t, nargs). L is used to create the coroutine. NULL when out of memory (it never
 * raises: loop callbacks make tasks, and an error raised there would unwind through libev). */
rb_task *rb_task_new(rb_module *m, lua_State *L, int nargs);
void rb_task_free(rb_task *t);                   /* pools its coroutine when it can */
void rb_task_start(rb_task *t, int nargs);
void rb_task_abort(rb_task *t);                  /* wakes the pending wait with nil, "aborted" */
/* Records t's abort (once): its time, and whether its code is running now. Code that was
 * waiting learns of the abort at its next resume, and the grace counts from there. */
void rb_task_mark_aborted(rb_task *t);
/* The count hook that stops a run past its deadline plus the grace, for good (task.c). */
void rb_task_install_hook(rb_task *t);
void rb_task_hook(lua_State *L, lua_Debug *ar);
int rb_lua_sleep(lua_State *L);                  /* relaybus.sleep(s) */
int rb_lua_spawn(lua_State *L);
int rb_task_is_aborted(rb_task *t);
/* The pollable runtime: resumes a step's budget put off, until the budget is spent again. */
void rb_task_run_deferred(rb_module *m);
/* The state closes: frees the tasks still alive (suspended in a wait that will never end). */
void rb_task_close_live(rb_module *m);
/* The module's part of the tasks (the watcher of bare yields), made with the module. */
void rb_task_init_module(rb_module *m);

/* signal (lua_dispatcher.c) */
/* A signal object with a flag of its own, pushed; returns the flag. */
rb_signal *rb_signal_push(lua_State *L, rb_module *m);
/* A flag kept in another object (not aborted, no callbacks). */
void rb_signal_init(rb_signal *s, rb_module *m);
void rb_signal_fire(rb_signal *s, rb_abort_reason reason);

/* lua_store.c */
#define RB_LIST_MAX 1000000     /* records one list call may return */
typedef struct lua_store lua_store;
int rb_lua_open_store(lua_State *L);             /* relaybus.open */
lua_store *rb_lua_store_object(lua_State *L, int idx);  /* raises unless an open store */
int rb_lua_store_open(lua_State *L, int idx);           /* 1 unless closed */
/* A started dispatcher uses the store: close() refuses until it has stopped (running), and
 * the store closes only once it is quiet (users). Deltas of +1 / -1 / 0. */
void rb_lua_store_use(lua_store *st, int running, int users);
void rb_lua_store_register(lua_State *L);
rb_store *rb_lua_check_store(lua_State *L, int idx);
void rb_push_record(lua_State *L, rb_module *m, const rb_delivery *d);
/* The tx object; the store userdata at store_idx is kept alive by it. */
void rb_push_tx(lua_State *L, rb_store *s, rb_tx *tx, int owned, int store_idx);
void rb_tx_invalidate_object(void *tx_object);   /* a tx userdata (rb_push_tx) */
const int *rb_lua_store_closed_flag(lua_State *L, int idx);
void rb_lua_push_wrapping_store(lua_State *L, rb_store *s, int inner_idx);


/* lua_dispatcher.c */
void rb_lua_dispatcher_register(lua_State *L);
int rb_lua_unstarted(rb_module *m);
void rb_lua_check_deadlines(rb_module *m);    /* rb_dispatcher_check_deadlines on each */
int rb_lua_dispatcher_new(lua_State *L);

/* lua_serve.c */
typedef struct lua_server lua_server;
int rb_lua_serve(lua_State *L);                  /* relaybus.serve */
void rb_lua_serve_register(lua_State *L);
int rb_lua_stop_servers(rb_module *m);           /* stops every server; returns how many */
struct rb_metrics *rb_lua_metrics(rb_module *m, int create);
/* lua_dispatcher.c, for it */
struct lua_dispatcher *rb_lua_dispatcher_next(struct lua_dispatcher *ld);
void rb_lua_dispatcher_attach_metrics(struct lua_dispatcher *ld, struct rb_metrics *mx);

/* lua_leases.c */
void rb_lua_leases_register(lua_State *L);
/* d:every's job on d (rb_dispatcher_every): each run calls the function at fn_idx as a task
 * guarded by the job's lease. Raises on failure. */
void rb_lua_every_register(lua_State *L, rb_module *m, rb_dispatcher *d, int store_ref,
                           const char *name, double interval, int fn_idx);
int rb_lua_try_acquire(lua_State *L);
int rb_lua_local_leases(lua_State *L);

/* Argument checks whose errors start with "relaybus:", as docs/lua.md ("Errors") says of misuse.
 * The luaL_ names are redirected here so every file of the binding gets them. */
const char *rb_checklstring(lua_State *L, int arg, size_t *len);
lua_Number rb_checknumber(lua_State *L, int arg);
lua_Integer rb_checkinteger(lua_State *L, int arg);
void rb_checktype(lua_State *L, int arg, int t);
void *rb_checkudata(lua_State *L, int arg, const char *tname);
lua_Number rb_optnumber(lua_State *L, int arg, lua_Number def);
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
/* The fallback of such an index function: pushes the method k of the object at idx (nil when
 * there is none); returns 1, for `return rb_push_method(L, 1, k);`. */
int rb_push_method(lua_State *L, int idx, const char *k);
/* Checks that the table at idx has only the given keys (NULL-terminated). */
void rb_check_options(lua_State *L, int idx, const char *what, const char *const *allowed);
double rb_opt_number(lua_State *L, int idx, const char *key, double dflt);
/* The topic at idx (a non-empty string without NUL); misuse "WHAT: topic ..." otherwise. */
const char *rb_check_topic(lua_State *L, int idx, const char *what);

#endif
