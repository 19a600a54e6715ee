/* frame_host.c -- a game-style host: a fixed-rate frame loop on poll() alone (no libev here),
 * giving relaybus a time budget per frame.
 *
 * Each frame does the game's own work (a busy loop of --game seconds), then steps relaybus with
 * the frame's budget; until the next frame starts it sleeps in poll() on relaybus's descriptor
 * and timeout, and steps again with what is left of the budget when relaybus needs it (a
 * lease renewal's answer, a handler's sleep ending). With the budget spent it only sleeps: the
 * handlers left over run in the next frame. A frame's time is its work: the game's and every
 * step's. The frame host prints the percentiles of frame times and of frame intervals.
 *
 *   build/frame_host [--hz 60] [--budget 0.002] [--game 0.001] key=value...   (workload.lua) */
#include <math.h>
#include <poll.h>
#include <string.h>
#include "workload_host.h"

typedef struct series { double *v; size_t n, cap; } series;

static void add(series *s, double x)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 1024;
        double *v = realloc(s->v, cap * sizeof *v);
        if (!v) return;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = x;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Prints "NAME p50=.. p99=.. max=.. ms" (nearest-rank percentiles). */
static void print_percentiles(const char *name, series *s)
{
    if (s->n == 0) {
        printf("%s n=0\n", name);
        return;
    }
    qsort(s->v, s->n, sizeof *s->v, cmp);
    size_t i50 = (size_t)ceil(0.50 * s->n) - 1, i99 = (size_t)ceil(0.99 * s->n) - 1;
    printf("%s n=%zu p50=%.3f p99=%.3f max=%.3f ms\n", name, s->n, s->v[i50] * 1e3, s->v[i99] * 1e3,
           s->v[s->n - 1] * 1e3);
}

/* Steps relaybus with budget; returns the seconds it took (-1 on error, printed). */
static double step(lua_State *L, double budget)
{
    double t0 = workload_now();
    if (rb_lua_step(L, budget) != 0) {
        fprintf(stderr, "frame_host: %s\n", lua_tostring(L, -1));
        lua_pop(L, 1);
        return -1;
    }
    return workload_now() - t0;
}

int main(int argc, char **argv)
{
    double hz = 60, budget = 0.002, game = 0.001;
    int i = 1;
    for (; i + 1 < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
        if (strcmp(argv[i], "--hz") == 0) hz = atof(argv[i + 1]);
        else if (strcmp(argv[i], "--budget") == 0) budget = atof(argv[i + 1]);
        else if (strcmp(argv[i], "--game") == 0) game = atof(argv[i + 1]);
        else break;
    }
    if (i >= argc || !(hz > 0) || !(budget > 0) || !(game >= 0)) {
        fprintf(stderr, "usage: frame_host [--hz 60] [--budget 0.002] [--game 0.001] url=STORE [key=value...]\n");
        return 2;
    }
    lua_State *L = workload_open(argc - i, argv + i);
    if (!L) return 1;
    int fd = rb_lua_pollfd(L);
    if (fd < 0) {
        fprintf(stderr, "frame_host: the runtime has no descriptor to poll\n");
        lua_close(L);
        return 1;
    }

    const double frame = 1 / hz;
    series times = {0}, intervals = {0};
    long late = 0;
    double t_begin = workload_now(), next = t_begin, prev = -1;
    int failed = 0;
    while (!failed && rb_lua_busy(L) > 0) {
        double start = workload_now();
        if (prev >= 0) add(&intervals, start - prev);
        prev = start;
        if (start - next > frame / 2) late++;

        /* the game's update: relaybus does not run meanwhile */
        while (workload_now() - start < game) {}
        double work = workload_now() - start;

        double spent = step(L, budget);
        if (spent < 0) { failed = 1; break; }
        work += spent;

        /* Until the next frame: sleep in poll(), stepping again when relaybus needs it and the
         * budget has something left. A frame that ran late starts the next one at once. */
        next += frame;
        if (next < workload_now()) next = workload_now();
        for (;;) {
            double now = workload_now();
            if (now >= next) break;
            double left = budget - spent, wait = next - now;
            double t = rb_lua_timeout(L);
            int can_step = left > 1e-5;
            if (can_step && t >= 0 && t < wait) wait = t;
            struct pollfd p = {.fd = can_step ? fd : -1, .events = POLLIN};
            int ms = (int)ceil(wait * 1e3);
            int r = poll(&p, 1, ms);
            if (!can_step) continue;
            if (r > 0 || (t >= 0 && workload_now() - now >= t)) {
                double s = step(L, left);
                if (s < 0) { failed = 1; break; }
                spent += s;
                work += s;
            }
        }
        add(&times, work);
    }
    double elapsed = workload_now() - t_begin;

    int rc = failed ? 1 : workload_report(L, "");
    printf("frames=%zu late=%ld secs=%.2f hz=%.0f budget_ms=%.1f game_ms=%.1f\n", times.n, late, elapsed, hz,
           budget * 1e3, game * 1e3);
    print_percentiles("frame_time", &times);
    print_percentiles("frame_interval", &intervals);
    free(times.v);
    free(intervals.v);
    lua_close(L);
    return rc;
}
