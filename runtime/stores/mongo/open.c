/* open.c -- the MongoDB store's open and close: the URL, the probe of what the server is, the
 * schema (schema.c), the workers (jobs.c); and the vtable. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/text.h"
#include "plugin/plugin.h"

const char *const MG_STORE_CLOSED = "mongodb: store closed";
static const rb_store_vtable mongo_vtable;

static void store_free(mstore *s)
{
    if (s->pool) mongoc_client_pool_destroy(s->pool);
    if (s->uri) mongoc_uri_destroy(s->uri);
    free(s->db);
    free(s->leases);
    free(s->topics);
    free(s->schedules);
    free(s->deps);
    free(s->groups);
    free(s->limits);
    mg_limits_forget_all(s);
    free(s->tickets);
    free(s->queue);
    rb_store_release_dispatch(&s->base);
    free(s->base.table);
    mg_vc_clear(s);
    rb_hmap_free(&s->vc);
    rb_hmap_free(&s->busy);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->busy_mu);
    pthread_cond_destroy(&s->busy_cv);
    free(s);
}

static void m_close(rb_store *st)
{
    mstore *s = (mstore *)st;
    if (!s || s->closing) return;
    s->closing = 1;
    rb_jobpool_close(s->jobs);  /* each job's callback runs: its result, or "store closed" */
    s->jobs = NULL;
    mg_tx_close_all(s);
    store_free(s);
}

/* libmongoc logs connection trouble (and, in Debian's build, debug chatter) to stderr on its
 * own, even for a URL it then refuses ("Port could not be parsed"), which would break the
 * promise of one line per failure. The store reports failures through its errors instead,
 * so libmongoc's own lines are relaybus debug lines (RELAYBUS_LOG=debug shows them). */
static void mongoc_log_quiet(mongoc_log_level_t level, const char *domain, const char *message,
                             void *ud)
{
    (void)ud;
    if (level <= MONGOC_LOG_LEVEL_WARNING)
        rb_log(RB_LOG_DEBUG, "%s: %s", domain ? domain : "mongoc", message ? message : "");
}

static pthread_once_t mongoc_once = PTHREAD_ONCE_INIT;
static void mongoc_global_init(void)
{
    mongoc_init();
    mongoc_log_set_handler(mongoc_log_quiet, NULL);
}

/* Pings through hello (the server's clock too) and learns what the server is. */
static int probe(mstore *s, mongoc_client_t *c, const char *uri, char *err, size_t errlen)
{
    bson_t reply, cmd = BSON_INITIALIZER;
    bson_error_t e;
    if (!mg_read_clock(s, c, &reply, &e)) {
        char shown[160];
        snprintf(err, errlen, "mongodb: cannot reach the server at %s: %.160s",
                 rb_redact_url(shown, sizeof shown, uri), e.message);
        mg_one_line(err, errlen);
        bson_destroy(&reply);
        return 0;
    }
    const char *msg = mg_doc_str(&reply, "msg");
    bson_iter_t it;
    s->replset = bson_iter_init_find(&it, &reply, "setName") || (msg && strcmp(msg, "isdbgrid") == 0);
    bson_destroy(&reply);
    BSON_APPEND_INT32(&cmd, "buildInfo", 1);
    int ferretdb2 = 0;
    if (mongoc_client_command_simple(c, "admin", &cmd, NULL, &reply, &e)) {
        s->ferretdb = bson_iter_init_find(&it, &reply, "ferretdbVersion");
        /* FerretDB 2 (on DocumentDB) answers {ferretdb: {version: ...}} instead. Its updates
         * are atomic there, so it takes the mongodb dialect; but it has no multi-document
         * transactions (no commitTransaction, and the writes of a failed one stay), whatever
         * replica set its hello names: transactions are refused as on FerretDB 1. */
        ferretdb2 = !s->ferretdb && bson_iter_init_find(&it, &reply, "ferretdb");
    }
    bson_destroy(&reply);
    bson_destroy(&cmd);
    if (s->ferretdb || ferretdb2) s->replset = 0;
    return 1;
}

/* The dialect the URL asked for, else the server's own. The MongoDB dialect on FerretDB (how
 * the tests run MongoDB's path) keeps one write per command, which FerretDB needs. */
static int choose_dialect(mstore *s, mg_dialect dialect)
{
    s->ferret = dialect == MG_DETECT ? s->ferretdb : dialect == MG_FERRETDB;
    if (s->ferretdb && !s->ferret)
        rb_log(RB_LOG_INFO, "mongodb: the mongodb dialect on FerretDB: claims search %s.%s "
               "without the ready queue, writes filter on the version, one write per command "
               "(FerretDB 1.24 deadlocks on concurrent multi-update commands), and the version "
               "filter is not atomic there (the tickets still decide)", s->db, s->base.table);
    return 1;
}

static mongoc_uri_t *parse_uri(const char *uri, char *err, size_t errlen)
{
    bson_error_t e;
    mongoc_uri_t *u = mongoc_uri_new_with_error(uri, &e);
    if (!u) {
        snprintf(err, errlen, "mongodb: bad URL: %.200s", e.message);
        mg_one_line(err, errlen);
        return NULL;
    }
    /* An unreachable server must fail in seconds, not libmongoc's default 30. */
    if (!mongoc_uri_has_option(u, MONGOC_URI_SERVERSELECTIONTIMEOUTMS))
        mongoc_uri_set_option_as_int32(u, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, 5000);
    if (!mongoc_uri_has_option(u, MONGOC_URI_CONNECTTIMEOUTMS))
        mongoc_uri_set_option_as_int32(u, MONGOC_URI_CONNECTTIMEOUTMS, 5000);
    /* A server that stops answering must fail an operation well within a lease, not after
     * libmongoc's default of five minutes; the worker thread is then free again. */
    if (!mongoc_uri_has_option(u, MONGOC_URI_SOCKETTIMEOUTMS))
        mongoc_uri_set_option_as_int32(u, MONGOC_URI_SOCKETTIMEOUTMS, 20000);
    if (!mongoc_uri_has_option(u, MONGOC_URI_APPNAME))
        mongoc_uri_set_appname(u, "relaybus");
    return u;
}

static mstore *store_new(struct ev_loop *loop, const rb_store_options *opts)
{
    mstore *s = rb_calloc(1, sizeof *s);
    if (!s) return NULL;
    const char *table = opts && opts->table ? opts->table : "relaybus_deliveries";
    size_t n = strlen(table) + 16;
    s->base.vt = &mongo_vtable;
    s->base.loop = loop;
    s->base.table = rb_strdup(table);
    s->leases = rb_malloc(n);
    s->tickets = rb_malloc(n);
    s->queue = rb_malloc(n);
    s->topics = rb_malloc(n);
    s->schedules = rb_malloc(n);
    s->deps = rb_malloc(n);
    s->groups = rb_malloc(n);
    s->limits = rb_malloc(n);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->busy_mu, NULL);
    pthread_cond_init(&s->busy_cv, NULL);
    if (!s->base.table || !s->leases || !s->tickets || !s->queue || !s->topics || !s->schedules || !s->deps ||
        !s->groups || !s->limits ||
        rb_hmap_reserve(&s->busy, 1024) != 0) {
        store_free(s);
        return NULL;
    }
    snprintf(s->leases, n, "%s_leases", table);
    snprintf(s->tickets, n, "%s_tickets", table);
    snprintf(s->queue, n, "%s_queue", table);
    snprintf(s->topics, n, "%s_topics", table);
    snprintf(s->schedules, n, "%s_schedules", table);
    snprintf(s->deps, n, "%s_deps", table);
    snprintf(s->groups, n, "%s_groups", table);
    snprintf(s->limits, n, "%s_limits", table);
    s->clock_checked = rb_monotonic();
    s->clock_offset = rb_wall_time() - rb_monotonic();   /* until the server tells its time */
    return s;
}

rb_store *rb_mongo_open(struct ev_loop *loop, const char *uri, const rb_store_options *opts,
                        char *err, size_t errlen)
{
    pthread_once(&mongoc_once, mongoc_global_init);
    char warm[33];
    rb_random_token(warm);  /* opens its urandom fd here, before worker threads share it */
    mstore *s = store_new(loop, opts);
    if (!s) {
        snprintf(err, errlen, MG_OOM);
        return NULL;
    }
    bson_error_t e;
    const char *db;
    mg_dialect dialect;
    char *plain = NULL;
    if (!mg_url_take_dialect(uri, &plain, &dialect, err, errlen)) goto fail;
    s->uri = parse_uri(plain, err, errlen);
    free(plain);
    if (!s->uri) goto fail;
    db = mongoc_uri_get_database(s->uri);
    if (!(s->db = rb_strdup(db && *db ? db : "relaybus"))) {
        snprintf(err, errlen, MG_OOM);
        goto fail;
    }
    if (!(s->pool = mongoc_client_pool_new_with_error(s->uri, &e))) {
        snprintf(err, errlen, "mongodb: %.200s", e.message);
        goto fail;
    }
    mongoc_client_pool_set_error_api(s->pool, MONGOC_ERROR_API_VERSION_2);
    mongoc_client_t *c = mongoc_client_pool_pop(s->pool);
    int ok = probe(s, c, uri, err, errlen) && choose_dialect(s, dialect) &&
             (opts && !opts->migrate ? mg_check_schema(s, c, err, errlen)
                                     : mg_migrate(s, c, err, errlen));
    mongoc_client_pool_push(s->pool, c);
    if (!ok) goto fail;
    if (!mg_jobs_start(s, err, errlen)) goto fail;
    return &s->base;
fail:
    mg_one_line(err, errlen);
    store_free(s);
    return NULL;
}

static const rb_store_vtable mongo_vtable = {
    .name = "mongodb",
    .enqueue = mg_enqueue,
    .claim = mg_claim,
    .settle = mg_settle,
    .get = mg_get,
    .list = mg_list,
    .stats = mg_stats,
    .kick = mg_kick,
    .purge = mg_purge,
    .topic_stats = mg_topic_stats,
    .pending_topics = mg_pending_topics,
    .bury = mg_bury,
    .cancel = mg_cancel,
    .cancel_all = mg_cancel_all,
    .progress = mg_progress,
    .remove = mg_remove,
    .lease = mg_lease,
    .begin = mg_begin,
    .tx_enqueue = mg_tx_enqueue,
    .tx_exec = NULL,
    .tx_query = NULL,
    .tx_doc = mg_tx_doc,
    .commit = mg_commit,
    .rollback = mg_rollback,
    .set_wakeup = NULL,
    .close = m_close,
    .pause = mg_pause,
    .paused = mg_paused,
    .limit = mg_limit,
    .limits = mg_limits,
    .schedule = mg_schedule,
    .unschedule = mg_unschedule,
    .schedules = mg_schedules,
    .schedule_fire = mg_schedule_fire,
};

/* Its table for plugin.h: the command and the Lua module load it from relaybus_mongo.so. */
const rb_store_plugin rb_plugin_mongo = { rb_mongo_open };
