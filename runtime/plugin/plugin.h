/* plugin.h -- the optional parts: the PostgreSQL and MongoDB stores, the HTTP client (libcurl,
 * OpenSSL's HMAC) and the dashboard's server (libmicrohttpd). Each is a table of functions.
 *
 * The C libraries (librelaybus.a, librelaybus.so) link every part in (plugin_static.c); the
 * relaybus command and the Lua module load each on first use from relaybus_NAME.so beside
 * them (plugin_dlopen.c): those libraries and what they pull in (OpenSSL, GnuTLS, ICU, Kerberos)
 * cost a process 11 MiB resident at start, which a worker on SQLite never needs, and a machine
 * without libmongoc still runs everything else. */
#ifndef RB_PLUGIN_H
#define RB_PLUGIN_H

#include <stddef.h>
#include "stores/store.h"
#include "http/http.h"
#include "serve/dashboard.h"

typedef enum {
    RB_PLUGIN_PG, RB_PLUGIN_MONGO, RB_PLUGIN_HTTP, RB_PLUGIN_SERVE, RB_PLUGIN_COUNT
} rb_plugin_id;

typedef struct rb_store_plugin {
    rb_store *(*open)(struct ev_loop *loop, const char *url, const rb_store_options *opts,
                      char *err, size_t errlen);
} rb_store_plugin;

typedef struct rb_http_plugin {
    rb_http *(*new_transport)(struct ev_loop *loop);
    rb_http_transfer *(*start)(rb_http *h, const rb_http_request *req, rb_http_cb cb, void *ud,
                               char *err, size_t errlen);
    void (*cancel)(rb_http_transfer *t);
    void (*free_transport)(rb_http *h);
    /* HMAC-SHA-256 of data under key into out (32 bytes): 0, or -1 when it failed. */
    int (*hmac_sha256)(const void *key, size_t klen, const void *data, size_t dlen,
                       unsigned char out[32]);
    /* 1 when a[0..n) equals b[0..n), in time that does not depend on where they differ. */
    int (*equal)(const void *a, const void *b, size_t n);
} rb_http_plugin;

typedef struct rb_serve_plugin {
    void (*options_init)(rb_dashboard_options *o);
    rb_dashboard *(*new_server)(struct ev_loop *loop, rb_store *store,
                                const rb_dashboard_options *o, char *err, size_t errlen);
    const char *(*url)(const rb_dashboard *d);
    int (*port)(const rb_dashboard *d);
    void (*free_server)(rb_dashboard *d);
} rb_serve_plugin;

/* The part's table (cast it to its type), loaded on the first call; NULL with one line in err
 * when it cannot be ("the PostgreSQL store is not installed: relaybus_pg.so: ..."). Any
 * thread. */
const void *rb_plugin_get(rb_plugin_id id, char *err, size_t errlen);

/* Each part's table, defined by the part itself. */
extern const rb_store_plugin rb_plugin_pg;
extern const rb_store_plugin rb_plugin_mongo;
extern const rb_http_plugin rb_plugin_http;
extern const rb_serve_plugin rb_plugin_serve;

#endif
