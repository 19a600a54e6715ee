/* lua_http.c -- the `relaybus.http` table: request{...} on the module's HTTP transport (one
 * rb_http per module, created on first use), waiting through rb_await so a handler yields and
 * the main chunk blocks; an aborted waiter cuts its transfer. Also what webhooks need around
 * it: retry_after, hmac_sha256, base64, a constant-time comparison and URL redaction. */
#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <lua.h>
#include <lauxlib.h>
#include "util/base64.h"
#include "util/clock.h"
#include "http/http.h"
#include "internal.h"
#include "plugin/plugin.h"
#include "util/text.h"

#define STATE_KEY "relaybus.http.transport"   /* registry: the userdata */
#define STATE_MT "relaybus.http.transport_mt"

/* Lives outside Lua memory: the module's cut hook keeps a pointer to it for the whole life
 * of the Lua state, possibly after the userdata that owns the transport was collected. */
typedef struct transport {
    rb_http *h;
    const rb_http_plugin *p;    /* h's plugin (plugin.h) */
    rb_module *m;
    int collected;      /* our userdata's __gc ran: the module's closing call frees us */
    int closed;         /* the module's closing call came first: our __gc frees us */
} transport;

/* One request in flight: the waiter and the transfer, for the cancel hook. */
typedef struct call {
    rb_await *w;
    rb_http_transfer *t;
    const rb_http_plugin *p;    /* t's plugin */
} call;

/* ---- the transport of this module ---- */

/* Called when the state closes (lua_close runs finalizers, in either order with ours): nothing
 * may call back into Lua, so the transport is dropped silently. (A stopping dispatcher cuts
 * only its own runs' transfers, through their aborts.) */
static void on_module_cut(void *ud)
{
    transport *tp = ud;
    if (tp->collected) {
        free(tp);
    } else {
        tp->p->free_transport(tp->h);
        tp->h = NULL;
        tp->closed = 1;
    }
}

/* Runs only at lua_close: the userdata is anchored in the registry. */
static int state_gc(lua_State *L)
{
    transport **ud = luaL_checkudata(L, 1, STATE_MT);
    transport *tp = *ud;
    *ud = NULL;
    if (!tp) return 0;
    if (tp->closed) {
        free(tp);
    } else {
        tp->p->free_transport(tp->h);
        tp->h = NULL;
        tp->collected = 1;
    }
    return 0;
}

/* The HTTP plugin (plugin.h), loaded on first use; raises when it cannot be. */
static const rb_http_plugin *http_plugin(lua_State *L, const char *fn)
{
    char err[512];
    const rb_http_plugin *p = rb_plugin_get(RB_PLUGIN_HTTP, err, sizeof err);
    if (!p) luaL_error(L, "relaybus: %s: %s", fn, err);
    return p;
}

/* The module's transport, made on first use; NULL with the reason in err when the HTTP
 * plugin cannot be loaded. */
static transport *get_transport(lua_State *L, char *err, size_t errlen)
{
    if (lua_getfield(L, LUA_REGISTRYINDEX, STATE_KEY) == LUA_TUSERDATA) {
        transport **ud = lua_touserdata(L, -1);
        lua_pop(L, 1);
        if (*ud && (*ud)->h) return *ud;
        rb_misuse(L, "http: the transport is closed");
    }
    lua_pop(L, 1);
    const rb_http_plugin *p = rb_plugin_get(RB_PLUGIN_HTTP, err, errlen);
    if (!p) return NULL;
    rb_module *m = rb_module_get(L);
    transport **ud = lua_newuserdatauv(L, sizeof *ud, 0);
    *ud = NULL;
    if (luaL_newmetatable(L, STATE_MT)) {
        lua_pushcfunction(L, state_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_setmetatable(L, -2);
    transport *tp = rb_calloc(1, sizeof *tp);
    if (tp) {
        tp->m = m;
        tp->p = p;
    }
    if (!tp || !(tp->h = p->new_transport(rb_module_loop(m)))) {
        free(tp);
        rb_misuse(L, "http: cannot create the transport (out of memory)");
        return NULL;
    }
    *ud = tp;
    lua_setfield(L, LUA_REGISTRYINDEX, STATE_KEY);
    rb_module_on_cut(m, on_module_cut, tp);
    return tp;
}

/* ---- reading the options ---- */

static const char *const request_keys[] = {
    "method", "url", "headers", "body", "timeout", "max_body", "truncate_body",
    "follow_redirects", NULL};

static void check_keys(lua_State *L, int idx)
{
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        int known = 0;
        if (lua_type(L, -1) == LUA_TSTRING)
            for (int i = 0; request_keys[i]; i++)
                if (strcmp(lua_tostring(L, -1), request_keys[i]) == 0) known = 1;
        if (!known)
            rb_misuse(L, "http.request: unknown option '%s'", luaL_tolstring(L, -1, NULL));
    }
}

/* Fetches opts[key] onto the stack; raises unless it is nil or of type `want`. */
static int opt_field(lua_State *L, int idx, const char *key, int want)
{
    int t = lua_getfield(L, idx, key);
    if (t != LUA_TNIL && t != want)
        rb_misuse(L, "http.request: '%s' must be a %s, not %s", key,
                   lua_typename(L, want), lua_typename(L, t));
    return t != LUA_TNIL;
}

/* A name for a message: one line, cut short, so a bad name cannot forge a second line. */
static const char *shown_name(lua_State *L, const char *s, size_t n)
{
    char buf[64];
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (size_t i = 0; i < n && luaL_bufflen(&b) < 40; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f) {
            snprintf(buf, sizeof buf, "\\x%02x", c);
            luaL_addstring(&b, buf);
        } else {
            luaL_addchar(&b, (char)c);
        }
    }
    luaL_pushresult(&b);
    return lua_tostring(L, -1);
}

static int header_named(const char *name, size_t n, const char *want)
{
    return n == strlen(want) && strncasecmp(name, want, n) == 0;
}

/* Turns opts.headers (name -> value) into "Name: value" strings left on the stack; their
 * pointers go to a userdata array, also on the stack, below them. Returns the count. A name
 * must be a token and a value must hold no CR, LF or NUL: either could start a header or a
 * request of its own (request smuggling). */
static size_t read_headers(lua_State *L, int idx, const char ***out)
{
    *out = NULL;
    if (!opt_field(L, idx, "headers", LUA_TTABLE)) return 0;
    int ht = lua_gettop(L);
    size_t n = 0;
    for (lua_pushnil(L); lua_next(L, ht); lua_pop(L, 1)) n++;
    const char **lines = lua_newuserdatauv(L, (n ? n : 1) * sizeof *lines, 0);
    luaL_checkstack(L, (int)n + 4, "too many headers");
    size_t i = 0;
    for (lua_pushnil(L); lua_next(L, ht); lua_pop(L, 1)) {
        if (lua_type(L, -2) != LUA_TSTRING ||
            (lua_type(L, -1) != LUA_TSTRING && lua_type(L, -1) != LUA_TNUMBER))
            rb_misuse(L, "http.request: headers must map names to strings");
        size_t nl, vl;
        const char *name = lua_tolstring(L, -2, &nl);
        lua_pushvalue(L, -1);           /* a number converts on a copy, not on the table's */
        const char *value = lua_tolstring(L, -1, &vl);
        if (!rb_http_valid_header_name(name, nl))
            rb_misuse(L, "http.request: invalid header name '%s': a name is token characters "
                         "(RFC 9110)", shown_name(L, name, nl));
        if (!rb_http_valid_header_value(value, vl))
            rb_misuse(L, "http.request: invalid value of header '%s': CR, LF and NUL are not "
                         "allowed", shown_name(L, name, nl));
        if (header_named(name, nl, "content-length") || header_named(name, nl, "transfer-encoding"))
            rb_misuse(L, "http.request: header '%s' is the transport's: it frames the body itself",
                      shown_name(L, name, nl));
        /* "Name;" is curl's way to send an empty value ("Name:" would remove the header) */
        const char *line = vl ? lua_pushfstring(L, "%s: %s", name, value)
                              : lua_pushfstring(L, "%s;", name);
        lua_remove(L, -2);
        lua_insert(L, ht);      /* keep it below the iteration's key and value */
        ht++;
        lines[i++] = line;
    }
    *out = lines;
    return n;
}

static void read_request(lua_State *L, rb_http_request *req)
{
    if (lua_type(L, 1) != LUA_TTABLE)
        rb_misuse(L, "http.request: expects a table of options, not %s",
                   luaL_typename(L, 1));
    check_keys(L, 1);
    memset(req, 0, sizeof *req);
    size_t len;
    if (!opt_field(L, 1, "url", LUA_TSTRING))
        rb_misuse(L, "http.request: 'url' is required");
    req->url = lua_tolstring(L, -1, &len);
    if (!rb_http_valid_url_text(req->url, len) || strlen(req->url) != len)
        rb_misuse(L, "http.request: invalid url: control characters and spaces must be "
                     "percent-encoded");
    if (opt_field(L, 1, "method", LUA_TSTRING)) {
        req->method = lua_tolstring(L, -1, &len);
        if (!rb_http_valid_method(req->method, len))
            rb_misuse(L, "http.request: invalid method '%s': a method is 1 to 32 token "
                         "characters (RFC 9110)", shown_name(L, req->method, len));
    }
    if (opt_field(L, 1, "body", LUA_TSTRING)) req->body = lua_tolstring(L, -1, &req->body_len);
    if (opt_field(L, 1, "timeout", LUA_TNUMBER)) {
        req->timeout = lua_tonumber(L, -1);
        if (!(req->timeout > 0)) rb_misuse(L, "http.request: 'timeout' must be > 0");
    }
    if (opt_field(L, 1, "max_body", LUA_TNUMBER)) {
        if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) <= 0)
            rb_misuse(L, "http.request: 'max_body' must be a positive integer");
        req->max_body = (size_t)lua_tointeger(L, -1);
    }
    if (opt_field(L, 1, "truncate_body", LUA_TBOOLEAN))
        req->truncate_body = lua_toboolean(L, -1);
    if (opt_field(L, 1, "follow_redirects", LUA_TBOOLEAN))
        req->follow_redirects = lua_toboolean(L, -1);
    const char **lines;
    req->nheaders = read_headers(L, 1, &lines);
    req->headers = lines;
}

/* ---- results ---- */

/* Sets t[lower(name)] = value, joining a repeated header with ", ". */
static void push_header(lua_State *T, int tbl, const char *line)
{
    const char *colon = strchr(line, ':');
    size_t nl = (size_t)(colon - line);
    luaL_Buffer b;
    luaL_buffinit(T, &b);
    for (size_t i = 0; i < nl; i++) luaL_addchar(&b, (char)tolower((unsigned char)line[i]));
    luaL_pushresult(&b);
    const char *v = colon + 1;
    while (*v == ' ' || *v == '\t') v++;
    lua_pushvalue(T, -1);
    if (lua_rawget(T, tbl) == LUA_TSTRING) {
        lua_pushfstring(T, "%s, %s", lua_tostring(T, -1), v);
        lua_remove(T, -2);
    } else {
        lua_pop(T, 1);
        lua_pushstring(T, v);
    }
    lua_rawset(T, tbl);
}

/* {status=, headers=, body=}, or nil, err; returns the count. */
static int push_result(lua_State *T, const char *err, const rb_http_response *r)
{
    luaL_checkstack(T, 8, "http result");
    if (err) {
        lua_pushnil(T);
        lua_pushstring(T, err);
        return 2;
    }
    lua_createtable(T, 0, 5);
    lua_pushinteger(T, r->status);
    lua_setfield(T, -2, "status");
    lua_createtable(T, 0, (int)r->nheaders);
    int tbl = lua_gettop(T);
    for (size_t i = 0; i < r->nheaders; i++) push_header(T, tbl, r->headers[i]);
    lua_setfield(T, -2, "headers");
    lua_pushlstring(T, r->body ? r->body : "", r->body_len);
    lua_setfield(T, -2, "body");
    if (r->truncated) {
        lua_pushboolean(T, 1);
        lua_setfield(T, -2, "truncated");
    }
    if (r->redirect_url) {
        lua_pushstring(T, r->redirect_url);
        lua_setfield(T, -2, "redirect_url");
    }
    return 1;
}

static void on_done(void *ud, const char *err, const rb_http_response *resp)
{
    call *c = ud;
    rb_await *w = c->w;
    free(c);
    lua_State *T = rb_await_target(w);
    rb_await_resolve(w, T ? push_result(T, err, resp) : 0);
}

/* The waiter was aborted: cut the transfer now. Its callback will not come, and the await
 * frees itself after this hook (task.c), so nothing is resolved here. */
static void on_cancel(void *ud)
{
    call *c = ud;
    c->p->cancel(c->t);
    free(c);
}

/* ---- Lua functions ---- */

static int l_request(lua_State *L)
{
    rb_http_request req;
    read_request(L, &req);
    char err[512];
    transport *tp = get_transport(L, err, sizeof err);
    if (!tp) {
        lua_pushnil(L);
        lua_pushstring(L, err);
        return 2;
    }
    call *c = rb_calloc(1, sizeof *c);
    if (!c) rb_misuse(L, "http.request: out of memory");
    c->p = tp->p;
    /* Started before the await begins: a bad URL returns nil, err with nothing to undo. The
     * transport calls back only from the loop, so c->w is set before on_done can run. */
    c->t = tp->p->start(tp->h, &req, on_done, c, err, sizeof err);
    if (!c->t) {
        free(c);
        lua_pushnil(L);
        lua_pushstring(L, err);
        return 2;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) {
        c->p->cancel(c->t);
        free(c);
        return 2;
    }
    c->w = w;
    rb_await_on_cancel(w, on_cancel, c);
    return rb_await_finish(L, w);
}

/* Pushes a digest (at most 32 bytes) in the encoding named by argument `arg`: "hex" (the
 * default), "base64", "raw". */
static int push_encoded(lua_State *L, int arg, const unsigned char *p, size_t n)
{
    static const char *const names[] = {"hex", "base64", "raw", NULL};
    int how = luaL_checkoption(L, arg, "hex", names);
    if (n > 32) n = 32;     /* the buffers below */
    if (how == 2) {
        lua_pushlstring(L, (const char *)p, n);
    } else if (how == 1) {
        char out[RB_BASE64_ENCODED_SIZE(32)];
        lua_pushlstring(L, out, rb_base64_encode(p, n, out));
    } else {
        char hex[2 * 32 + 1];
        for (size_t i = 0; i < n; i++) {
            hex[2 * i] = "0123456789abcdef"[p[i] >> 4];
            hex[2 * i + 1] = "0123456789abcdef"[p[i] & 15];
        }
        lua_pushlstring(L, hex, 2 * n);
    }
    return 1;
}

/* hmac_sha256(key, data [, "hex"|"base64"|"raw"]) */
static int l_hmac_sha256(lua_State *L)
{
    size_t klen, dlen;
    const char *key = luaL_checklstring(L, 1, &klen);
    const char *data = luaL_checklstring(L, 2, &dlen);
    unsigned char mac[32];
    if (klen > INT_MAX) rb_misuse(L, "http.hmac_sha256: the key is too long");
    if (http_plugin(L, "http.hmac_sha256")->hmac_sha256(key, klen, data, dlen, mac) != 0)
        rb_misuse(L, "http.hmac_sha256: HMAC failed");
    return push_encoded(L, 3, mac, sizeof mac);
}

static int l_base64_encode(lua_State *L)
{
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    if (n > ((size_t)1 << 30)) rb_misuse(L, "http.base64_encode: more than 1 GiB");
    luaL_Buffer b;
    char *out = luaL_buffinitsize(L, &b, RB_BASE64_ENCODED_SIZE(n));
    luaL_pushresultsize(&b, rb_base64_encode((const unsigned char *)s, n, out));
    return 1;
}

/* base64_decode(s) -> bytes, or nil, err when s is not base64 */
static int l_base64_decode(lua_State *L)
{
    size_t n, outlen = 0;
    const char *s = luaL_checklstring(L, 1, &n);
    luaL_Buffer b;
    unsigned char *out = (unsigned char *)luaL_buffinitsize(L, &b, n / 4 * 3 + 3);
    if (rb_base64_decode(s, n, out, &outlen) != 0) {
        lua_pushnil(L);
        lua_pushliteral(L, "not base64");
        return 2;
    }
    luaL_pushresultsize(&b, outlen);
    return 1;
}

/* equal(a, b): compares in time that depends on the lengths only, for signatures. */
static int l_equal(lua_State *L)
{
    size_t an, bn;
    const char *a = luaL_checklstring(L, 1, &an);
    const char *b = luaL_checklstring(L, 2, &bn);
    const rb_http_plugin *p = http_plugin(L, "http.equal");
    lua_pushboolean(L, an == bn && p->equal(a, b, an));
    return 1;
}

/* retry_after(value [, now]) -> seconds from now (epoch s; default the wall clock), or nil */
static int l_retry_after(lua_State *L)
{
    size_t n;
    const char *v = luaL_optlstring(L, 1, NULL, &n);
    double now = luaL_optnumber(L, 2, rb_wall_time());
    if (!isfinite(now)) rb_misuse(L, "http.retry_after: 'now' must be a finite number");
    double secs;
    if (!v || strlen(v) != n || !rb_http_retry_after(v, now, &secs)) {
        lua_pushnil(L);
        return 1;
    }
    lua_pushnumber(L, secs);
    return 1;
}

/* redact_url(url): the URL with its user-info password and secret-looking parameters hidden */
static int l_redact_url(lua_State *L)
{
    size_t n;
    const char *url = luaL_checklstring(L, 1, &n);
    luaL_Buffer b;
    size_t cap = 2 * n + 16;            /* each "***" replaces at least a few bytes */
    char *out = luaL_buffinitsize(L, &b, cap);
    rb_redact_url(out, cap, url);
    luaL_pushresultsize(&b, strlen(out));
    return 1;
}

int rb_lua_open_http(lua_State *L)
{
    static const luaL_Reg fns[] = {
        {"request", l_request},
        {"retry_after", l_retry_after},
        {"hmac_sha256", l_hmac_sha256},
        {"base64_encode", l_base64_encode},
        {"base64_decode", l_base64_decode},
        {"equal", l_equal},
        {"redact_url", l_redact_url},
        {NULL, NULL}};
    luaL_newlib(L, fns);
    return 1;
}
