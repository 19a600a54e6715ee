/* store.c -- opening a store by URL, and the small helpers every store shares. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/random.h>
#include "store.h"
#ifdef __GLIBC__
#include <malloc.h>
#endif

/* Once per process, on the first SQLite open. glibc gives the top of the heap back to the
 * kernel whenever more than 128 KiB of it is free. SQLite's statement journal takes and frees
 * a 64 KiB chunk per writing statement, so each claimed or settled row cost a brk() down and
 * up again, and each brk() down a TLB flush on every CPU: drains ran 3-7x slower on a busy
 * machine. A higher trim threshold keeps such memory for reuse (it still goes back past
 * 32 MiB); a fixed mmap threshold keeps glibc from raising it again on its own. Not when the
 * user tuned malloc through the environment. */
static void tune_malloc(void)
{
#ifdef __GLIBC__
    const char *tunables = getenv("GLIBC_TUNABLES");
    if (getenv("MALLOC_TRIM_THRESHOLD_") || getenv("MALLOC_MMAP_THRESHOLD_") ||
        getenv("MALLOC_TOP_PAD_") ||
        (tunables && strstr(tunables, "glibc.malloc.")))
        return;
    mallopt(M_MMAP_THRESHOLD, 4 << 20);
    mallopt(M_TRIM_THRESHOLD, 32 << 20);
#endif
}

rb_store *rb_store_open(struct ev_loop *loop, const char *url, const rb_store_options *opts,
                        char *err, size_t errlen)
{
    rb_store_options o = {NULL, 1};
    if (opts) o = *opts;
    if (!o.table) o.table = "relaybus_deliveries";
    if (!rb_valid_identifier(o.table)) {
        snprintf(err, errlen, "invalid table name '%s' (letters, digits and _ only)", o.table);
        return NULL;
    }
    if (!url || !*url) {
        snprintf(err, errlen, "empty store URL");
        return NULL;
    }
    if (strncmp(url, "sqlite:", 7) == 0) {
        const char *path = url + 7;
        if (strncmp(path, "//", 2) == 0) path += 2;   /* accept sqlite://PATH too */
        if (!*path) {
            snprintf(err, errlen, "sqlite URL needs a path: sqlite:PATH or sqlite::memory:");
            return NULL;
        }
        static pthread_once_t malloc_once = PTHREAD_ONCE_INIT;
        pthread_once(&malloc_once, tune_malloc);
        return rb_sqlite_open(loop, path, &o, err, errlen);
    }
    if (strncmp(url, "postgresql://", 13) == 0 || strncmp(url, "postgres://", 11) == 0)
        return rb_pg_open(loop, url, &o, err, errlen);
    if (strncmp(url, "mongodb://", 10) == 0 || strncmp(url, "mongodb+srv://", 14) == 0)
        return rb_mongo_open(loop, url, &o, err, errlen);
    snprintf(err, errlen,
             "unsupported store URL '%.200s' (expected sqlite:PATH, postgresql://... or mongodb://...)",
             url);
    return NULL;
}

int rb_valid_identifier(const char *name)
{
    if (!name || !(isalpha((unsigned char)name[0]) || name[0] == '_')) return 0;
    size_t n = 0;
    for (const char *p = name; *p; p++, n++)
        if (!(isalnum((unsigned char)*p) || *p == '_')) return 0;
    return n <= 63;
}

/* splitmix64: spreads the fallback's inputs over all bits. */
static uint64_t mix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static int fill_random(unsigned char *raw, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(raw + got, n - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    if (got == n) return 1;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);     /* a kernel without getrandom */
    if (fd < 0) return 0;
    ssize_t r = read(fd, raw, n);
    close(fd);
    return r == (ssize_t)n;
}

void rb_random_token(char out[33])
{
    unsigned char raw[16];
    if (!fill_random(raw, sizeof raw)) {
        /* No randomness from the kernel at all: tokens must still never repeat, so a
         * process-wide counter goes in with the clock and the pid. */
        static _Atomic uint64_t counter;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t a = mix64(((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16));
        uint64_t b = mix64(a ^ ++counter);
        memcpy(raw, &a, 8);
        memcpy(raw + 8, &b, 8);
    }
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < sizeof raw; i++) {
        out[2 * i] = hex[raw[i] >> 4];
        out[2 * i + 1] = hex[raw[i] & 15];
    }
    out[32] = 0;
}

double rb_wall_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

void rb_store_notify_local(rb_store *s)
{
    if (s->local_wakeup) s->local_wakeup(s->local_wakeup_ud);
}

void rb_rowset_free(rb_rowset *rs)
{
    if (!rs) return;
    for (int c = 0; c < rs->ncols; c++) free(rs->names[c]);
    free(rs->names);
    for (size_t i = 0; i < rs->nrows * (size_t)rs->ncols; i++)
        if (rs->vals[i].type == RB_VTEXT) free((char *)rs->vals[i].s);
    free(rs->vals);
    free(rs);
}
