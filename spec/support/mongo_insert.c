/* mongo_insert.c -- inserts documents into a collection behind the store's back, for the specs
 * that must plant what a crashed process leaves (a write ticket whose write never landed):
 *   mongo_insert URL COLLECTION < documents, one canonical/relaxed extended JSON per line
 * The database is the URL's (relaybus when it names none). Prints the number inserted; exits
 * 1 on any error, with a message on stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <mongoc/mongoc.h>

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: mongo_insert URL COLLECTION < docs.jsonl\n");
        return 2;
    }
    mongoc_init();
    bson_error_t e;
    mongoc_uri_t *uri = mongoc_uri_new_with_error(argv[1], &e);
    if (!uri) {
        fprintf(stderr, "mongo_insert: bad URL: %s\n", e.message);
        return 1;
    }
    const char *db = mongoc_uri_get_database(uri);
    mongoc_client_t *c = mongoc_client_new_from_uri(uri);
    mongoc_collection_t *cl = mongoc_client_get_collection(c, db && *db ? db : "relaybus", argv[2]);
    mongoc_bulk_operation_t *b = mongoc_collection_create_bulk_operation_with_opts(cl, NULL);
    char *line = NULL;
    size_t cap = 0, n = 0;
    ssize_t len;
    int rc = 0;
    while ((len = getline(&line, &cap, stdin)) > 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (len == 0) continue;
        bson_t *d = bson_new_from_json((const uint8_t *)line, len, &e);
        if (!d) {
            fprintf(stderr, "mongo_insert: bad JSON (%s): %s\n", e.message, line);
            rc = 1;
            break;
        }
        mongoc_bulk_operation_insert(b, d);
        bson_destroy(d);
        n++;
    }
    free(line);
    if (rc == 0 && n > 0) {
        bson_t reply;
        if (!mongoc_bulk_operation_execute(b, &reply, &e)) {
            fprintf(stderr, "mongo_insert: %s\n", e.message);
            rc = 1;
        }
        bson_destroy(&reply);
    }
    if (rc == 0) printf("%zu\n", n);
    mongoc_bulk_operation_destroy(b);
    mongoc_collection_destroy(cl);
    mongoc_client_destroy(c);
    mongoc_uri_destroy(uri);
    mongoc_cleanup();
    return rc;
}
