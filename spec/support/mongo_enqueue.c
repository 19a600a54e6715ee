/* mongo_enqueue.c -- enqueues deliveries the way an application on its own MongoDB driver
 * would (docs/stores.md "Enqueueing with a plain insert"), for spec/mongo_native_spec.lua:
 *   mongo_enqueue URL COLLECTION [queue] < lines
 *   mongo_enqueue URL COLLECTION dump ID     (prints the delivery's payload and payload_format
 *                                             as canonical Extended JSON: what the store wrote)
 * Each line is canonical Extended JSON {"topic": ..., "payload": ..., "payload_format": ...}
 * (so the payload's BSON types are exact: {"$numberLong": ...}, {"$numberDouble": ...});
 * payload_format is copied when the line has it, else "bson". The other fields are written
 * here, in one session; with `queue` (the ferretdb dialect) each delivery's queue entry goes
 * in first. Prints the new ids, one a line; exits 1 on any error, with a message on stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <mongoc/mongoc.h>

static double now_s(void)
{
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return tv.tv_sec + tv.tv_usec / 1e6;
}

/* The delivery document for one input line, its id in hex. */
static bson_t *delivery(const bson_t *in, double now, char hex[25])
{
    bson_iter_t it;
    bson_oid_t oid;
    bson_t *d = bson_new();
    bson_oid_init(&oid, NULL);
    bson_oid_to_string(&oid, hex);
    BSON_APPEND_OID(d, "_id", &oid);
    if (bson_iter_init_find(&it, in, "topic")) bson_append_iter(d, "topic", -1, &it);
    if (bson_iter_init_find(&it, in, "payload")) bson_append_iter(d, "payload", -1, &it);
    if (bson_iter_init_find(&it, in, "payload_format")) bson_append_iter(d, "payload_format", -1, &it);
    else BSON_APPEND_UTF8(d, "payload_format", "bson");
    BSON_APPEND_UTF8(d, "status", "pending");
    BSON_APPEND_INT32(d, "attempts", 0);
    BSON_APPEND_INT32(d, "max_attempts", 25);
    BSON_APPEND_INT64(d, "fence", 0);
    BSON_APPEND_INT64(d, "v", 0);
    BSON_APPEND_DOUBLE(d, "run_at", now);
    BSON_APPEND_DOUBLE(d, "created_at", now);
    BSON_APPEND_DOUBLE(d, "lease_expires_at", 0);
    BSON_APPEND_NULL(d, "lease_token");
    return d;
}

static bson_t *queue_entry(const bson_t *in, const char *hex, double now)
{
    bson_iter_t it;
    char id[40];
    bson_t *e = bson_new();
    snprintf(id, sizeof id, "%s:0", hex);
    BSON_APPEND_UTF8(e, "_id", id);
    BSON_APPEND_UTF8(e, "d", hex);
    if (bson_iter_init_find(&it, in, "topic")) bson_append_iter(e, "t", -1, &it);
    BSON_APPEND_INT64(e, "g", 0);
    BSON_APPEND_DOUBLE(e, "at", now);
    BSON_APPEND_DOUBLE(e, "c", now);
    return e;
}

static int insert(mongoc_collection_t *cl, const bson_t *doc, mongoc_client_session_t *cs)
{
    bson_t opts = BSON_INITIALIZER;
    bson_error_t e;
    int ok = mongoc_client_session_append(cs, &opts, &e) &&
             mongoc_collection_insert_one(cl, doc, &opts, NULL, &e);
    if (!ok) fprintf(stderr, "mongo_enqueue: %s\n", e.message);
    bson_destroy(&opts);
    return ok;
}

static int dump(mongoc_collection_t *cl, const char *id)
{
    bson_oid_t oid;
    if (!bson_oid_is_valid(id, strlen(id))) return 1;
    bson_oid_init_from_string(&oid, id);
    bson_t *f = BCON_NEW("_id", BCON_OID(&oid));
    bson_t *o = BCON_NEW("projection", "{", "_id", BCON_INT32(0), "payload", BCON_INT32(1),
                         "payload_format", BCON_INT32(1), "}");
    mongoc_cursor_t *cur = mongoc_collection_find_with_opts(cl, f, o, NULL);
    const bson_t *d;
    int rc = 1;
    if (mongoc_cursor_next(cur, &d)) {
        char *s = bson_as_canonical_extended_json(d, NULL);
        printf("%s\n", s);
        bson_free(s);
        rc = 0;
    }
    mongoc_cursor_destroy(cur);
    bson_destroy(o);
    bson_destroy(f);
    return rc;
}

int main(int argc, char **argv)
{
    int dumping = argc == 5 && strcmp(argv[3], "dump") == 0;
    if (!dumping && (argc < 3 || argc > 4 || (argc == 4 && strcmp(argv[3], "queue") != 0))) {
        fprintf(stderr, "usage: mongo_enqueue URL COLLECTION [queue] < lines\n"
                        "       mongo_enqueue URL COLLECTION dump ID\n");
        return 2;
    }
    mongoc_init();
    bson_error_t e;
    mongoc_uri_t *uri = mongoc_uri_new_with_error(argv[1], &e);
    if (!uri) {
        fprintf(stderr, "mongo_enqueue: bad URL: %s\n", e.message);
        return 1;
    }
    const char *db = mongoc_uri_get_database(uri);
    char qname[256];
    snprintf(qname, sizeof qname, "%s_queue", argv[2]);
    mongoc_client_t *c = mongoc_client_new_from_uri(uri);
    mongoc_collection_t *cl = mongoc_client_get_collection(c, db && *db ? db : "relaybus", argv[2]);
    mongoc_collection_t *qc = mongoc_client_get_collection(c, db && *db ? db : "relaybus", qname);
    if (dumping) {
        int r = dump(cl, argv[4]);
        mongoc_collection_destroy(qc);
        mongoc_collection_destroy(cl);
        mongoc_client_destroy(c);
        mongoc_uri_destroy(uri);
        mongoc_cleanup();
        return r;
    }
    mongoc_client_session_t *cs = mongoc_client_start_session(c, NULL, &e);
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = cs ? 0 : 1;
    if (!cs) fprintf(stderr, "mongo_enqueue: no session: %s\n", e.message);
    while (rc == 0 && (len = getline(&line, &cap, stdin)) > 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (len == 0) continue;
        bson_t *in = bson_new_from_json((const uint8_t *)line, len, &e);
        if (!in) {
            fprintf(stderr, "mongo_enqueue: bad JSON (%s): %s\n", e.message, line);
            rc = 1;
            break;
        }
        char hex[25];
        double now = now_s();
        bson_t *d = delivery(in, now, hex);
        bson_t *q = argc == 4 ? queue_entry(in, hex, now) : NULL;
        if ((q && !insert(qc, q, cs)) || !insert(cl, d, cs)) rc = 1;  /* the entry first */
        else printf("%s\n", hex);
        if (q) bson_destroy(q);
        bson_destroy(d);
        bson_destroy(in);
    }
    free(line);
    if (cs) mongoc_client_session_destroy(cs);
    mongoc_collection_destroy(qc);
    mongoc_collection_destroy(cl);
    mongoc_client_destroy(c);
    mongoc_uri_destroy(uri);
    mongoc_cleanup();
    return rc;
}
