/* leases.h -- named leases: one holder at a time for a named piece of work, for at most a
 * bounded time (docs/c.md "leases.h"; in Lua, docs/lua.md "Named leases").
 *
 * A lease is held under a random token in the store (its clock decides expiry); the holder's
 * deadline is kept on the monotonic clock, measured from just before the claim was sent and
 * less a margin, so the holder stops before anyone else can take the name. Past the deadline
 * the holder has no claim at all: extend and release then fail, and release is conditional on
 * the token, so a late release never revokes a successor. */
#ifndef RB_LEASES_H
#define RB_LEASES_H

#include "stores/store.h"

typedef struct rb_lease rb_lease;

/* lease is NULL with err NULL when someone else holds the name: an ordinary outcome. */
typedef void (*rb_lease_acquire_cb)(void *ud, const char *err, rb_lease *lease);
/* ok: 1 when done; 0 with err ("lease lost", or the store's message) otherwise. */
typedef void (*rb_lease_done_cb)(void *ud, const char *err, int ok);

void rb_lease_try_acquire(rb_store *s, const char *name, double duration,
                          rb_lease_acquire_cb cb, void *ud);
const char *rb_lease_name(const rb_lease *l);
const char *rb_lease_token(const rb_lease *l);
double rb_lease_deadline(const rb_lease *l);        /* monotonic seconds */
/* 1 once the deadline has passed (reads the clock) or the lease was released. */
int rb_lease_over(const rb_lease *l);
/* fn(l, ud) is called once, from the loop, when the deadline passes. */
void rb_lease_on_expire(rb_lease *l, void (*fn)(rb_lease *l, void *ud), void *ud);
/* duration <= 0: the duration of the acquire. */
void rb_lease_extend(rb_lease *l, double duration, rb_lease_done_cb cb, void *ud);
void rb_lease_release(rb_lease *l, rb_lease_done_cb cb, void *ud);
/* Forgets the handle (its timer stops; the store's claim runs out by itself). Safe while an
 * extend or release is in flight: their callbacks are then not called. */
void rb_lease_free(rb_lease *l);

/* This process's own named leases (relaybus.local_leases()): exclusive among the code of this
 * process only, no store involved. Its answers come at once (inside the call). A handle of
 * it must not be extended or released once the table is freed. */
typedef struct rb_local_leases rb_local_leases;
rb_local_leases *rb_local_leases_new(struct ev_loop *loop);     /* NULL when out of memory */
void rb_local_leases_free(rb_local_leases *ls);
void rb_local_lease_try_acquire(rb_local_leases *ls, const char *name, double duration,
                                rb_lease_acquire_cb cb, void *ud);

#endif
