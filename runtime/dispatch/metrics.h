/* metrics.h -- counters and histograms of the dispatchers of a process, fed by their
 * lifecycle events (dispatcher.h), written as Prometheus text exposition (format 0.0.4).
 *
 * One rb_metrics serves any number of dispatchers on one loop thread: attach it to each
 * (rb_metrics_attach, which is rb_dispatcher_on_event with rb_metrics_on_event). Counting is
 * a few additions per event; a topic's series are found by a hash of its name. Topics past
 * RB_METRICS_MAX_TOPICS share the series of the topic "_other". Names (docs/c.md):
 *   relaybus_runs_total{topic,outcome}      counter
 *   relaybus_run_duration_seconds{topic}    histogram
 *   relaybus_start_delay_seconds{topic}     histogram
 *   relaybus_runs_active                    gauge (claimed, not yet settled)
 *   relaybus_claims_total                   counter (deliveries claimed)
 *   relaybus_lease_renewals_total           counter
 * and, from a store's stats (rb_metrics_write_store): relaybus_store_up,
 * relaybus_deliveries{status}, relaybus_due_deliveries, relaybus_oldest_due_age_seconds,
 * relaybus_topic_deliveries{topic,status}, relaybus_topic_oldest_due_seconds{topic}. */
#ifndef RB_METRICS_H
#define RB_METRICS_H

#include <stdint.h>
#include "dispatch/dispatcher.h"
#include "util/buf.h"

#define RB_METRICS_MAX_TOPICS 1000

typedef struct rb_metrics rb_metrics;

rb_metrics *rb_metrics_new(void);               /* NULL when out of memory */
/* Detach it from every dispatcher first (rb_dispatcher_off_event), or free those first. */
void rb_metrics_free(rb_metrics *m);
void rb_metrics_on_event(rb_dispatcher *d, const rb_event *ev, void *ud);
int rb_metrics_attach(rb_metrics *m, rb_dispatcher *d);    /* 0, or -1 out of memory */
void rb_metrics_detach(rb_metrics *m, rb_dispatcher *d);

/* Totals over every topic, for a chart: runs completed, runs failed (retried, buried, timed
 * out), and the other counters. */
typedef struct rb_metrics_totals {
    uint64_t completed, failed, claims, renewals, runs;
    int64_t active;
} rb_metrics_totals;
void rb_metrics_totals_get(const rb_metrics *m, rb_metrics_totals *t);

/* Appends the process metrics to b (see buf.h for out of memory). */
void rb_metrics_write(const rb_metrics *m, rb_buf *b);
/* Appends the store gauges: relaybus_store_up (0 when st is NULL: the store did not answer,
 * and nothing else of it is written), the counts of st, and per topic those of `topics`
 * (topic_stats' rowset, may be NULL). */
void rb_metrics_write_store(rb_buf *b, const rb_stats *st, const rb_rowset *topics);
/* Appends s as a label value: \, " and newline escaped as the format says; bytes that are no
 * valid UTF-8 become U+FFFD. */
void rb_metrics_label(rb_buf *b, const char *s);

#endif
