/* metrics.c -- see metrics.h. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util/alloc.h"
#include "util/hmap.h"
#include "dispatch/metrics.h"
#include "util/text.h"

static const double DURATION_BOUNDS[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                         10, 30, 60, 300};
static const double DELAY_BOUNDS[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                      30, 60, 300, 900, 3600};
#define NDUR (sizeof DURATION_BOUNDS / sizeof DURATION_BOUNDS[0])
#define NDELAY (sizeof DELAY_BOUNDS / sizeof DELAY_BOUNDS[0])

typedef struct hist {
    uint64_t count;
    double sum;
    uint64_t buckets[NDELAY];   /* not cumulative; the larger of the two bound lists */
} hist;

typedef struct series {
    rb_hnode node;              /* in rb_metrics.topics, by topic */
    char *topic;                /* valid UTF-8 (rb_text_clean) */
    uint64_t runs[RB_OUT_COUNT];
    hist duration, delay;
} series;

struct rb_metrics {
    rb_hmap topics;             /* of series.node, at most RB_METRICS_MAX_TOPICS */
    series *other;              /* "_other", past the topic limit */
    uint64_t claims, renewals;
    int64_t active;
};

rb_metrics *rb_metrics_new(void) { return rb_calloc(1, sizeof(rb_metrics)); }

static void series_free(series *s)
{
    if (!s) return;
    free(s->topic);
    free(s);
}

void rb_metrics_free(rb_metrics *m)
{
    if (!m) return;
    for (size_t i = 0; i < m->topics.nbuckets; i++)
        for (rb_hnode *n = m->topics.buckets[i], *next; n; n = next) {
            next = n->next;
            series_free(RB_HMAP_ENTRY(n, series, node));
        }
    rb_hmap_free(&m->topics);
    series_free(m->other);
    free(m);
}

static series *series_new(const char *topic)
{
    series *s = rb_calloc(1, sizeof *s);
    if (!s) return NULL;
    s->topic = rb_text_clean(topic, strlen(topic), 200);
    if (!s->topic) { free(s); return NULL; }
    return s;
}

/* The series whose label is topic (the cleaned text), or NULL. */
static series *lookup(const rb_metrics *m, const char *topic)
{
    for (rb_hnode *n = rb_hmap_first(&m->topics, rb_hash_text(topic)); n; n = rb_hmap_next(n)) {
        series *s = RB_HMAP_ENTRY(n, series, node);
        if (!strcmp(s->topic, topic)) return s;
    }
    return NULL;
}

/* The series of topic; NULL only when out of memory. The key is the label, the topic
 * cleaned: a topic that is not valid UTF-8 is found by its cleaned form, made anew each
 * time (rare, and never in the hot path of a sane deployment). */
static series *find(rb_metrics *m, const char *topic)
{
    series *s = lookup(m, topic);
    if (s) return s;
    if (m->topics.count >= RB_METRICS_MAX_TOPICS) {
        /* the overflow's label is "_other": a topic of that name already counted is it */
        if ((s = lookup(m, "_other"))) return s;
        if (!m->other) m->other = series_new("_other");
        return m->other;
    }
    if (!(s = series_new(topic))) return NULL;
    if (strcmp(s->topic, topic) != 0) {
        series *same = lookup(m, s->topic);
        if (same) { series_free(s); return same; }
    }
    if (rb_hmap_add(&m->topics, &s->node, rb_hash_text(s->topic)) != 0) {
        series_free(s);
        return NULL;
    }
    return s;
}

static void observe(hist *h, const double *bounds, size_t n, double v)
{
    if (!(v >= 0)) v = 0;       /* NaN, and a clock that stepped back */
    h->count++;
    h->sum += v;
    for (size_t i = 0; i < n; i++)
        if (v <= bounds[i]) { h->buckets[i]++; return; }
}

void rb_metrics_on_event(rb_dispatcher *d, const rb_event *ev, void *ud)
{
    (void)d;
    rb_metrics *m = ud;
    switch (ev->kind) {
    case RB_EV_CLAIM: return;
    case RB_EV_CLAIMED: m->claims++; m->active++; return;
    case RB_EV_RENEWED: m->renewals++; return;
    case RB_EV_STARTED: {
        series *s = ev->delivery ? find(m, ev->delivery->topic) : NULL;
        if (s) observe(&s->delay, DELAY_BOUNDS, NDELAY, ev->start_delay);
        return;
    }
    case RB_EV_SETTLED: {
        if (m->active > 0) m->active--;
        series *s = ev->delivery ? find(m, ev->delivery->topic) : NULL;
        if (!s) return;
        if ((unsigned)ev->outcome < RB_OUT_COUNT) s->runs[ev->outcome]++;
        observe(&s->duration, DURATION_BOUNDS, NDUR, ev->duration);
        return;
    }
    }
}

int rb_metrics_attach(rb_metrics *m, rb_dispatcher *d)
{
    return rb_dispatcher_on_event(d, rb_metrics_on_event, m);
}

void rb_metrics_detach(rb_metrics *m, rb_dispatcher *d)
{
    rb_dispatcher_off_event(d, rb_metrics_on_event, m);
}

static void add_totals(const series *s, rb_metrics_totals *t)
{
    if (!s) return;
    for (int o = 0; o < RB_OUT_COUNT; o++) t->runs += s->runs[o];
    t->completed += s->runs[RB_OUT_COMPLETED];
    t->failed += s->runs[RB_OUT_RETRIED] + s->runs[RB_OUT_BURIED] + s->runs[RB_OUT_TIMEOUT];
}

void rb_metrics_totals_get(const rb_metrics *m, rb_metrics_totals *t)
{
    memset(t, 0, sizeof *t);
    if (!m) return;
    for (size_t i = 0; i < m->topics.nbuckets; i++)
        for (const rb_hnode *n = m->topics.buckets[i]; n; n = n->next)
            add_totals(RB_HMAP_ENTRY(n, series, node), t);
    add_totals(m->other, t);
    t->claims = m->claims;
    t->renewals = m->renewals;
    t->active = m->active;
}

/* ---- text exposition ------------------------------------------------------------------- */
void rb_metrics_label(rb_buf *b, const char *s)
{
    char *clean = rb_text_clean(s, strlen(s), 1024);
    if (!clean) { b->failed = 1; return; }
    for (const char *p = clean; *p; p++) {
        if (*p == '\\') rb_buf_add(b, "\\\\", 2);
        else if (*p == '"') rb_buf_add(b, "\\\"", 2);
        else if (*p == '\n') rb_buf_add(b, "\\n", 2);
        else rb_buf_add(b, p, 1);
    }
    free(clean);
}

/* Prometheus floats, +Inf spelled so: the shortest text that reads back as v ("0.005", not
 * %.17g's "0.0050000000000000001", which Go reads as the same number but which a bucket's
 * le label matches only as text). */
static void num(rb_buf *b, double v)
{
    if (isinf(v)) { rb_buf_puts(b, v > 0 ? "+Inf" : "-Inf"); return; }
    if (isnan(v)) { rb_buf_puts(b, "NaN"); return; }
    char text[32];
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(text, sizeof text, "%.*g", digits, v);
        if (strtod(text, NULL) == v) break;
    }
    rb_buf_puts(b, text);
}

static void write_hist(rb_buf *b, const char *name, const series *s, const hist *h,
                       const double *bounds, size_t n)
{
    uint64_t cum = 0;
    for (size_t i = 0; i < n; i++) {
        cum += h->buckets[i];
        rb_buf_printf(b, "%s_bucket{topic=\"", name);
        rb_metrics_label(b, s->topic);
        rb_buf_puts(b, "\",le=\"");
        num(b, bounds[i]);
        rb_buf_printf(b, "\"} %llu\n", (unsigned long long)cum);
    }
    rb_buf_printf(b, "%s_bucket{topic=\"", name);
    rb_metrics_label(b, s->topic);
    rb_buf_printf(b, "\",le=\"+Inf\"} %llu\n", (unsigned long long)h->count);
    rb_buf_printf(b, "%s_sum{topic=\"", name);
    rb_metrics_label(b, s->topic);
    rb_buf_puts(b, "\"} ");
    num(b, h->sum);
    rb_buf_printf(b, "\n%s_count{topic=\"", name);
    rb_metrics_label(b, s->topic);
    rb_buf_printf(b, "\"} %llu\n", (unsigned long long)h->count);
}

/* The series in a stable order (by topic), so two scrapes list them alike. */
static int by_topic(const void *a, const void *b)
{
    return strcmp((*(series *const *)a)->topic, (*(series *const *)b)->topic);
}

void rb_metrics_write(const rb_metrics *m, rb_buf *b)
{
    series *list[RB_METRICS_MAX_TOPICS + 1];
    size_t n = 0;
    if (m) {
        for (size_t i = 0; i < m->topics.nbuckets; i++)
            for (rb_hnode *e = m->topics.buckets[i]; e; e = e->next)
                list[n++] = RB_HMAP_ENTRY(e, series, node);
        if (m->other) list[n++] = m->other;
        qsort(list, n, sizeof list[0], by_topic);
    }
    rb_buf_puts(b, "# HELP relaybus_runs_total Runs settled, by topic and outcome.\n"
                   "# TYPE relaybus_runs_total counter\n");
    for (size_t i = 0; i < n; i++)
        for (int o = 0; o < RB_OUT_COUNT; o++) {
            rb_buf_puts(b, "relaybus_runs_total{topic=\"");
            rb_metrics_label(b, list[i]->topic);
            rb_buf_printf(b, "\",outcome=\"%s\"} %llu\n", rb_outcome_name((rb_outcome)o),
                          (unsigned long long)list[i]->runs[o]);
        }
    rb_buf_puts(b, "# HELP relaybus_run_duration_seconds Time from a handler's start to the end"
                   " of its run.\n# TYPE relaybus_run_duration_seconds histogram\n");
    for (size_t i = 0; i < n; i++)
        write_hist(b, "relaybus_run_duration_seconds", list[i], &list[i]->duration,
                   DURATION_BOUNDS, NDUR);
    rb_buf_puts(b, "# HELP relaybus_start_delay_seconds Time from a delivery's run_at to its"
                   " handler's start.\n# TYPE relaybus_start_delay_seconds histogram\n");
    for (size_t i = 0; i < n; i++)
        write_hist(b, "relaybus_start_delay_seconds", list[i], &list[i]->delay, DELAY_BOUNDS,
                   NDELAY);
    rb_buf_printf(b, "# HELP relaybus_runs_active Runs claimed and not yet settled.\n"
                     "# TYPE relaybus_runs_active gauge\nrelaybus_runs_active %lld\n",
                  (long long)(m ? m->active : 0));
    rb_buf_printf(b, "# HELP relaybus_claims_total Deliveries claimed for a run.\n"
                     "# TYPE relaybus_claims_total counter\nrelaybus_claims_total %llu\n",
                  (unsigned long long)(m ? m->claims : 0));
    rb_buf_printf(b, "# HELP relaybus_lease_renewals_total Lease renewals written.\n"
                     "# TYPE relaybus_lease_renewals_total counter\n"
                     "relaybus_lease_renewals_total %llu\n",
                  (unsigned long long)(m ? m->renewals : 0));
}

/* relaybus_topic_deliveries from topic_stats' rowset: topic, then a count per status. */
static void write_topics(rb_buf *b, const rb_rowset *rs)
{
    if (!rs || rs->ncols < 1 + RB_STATUS_COUNT) return;
    rb_buf_puts(b, "# HELP relaybus_topic_deliveries Deliveries in the store, by topic and status.\n"
                   "# TYPE relaybus_topic_deliveries gauge\n");
    for (size_t i = 0; i < rs->nrows; i++) {
        const rb_value *v = &rs->vals[i * (size_t)rs->ncols];
        if (v[0].type != RB_VTEXT) continue;
        for (int k = 0; k < RB_STATUS_COUNT; k++) {
            const rb_value *c = &v[1 + k];
            if (c->type == RB_VNULL) continue;      /* not counted per topic (a large table) */
            long long n = c->type == RB_VINT ? (long long)c->i
                        : c->type == RB_VFLOAT ? (long long)c->f : 0;
            rb_buf_puts(b, "relaybus_topic_deliveries{topic=\"");
            rb_metrics_label(b, v[0].s);
            rb_buf_printf(b, "\",status=\"%s\"} %lld\n", rb_status_name((rb_status)k), n);
        }
    }
    if (rs->ncols < 2 + RB_STATUS_COUNT) return;
    rb_buf_puts(b, "# HELP relaybus_topic_oldest_due_seconds How long the oldest due pending"
                   " delivery of the topic has been due.\n"
                   "# TYPE relaybus_topic_oldest_due_seconds gauge\n");
    for (size_t i = 0; i < rs->nrows; i++) {
        const rb_value *v = &rs->vals[i * (size_t)rs->ncols];
        const rb_value *age = &v[1 + RB_STATUS_COUNT];
        if (v[0].type != RB_VTEXT) continue;
        rb_buf_puts(b, "relaybus_topic_oldest_due_seconds{topic=\"");
        rb_metrics_label(b, v[0].s);
        rb_buf_puts(b, "\"} ");
        num(b, age->type == RB_VFLOAT ? age->f : age->type == RB_VINT ? (double)age->i : 0);
        rb_buf_puts(b, "\n");
    }
}

void rb_metrics_write_store(rb_buf *b, const rb_stats *st, const rb_rowset *topics)
{
    rb_buf_printf(b, "# HELP relaybus_store_up Whether the store answered this scrape's query"
                     " (1) or not (0).\n# TYPE relaybus_store_up gauge\nrelaybus_store_up %d\n",
                  st != NULL);
    if (!st) return;
    rb_buf_printf(b, "# HELP relaybus_deliveries Deliveries in the store, by status.\n"
                     "# TYPE relaybus_deliveries gauge\n"
                     "relaybus_deliveries{status=\"pending\"} %lld\n"
                     "relaybus_deliveries{status=\"processing\"} %lld\n"
                     "relaybus_deliveries{status=\"completed\"} %lld\n"
                     "relaybus_deliveries{status=\"buried\"} %lld\n"
                     "relaybus_deliveries{status=\"cancelled\"} %lld\n",
                  (long long)st->pending, (long long)st->processing, (long long)st->completed,
                  (long long)st->buried, (long long)st->cancelled);
    rb_buf_printf(b, "# HELP relaybus_deliveries_estimated Whether relaybus_deliveries of the"
                     " status is the store's estimate (1) or a count (0).\n"
                     "# TYPE relaybus_deliveries_estimated gauge\n"
                     "relaybus_deliveries_estimated{status=\"completed\"} %d\n",
                  st->completed_estimated != 0);
    rb_buf_printf(b, "# HELP relaybus_due_deliveries Deliveries due now (pending, or with an"
                     " expired lease).\n# TYPE relaybus_due_deliveries gauge\n"
                     "relaybus_due_deliveries %lld\n", (long long)st->due);
    rb_buf_printf(b, "# HELP relaybus_stalled_deliveries Processing deliveries whose lease is over"
                     " (their worker died or froze; the next claim takes them over).\n"
                     "# TYPE relaybus_stalled_deliveries gauge\n"
                     "relaybus_stalled_deliveries %lld\n", (long long)st->stalled);
    rb_buf_puts(b, "# HELP relaybus_oldest_due_age_seconds How long the oldest due delivery has"
                   " been due.\n# TYPE relaybus_oldest_due_age_seconds gauge\n"
                   "relaybus_oldest_due_age_seconds ");
    num(b, st->oldest_due_age);
    rb_buf_puts(b, "\n");
    write_topics(b, topics);
}
