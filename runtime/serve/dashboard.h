/* dashboard.h -- the operator's HTTP server: a page, Prometheus /metrics and a JSON API over a
 * store, served by libmicrohttpd on the runtime's own loop (its external-event mode: one
 * ev_io on MHD's epoll descriptor and one rb_timer), never on a thread of its own. Store
 * calls are the store's asynchronous operations: a request waits suspended, the loop runs on.
 *
 *   GET  /                          the page (HTML, CSS and JavaScript compiled in)
 *   GET  /metrics                   Prometheus text 0.0.4 (store gauges + the process's)
 *   GET  /api/stats                 counts by status and by topic, due, oldest due age
 *   GET  /api/deliveries?status=&topic=&limit=&after=   newest first, paged by `next`
 *   GET  /api/deliveries/ID         one delivery, payload included
 *   POST /api/deliveries/ID/kick    a buried one back to pending
 *   POST /api/deliveries/kick?status=buried
 *   POST /api/deliveries/ID/bury    a pending or processing one, buried now
 *   DELETE /api/deliveries/ID       a completed or buried one
 *
 * Actions need the token: without one configured they answer 403 (read-only), with one they
 * need "Authorization: Bearer TOKEN" (401 otherwise; compared in constant time). Requests
 * carry no body (413), headers are bounded by MHD's memory limit, connections time out (idle,
 * and a deadline for each request head and each answer), past the connection limit the one
 * waiting longest for its head is closed, and store queries in flight are capped (503 past it); stats are cached for `cache` seconds.
 * On a loopback address the Host header must name it (no DNS-rebinding page reads it). */
#ifndef RB_DASHBOARD_H
#define RB_DASHBOARD_H

#include <ev.h>
#include "stores/store.h"
#include "dispatch/metrics.h"

typedef struct rb_dashboard rb_dashboard;

typedef struct rb_dashboard_options {
    const char *listen;         /* "HOST:PORT", "[V6]:PORT"; NULL = "127.0.0.1:8480"; port 0 =
                                 * any free one (rb_dashboard_url tells which) */
    const char *token;          /* NULL or "" = read-only */
    const rb_metrics *metrics;  /* this process's dispatchers, or NULL; must outlive it */
    double cache;               /* s the store's stats are reused; default 1 */
} rb_dashboard_options;

#define RB_DASHBOARD_LISTEN "127.0.0.1:8480"
#define RB_DASHBOARD_MAX_LIMIT 500      /* deliveries one page may ask for */
#define RB_DASHBOARD_MAX_QUERIES 16     /* store calls in flight at once */

void rb_dashboard_options_init(rb_dashboard_options *o);
/* Listens now. NULL with a one-line reason in err (a bad address, a port in use). The store
 * must stay open until rb_dashboard_free. */
rb_dashboard *rb_dashboard_new(struct ev_loop *loop, rb_store *store,
                               const rb_dashboard_options *o, char *err, size_t errlen);
const char *rb_dashboard_url(const rb_dashboard *d);   /* "http://HOST:PORT/" */
int rb_dashboard_port(const rb_dashboard *d);
/* Closes every connection and frees it; store calls still in flight end harmlessly later. */
void rb_dashboard_free(rb_dashboard *d);

#endif
