/* host_loop_test.c -- the Lua module on the host's own libev loop: a relaybus task that ends,
 * or a dispatcher that stops, wakes relaybus.run() alone and never ends the host's ev_run (the
 * host decides when its loop ends: here its own timer does); such a state is not stepped; and
 * two pollable runtimes on one thread keep their timers apart. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include "harness.h"
#include "relaybus.h"

typedef struct host { int timer_ended_it; } host;

static void on_end(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    ((host *)w->data)->timer_ended_it = 1;
    ev_break(loop, EVBREAK_ALL);
}

/* Runs script on a state bound to a new loop, then the host's ev_run(loop, 0) until its own
 * 0.5 s timer ends it; returns whether it was that timer (not relaybus) that ended the loop. */
static int host_loop_survives(const char *script)
{
    struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    rb_lua_set_loop(L, loop);
    luaL_requiref(L, "relaybus", luaopen_relaybus, 0);
    lua_pop(L, 1);
    if (luaL_dostring(L, script) != LUA_OK) fail_msg("script: %s", lua_tostring(L, -1));
    host h = {0};
    ev_timer end;
    ev_timer_init(&end, on_end, 0.5, 0);
    end.data = &h;
    ev_timer_start(loop, &end);
    ev_run(loop, 0);
    ev_timer_stop(loop, &end);
    int busy = rb_lua_busy(L);
    lua_close(L);
    ev_loop_destroy(loop);
    assert_int_equal(busy, 0);
    return h.timer_ended_it;
}

static void task_end_keeps_host_loop(void **state)
{
    (void)state;
    assert_true(host_loop_survives(
        "local relaybus = require 'relaybus'\n"
        "relaybus.spawn(function() relaybus.sleep(0.05) end)\n"));
}

static void dispatcher_stop_keeps_host_loop(void **state)
{
    (void)state;
    char path[] = "/tmp/relaybus-host-loop-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    char script[1024];
    snprintf(script, sizeof script,
             "local relaybus = require 'relaybus'\n"
             "local store = assert(relaybus.open('sqlite:%s'))\n"
             "assert(store:enqueue('t', {}))\n"
             "local d = relaybus.dispatcher(store, {poll_interval = 0.01})\n"
             "d:handle('t', function() relaybus.spawn(function() d:stop() end) end)\n"
             "d:start()\n", path);
    assert_true(host_loop_survives(script));
    unlink(path);
    char side[sizeof path + 8];
    snprintf(side, sizeof side, "%s-wal", path);
    unlink(side);
    snprintf(side, sizeof side, "%s-shm", path);
    unlink(side);
}

/* A state on the host's loop is not stepped: no descriptor, no timeout, and a step is refused
 * with the reason on the stack. */
static void host_loop_state_is_not_stepped(void **state)
{
    (void)state;
    struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    rb_lua_set_loop(L, loop);
    luaL_requiref(L, "relaybus", luaopen_relaybus, 0);
    lua_pop(L, 1);
    assert_int_equal(rb_lua_pollfd(L), -1);
    assert_true(rb_lua_timeout(L) < 0);
    int top = lua_gettop(L);
    assert_int_equal(rb_lua_step(L, 0.002), -1);
    assert_string_equal(lua_tostring(L, -1), "relaybus: step: this runtime runs on the host's loop (rb_lua_set_loop)");
    lua_settop(L, top);
    lua_close(L);
    ev_loop_destroy(loop);
}

/* Two pollable runtimes on one thread: each has its own descriptor and its own timers. */
static void two_runtimes_one_thread(void **state)
{
    (void)state;
    lua_State *a = luaL_newstate(), *b = luaL_newstate();
    luaL_openlibs(a);
    luaL_openlibs(b);
    luaL_requiref(a, "relaybus", luaopen_relaybus, 0);
    luaL_requiref(b, "relaybus", luaopen_relaybus, 0);
    lua_pop(a, 1);
    lua_pop(b, 1);
    assert_true(rb_lua_pollfd(a) >= 0 && rb_lua_pollfd(b) >= 0);
    assert_int_not_equal(rb_lua_pollfd(a), rb_lua_pollfd(b));
    assert_int_equal(luaL_dostring(a, "local r = require 'relaybus'\n"
                                      "r.spawn(function() r.sleep(0.3) end)"), LUA_OK);
    assert_true(rb_lua_timeout(b) < 0);             /* a's sleep is not b's */
    double t = rb_lua_timeout(a);
    if (!(t > 0.2 && t <= 0.31)) fail_msg("timeout %g", t);
    assert_int_equal(rb_lua_step(b, 0), 0);
    assert_int_equal(rb_lua_busy(a), 1);
    assert_int_equal(rb_lua_busy(b), 0);
    lua_close(b);
    assert_true(rb_lua_timeout(a) > 0);             /* closing b left a's timers listed */
    /* Let the task end before a closes (a state closed with a task still waiting frees it:
     * rb_task_close_live). */
    for (int i = 0; i < 2000 && rb_lua_busy(a) > 0; i++) {
        usleep(1000);
        assert_int_equal(rb_lua_step(a, 0), 0);
    }
    assert_int_equal(rb_lua_busy(a), 0);
    lua_close(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(task_end_keeps_host_loop),
        cmocka_unit_test(dispatcher_stop_keeps_host_loop),
        cmocka_unit_test(host_loop_state_is_not_stepped),
        cmocka_unit_test(two_runtimes_one_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
