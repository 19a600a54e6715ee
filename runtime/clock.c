/* clock.c -- the clocks and the time rules of clock.h. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include "clock.h"

static double read_clock(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

double rb_monotonic(void) { return read_clock(CLOCK_MONOTONIC); }
double rb_wall_time(void) { return read_clock(CLOCK_REALTIME); }
double rb_boot_time(void) { return read_clock(CLOCK_BOOTTIME); }

static char boot_id[40];

static void read_boot_id(void)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (!f) return;
    char buf[64] = "";
    if (fgets(buf, sizeof buf, f)) {
        buf[strcspn(buf, "\r\n")] = 0;
        if (strlen(buf) < sizeof boot_id) strcpy(boot_id, buf);
    }
    fclose(f);
}

const char *rb_boot_id(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, read_boot_id);
    return boot_id;
}

int rb_valid_seconds(double s) { return isfinite(s) && s >= 0 && s <= RB_MAX_SECONDS; }

double rb_lease_margin(double duration)
{
    double m = duration * 0.1;
    if (m < 0.2) m = 0.2;
    if (m > 5) m = 5;
    if (m > duration * 0.5) m = duration * 0.5;
    return m;
}
