/* dispatcher_shared.c -- what the dispatchers on one store share (rb_store.dispatch): the
 * registry of their unsettled runs, the list a local enqueue or a notification wakes, and
 * what their claims learnt of the store. */
#include <stdlib.h>
#include <string.h>
#include "dispatch/dispatcher_impl.h"
#include "util/alloc.h"
#include "util/check.h"

disp_shared *disp_shared_of(const rb_store *s)
{
    return s->dispatch;
}

static void shared_free(void *p)
{
    disp_shared *sh = p;        /* (its dispatchers stopped before: store.h's rule for hosts) */
    rb_hmap_free(&sh->registry);
    free(sh);
}

disp_shared *disp_shared_get(rb_store *s)
{
    if (!s->dispatch && (s->dispatch = rb_calloc(1, sizeof(disp_shared))))
        s->dispatch_free = shared_free;
    return s->dispatch;
}

/* The registry's table is let go once it is empty and no dispatcher is started on the store
 * (a store kept open for other work holds no table of runs); what the dispatchers learnt
 * stays for the next one, until the store's close (rb_store_release_dispatch). */
void disp_shared_release(rb_store *s)
{
    disp_shared *sh = s->dispatch;
    if (!sh || sh->registry.count || sh->dispatchers) return;
    rb_hmap_free(&sh->registry);
}

int disp_deaf_to(const disp_shared *sh, unsigned listener)
{
    return sh && sh->deaf && sh->deaf_listener == listener;
}

/* ---- the registry of unsettled runs ------------------------------------------------------ */
/* Keyed by delivery id: a delivery is never started again here while an earlier run of it has
 * not settled (a lease that expired under a frozen process, then reclaimed by us). The runs
 * are its members (rb_run.active): an entry costs no allocation. */

rb_run *disp_active_find(const rb_store *s, const char *id)
{
    const disp_shared *sh = disp_shared_of(s);
    if (!sh) return NULL;
    for (rb_hnode *n = rb_hmap_first(&sh->registry, rb_hash_text(id)); n; n = rb_hmap_next(n)) {
        rb_run *e = RB_HMAP_ENTRY(n, rb_run, active);
        if (strcmp(e->rec->id, id) == 0) return e;
    }
    return NULL;
}

int disp_active_add(rb_store *s, rb_run *run)
{
    disp_shared *sh = disp_shared_get(s);
    if (!sh) return -1;
    return rb_hmap_add(&sh->registry, &run->active, rb_hash_text(run->rec->id));
}

/* (a run that is not in the registry, a parked one, is left as it is) */
void disp_active_remove(rb_store *s, rb_run *run)
{
    disp_shared *sh = disp_shared_of(s);
    if (sh) rb_hmap_remove(&sh->registry, &run->active);
    disp_shared_release(s);
}
