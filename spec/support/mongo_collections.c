/* mongo_collections.c -- prints the names of the collections of a MongoDB database, one a
 * line, for specs that check a command created nothing: mongo_collections URI DB. Exit 1
 * with one line on stderr when the server cannot say. */
#include <stdio.h>
#include <mongoc/mongoc.h>

static void quiet(mongoc_log_level_t level, const char *domain, const char *message, void *ud)
{
    (void)level; (void)domain; (void)message; (void)ud;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fputs("usage: mongo_collections URI DB\n", stderr);
        return 2;
    }
    mongoc_init();
    mongoc_log_set_handler(quiet, NULL);
    bson_error_t e;
    mongoc_uri_t *uri = mongoc_uri_new_with_error(argv[1], &e);
    mongoc_client_t *c = uri ? mongoc_client_new_from_uri(uri) : NULL;
    mongoc_database_t *db = c ? mongoc_client_get_database(c, argv[2]) : NULL;
    char **names = db ? mongoc_database_get_collection_names_with_opts(db, NULL, &e) : NULL;
    int status = names ? 0 : 1;
    if (!names) fprintf(stderr, "mongo_collections: %s\n", e.message);
    for (char **n = names; n && *n; n++) puts(*n);
    bson_strfreev(names);
    mongoc_database_destroy(db);
    mongoc_client_destroy(c);
    mongoc_uri_destroy(uri);
    mongoc_cleanup();
    return status;
}
