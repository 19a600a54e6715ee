/* threads_host.c -- one runtime per thread: T threads, each with R lua_States of its own (a
 * runtime each, on its own private loop), all draining at once, each thread polling its
 * runtimes' descriptors and stepping them.
 *
 *   build/threads_host [--threads 4] [--per-thread 1] --sqlite DIR [key=value...]
 *       each runtime its own SQLite file DIR/tI_K.db, with the whole workload (checks included)
 *   build/threads_host [--threads 4] [--per-thread 1] --pg URL --table NAME [n=N] [key=value...]
 *       all runtimes drain one PostgreSQL table: the first enqueues n, every one stops once the
 *       table counts n completed (checks=0)
 *
 * At the end each runtime's result line is printed ("runtime I.K: result ok=1 ..."), then the
 * check of every handler run merged ("check ok=1 ids=N runs=R missing=0 overlaps=0 ..."):
 * nothing lost, no delivery run twice at once. Exit 0 when all are ok. */
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include "workload_host.h"

/* runtime/util/timer.c lists the timers of at most 8 owned loops per thread (rb_loop_own) */
#define MAX_RUNTIMES 8
#define MAX_ARGS 32

typedef struct worker {
    int index, per;
    char *args[MAX_RUNTIMES][MAX_ARGS];
    int nargs[MAX_RUNTIMES];
    char *reports[MAX_RUNTIMES];
    char *logs[MAX_RUNTIMES];
    int failed;
    pthread_t thread;
} worker;

static void *run_worker(void *arg)
{
    worker *w = arg;
    lua_State *L[MAX_RUNTIMES] = {0};
    for (int k = 0; k < w->per; k++)
        if (!(L[k] = workload_open(w->nargs[k], w->args[k]))) w->failed = 1;
    /* Sleep until one runtime's descriptor is readable or the earliest timeout, step them all. */
    while (!w->failed) {
        struct pollfd p[MAX_RUNTIMES];
        double wait = -1;
        int busy = 0;
        for (int k = 0; k < w->per; k++) {
            p[k] = (struct pollfd){.fd = rb_lua_pollfd(L[k]), .events = POLLIN};
            if (rb_lua_busy(L[k]) == 0) { p[k].fd = -1; continue; }
            busy = 1;
            double t = rb_lua_timeout(L[k]);
            if (t >= 0 && (wait < 0 || t < wait)) wait = t;
        }
        if (!busy) break;
        poll(p, w->per, wait < 0 ? -1 : (int)ceil(wait * 1e3));
        for (int k = 0; k < w->per; k++) {
            if (rb_lua_busy(L[k]) == 0) continue;
            if (rb_lua_step(L[k], 0) != 0) {
                fprintf(stderr, "threads_host: runtime %d.%d: %s\n", w->index, k, lua_tostring(L[k], -1));
                w->failed = 1;
            }
        }
    }
    for (int k = 0; k < w->per; k++) {
        if (!L[k]) continue;
        w->reports[k] = workload_call(L[k], "report");
        w->logs[k] = workload_call(L[k], "log");
        lua_close(L[k]);
    }
    return NULL;
}

/* Appends "prefix" to every line's id of text into b (ids of different SQLite files may be
 * equal; a shared table's are one set). */
static void add_log(luaL_Buffer *b, const char *text, const char *prefix)
{
    for (const char *line = text; *line;) {
        const char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line + 1) : strlen(line);
        luaL_addstring(b, prefix);
        luaL_addlstring(b, line, n);
        line += n;
    }
}

static char *fmt(const char *f, const char *a, int i, int k)
{
    char buf[1024];
    snprintf(buf, sizeof buf, f, a, i, k);
    return strdup(buf);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);   /* lines out at once: a sanitizer's exit keeps them */
    int threads = 4, per = 1;
    const char *sqlite_dir = NULL, *pg = NULL, *table = "relaybus_threads";
    int i = 1;
    for (; i + 1 < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
        if (strcmp(argv[i], "--threads") == 0) threads = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--per-thread") == 0) per = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--sqlite") == 0) sqlite_dir = argv[i + 1];
        else if (strcmp(argv[i], "--pg") == 0) pg = argv[i + 1];
        else if (strcmp(argv[i], "--table") == 0) table = argv[i + 1];
        else break;
    }
    int extra = argc - i;
    if (!(threads >= 1 && threads <= 64) || !(per >= 1 && per <= MAX_RUNTIMES) || !sqlite_dir == !pg ||
        extra > MAX_ARGS - 6) {
        fprintf(stderr, "usage: threads_host [--threads 4] [--per-thread 1] (--sqlite DIR | --pg URL "
                        "[--table NAME]) [key=value...]\n");
        return 2;
    }
    long n = 200;
    for (int a = i; a < argc; a++)
        if (strncmp(argv[a], "n=", 2) == 0) n = atol(argv[a] + 2);

    worker *ws = calloc((size_t)threads, sizeof *ws);
    if (!ws) return 1;
    char nbuf[64];
    snprintf(nbuf, sizeof nbuf, "%ld", n);
    for (int t = 0; t < threads; t++) {
        worker *w = &ws[t];
        w->index = t;
        w->per = per;
        for (int k = 0; k < per; k++) {
            int c = 0;
            if (sqlite_dir) {
                w->args[k][c++] = fmt("url=sqlite:%s/t%d_%d.db", sqlite_dir, t, k);
            } else {
                w->args[k][c++] = fmt("url=%s", pg, 0, 0);
                w->args[k][c++] = fmt("table=%s", table, 0, 0);
                w->args[k][c++] = fmt("expect=%s", nbuf, 0, 0);
                w->args[k][c++] = strdup("checks=0");
                /* the first runtime enqueues; the others only drain */
                w->args[k][c++] = strdup(t == 0 && k == 0 ? "enqueue=1" : "enqueue=0");
            }
            for (int a = i; a < argc; a++) w->args[k][c++] = strdup(argv[a]);
            w->nargs[k] = c;
        }
    }
    double t0 = workload_now();
    for (int t = 0; t < threads; t++)
        if (pthread_create(&ws[t].thread, NULL, run_worker, &ws[t]) != 0) {
            fprintf(stderr, "threads_host: cannot start a thread\n");
            return 1;
        }
    for (int t = 0; t < threads; t++) pthread_join(ws[t].thread, NULL);
    double elapsed = workload_now() - t0;

    /* The results, and the merged check in a plain Lua state (no relaybus in it). */
    int rc = 0;
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    if (luaL_loadfile(L, workload_path()) != LUA_OK || lua_pcall(L, 0, 1, 0) != LUA_OK) {
        fprintf(stderr, "threads_host: %s\n", lua_tostring(L, -1));
        return 1;
    }
    lua_getfield(L, -1, "check");
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (int t = 0; t < threads; t++) {
        if (ws[t].failed) rc = 1;
        for (int k = 0; k < per; k++) {
            const char *rep = ws[t].reports[k];
            printf("runtime %d.%d: %s\n", t, k, rep ? rep : "(no result)");
            if (!rep || strncmp(rep, "result ok=1", 11) != 0) rc = 1;
            char prefix[32] = "";
            if (sqlite_dir) snprintf(prefix, sizeof prefix, "t%d.%d:", t, k);
            if (ws[t].logs[k]) add_log(&b, ws[t].logs[k], prefix);
            free(ws[t].reports[k]);
            free(ws[t].logs[k]);
            for (int a = 0; a < ws[t].nargs[k]; a++) free(ws[t].args[k][a]);
        }
    }
    luaL_pushresult(&b);
    lua_pushinteger(L, sqlite_dir ? (lua_Integer)n * threads * per : n);
    if (lua_pcall(L, 2, 1, 0) != LUA_OK) {
        fprintf(stderr, "threads_host: check: %s\n", lua_tostring(L, -1));
        rc = 1;
    } else {
        const char *line = lua_tostring(L, -1);
        printf("%s\n", line);
        if (strncmp(line, "check ok=1", 10) != 0) rc = 1;
    }
    printf("threads=%d per_thread=%d secs=%.2f rate=%.1f\n", threads, per, elapsed,
           (double)(sqlite_dir ? n * threads * per : n) / elapsed);
    lua_close(L);
    free(ws);
    return rc;
}
