/* watchdog.c -- stops Lua code that runs past its kill time while the loop thread cannot:
 * time spent inside C functions (string.rep of 50 MB in a loop) executes few Lua instructions,
 * so the count hook alone fires too rarely, and no timer runs while the thread is busy.
 *
 * One thread per runtime, started by the first watched resume. Around each lua_resume the
 * loop thread publishes the coroutine it resumes and the time it must stop by; if that resume
 * is still in progress then, the watchdog sets the coroutine's count hook to fire at the next
 * instruction, and the hook (task.c) stops the run. lua_sethook is the one call made from this
 * thread: Lua makes it safe to call asynchronously (lua.c calls it from a signal handler;
 * ldebug.c states the assumptions: atomic pointer and byte stores). Nothing else of a Lua
 * state is touched here.
 *
 * The watchdog sleeps until the published time; a publish wakes it only when it is idle or
 * asleep past the new time, and it lingers a second before going idle, so a busy loop costs a
 * mutex per resume and no wake-ups, and an idle runtime costs nothing. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include "internal.h"
#include "util/log.h"

#define LINGER 1.0          /* s the watchdog stays awake after the last watched resume */
#define AFTER_FIRE 0.05     /* s between checks once it has set a hook, until the resume ends */

struct rb_watchdog {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int started, failed, quit;
    lua_Hook hook;
    rb_watch cur;               /* the resume in progress (co NULL when none) */
    unsigned long gen;          /* bumps with every publish */
    double sleeping_until;      /* the watchdog's wake-up time; INFINITY when idle */
};

static struct timespec abs_time(double mono)
{
    struct timespec ts;
    if (!(mono < 1e12)) mono = 1e12;
    ts.tv_sec = (time_t)mono;
    ts.tv_nsec = (long)((mono - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    return ts;
}

static void sleep_until(rb_watchdog *w, double until)
{
    w->sleeping_until = until;
    if (isinf(until)) {
        pthread_cond_wait(&w->cv, &w->mu);
    } else {
        struct timespec ts = abs_time(until);
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    w->sleeping_until = 0;
}

static void *watch_loop(void *arg)
{
    rb_watchdog *w = arg;
    pthread_mutex_lock(&w->mu);
    double idle_after = rb_monotonic() + LINGER;
    unsigned long fired_gen = 0;
    while (!w->quit) {
        double now = rb_monotonic();
        if (!w->cur.co) {
            sleep_until(w, now >= idle_after ? INFINITY : idle_after);
            continue;
        }
        idle_after = now + LINGER;
        if (now < w->cur.kill_at) {
            sleep_until(w, w->cur.kill_at);
            continue;
        }
        if (fired_gen != w->gen) {
            /* Past its time and still inside the same resume: stop at the next instruction. */
            lua_sethook(w->cur.co, w->hook, LUA_MASKCOUNT, 1);
            fired_gen = w->gen;
        }
        sleep_until(w, now + AFTER_FIRE);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

rb_watchdog *rb_watchdog_new(lua_Hook hook)
{
    rb_watchdog *w = rb_calloc(1, sizeof *w);
    if (!w) return NULL;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&w->mu, NULL);
    w->hook = hook;
    return w;
}

void rb_watchdog_free(rb_watchdog *w)
{
    if (!w) return;
    if (w->started) {
        pthread_mutex_lock(&w->mu);
        w->quit = 1;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
    }
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

/* Called with mu held. */
static void start_thread(rb_watchdog *w)
{
    if (w->started || w->failed) return;
    if (pthread_create(&w->thread, NULL, watch_loop, w) != 0) {
        w->failed = 1;
        rb_log(RB_LOG_WARN, "cannot start the watchdog thread: Lua code busy inside C "
                            "functions is then stopped only at instruction counts");
        return;
    }
    w->started = 1;
}

rb_watch rb_watchdog_enter(rb_watchdog *w, lua_State *co, double kill_at)
{
    rb_watch outer = {NULL, INFINITY};
    if (!w) return outer;
    pthread_mutex_lock(&w->mu);
    outer = w->cur;
    w->cur.co = isinf(kill_at) ? NULL : co;
    w->cur.kill_at = kill_at;
    w->gen++;
    if (w->cur.co) {
        start_thread(w);
        if (w->started && w->sleeping_until > kill_at) pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return outer;
}

void rb_watchdog_leave(rb_watchdog *w, rb_watch outer)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->cur = outer;
    w->gen++;
    pthread_mutex_unlock(&w->mu);
}
