/* schema.c -- the MongoDB store's collections and indexes: made by migrate, checked without. */
#include <stdio.h>
#include <string.h>
#include "stores/mongo/mstore.h"

/* One index per command: FerretDB 1.24 panics when one createIndexes names two or more
 * indexes that already exist (it deletes from the list it is walking). */
static int create_index(mongoc_client_t *c, const char *db, const char *collname, bson_t *index,
                        char *err, size_t errlen)
{
    bson_t cmd = BSON_INITIALIZER, arr, reply;
    bson_error_t e;
    BSON_APPEND_UTF8(&cmd, "createIndexes", collname);
    BSON_APPEND_ARRAY_BEGIN(&cmd, "indexes", &arr);
    BSON_APPEND_DOCUMENT(&arr, "0", index);
    bson_append_array_end(&cmd, &arr);
    mongoc_database_t *d = mongoc_client_get_database(c, db);
    int ok = mongoc_database_write_command_with_opts(d, &cmd, NULL, &reply, &e);
    if (!ok) {
        snprintf(err, errlen, "mongodb: cannot create indexes on %s.%s: %.200s", db, collname, e.message);
        mg_one_line(err, errlen);
    }
    mongoc_database_destroy(d);
    bson_destroy(&reply);
    bson_destroy(&cmd);
    bson_destroy(index);
    return ok;
}

/* Claims sort by run_at among due statuses; purges look for old settled ones; dedupe is unique
 * among live deliveries only (sparse: completed and buried ones drop the field). FerretDB
 * accepts and ignores sparse, but its SQLite index skips missing fields anyway. */
int mg_migrate(mstore *s, mongoc_client_t *c, char *err, size_t errlen)
{
    const char *t = s->base.table;
    return create_index(c, s->db, t, BCON_NEW("key", "{", "status", BCON_INT32(1), "run_at", BCON_INT32(1), "}",
                                              "name", BCON_UTF8("status_run_at")), err, errlen) &&
           create_index(c, s->db, t, BCON_NEW("key", "{", "dedupe", BCON_INT32(1), "}",
                                              "name", BCON_UTF8("dedupe"), "unique", BCON_BOOL(true),
                                              "sparse", BCON_BOOL(true)), err, errlen) &&
           create_index(c, s->db, t, BCON_NEW("key", "{", "status", BCON_INT32(1), "settled_at", BCON_INT32(1), "}",
                                              "name", BCON_UTF8("status_settled_at")), err, errlen) &&
           create_index(c, s->db, s->tickets, BCON_NEW("key", "{", "at", BCON_INT32(1), "}",
                                                       "name", BCON_UTF8("at")), err, errlen) &&
           /* the held deliveries by the dependencies they wait for (deps.c); not required
            * by the check below, so a collection made before it still opens (its settles of
            * dependencies then scan) */
           create_index(c, s->db, t, BCON_NEW("key", "{", "after", BCON_INT32(1), "}",
                                              "name", BCON_UTF8("after"),
                                              "sparse", BCON_BOOL(true)), err, errlen) &&
           (!s->ferret || mg_queue_backfill(s, c, err, errlen));
}

/* Which of the names[] (at most 8) are indexes of the collection: a bit each, or -1 with err
 * set. A collection that does not exist has none. */
static int index_names(mstore *s, mongoc_client_t *c, const char *collname,
                       const char *const *names, int n, char *err, size_t errlen)
{
    mongoc_collection_t *cl = mg_coll(s, c, collname);
    mongoc_cursor_t *cur = mongoc_collection_find_indexes_with_opts(cl, NULL);
    const bson_t *doc;
    int found = 0;
    while (mongoc_cursor_next(cur, &doc)) {
        const char *name = mg_doc_str(doc, "name");
        for (int i = 0; name && i < n; i++)
            if (strcmp(name, names[i]) == 0) found |= 1 << i;
    }
    bson_error_t e;
    if (mongoc_cursor_error(cur, &e) && e.code != 26) {   /* 26: no such collection */
        snprintf(err, errlen, "mongodb: cannot list the indexes of %s.%s: %.200s", s->db,
                 collname, e.message);
        found = -1;
    }
    mongoc_cursor_destroy(cur);
    mongoc_collection_destroy(cl);
    return found;
}

/* Without migrate the indexes migrate makes must be there. Only reads: a collection springs
 * into existence at its first write, and a mistyped table name must not make one. */
int mg_check_schema(mstore *s, mongoc_client_t *c, char *err, size_t errlen)
{
    static const char *const table_ix[] = {"status_run_at", "dedupe", "status_settled_at"};
    static const char *const tickets_ix[] = {"at"};
    int t = index_names(s, c, s->base.table, table_ix, 3, err, errlen);
    int k = t == 7 ? index_names(s, c, s->tickets, tickets_ix, 1, err, errlen) : 0;
    if (t < 0 || k < 0) return 0;
    int q = 1;
    if (t == 7 && k == 1 && s->ferret) {
        bson_error_t e;
        memset(&e, 0, sizeof e);
        mongoc_database_t *d = mongoc_client_get_database(c, s->db);
        q = mongoc_database_has_collection(d, s->queue, &e);
        mongoc_database_destroy(d);
        if (!q && e.code != 0) {
            snprintf(err, errlen, "mongodb: cannot list the collections of %s: %.200s", s->db,
                     e.message);
            return 0;
        }
    }
    if (t == 7 && k == 1 && q) return 1;
    if (t == 0)
        snprintf(err, errlen, "mongodb: no relaybus schema here (run relaybus migrate): "
                 "collection %s.%s has no relaybus indexes", s->db, s->base.table);
    else
        snprintf(err, errlen, "mongodb: the schema of %s.%s is incomplete (run relaybus "
                 "migrate)", s->db, s->base.table);
    return 0;
}
