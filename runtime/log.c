/* log.c -- leveled one-line logging to stderr (or to a sink the host installs), with
 * limiters for conditions that repeat. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "clock.h"
#include "log.h"
#include "text.h"

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

void rb_log_set_json(int on) { json_mode = on ? 1 : 0; }

int rb_log_enabled(rb_log_level level) { return (int)level >= current_threshold(); }

void rb_log_set_level(rb_log_level level) { threshold = (int)level; }

void rb_log_set_sink(void (*sink)(rb_log_level, const char *, void *), void *ud)
{
    sink_fn = sink;
    sink_ud = ud;
}

/* Appends s as a JSON string: valid UTF-8 (rb_text_clean), quotes, backslashes and control
 * bytes escaped. Returns the new length (out is cut at cap, always terminated). */
static size_t json_str(char *out, size_t n, size_t cap, const char *s)
{
    char *clean = rb_text_clean(s, strlen(s), 2048);
    const char *p = clean ? clean : "(out of memory)";
    if (n + 1 < cap) out[n++] = '"';
    for (; *p && n + 8 < cap; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"' || c == '\\') { out[n++] = '\\'; out[n++] = (char)c; }
        else if (c < 0x20) n += (size_t)snprintf(out + n, cap - n, "\\u%04x", c);
        else out[n++] = (char)c;
    }
    if (n + 1 < cap) out[n++] = '"';
    out[n < cap ? n : cap - 1] = 0;
    free(clean);
    return n;
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
        char js[4096], when[40];
        double now = rb_wall_time();
        time_t secs = (time_t)now;
        struct tm tm;
        gmtime_r(&secs, &tm);
        size_t w = strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
        snprintf(when + w, sizeof when - w, ".%03dZ", (int)((now - (double)secs) * 1000) % 1000);
        size_t k = (size_t)snprintf(js, sizeof js, "{\"time\":\"%s\",\"level\":\"%s\",\"message\":",
                                    when, names[level]);
        k = json_str(js, k, sizeof js - 64, line);
        if (id) { k += (size_t)snprintf(js + k, sizeof js - k, ",\"delivery_id\":"); k = json_str(js, k, sizeof js - 32, id); }
        if (topic) { k += (size_t)snprintf(js + k, sizeof js - k, ",\"topic\":"); k = json_str(js, k, sizeof js - 4, topic); }
        snprintf(js + k, sizeof js - k, "}");
        if (sink_fn) sink_fn(level, js, sink_ud);
        else fprintf(stderr, "%s\n", js);
        return;
    }
    if (sink_fn) sink_fn(level, line, sink_ud);
    else fprintf(stderr, "relaybus: %s\n", line);
}

static void emit(rb_log_level level, const char *prefix, const char *fmt, va_list ap)
{
    emit_d(level, prefix, NULL, NULL, fmt, ap);
}

void rb_log_d(rb_log_level level, const char *id, const char *topic, const char *fmt, ...)
{
    if (!rb_log_enabled(level)) return;
    va_list ap;
    va_start(ap, fmt);
    emit_d(level, "", id, topic, fmt, ap);
    va_end(ap);
}

void rb_log(rb_log_level level, const char *fmt, ...)
{
    if (!rb_log_enabled(level)) return;
    va_list ap;
    va_start(ap, fmt);
    emit(level, "", fmt, ap);
    va_end(ap);
}

static int limit_pass(rb_log_limit *lim, long *dropped_out);

/* A line through the limit of its place, with the count of those it left out before it. */
static void limited_v(rb_log_limit *lim, rb_log_level level, const char *id, const char *topic,
                      const char *fmt, va_list ap)
{
    long dropped = 0;
    if (!limit_pass(lim, &dropped)) return;
    char prefix[64] = "";
    if (dropped) snprintf(prefix, sizeof prefix, "(%ld similar lines left out) ", dropped);
    emit_d(level, prefix, id, topic, fmt, ap);
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

/* 1 when the limiter lets a line through now; *dropped_out: lines left out before it. */
static int limit_pass(rb_log_limit *lim, long *dropped_out)
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
