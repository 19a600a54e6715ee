/* log.c -- leveled one-line logging to stderr (or to a sink the host installs). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "log.h"

static int threshold = -1;
static void (*sink_fn)(rb_log_level, const char *, void *);
static void *sink_ud;

static int current_threshold(void)
{
    if (threshold >= 0) return threshold;
    const char *env = getenv("RELAYBUS_LOG");
    threshold = RB_LOG_WARN;
    static const char *const names[] = {"debug", "info", "warn", "error", "off"};
    for (int i = 0; env && i < 5; i++)
        if (strcmp(env, names[i]) == 0) threshold = i;
    return threshold;
}

int rb_log_enabled(rb_log_level level) { return (int)level >= current_threshold(); }

void rb_log_set_sink(void (*sink)(rb_log_level, const char *, void *), void *ud)
{
    sink_fn = sink;
    sink_ud = ud;
}

void rb_log(rb_log_level level, const char *fmt, ...)
{
    if (!rb_log_enabled(level)) return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (sink_fn) sink_fn(level, line, sink_ud);
    else fprintf(stderr, "relaybus: %s\n", line);
}
