/* clock.h -- the clocks relaybus reads, and the rules for the times it is given.
 *
 * Local deadlines are kept on the monotonic clock, which never steps. Leases of a SQLite file
 * (one host) are timed on the boot clock, which also counts suspended time and is the same for
 * every process of one boot. The wall clock only schedules (run_at) and labels records. */
#ifndef RB_CLOCK_H
#define RB_CLOCK_H

double rb_monotonic(void);      /* CLOCK_MONOTONIC, s */
double rb_wall_time(void);      /* CLOCK_REALTIME, epoch s */
double rb_boot_time(void);      /* CLOCK_BOOTTIME, s since this boot */
double rb_thread_cpu_time(void);/* CLOCK_THREAD_CPUTIME_ID: s of CPU this thread has used */
/* The identity of this process's boot clock, or "" when unknown: the kernel's boot_id (36
 * characters), followed by "/time:INODE" in a time namespace other than the first. Processes
 * of one boot in different time namespaces (a container restored by CRIU) see boot clocks
 * offset from each other: they share the first 36 characters and compare wall clocks. */
#define RB_BOOT_ID_LEN 36
const char *rb_boot_id(void);

/* The longest duration, delay or age relaybus accepts: 100 years, in s. */
#define RB_MAX_SECONDS 3155760000.0
/* The latest run_at accepted (9999-12-31T23:59:59Z), epoch s. */
#define RB_MAX_EPOCH 253402300799.0

/* 1 when s is finite and within [0, RB_MAX_SECONDS]. */
int rb_valid_seconds(double s);

/* How far ahead of a lease's expiry in the store its holder's local deadline ends: time for
 * clock-rate differences, the interrupt's grace and the final write. A tenth of the lease,
 * at least 0.2 s and at most 5 s, and never more than half of it. One rule for the leases of
 * deliveries and named leases. */
double rb_lease_margin(double duration);
/* The shortest lease whose local deadline is s seconds after it is asked for: the inverse of
 * duration - rb_lease_margin(duration). */
double rb_lease_for(double s);

#endif
