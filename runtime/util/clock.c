/* clock.c -- the clocks and the time rules of clock.h. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include "util/clock.h"

static double read_clock(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

double rb_monotonic(void) { return read_clock(CLOCK_MONOTONIC); }
double rb_wall_time(void) { return read_clock(CLOCK_REALTIME); }
double rb_boot_time(void) { return read_clock(CLOCK_BOOTTIME); }
double rb_thread_cpu_time(void) { return read_clock(CLOCK_THREAD_CPUTIME_ID); }

static char boot_id[RB_BOOT_ID_LEN + 40];

/* The inode the kernel gives its first time namespace (PROC_TIME_INIT_INO): processes there
 * write the bare boot id, as relaybus did before time namespaces counted. */
#define FIRST_TIME_NS 0xEFFFFFFAu

static void read_boot_id(void)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (!f) return;
    char buf[64] = "";
    if (fgets(buf, sizeof buf, f)) {
        buf[strcspn(buf, "\r\n")] = 0;
        if (strlen(buf) == RB_BOOT_ID_LEN) strcpy(boot_id, buf);
    }
    fclose(f);
    struct stat ns;
    if (!boot_id[0] || stat("/proc/self/ns/time", &ns) != 0) return;  /* before Linux 5.6 */
    if ((unsigned long long)ns.st_ino != FIRST_TIME_NS)
        snprintf(boot_id + RB_BOOT_ID_LEN, sizeof boot_id - RB_BOOT_ID_LEN, "/time:%llu",
                 (unsigned long long)ns.st_ino);
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

double rb_lease_for(double s)
{
    if (s <= 0.2) return 2 * s;     /* up to 0.4 s the margin is half the lease */
    if (s <= 1.8) return s + 0.2;   /* up to 2 s, 0.2 s */
    if (s <= 45) return s / 0.9;    /* up to 50 s, a tenth */
    return s + 5;
}
