/* await.h -- how a C function of the Lua binding waits for an asynchronous result.
 *
 * Inside a relaybus coroutine (a handler or a task) the function yields and the loop goes on;
 * in the main chunk it runs the loop until the result arrives, so the call blocks. Either way
 * the Lua caller sees an ordinary function call that returns the results.
 *
 *   static int l_thing(lua_State *L) {
 *       rb_await *w = rb_await_begin(L);       // NULL when the run is already aborted:
 *       if (!w) return 2;                       // nil, "aborted" already pushed
 *       start_io(..., on_done, w);              // on_done may run before start_io returns
 *       return rb_await_finish(L, w);
 *   }
 *   static void on_done(void *ud, ...) {
 *       rb_await *w = ud;
 *       lua_State *T = rb_await_target(w);      // NULL when the waiter gave up (aborted)
 *       if (T) { lua_pushxxx(T, ...); ... }
 *       rb_await_resolve(w, T ? nresults : 0);  // frees w
 *   }
 *
 * When the waiting run is aborted, the wait ends at once with nil, "aborted"; the late
 * completion then finds rb_await_target() == NULL and only frees its data. An optional cancel
 * hook lets the I/O stop early (an HTTP transfer is cut). */
#ifndef RB_AWAIT_H
#define RB_AWAIT_H

#include <lua.h>

typedef struct rb_await rb_await;

/* Starts a wait. Returns NULL after pushing nil, "aborted" when the calling run is already
 * aborted (the caller returns those 2 results). Raises only on misuse or out of memory: a
 * wait where none is possible (inside the event loop but not in a relaybus coroutine, e.g. a
 * coroutine of the handler's own or a host's callback) raises a "relaybus: ..." error. */
rb_await *rb_await_begin(lua_State *L);
int rb_await_finish(lua_State *L, rb_await *w);
lua_State *rb_await_target(rb_await *w);
void rb_await_resolve(rb_await *w, int nresults);
/* cancel(ud) is called at most once, when the waiter is aborted before the result came.
 * With a cancel hook, the I/O must NOT complete the wait after cancel returns (rb_await
 * frees itself); without one, the late completion sees rb_await_target() == NULL and must
 * still call rb_await_resolve(w, 0) so the wait is freed. */
void rb_await_on_cancel(rb_await *w, void (*cancel)(void *ud), void *ud);
/* The wait reports what really happened even past an abort: the abort does not end it, and a
 * result after the deadline is not replaced by "aborted". For writes whose outcome the caller
 * must know (a settle that may have been written). */
void rb_await_truthful(rb_await *w);

#endif
