/* lua_testing.c -- the Lua module relaybus_testing, which only the specs load; nothing of it
 * ships in relaybus itself:
 *   testing.faults(store, opts)   a store object whose operations go through the
 *                                 fault-injecting wrapper of store_faults.h
 *   testing.fault_stats(store)    that wrapper's counts
 *   testing.fail_alloc(n)         the nth allocation of the C core from now fails (0: none);
 *                                 returns how many have failed through it so far
 *                                 (alloc_faults.h; needs relaybus_allocfail.so loaded globally
 *                                 before relaybus.so, as spec/support/stores.lua does)
 *   testing.daemon(fn, ...)       relaybus.spawn for a task relaybus.run() does not wait for
 *   testing.schedule_fire(store, name, due, next, topic, payload_json, key)
 *                                 the store's fire of one tick, as a dispatcher sends it
 * It calls relaybus's own functions: the relaybus command exports them, and from a plain Lua
 * interpreter relaybus.so must be loaded globally first (spec/support/stores.lua does).
 *
 * The object testing.faults makes wraps the one given and keeps it alive; closing the wrapper
 * leaves the inner store open (its own object closes it), and once the inner object is closed
 * the wrapper answers every operation "store closed". */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "util/log.h"
#include "store_faults.h"

static const char *const faults_opts[] = {"seed", "fail", "lost", "late", "max_delay", "min_delay",
                                          "stuck_after", "ops", NULL};
static const char *const rate_opts[] = {"fail", "lost", "late", NULL};

/* Reads fail/lost/late of the table at idx over `dflt`; what names it in errors. */
static rb_fault_rates read_rates(lua_State *L, int idx, rb_fault_rates dflt, const char *what)
{
    rb_fault_rates r = dflt;
    r.fail = rb_opt_number(L, idx, "fail", dflt.fail);
    r.lost = rb_opt_number(L, idx, "lost", dflt.lost);
    r.late = rb_opt_number(L, idx, "late", dflt.late);
    if (!(r.fail >= 0 && r.fail <= 1) || !(r.lost >= 0 && r.lost <= 1) ||
        !(r.late >= 0 && r.late <= 1))
        rb_misuse(L, "faults: %srates must be in [0, 1]", what);
    if (r.fail + r.lost > 1) rb_misuse(L, "faults: %sfail + lost must be <= 1", what);
    return r;
}

static uint64_t read_seed(lua_State *L, int idx)
{
    if (!lua_istable(L, idx)) goto random;
    lua_getfield(L, idx, "seed");
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        goto random;
    }
    if (!lua_isinteger(L, -1)) rb_misuse(L, "faults: seed must be an integer");
    uint64_t seed = (uint64_t)lua_tointeger(L, -1);
    lua_pop(L, 1);
    return seed;
random: {
        /* No seed given: a random one, reported by fault_stats so the run can be replayed. */
        char tok[33];
        rb_random_token(tok);
        tok[16] = 0;
        return (uint64_t)strtoull(tok, NULL, 16);
    }
}

static int l_faults(lua_State *L)
{
    rb_store *inner = rb_lua_check_store(L, 1);
    rb_check_options(L, 2, "faults", faults_opts);
    rb_faults_options o;
    rb_faults_options_init(&o, read_seed(L, 2));
    if (lua_istable(L, 2)) {
        rb_fault_rates all = read_rates(L, 2, (rb_fault_rates){0, 0, 0}, "");
        for (int i = 0; i < RB_FOP_COUNT; i++) o.rates[i] = all;
        o.max_delay = rb_opt_number(L, 2, "max_delay", o.max_delay);
        if (!(o.max_delay >= 0 && o.max_delay <= 3600))
            rb_misuse(L, "faults: max_delay must be in [0, 3600]");
        o.min_delay = rb_opt_number(L, 2, "min_delay", o.min_delay);
        if (!(o.min_delay >= 0 && o.min_delay <= o.max_delay))
            rb_misuse(L, "faults: min_delay must be in [0, max_delay]");
        o.stuck_after = rb_opt_number(L, 2, "stuck_after", o.stuck_after);
        if (!(o.stuck_after > 0)) rb_misuse(L, "faults: stuck_after must be > 0");
        lua_getfield(L, 2, "ops");
        int ops = lua_gettop(L);
        if (!lua_isnil(L, ops)) {
            if (!lua_istable(L, ops)) rb_misuse(L, "faults: ops must be a table");
            lua_pushnil(L);
            while (lua_next(L, ops)) {
                int op = lua_type(L, -2) == LUA_TSTRING ? rb_fault_op_parse(lua_tostring(L, -2)) : -1;
                if (op < 0)
                    rb_misuse(L, "faults: ops: unknown operation '%s'", luaL_tolstring(L, -2, NULL));
                if (!lua_istable(L, -1))
                    rb_misuse(L, "faults: ops.%s must be a table {fail=, lost=, late=}",
                              rb_fault_op_name(op));
                char what[64];
                snprintf(what, sizeof what, "ops.%s: ", rb_fault_op_name(op));
                rb_check_options(L, -1, "faults ops", rate_opts);
                o.rates[op] = read_rates(L, lua_gettop(L), all, what);
                lua_pop(L, 1);
            }
        }
        lua_pop(L, 1);
    }
    o.inner_gone = rb_lua_store_closed_flag(L, 1);
    char err[256] = "";
    rb_store *s = rb_faults_wrap(inner, &o, err, sizeof err);
    if (!s) {
        lua_pushnil(L);
        lua_pushstring(L, err[0] ? err : "cannot wrap the store");
        return 2;
    }
    rb_lua_push_wrapping_store(L, s, 1);
    return 1;
}

static void set_count(lua_State *L, const char *k, long v)
{
    lua_pushinteger(L, (lua_Integer)v);
    lua_setfield(L, -2, k);
}

/* One table {op = n} of the counts that are not zero. */
static void push_by_op(lua_State *L, const long *counts)
{
    lua_newtable(L);
    for (int i = 0; i < RB_FOP_COUNT; i++)
        if (counts[i]) set_count(L, rb_fault_op_name(i), counts[i]);
}

/* testing.fault_stats(store) -> {seed=, calls={op=n}, injected={fail={op=n}, lost=..., late=...},
 * faults=, waiting=, in_inner=, held=, sync_answers=, violations={twice=, wrong_thread=,
 * multiline=, err_with_result=, stuck=, unanswered=}} */
static int l_fault_stats(lua_State *L)
{
    rb_store *s = rb_lua_check_store(L, 1);
    rb_fault_stats st;
    if (rb_faults_stats(s, &st) != 0)
        return rb_misuse(L, "fault_stats: this store was not made by testing.faults");
    lua_createtable(L, 0, 10);
    lua_pushinteger(L, (lua_Integer)st.seed);
    lua_setfield(L, -2, "seed");
    push_by_op(L, st.calls);
    lua_setfield(L, -2, "calls");
    long total = 0;
    lua_createtable(L, 0, RB_FAULT_KINDS);
    for (int k = 0; k < RB_FAULT_KINDS; k++) {
        push_by_op(L, st.injected[k]);
        lua_setfield(L, -2, rb_fault_kind_name(k));
        for (int i = 0; i < RB_FOP_COUNT; i++) total += st.injected[k][i];
    }
    lua_setfield(L, -2, "injected");
    set_count(L, "faults", total);
    set_count(L, "waiting", st.waiting);
    set_count(L, "in_inner", st.in_inner);
    set_count(L, "held", st.held);
    set_count(L, "sync_answers", st.sync_answers);
    lua_createtable(L, 0, 6);
    set_count(L, "twice", st.twice);
    set_count(L, "wrong_thread", st.wrong_thread);
    set_count(L, "multiline", st.multiline);
    set_count(L, "err_with_result", st.err_with_result);
    set_count(L, "stuck", st.stuck);
    set_count(L, "unanswered", st.unanswered);
    lua_setfield(L, -2, "violations");
    return 1;
}

/* (looked up when called: the relaybus command, which also loads this module, has the plain
 * allocation calls and no hook) */
static int l_fail_alloc(lua_State *L)
{
    lua_Integer n = luaL_checkinteger(L, 1);
    long (*fail_nth)(long) = (long (*)(long))dlsym(RTLD_DEFAULT, "rb_alloc_fail_nth");
    if (!fail_nth)
        return luaL_error(L, "testing.fail_alloc: relaybus_allocfail.so was not loaded before "
                             "relaybus.so");
    lua_pushinteger(L, fail_nth((long)(n > 0 ? n : 0)));
    return 1;
}

/* testing.schedule_fire(store, name, due, next, topic, payload_json, key): the store's fire
 * of one tick, as a dispatcher sends it (a stale one, a repeated one): its count, or nil, err. */
static void on_fired(void *ud, const char *err, int64_t count)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int n = 0;
    if (T && err) {
        lua_pushnil(T);
        lua_pushstring(T, err);
        n = 2;
    } else if (T) {
        lua_pushinteger(T, (lua_Integer)count);
        n = 1;
    }
    rb_await_resolve(w, n);
}

static int l_schedule_fire(lua_State *L)
{
    rb_store *s = rb_lua_check_store(L, 1);
    rb_enqueue_item tick = {.topic = luaL_checkstring(L, 5), .payload = luaL_checkstring(L, 6),
                            .key = luaL_checkstring(L, 7), .max_attempts = 25};
    const char *name = luaL_checkstring(L, 2);
    double due = luaL_checknumber(L, 3), next = luaL_checknumber(L, 4);
    tick.run_at = due;
    if (!s->vt->schedule_fire) return luaL_error(L, "testing.schedule_fire: no schedules here");
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->schedule_fire(s, name, due, next, &tick, on_fired, w);
    return rb_await_finish(L, w);
}

/* testing.daemon(fn, ...): a task that relaybus.run() does not wait for (a spec's background
 * work that must not keep a script running). */
static void on_daemon_end(rb_task *t, int ok, const char *err)
{
    if (!ok) rb_log(RB_LOG_ERROR, "testing.daemon: task failed: %s", err);
    rb_task_free(t);
}

static int l_daemon(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TFUNCTION);
    rb_module *m = rb_module_get(L);
    int nargs = lua_gettop(L) - 1;
    rb_task *t = rb_task_new(m, m->L, nargs);
    if (!t) return luaL_error(L, "relaybus: out of memory");
    t->on_end = on_daemon_end;
    lua_xmove(L, t->co, nargs + 1);
    rb_task_start(t, nargs);
    return 0;
}

int luaopen_relaybus_testing(lua_State *L);

int luaopen_relaybus_testing(lua_State *L)
{
    static const luaL_Reg fns[] = {
        {"faults", l_faults},
        {"fault_stats", l_fault_stats},
        {"fail_alloc", l_fail_alloc},
        {"daemon", l_daemon},
        {"schedule_fire", l_schedule_fire},
        {NULL, NULL},
    };
    luaL_newlib(L, fns);
    return 1;
}
