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
#include "stores/store.h"
#include "plugin/plugin.h"
#include "util/text.h"
#ifdef __GLIBC__
#include <malloc.h>
#endif

/* rb_tune_malloc: glibc gives the top of the heap back to the
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

void rb_tune_malloc(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, tune_malloc);
}

static int has_prefix(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

rb_store_kind rb_store_parse_url(const char *url, const char **path, char *err, size_t errlen)
{
    char shown[200];
    *path = NULL;
    if (!url || !*url) {
        snprintf(err, errlen, "empty store URL");
        return 0;
    }
    if (has_prefix(url, "sqlite:")) {
        const char *p = url + 7;
        /* Tools disagree on sqlite://x (sqlx: ./x; SQLAlchemy needs sqlite:///x for that, and
         * sqlite:////x for /x): guessing would open some other file than the user meant, so
         * only sqlite:PATH is a SQLite URL. */
        if (has_prefix(p, "//")) {
            char redacted[200];
            rb_redact_url(redacted, sizeof redacted, url);   /* keeps its "sqlite://" */
            const char *rest = redacted + 9;
            while (*rest == '/') rest++;
            rb_one_line(shown, 80, rest);
            snprintf(err, errlen, "sqlite: a sqlite:// URL is ambiguous; write sqlite:PATH "
                     "(sqlite:%s for a path relative to the current directory, sqlite:/%s "
                     "for an absolute one)", shown, shown);
            return 0;
        }
        if (!*p) {
            snprintf(err, errlen, "sqlite URL needs a path: sqlite:PATH or sqlite::memory:");
            return 0;
        }
        *path = p;
        return RB_STORE_SQLITE;
    }
    if (has_prefix(url, "postgresql://") || has_prefix(url, "postgres://")) return RB_STORE_PG;
    if (has_prefix(url, "mongodb://") || has_prefix(url, "mongodb+srv://")) return RB_STORE_MONGO;
    char redacted[sizeof shown];
    rb_one_line(shown, sizeof shown, rb_redact_url(redacted, sizeof redacted, url));
    snprintf(err, errlen,
             "unsupported store URL '%s' (expected sqlite:PATH, postgresql://... or mongodb://...)",
             shown);
    return 0;
}

rb_store *rb_store_open(struct ev_loop *loop, const char *url, const rb_store_options *opts,
                        char *err, size_t errlen)
{
    rb_store_options o = {NULL, 1};
    if (opts) o = *opts;
    if (!o.table) o.table = "relaybus_deliveries";
    if (!rb_valid_identifier(o.table)) {
        char shown[80];
        snprintf(err, errlen, "invalid table name '%s' (letters, digits and _ only)",
                 rb_one_line(shown, sizeof shown, o.table));
        return NULL;
    }
    const char *path;
    rb_store *s = NULL;
    /* The drivers' messages may quote parts of the URL, its password among them: they write
     * to raw, which is cleaned into err. */
    char raw[2048] = "", clean[sizeof raw];
    rb_store_kind kind = rb_store_parse_url(url, &path, err, errlen);
    switch (kind) {
    case RB_STORE_SQLITE: {
        s = rb_sqlite_open(loop, path, &o, raw, sizeof raw);
        break;
    }
    case RB_STORE_PG:
    case RB_STORE_MONGO: {
        const rb_store_plugin *p = rb_plugin_get(
            kind == RB_STORE_PG ? RB_PLUGIN_PG : RB_PLUGIN_MONGO, raw, sizeof raw);
        if (p) s = p->open(loop, url, &o, raw, sizeof raw);
        break;
    }
    default:
        return NULL;
    }
    if (!s && errlen) {
        rb_redact_secrets(clean, sizeof clean, raw[0] ? raw : "cannot open the store", url);
        rb_one_line(err, errlen, clean);
    }
    return s;
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

int rb_decimal_id(const char *id)
{
    if (!id || *id < '1' || *id > '9') return 0;
    size_t n = 0;
    for (const char *p = id; *p; p++, n++)
        if (*p < '0' || *p > '9') return 0;
    return n <= 18;
}

int rb_live_status(const char *status)
{
    return status && (!strcmp(status, "pending") || !strcmp(status, "processing"));
}

int rb_settled_status(const char *status)
{
    return status && (!strcmp(status, "completed") || !strcmp(status, "buried") ||
                      !strcmp(status, "cancelled"));
}

int rb_limit_valid(const rb_limit *lim)
{
    if (!lim || (lim->rate <= 0 && lim->concurrency <= 0)) return 0;
    if (lim->rate < 0 || lim->rate > RB_LIMIT_MAX) return 0;
    if (lim->rate > 0 && !(lim->per >= RB_LIMIT_PER_MIN && lim->per <= RB_MAX_SECONDS)) return 0;
    return lim->concurrency >= 0 && lim->concurrency <= RB_LIMIT_MAX;
}

int rb_group_valid(const char *group, size_t len)
{
    return group && len >= 1 && len <= RB_GROUP_MAX && strlen(group) == len &&
           rb_utf8_valid(group, len);
}

void rb_store_notify_local(rb_store *s)
{
    if (s->local_wakeup) s->local_wakeup(s->local_wakeup_ud);
}

void rb_store_cancelled(rb_store *s, const char *id, const char *token)
{
    if (s->local_cancelled && id && token) s->local_cancelled(s->local_wakeup_ud, id, token);
}

void rb_store_schedules_changed(rb_store *s)
{
    if (s->local_schedules) s->local_schedules(s->local_wakeup_ud);
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

void rb_store_release_dispatch(rb_store *s)
{
    if (s->dispatch && s->dispatch_free) s->dispatch_free(s->dispatch);
    s->dispatch = NULL;
}
