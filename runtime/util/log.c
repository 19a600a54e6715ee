/* log.c -- leveled one-line logging to stderr (or to a sink the host installs), with
 * limiters for conditions that repeat. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "util/buf.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/text.h"

static _Atomic int threshold = -1;   /* read by every thread that logs */
static void (*sink_fn)(rb_log_level, const char *, void *);
static void *sink_ud;
static pthread_mutex_t limit_mu = PTHREAD_MUTEX_INITIALIZER;

static _Atomic int json_mode = -1;

/* RELAYBUS_LOG: a level, "json", or both separated by a comma (json,debug). */
static void read_env(void)
{
    const char *env = getenv("RELAYBUS_LOG");
    int t = RB_LOG_WARN, j = 0;
    static const char *const names[] = {"debug", "info", "warn", "error", "off"};
    char buf[64];
    snprintf(buf, sizeof buf, "%s", env ? env : "");
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (!strcmp(tok, "json")) j = 1;
        for (int i = 0; i < 5; i++)
            if (strcmp(tok, names[i]) == 0) t = i;
    }
    if (threshold < 0) threshold = t;
    if (json_mode < 0) json_mode = j;
}

static int current_threshold(void)
{
    if (threshold < 0) read_env();
    return threshold;
}

int rb_log_json(void)
{
    if (json_mode < 0) read_env();
    return json_mode;
}


int rb_log_enabled(rb_log_level level) { return (int)level >= current_threshold(); }

void rb_log_set_level(rb_log_level level) { threshold = (int)level; }

void rb_log_set_sink(void (*sink)(rb_log_level, const char *, void *), void *ud)
{
    sink_fn = sink;
    sink_ud = ud;
}

/* Appends ,"key": and s as a JSON string, cut to 2048 bytes (rb_text_clean). */
static void json_field(rb_buf *b, const char *key, const char *s)
{
    char *clean = rb_text_clean(s, strlen(s), 2048);
    const char *v = clean ? clean : "(out of memory)";
    rb_buf_printf(b, ",\"%s\":", key);
    rb_json_string(b, v, strlen(v));
    free(clean);
}

static void emit_d(rb_log_level level, const char *prefix, const char *id, const char *topic,
                   const char *fmt, va_list ap)
{
    char raw[1024], line[1100];
    vsnprintf(raw, sizeof raw, fmt, ap);
    size_t n = (size_t)snprintf(line, sizeof line, "%s", prefix);
    rb_one_line(line + n, sizeof line - n, raw);
    if (rb_log_json()) {
        static const char *const names[] = {"debug", "info", "warn", "error", "off"};
        char when[40];
        double now = rb_wall_time();
        time_t secs = (time_t)now;
        struct tm tm;
        gmtime_r(&secs, &tm);
        size_t w = strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
        snprintf(when + w, sizeof when - w, ".%03dZ", (int)((now - (double)secs) * 1000) % 1000);
        rb_buf js = {0};
        rb_buf_printf(&js, "{\"time\":\"%s\",\"level\":\"%s\"", when, names[level]);
        json_field(&js, "message", line);
        if (id) json_field(&js, "delivery_id", id);
        if (topic) json_field(&js, "topic", topic);
        rb_buf_puts(&js, "}");
        const char *out = rb_buf_failed(&js) ? "{\"message\":\"(out of memory)\"}" : js.data;
        if (sink_fn) sink_fn(level, out, sink_ud);
        else fprintf(stderr, "%s\n", out);
        rb_buf_free(&js);
        return;
    }
    if (sink_fn) sink_fn(level, line, sink_ud);
    else fprintf(stderr, "relaybus: %s\n", line);
}

static void emit(rb_log_level level, const char *prefix, const char *fmt, va_list ap)
{
    emit_d(level, prefix, NULL, NULL, fmt, ap);
}

void rb_log(rb_log_level level, const char *fmt, ...)
{
    if (!rb_log_enabled(level)) return;
    va_list ap;
    va_start(ap, fmt);
    emit(level, "", fmt, ap);
    va_end(ap);
}

/* The limiters that have left a line out, for rb_log_flush (under limit_mu). */
static rb_log_limit *limited_list;

static void flush_at_exit(void) { rb_log_flush(); }
static void register_flush(void) { atexit(flush_at_exit); }

/* Under limit_mu: keeps the line lim leaves out, as the one rb_log_flush writes if no later
 * line of lim carries the count (kept with the count, so a flush never sees one without the
 * other). */
static void keep_left_out(rb_log_limit *lim, rb_log_level level, const char *id,
                          const char *topic, const char *fmt, va_list ap)
{
    lim->level = level;
    vsnprintf(lim->last, sizeof lim->last, fmt, ap);
    snprintf(lim->id, sizeof lim->id, "%s", id ? id : "");
    snprintf(lim->topic, sizeof lim->topic, "%s", topic ? topic : "");
    if (!lim->listed) {
        lim->listed = 1;
        lim->next = limited_list;
        limited_list = lim;
    }
}

static int limit_pass(rb_log_limit *lim, long *dropped_out, rb_log_level level, const char *id,
                      const char *topic, const char *fmt, va_list ap);

/* A line through the limit of its place, with the count of those it left out before it. */
static void limited_v(rb_log_limit *lim, rb_log_level level, const char *id, const char *topic,
                      const char *fmt, va_list ap)
{
    long dropped = 0;
    va_list keep;
    va_copy(keep, ap);
    int write = limit_pass(lim, &dropped, level, id, topic, fmt, keep);
    va_end(keep);
    if (!write) {
        static pthread_once_t once = PTHREAD_ONCE_INIT;
        pthread_once(&once, register_flush);
        return;
    }
    char prefix[64] = "";
    if (dropped) snprintf(prefix, sizeof prefix, "(%ld similar lines left out) ", dropped);
    emit_d(level, prefix, id, topic, fmt, ap);
}

/* emit_d's arguments as a va_list, for a line that is already text. */
static void emit_text(rb_log_level level, const char *prefix, const char *id, const char *topic,
                      const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    emit_d(level, prefix, id, topic, fmt, ap);
    va_end(ap);
}

void rb_log_flush(void)
{
    for (;;) {
        /* one line at a time, written outside the lock (a sink may log) */
        char last[sizeof limited_list->last], id[sizeof limited_list->id];
        char topic[sizeof limited_list->topic], prefix[64] = "";
        rb_log_level level = RB_LOG_INFO;
        long dropped = 0;
        pthread_mutex_lock(&limit_mu);
        for (rb_log_limit *lim = limited_list; lim; lim = lim->next) {
            if (lim->dropped == 0) continue;
            dropped = lim->dropped;
            lim->dropped = 0;
            level = lim->level;
            memcpy(last, lim->last, sizeof last);
            memcpy(id, lim->id, sizeof id);
            memcpy(topic, lim->topic, sizeof topic);
            break;
        }
        pthread_mutex_unlock(&limit_mu);
        if (!dropped) return;
        /* the last line left out is written now; the count is of those before it */
        if (dropped > 1) snprintf(prefix, sizeof prefix, "(%ld similar lines left out) ", dropped - 1);
        emit_text(level, prefix, id[0] ? id : NULL, topic[0] ? topic : NULL, "%s", last);
    }
}

void rb_log_limited_d(rb_log_limit *lim, rb_log_level level, const char *id, const char *topic,
                      const char *fmt, ...)
{
    if (!rb_log_enabled(level)) return;
    va_list ap;
    va_start(ap, fmt);
    limited_v(lim, level, id, topic, fmt, ap);
    va_end(ap);
}

/* 1 when the limiter lets a line through now; *dropped_out: lines left out before it. A
 * line left out is kept (keep_left_out) from fmt and ap. */
static int limit_pass(rb_log_limit *lim, long *dropped_out, rb_log_level level, const char *id,
                      const char *topic, const char *fmt, va_list ap)
{
    double now = rb_monotonic();
    long dropped = 0;
    pthread_mutex_lock(&limit_mu);
    if (lim->lines == 0 || now - lim->window_start >= RB_LOG_WINDOW) {
        lim->window_start = now;
        lim->lines = 0;
    }
    int write = lim->lines < RB_LOG_BURST;
    if (write) {
        lim->lines++;
        dropped = lim->dropped;
        lim->dropped = 0;
    } else {
        lim->dropped++;
        keep_left_out(lim, level, id, topic, fmt, ap);
    }
    pthread_mutex_unlock(&limit_mu);
    *dropped_out = dropped;
    return write;
}

void rb_log_limited(rb_log_limit *lim, rb_log_level level, const char *fmt, ...)
{
    if (!rb_log_enabled(level)) return;
    va_list ap;
    va_start(ap, fmt);
    limited_v(lim, level, NULL, NULL, fmt, ap);
    va_end(ap);
}
