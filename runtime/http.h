/* http.h -- the HTTP transport: libcurl's multi interface driven by the host's libev loop.
 *
 * No thread and no blocking call: curl's sockets are ev_io watchers and its timeout one
 * ev_timer. A transfer ends with exactly one callback, unless it is cancelled first with
 * rb_http_cancel (then never). Connections are reused across transfers of one transport. */
#ifndef RB_HTTP_H
#define RB_HTTP_H

#include <stddef.h>
#include <ev.h>

typedef struct rb_http rb_http;
typedef struct rb_http_transfer rb_http_transfer;

typedef struct rb_http_request {
    const char *method;             /* NULL = "GET", or "POST" when body is set */
    const char *url;
    const char *const *headers;     /* "Name: value" lines */
    size_t nheaders;
    const char *body;               /* may be NULL */
    size_t body_len;
    double timeout;                 /* s for the whole transfer; 0 = 30 */
    size_t max_body;                /* response body limit in bytes; 0 = 16 MiB */
    int follow_redirects;           /* 0 by default */
} rb_http_request;

typedef struct rb_http_response {
    long status;
    char **headers;                 /* "Name: value" lines of the final response */
    size_t nheaders;
    char *body;
    size_t body_len;
} rb_http_response;

/* err: one-line message for failures below HTTP ("connection refused", "timed out", ...);
 * resp is valid only during the callback. */
typedef void (*rb_http_cb)(void *ud, const char *err, const rb_http_response *resp);

rb_http *rb_http_new(struct ev_loop *loop);
/* Returns NULL (and calls nothing) when the request is invalid; err filled. */
rb_http_transfer *rb_http_start(rb_http *h, const rb_http_request *req, rb_http_cb cb, void *ud,
                                char *err, size_t errlen);
/* Stops a transfer; its callback is never called. */
void rb_http_cancel(rb_http_transfer *t);
/* Ends every open transfer, calling each callback with err = reason. */
void rb_http_cut_all(rb_http *h, const char *reason);
size_t rb_http_active(rb_http *h);
void rb_http_free(rb_http *h);

#endif
