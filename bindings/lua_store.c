/* lua_store.c -- stores and transactions as Lua objects: relaybus.open, the store methods
 * (enqueue, enqueue_json, enqueue_many, get, list, stats, kick, purge, close, kind, and _begin
 * under the prelude's store:transaction; try_acquire is lua_leases.c's) and the tx object
 * (enqueue, enqueue_json, enqueue_many, exec, query, _commit, _rollback, and the document
 * operations the prelude wraps as tx:collection).
 * Each method starts the store's asynchronous operation and waits for it through await.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "schedule/schedule.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/check.h"

struct lua_store {
    rb_store *s;
    rb_module *m;
    int closed;
    lua_State *tx_thread;   /* the thread inside this store's open transaction, or NULL */
    int running;            /* started dispatchers not yet stopped: close() refuses */
    int users;              /* started dispatchers not yet quiet: close() waits for them */
    int transactions;       /* open store:transaction transactions: close() refuses */
    int close_pending;      /* closed for callers; the store itself closes at users == 0 */
};

typedef struct lua_tx {
    rb_tx *tx;
    rb_store *s;
    lua_store *owner;       /* store:transaction's store, NULL for a handler's transaction */
    int closed;
    int owned;      /* 1: store:transaction's (commit/rollback allowed); 0: a handler's */
} lua_tx;

/* 1 when L runs a transactional handler whose transaction is on store s. */
static int in_handler_tx(lua_State *L, const rb_store *s)
{
    rb_task *t = rb_task_current(L);
    return t && t->run && rb_run_tx(t->run) && rb_dispatcher_store(rb_run_dispatcher(t->run)) == s;
}

static lua_store *check_lua_store(lua_State *L, int idx)
{
    lua_store *st = luaL_checkudata(L, idx, RB_STORE_MT);
    if (st->closed) rb_misuse(L, "store is closed");
    /* On a store whose transaction holds everything (SQLite), a call from inside the
     * transaction would wait for the transaction, i.e. for itself. */
    if (st->s->vt->tx_exclusive && (st->tx_thread == L || in_handler_tx(L, st->s)))
        rb_misuse(L, "this %s store is inside a transaction here (store:transaction or a "
                     "transactional handler): use the tx object (tx:enqueue, tx:query, "
                     "tx:exec) until it ends", st->s->vt->name);
    return st;
}

rb_store *rb_lua_check_store(lua_State *L, int idx) { return check_lua_store(L, idx)->s; }
lua_store *rb_lua_store_object(lua_State *L, int idx) { return check_lua_store(L, idx); }
int rb_lua_store_open(lua_State *L, int idx) { return !((lua_store *)luaL_checkudata(L, idx, RB_STORE_MT))->closed; }

static void close_store(lua_store *st);

void rb_lua_store_use(lua_store *st, int running, int users)
{
    st->running += running;
    st->users += users;
    if (st->close_pending && st->users == 0) close_store(st);
}

/* ---- results to Lua ---------------------------------------------------------------------- */
static void set_num(lua_State *L, const char *k, double v)
{
    lua_pushnumber(L, v);
    lua_setfield(L, -2, k);
}

static void set_str(lua_State *L, const char *k, const char *v)
{
    if (!v) return;
    lua_pushstring(L, v);
    lua_setfield(L, -2, k);
}

/* A JSON text of the history (progress, errors) as field k; text that is not JSON (a row
 * written by hand) is left out. */
static void set_json(lua_State *L, const char *k, const char *json)
{
    if (!json) return;
    if (rb_json_decode(L, json, strlen(json))) lua_setfield(L, -2, k);
    else lua_pop(L, 1);
}

void rb_push_record(lua_State *L, rb_module *m, const rb_delivery *d)
{
    (void)m;
    lua_createtable(L, 0, 16);
    set_str(L, "id", d->id);
    set_str(L, "topic", d->topic);
    set_str(L, "key", d->key);
    set_str(L, "group", d->group);
    set_str(L, "status", rb_status_name(d->status));
    lua_pushinteger(L, d->attempts);
    lua_setfield(L, -2, "attempts");
    lua_pushinteger(L, d->max_attempts);
    lua_setfield(L, -2, "max_attempts");
    lua_pushinteger(L, (lua_Integer)d->fence);
    lua_setfield(L, -2, "fence");
    set_num(L, "run_at", d->run_at);
    set_num(L, "created_at", d->created_at);
    if (d->lease_expires_at > 0) set_num(L, "lease_expires_at", d->lease_expires_at);
    set_str(L, "last_error", d->last_error);
    if (d->settled_at > 0) set_num(L, "settled_at", d->settled_at);
    if (d->waiting > 0) {
        lua_pushinteger(L, d->waiting);
        lua_setfield(L, -2, "waiting");
    }
    set_json(L, "progress", d->progress);
    set_json(L, "errors", d->errors);
    if (d->payload) {
        if (rb_json_decode(L, d->payload, strlen(d->payload))) {
            lua_setfield(L, -2, "payload");
        } else {
            /* A row written by hand with invalid JSON: say so instead of failing the read. */
            lua_pushfstring(L, "invalid JSON payload: %s", lua_tostring(L, -1));
            lua_setfield(L, -3, "payload_error");
            lua_pop(L, 1);
        }
    }
}

/* ---- callbacks that resolve a wait ------------------------------------------------------ */
static int push_err(lua_State *T, const char *err)
{
    lua_pushnil(T);
    lua_pushstring(T, err);
    return 2;
}

/* What an enqueue answers: the id (one) or the list of ids, and with_made (a replace) also
 * whether each item's payload is the one that will run (false where a live delivery was kept
 * as it was), as a boolean or a list of them. */
static void resolve_ids(void *ud, const char *err, char **ids, const unsigned char *kept,
                        size_t n, int one, int with_made)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) {
        nres = push_err(T, err);
    } else if (T && one && n < 1) {
        nres = push_err(T, "enqueue returned no id");
    } else if (T) {
        for (int made = 0; made <= with_made; made++, nres++) {
            if (!one) lua_createtable(T, (int)n, 0);
            for (size_t i = 0; i < (one ? 1 : n); i++) {
                if (made) lua_pushboolean(T, !(kept && kept[i]));
                else lua_pushstring(T, ids[i]);
                if (!one) lua_rawseti(T, -2, (lua_Integer)i + 1);
            }
        }
    }
    rb_await_resolve(w, nres);
}

static void on_ids(void *ud, const char *err, char **ids, const unsigned char *kept, size_t n)
{
    resolve_ids(ud, err, ids, kept, n, 0, 0);
}

static void on_ids_made(void *ud, const char *err, char **ids, const unsigned char *kept,
                        size_t n)
{
    resolve_ids(ud, err, ids, kept, n, 0, 1);
}

static void on_one_id(void *ud, const char *err, char **ids, const unsigned char *kept, size_t n)
{
    resolve_ids(ud, err, ids, kept, n, 1, 0);
}

static void on_one_id_made(void *ud, const char *err, char **ids, const unsigned char *kept,
                           size_t n)
{
    resolve_ids(ud, err, ids, kept, n, 1, 1);
}

static void on_records_one(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        if (n > 0) rb_push_record(T, rb_module_get(T), recs[0]);
        else lua_pushnil(T);
        nres = 1;
    }
    rb_delivery_list_free(recs, n);
    rb_await_resolve(w, nres);
}

static void on_records_list(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        rb_module *m = rb_module_get(T);
        lua_createtable(T, (int)n, 0);
        for (size_t i = 0; i < n; i++) {
            rb_push_record(T, m, recs[i]);
            lua_rawseti(T, -2, (lua_Integer)i + 1);
        }
        nres = 1;
    }
    rb_delivery_list_free(recs, n);
    rb_await_resolve(w, nres);
}

static void on_count(void *ud, const char *err, int64_t count)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        lua_pushinteger(T, (lua_Integer)count);
        nres = 1;
    }
    rb_await_resolve(w, nres);
}

static void on_stats(void *ud, const char *err, const rb_stats *st)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        lua_createtable(T, 0, 8);
        lua_pushinteger(T, st->pending);    lua_setfield(T, -2, "pending");
        lua_pushinteger(T, st->processing); lua_setfield(T, -2, "processing");
        lua_pushinteger(T, st->completed);  lua_setfield(T, -2, "completed");
        lua_pushinteger(T, st->buried);     lua_setfield(T, -2, "buried");
        lua_pushinteger(T, st->cancelled);  lua_setfield(T, -2, "cancelled");
        lua_pushinteger(T, st->due);        lua_setfield(T, -2, "due");
        lua_pushnumber(T, st->oldest_due_age); lua_setfield(T, -2, "oldest_due_age");
        lua_pushinteger(T, st->stalled);    lua_setfield(T, -2, "stalled");
        if (st->completed_estimated) {
            lua_pushboolean(T, 1);
            lua_setfield(T, -2, "completed_estimated");
        }
        nres = 1;
    }
    rb_await_resolve(w, nres);
}

/* store:_topic_stats(): {{topic =, pending =, processing =, completed =, buried =,
 * cancelled =}, ...}
 * (internal: for `relaybus stats --topics`). */
static void on_topic_stats(void *ud, const char *err, rb_rowset *rs)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        lua_createtable(T, rs ? (int)rs->nrows : 0, 0);
        for (size_t i = 0; rs && rs->ncols >= 1 + RB_STATUS_COUNT && i < rs->nrows; i++) {
            const rb_value *v = &rs->vals[i * (size_t)rs->ncols];
            lua_createtable(T, 0, 1 + RB_STATUS_COUNT);
            if (v[0].type == RB_VTEXT) lua_pushlstring(T, v[0].s, v[0].len);
            else lua_pushliteral(T, "");
            lua_setfield(T, -2, "topic");
            for (int c = 1; c <= RB_STATUS_COUNT; c++) {
                if (v[c].type == RB_VNULL) continue;    /* not counted per topic: absent */
                lua_pushinteger(T, v[c].type == RB_VINT ? v[c].i : v[c].type == RB_VFLOAT
                                       ? (lua_Integer)v[c].f : 0);
                lua_setfield(T, -2, rb_status_name((rb_status)(c - 1)));
            }
            lua_rawseti(T, -2, (lua_Integer)i + 1);
        }
        nres = 1;
    }
    rb_rowset_free(rs);
    rb_await_resolve(w, nres);
}

static void on_done(void *ud, const char *err)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        lua_pushboolean(T, 1);
        nres = 1;
    }
    rb_await_resolve(w, nres);
}

/* ---- building enqueue items ----------------------------------------------------------------- */
static const char *const enqueue_opts[] = {"delay", "run_at", "max_attempts", "key", "group",
                                           "replace", "after", NULL};

/* opts.after (on the stack at -1): a list of delivery ids (strings, or integers) into
 * it->after; the array is a userdata left on the stack, whose user value keeps the texts of
 * the integers. */
static void read_after(lua_State *L, rb_enqueue_item *it, const char *what)
{
    if (lua_isnil(L, -1)) return;
    if (!lua_istable(L, -1)) rb_misuse(L, "%s: after must be a list of delivery ids", what);
    int list = lua_gettop(L);
    size_t n = lua_rawlen(L, list);
    if (n > RB_AFTER_MAX) rb_misuse(L, "%s: after names more than %d deliveries", what, RB_AFTER_MAX);
    const char **ids = lua_newuserdatauv(L, (n ? n : 1) * sizeof *ids, 1);
    lua_createtable(L, 0, 0);           /* the texts of integer ids */
    lua_setiuservalue(L, -2, 1);
    for (size_t i = 0; i < n; i++) {
        int type = lua_rawgeti(L, list, (lua_Integer)i + 1);
        if (type == LUA_TNUMBER && lua_isinteger(L, -1)) {
            lua_getiuservalue(L, list + 1, 1);
            lua_pushfstring(L, "%I", (LUAI_UACINT)lua_tointeger(L, -2));
            lua_rawseti(L, -2, (lua_Integer)i + 1);
            lua_rawgeti(L, -1, (lua_Integer)i + 1);
            ids[i] = lua_tostring(L, -1);           /* kept by the user value's table */
            lua_pop(L, 3);
            continue;
        }
        if (type != LUA_TSTRING || strlen(lua_tostring(L, -1)) != lua_rawlen(L, -1) ||
            lua_rawlen(L, -1) == 0)
            rb_misuse(L, "%s: after must be a list of delivery ids (item %d is not one)", what,
                      (int)i + 1);
        ids[i] = lua_tostring(L, -1);               /* kept by the list */
        lua_pop(L, 1);
    }
    size_t keys = 0;            /* every key one of 1..n: {x = 1} or {[2] = id} is no list */
    lua_pushnil(L);
    while (lua_next(L, list)) {
        lua_pop(L, 1);
        keys++;
    }
    if (keys != n) rb_misuse(L, "%s: after must be a list of delivery ids (a sequence)", what);
    it->after = n ? ids : NULL;
    it->nafter = n;
}

/* A Lua string payload is stored as a JSON string (docs/lua.md, enqueue); one that looks like
 * JSON text was most likely meant as that, so say once per process where the way is. */
static void warn_string_payload(lua_State *L, int pi)
{
    static _Atomic int warned;   /* once per process */
    if (warned || lua_type(L, pi) != LUA_TSTRING) return;
    const char *s = lua_tostring(L, pi);
    s += strspn(s, " \t\r\n");
    if (*s != '{' && *s != '[') return;
    warned = 1;
    rb_log(RB_LOG_WARN, "payload is a Lua string that looks like JSON text; it is stored as a "
                        "JSON string (use store:enqueue_json to enqueue JSON text)");
}

/* Reads topic (at ti), payload (at pi) and opts (at oi) into *it; the JSON text is pushed on
 * L's stack, which keeps it alive for the duration of the call. With is_text the payload is
 * JSON text already (enqueue_json): it must parse, and is stored as it is. */
static void read_item(lua_State *L, int ti, int pi, int oi, rb_enqueue_item *it, const char *what,
                      int is_text)
{
    memset(it, 0, sizeof *it);
    it->topic = rb_check_topic(L, ti, what);
    if (is_text) {
        char why[400];
        size_t len;
        if (lua_type(L, pi) != LUA_TSTRING) rb_misuse(L, "%s: the payload must be JSON text (a string)", what);
        const char *text = lua_tolstring(L, pi, &len);
        if (!rb_json_check(text, len, why, sizeof why)) rb_misuse(L, "%s: the payload is %s", what, why);
        lua_pushvalue(L, pi);
    } else {
        warn_string_payload(L, pi);
        if (!rb_json_encode(L, pi))
            rb_misuse(L, "%s: payload is not JSON-encodable (%s)", what, lua_tostring(L, -1));
    }
    it->payload = lua_tostring(L, -1);
    it->max_attempts = 25;
    if (!lua_isnoneornil(L, oi)) {
        rb_check_options(L, oi, what, enqueue_opts);
        it->delay = rb_opt_number(L, oi, "delay", 0);
        it->run_at = rb_opt_number(L, oi, "run_at", 0);
        if (!(it->run_at >= 0 && it->run_at <= RB_MAX_EPOCH))
            rb_misuse(L, "%s: run_at must be epoch seconds from 0 to the year 9999", what);
        double ma = rb_opt_number(L, oi, "max_attempts", 25);
        if (!(ma >= 1) || ma != floor(ma) || ma > 1e9)
            rb_misuse(L, "%s: max_attempts must be a positive integer", what);
        it->max_attempts = (int)ma;
        if (!rb_valid_seconds(it->delay))
            rb_misuse(L, "%s: delay must be a number of seconds from 0 to 100 years", what);
        lua_getfield(L, oi, "key");
        if (!lua_isnil(L, -1) && lua_type(L, -1) != LUA_TSTRING && lua_type(L, -1) != LUA_TNUMBER)
            rb_misuse(L, "%s: key must be a string", what);
        it->key = lua_isnil(L, -1) ? NULL : lua_tostring(L, -1);
        if (it->key && strlen(it->key) != lua_rawlen(L, -1))
            rb_misuse(L, "%s: key must not contain a NUL byte", what);
        lua_getfield(L, oi, "group");
        if (!lua_isnil(L, -1) && lua_type(L, -1) != LUA_TSTRING && lua_type(L, -1) != LUA_TNUMBER)
            rb_misuse(L, "%s: group must be a string", what);
        it->group = lua_isnil(L, -1) ? NULL : lua_tostring(L, -1);
        if (it->group && !rb_group_valid(it->group, lua_rawlen(L, -1)))
            rb_misuse(L, "%s: group must be 1 to %d bytes of UTF-8 without a NUL byte", what,
                      RB_GROUP_MAX);
        lua_getfield(L, oi, "replace");
        if (!lua_isnil(L, -1) && !lua_isboolean(L, -1))
            rb_misuse(L, "%s: replace must be a boolean", what);
        it->replace = lua_toboolean(L, -1);
        if (it->replace && !it->key) rb_misuse(L, "%s: replace needs a key", what);
        lua_getfield(L, oi, "after");
        read_after(L, it, what);
        if (it->nafter && it->group) rb_misuse(L, "%s: after does not go with group yet", what);
        if (it->nafter && it->replace) rb_misuse(L, "%s: after does not go with replace", what);
        /* the key, group and payload strings stay on the stack until the call ends */
    }
}

static int do_enqueue(lua_State *L, rb_store *s, rb_tx *tx, int is_text)
{
    rb_enqueue_item it;
    lua_settop(L, 4);   /* opts at 4 even when absent: read_item pushes above it */
    read_item(L, 2, 3, 4, &it, is_text ? "enqueue_json" : "enqueue", is_text);
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    rb_ids_cb cb = it.replace ? on_one_id_made : on_one_id;
    if (tx) s->vt->tx_enqueue(tx, &it, 1, cb, w);
    else s->vt->enqueue(s, &it, 1, cb, w);
    return rb_await_finish(L, w);
}

/* The number of items of the list at idx, which must be a sequence: its positive numeric keys
 * are 1..n (other keys, as table.pack's n, are not items). A list with a hole would lose the
 * items past it unseen, since # may stop at any border: misuse, naming the first hole. */
static size_t sequence_length(lua_State *L, int idx)
{
    size_t count = 0;
    lua_Integer most = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TNUMBER) continue;
        lua_Number k = lua_tonumber(L, -1);
        if (!(k > 0)) continue;
        if (!lua_isinteger(L, -1)) {
            lua_pop(L, 1);
            rb_misuse(L, "enqueue_many: the list is not a sequence: key %s is no item index",
                      lua_pushfstring(L, "%f", k));
        }
        count++;
        if (lua_tointeger(L, -1) > most) most = lua_tointeger(L, -1);
    }
    if ((lua_Integer)count != most) {
        lua_Integer hole = 1;
        while (lua_rawgeti(L, idx, hole) != LUA_TNIL) {
            lua_pop(L, 1);
            hole++;
        }
        rb_misuse(L, "enqueue_many: the list is not a sequence: it has no item %lld but has later "
                     "ones (a nil in the list?)", (long long)hole);
    }
    return count;
}

static int do_enqueue_many(lua_State *L, rb_store *s, rb_tx *tx)
{
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_settop(L, 2);
    size_t n = sequence_length(L, 2);
    if (n == 0) {
        lua_newtable(L);
        return 1;
    }
    rb_enqueue_item *items = lua_newuserdatauv(L, n * sizeof *items, 0);  /* freed by GC */
    /* The strings the items point at (a payload's JSON text, a key given as a number) live in
     * this table until the call ends: on the stack, a long list would overflow it. */
    lua_createtable(L, (int)(n < 1000000 ? n : 1000000), 0);
    int anchor = lua_gettop(L);
    lua_Integer kept = 0;
    for (size_t i = 0; i < n; i++) {
        char what[48];
        snprintf(what, sizeof what, "enqueue_many: item %zu", i + 1);
        lua_rawgeti(L, 2, (lua_Integer)i + 1);
        if (!lua_istable(L, -1)) rb_misuse(L, "%s: must be a table {topic, payload [, opts]}", what);
        int e = lua_gettop(L);
        lua_rawgeti(L, e, 1);
        lua_rawgeti(L, e, 2);
        lua_rawgeti(L, e, 3);
        read_item(L, e + 1, e + 2, e + 3, &items[i], what, 0);
        while (lua_gettop(L) > e) lua_rawseti(L, anchor, ++kept);
        lua_pop(L, 1);
    }
    luaL_checkstack(L, 4, NULL);
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    int any_replace = 0;
    for (size_t i = 0; i < n; i++) any_replace |= items[i].replace;
    rb_ids_cb cb = any_replace ? on_ids_made : on_ids;
    if (tx) s->vt->tx_enqueue(tx, items, n, cb, w);
    else s->vt->enqueue(s, items, n, cb, w);
    return rb_await_finish(L, w);
}

/* ---- store methods ------------------------------------------------------------------------- */
static int l_store_enqueue(lua_State *L)
{
    return do_enqueue(L, check_lua_store(L, 1)->s, NULL, 0);
}

/* store:enqueue_json(topic, text [, opts]): the payload as JSON text, kept as given */
static int l_store_enqueue_json(lua_State *L)
{
    return do_enqueue(L, check_lua_store(L, 1)->s, NULL, 1);
}

static int l_store_enqueue_many(lua_State *L)
{
    return do_enqueue_many(L, check_lua_store(L, 1)->s, NULL);
}

static int l_store_get(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    const char *id = luaL_checkstring(L, 2);
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->get(s, id, on_records_one, w);
    return rb_await_finish(L, w);
}

static const char *const list_opts[] = {"status", "topic", "limit", "key", "topic_prefix",
                                        "error_text", NULL};

/* A list filter field: absent (NULL), or a string without NUL; anything else is misuse. */
static const char *list_text(lua_State *L, const char *field)
{
    lua_getfield(L, 2, field);
    if (lua_isnil(L, -1)) return NULL;
    size_t n = 0;
    const char *v = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &n) : NULL;
    if (!v) rb_misuse(L, "list: %s must be a string", field);
    if (strlen(v) != n) rb_misuse(L, "list: %s must not contain a NUL byte", field);
    if (n > RB_SEARCH_MAX) rb_misuse(L, "list: %s must be at most %d bytes", field, RB_SEARCH_MAX);
    return v;
}

static int l_store_list(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    rb_check_options(L, 2, "list", list_opts);
    rb_list_req req = {.limit = 100};
    if (lua_istable(L, 2)) {
        lua_getfield(L, 2, "status");
        if (!lua_isnil(L, -1) && lua_type(L, -1) != LUA_TSTRING)
            rb_misuse(L, "list: status must be a string");
        req.status = lua_tostring(L, -1);
        if (req.status && rb_status_parse(req.status) < 0)
            rb_misuse(L, "list: unknown status '%s'", req.status);
        req.topic = list_text(L, "topic");
        req.key = list_text(L, "key");
        req.topic_prefix = list_text(L, "topic_prefix");
        req.error_text = list_text(L, "error_text");
        double lim = rb_opt_number(L, 2, "limit", 100);
        if (!(lim >= 1 && lim <= RB_LIST_MAX) || lim != floor(lim))
            rb_misuse(L, "list: limit must be an integer from 1 to %d", RB_LIST_MAX);
        req.limit = (size_t)lim;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->list(s, &req, on_records_list, w);
    return rb_await_finish(L, w);
}

/* Awaits a store operation that answers rows (op NULL: the store has none; `missing` says so). */
static int await_rows(lua_State *L, rb_store *s, void (*op)(rb_store *, rb_rows_cb, void *),
                      rb_rows_cb on_rows, const char *missing)
{
    if (!op) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: %s", s->vt->name, missing);
        return 2;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    op(s, on_rows, w);
    return rb_await_finish(L, w);
}

static int l_store_topic_stats(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    return await_rows(L, s, s->vt->topic_stats, on_topic_stats,
                      "counts per topic are not supported here");
}

static int l_store_stats(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->stats(s, on_stats, w);
    return rb_await_finish(L, w);
}

static const char *const kick_opts[] = {"status", "topic", NULL};

/* store:kick(id), store:kick{status = "buried" [, topic = T]}: how many went back to pending. */
static int l_store_kick(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    rb_kick_mode mode;
    const char *id = NULL, *topic = NULL;
    if (lua_istable(L, 2)) {
        rb_check_options(L, 2, "kick", kick_opts);
        lua_getfield(L, 2, "status");
        const char *st = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (!st || strcmp(st, "buried") != 0)
            rb_misuse(L, "kick: only {status=\"buried\"} is supported, with or without topic");
        lua_getfield(L, 2, "topic");
        if (!lua_isnil(L, -1)) topic = rb_check_topic(L, lua_gettop(L), "kick");
        mode = RB_KICK_BURIED;
    } else {
        id = luaL_checkstring(L, 2);
        mode = RB_KICK_ONE;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->kick(s, mode, id, topic, on_count, w);
    return rb_await_finish(L, w);
}

static void on_changed(void *ud, const char *err, int64_t count)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        lua_pushboolean(T, count > 0);
        nres = 1;
    }
    rb_await_resolve(w, nres);
}

/* store:cancel(id): true when the delivery was pending or processing and is cancelled now,
 * false when there was nothing to cancel (settled, unknown, or no id of this store). */
static const char *const cancel_opts[] = {"status", "topic", "all", NULL};

/* store:cancel{[status = "pending" | "processing"] [, topic = T]}, or {all = true}: every
 * live delivery of them cancelled; how many. An empty table is misuse: a typo must not
 * cancel everything. */
static int cancel_all(lua_State *L, rb_store *s)
{
    rb_check_options(L, 2, "cancel", cancel_opts);
    lua_getfield(L, 2, "all");
    if (!lua_isnil(L, -1) && !lua_isboolean(L, -1)) rb_misuse(L, "cancel: all must be a boolean");
    int all = lua_toboolean(L, -1);
    lua_getfield(L, 2, "status");
    lua_getfield(L, 2, "topic");
    if (!all && lua_isnil(L, -1) && lua_isnil(L, -2))
        rb_misuse(L, "cancel: give topic and/or status, or all = true to cancel every live delivery");
    if (all && (!lua_isnil(L, -1) || !lua_isnil(L, -2)))
        rb_misuse(L, "cancel: all = true takes no topic or status");
    lua_pop(L, 3);
    lua_getfield(L, 2, "status");
    const char *status = lua_isnil(L, -1) ? NULL : lua_tostring(L, -1);
    if (!lua_isnil(L, -1) && (lua_type(L, -1) != LUA_TSTRING || !rb_live_status(status)))
        rb_misuse(L, "cancel: status must be \"pending\" or \"processing\" (or left out: both)");
    lua_getfield(L, 2, "topic");
    const char *topic = lua_isnil(L, -1) ? NULL : rb_check_topic(L, lua_gettop(L), "cancel");
    if (!s->vt->cancel_all) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: cancel of many is not supported here", s->vt->name);
        return 2;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->cancel_all(s, status, topic, "cancelled", on_count, w);
    return rb_await_finish(L, w);
}

static int l_store_cancel(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    if (lua_istable(L, 2)) return cancel_all(L, s);
    if (lua_type(L, 2) != LUA_TSTRING && lua_type(L, 2) != LUA_TNUMBER)
        return rb_misuse(L, "cancel: expected a delivery id (a string or a number), or {status =, topic =}");
    if (lua_type(L, 2) == LUA_TNUMBER) {
        /* 1.0 names delivery 1, as 1 does (its text would be "1.0", no id) */
        int whole;
        lua_Integer v = lua_tointegerx(L, 2, &whole);
        if (!whole) return rb_misuse(L, "cancel: a delivery id given as a number must be a whole number");
        lua_pushfstring(L, "%I", (LUAI_UACINT)v);
        lua_replace(L, 2);
    }
    size_t n;
    const char *id = lua_tolstring(L, 2, &n);
    if (strlen(id) != n) {      /* no id holds a NUL */
        lua_pushboolean(L, 0);
        return 1;
    }
    if (!s->vt->cancel) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: cancel is not supported here", s->vt->name);
        return 2;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->cancel(s, id, "cancelled", on_changed, w);
    return rb_await_finish(L, w);
}

/* store:pause(topic) / store:resume(topic): true when that changed the topic's state, false
 * when it already was so. */
static int pause_or_resume(lua_State *L, int paused)
{
    const char *what = paused ? "pause" : "resume";
    rb_store *s = check_lua_store(L, 1)->s;
    const char *topic = rb_check_topic(L, 2, what);
    if (!s->vt->pause) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: %s is not supported here", s->vt->name, what);
        return 2;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->pause(s, topic, paused, on_changed, w);
    return rb_await_finish(L, w);
}

static int l_store_pause(lua_State *L) { return pause_or_resume(L, 1); }
static int l_store_resume(lua_State *L) { return pause_or_resume(L, 0); }

/* store:limit(topic, {rate = N, per = S, concurrency = M}) sets a topic's limits,
 * store:limit(topic, nil) clears them: true, or nil, err. */
static const char *const limit_opts[] = {"rate", "per", "concurrency", NULL};

/* true, or nil, err: a limit's count says nothing (set or cleared, it holds now) */
static void on_done_true(void *ud, const char *err, int64_t count)
{
    (void)count;
    on_changed(ud, err, 1);
}

/* An integer option of limit, 0 when absent. */
static int64_t limit_count(lua_State *L, int idx, const char *name)
{
    int type = lua_getfield(L, idx, name);
    double v = lua_tonumber(L, -1);
    lua_pop(L, 1);
    if (type == LUA_TNIL) return 0;
    if (type != LUA_TNUMBER || !(v >= 1) || v != floor(v) || v > RB_LIMIT_MAX)
        rb_misuse(L, "limit: %s must be a whole number from 1 to %d", name, RB_LIMIT_MAX);
    return (int64_t)v;
}

static int l_store_limit(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    const char *topic = rb_check_topic(L, 2, "limit");
    rb_limit lim = {0};
    if (lua_isnone(L, 3))
        rb_misuse(L, "limit: give the limits {rate =, per =, concurrency =}, or nil to clear them");
    int clear = lua_isnil(L, 3);
    if (!clear) {
        if (!lua_istable(L, 3))
            rb_misuse(L, "limit: the limits must be a table {rate =, per =, concurrency =} (nil clears them)");
        rb_check_options(L, 3, "limit", limit_opts);
        lim.rate = limit_count(L, 3, "rate");
        lim.concurrency = limit_count(L, 3, "concurrency");
        int per_type = lua_getfield(L, 3, "per");
        lim.per = lua_tonumber(L, -1);
        lua_pop(L, 1);
        if (per_type != LUA_TNIL && per_type != LUA_TNUMBER)
            rb_misuse(L, "limit: per must be a number of seconds");
        if (lim.rate && per_type == LUA_TNIL) rb_misuse(L, "limit: rate and per go together");
        if (lim.rate && !(lim.per >= RB_LIMIT_PER_MIN && rb_valid_seconds(lim.per)))
            rb_misuse(L, "limit: per must be a number of seconds from 0.001 to 100 years");
        if (!lim.rate && per_type != LUA_TNIL) rb_misuse(L, "limit: per goes with rate");
        if (!lim.rate && !lim.concurrency)
            rb_misuse(L, "limit: give rate and per, or concurrency, or both (nil clears the limits)");
    }
    if (!s->vt->limit) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: limits are not supported on this store yet", s->vt->name);
        return 2;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->limit(s, topic, clear ? NULL : &lim, on_done_true, w);
    return rb_await_finish(L, w);
}

/* A list of rows of the store's topic tables (text topic first): push_row pushes one value
 * for a row; rows of fewer than min_cols columns, or without a text topic, are left out. */
static void resolve_topic_rows(void *ud, const char *err, rb_rowset *rs, int min_cols,
                               void (*push_row)(lua_State *T, const rb_value *v))
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        lua_createtable(T, rs ? (int)rs->nrows : 0, 0);
        for (size_t i = 0, k = 0; rs && rs->ncols >= min_cols && i < rs->nrows; i++) {
            const rb_value *v = &rs->vals[i * (size_t)rs->ncols];
            if (v[0].type != RB_VTEXT) continue;
            push_row(T, v);
            lua_rawseti(T, -2, (lua_Integer)++k);
        }
        nres = 1;
    }
    rb_rowset_free(rs);
    rb_await_resolve(w, nres);
}

/* store:limits(): {{topic =, rate =, per =, concurrency =}, ...} (absent: off) */
static void push_limit(lua_State *T, const rb_value *v)
{
    static const char *const names[] = {NULL, "rate", "per", "concurrency"};
    lua_createtable(T, 0, 4);
    lua_pushlstring(T, v[0].s, v[0].len);
    lua_setfield(T, -2, "topic");
    for (int c = 1; c < 4; c++) {
        if (v[c].type == RB_VINT) lua_pushinteger(T, v[c].i);
        else if (v[c].type == RB_VFLOAT && c != 2) lua_pushinteger(T, (lua_Integer)v[c].f);
        else if (v[c].type == RB_VFLOAT) lua_pushnumber(T, v[c].f);
        else continue;
        lua_setfield(T, -2, names[c]);
    }
}

static void on_limits(void *ud, const char *err, rb_rowset *rs)
{
    resolve_topic_rows(ud, err, rs, 4, push_limit);
}

static int l_store_limits(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    if (!s->vt->limits) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: limits are not supported on this store yet", s->vt->name);
        return 2;
    }
    return await_rows(L, s, s->vt->limits, on_limits, "limits are not supported here");
}

/* ---- schedules ------------------------------------------------------------------------------- */
static const char *const schedule_opts[] = {"cron", "every", "timezone", "topic", "payload",
                                            "payload_json", NULL};

/* true, and whether the schedule was made (false: one of that name was replaced) */
static void on_made(void *ud, const char *err, int64_t count)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        lua_pushboolean(T, 1);
        lua_pushboolean(T, count > 0);
        nres = 2;
    }
    rb_await_resolve(w, nres);
}

/* A schedule's name at idx (rb_schedule_name_valid). */
static const char *check_schedule_name(lua_State *L, int idx, const char *what)
{
    if (lua_type(L, idx) != LUA_TSTRING || !rb_schedule_name_valid(lua_tostring(L, idx), lua_rawlen(L, idx)))
        rb_misuse(L, "%s: the name must be 1 to %d bytes of UTF-8 without a NUL byte", what,
                  RB_SCHEDULE_NAME_MAX);
    return lua_tostring(L, idx);
}

/* An optional string field of the table at idx: NULL when absent. */
static const char *opt_text_field(lua_State *L, int idx, const char *field, const char *what)
{
    int type = lua_getfield(L, idx, field);
    if (type == LUA_TNIL) { lua_pop(L, 1); return NULL; }
    if (type != LUA_TSTRING || strlen(lua_tostring(L, -1)) != lua_rawlen(L, -1))
        rb_misuse(L, "%s: %s must be a string without a NUL byte", what, field);
    return lua_tostring(L, -1);     /* left on the stack, which keeps it */
}

/* store:schedule(name, {cron = SPEC | every = S, topic = T [, payload = P | payload_json = TEXT]
 * [, timezone = TZ]}): true, made (false when one of that name was replaced), or nil, err. */
static int l_store_schedule(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    lua_settop(L, 3);
    rb_schedule sch = {0};
    sch.name = check_schedule_name(L, 2, "schedule");
    if (!lua_istable(L, 3))
        rb_misuse(L, "schedule: the definition must be a table {cron = SPEC or every = S, topic = T, payload = P}");
    rb_check_options(L, 3, "schedule", schedule_opts);
    lua_getfield(L, 3, "topic");
    sch.topic = rb_check_topic(L, lua_gettop(L), "schedule");
    sch.cron = opt_text_field(L, 3, "cron", "schedule");
    sch.timezone = opt_text_field(L, 3, "timezone", "schedule");
    int every_type = lua_getfield(L, 3, "every");
    if (every_type != LUA_TNIL && every_type != LUA_TNUMBER)
        rb_misuse(L, "schedule: every must be a number of seconds");
    sch.every = lua_tonumber(L, -1);
    /* (0 and -0 given are out of range, not "left out": rb_schedule_next reads 0 as absent) */
    if (every_type == LUA_TNUMBER && !(sch.every > 0))
        rb_misuse(L, "schedule: every must be a number of seconds from 1 to 100 years");
    if (!sch.cron && every_type == LUA_TNIL) rb_misuse(L, "schedule: give cron or every");
    if (sch.cron && every_type != LUA_TNIL) rb_misuse(L, "schedule: give cron or every, not both");
    /* payload_json: JSON text, stored as given (as enqueue_json's) */
    const char *text = opt_text_field(L, 3, "payload_json", "schedule");
    int payload_type = lua_getfield(L, 3, "payload");
    if (text) {
        char why[400];
        if (payload_type != LUA_TNIL) rb_misuse(L, "schedule: give payload or payload_json, not both");
        if (!rb_json_check(text, strlen(text), why, sizeof why))
            rb_misuse(L, "schedule: payload_json is %s", why);
        sch.payload = text;
    } else {
        if (!rb_json_encode(L, lua_gettop(L)))
            rb_misuse(L, "schedule: payload is not JSON-encodable (%s)", lua_tostring(L, -1));
        sch.payload = lua_tostring(L, -1);
    }
    char err[400];
    double now = rb_wall_time();
    if (rb_schedule_next(sch.cron, sch.every, sch.timezone, now, now, &sch.next_at, err,
                         sizeof err) != 0)
        rb_misuse(L, "schedule: %s", err);
    if (!s->vt->schedule) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: schedules are not supported on this store yet", s->vt->name);
        return 2;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->schedule(s, &sch, on_made, w);
    return rb_await_finish(L, w);
}

/* store:unschedule(name): true when it was removed, false when there was none. */
static int l_store_unschedule(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    const char *name = check_schedule_name(L, 2, "unschedule");
    if (!s->vt->unschedule) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: schedules are not supported on this store yet", s->vt->name);
        return 2;
    }
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->unschedule(s, name, on_changed, w);
    return rb_await_finish(L, w);
}

/* store:schedules(): {{name =, topic =, payload =, cron = | every =, timezone =, next_at =,
 * fired_at =}, ...} by name (absent fields: not set) */
static void push_schedule(lua_State *T, const rb_value *v)
{
    static const char *const names[] = {"name", "topic", NULL, "cron", "every", "timezone",
                                        "next_at", "fired_at"};
    lua_createtable(T, 0, 8);
    for (int c = 0; c < 8; c++) {
        if (c == 2) {
            if (v[c].type == RB_VTEXT && rb_json_decode(T, v[c].s, v[c].len)) lua_setfield(T, -2, "payload");
            else if (v[c].type == RB_VTEXT) lua_pop(T, 1);
            continue;
        }
        if (v[c].type == RB_VTEXT) lua_pushlstring(T, v[c].s, v[c].len);
        else if (v[c].type == RB_VFLOAT) lua_pushnumber(T, v[c].f);
        else if (v[c].type == RB_VINT) lua_pushnumber(T, (lua_Number)v[c].i);
        else continue;
        lua_setfield(T, -2, names[c]);
    }
}

static void on_schedules(void *ud, const char *err, rb_rowset *rs)
{
    resolve_topic_rows(ud, err, rs, 8, push_schedule);
}

static int l_store_schedules(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    return await_rows(L, s, s->vt->schedules, on_schedules, "schedules are not supported on this store yet");
}

static void push_topic(lua_State *T, const rb_value *v) { lua_pushlstring(T, v[0].s, v[0].len); }

static void on_paused(void *ud, const char *err, rb_rowset *rs)
{
    resolve_topic_rows(ud, err, rs, 1, push_topic);
}

/* store:paused(): the paused topics' names, sorted. */
static int l_store_paused(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    return await_rows(L, s, s->vt->paused, on_paused, "pause is not supported here");
}

static const char *const purge_opts[] = {"status", "older_than", "limit", "topic", NULL};

static int l_store_purge(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    luaL_checktype(L, 2, LUA_TTABLE);
    rb_check_options(L, 2, "purge", purge_opts);
    lua_getfield(L, 2, "status");
    const char *st = lua_tostring(L, -1);
    if (!rb_settled_status(st))
        rb_misuse(L, "purge: status must be \"completed\", \"buried\" or \"cancelled\"");
    double older = rb_opt_number(L, 2, "older_than", 0);
    double limit = rb_opt_number(L, 2, "limit", 0);
    if (!rb_valid_seconds(older))
        rb_misuse(L, "purge: older_than must be a number of seconds from 0 to 100 years");
    if (!(limit >= 0 && limit <= 1e9) || limit != floor(limit))
        rb_misuse(L, "purge: limit must be an integer from 0 (no limit) to 1e9");
    lua_getfield(L, 2, "topic");
    const char *topic = lua_isnil(L, -1) ? NULL : rb_check_topic(L, lua_gettop(L), "purge");
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    s->vt->purge(s, st, topic, older, (size_t)limit, on_count, w);
    return rb_await_finish(L, w);
}

typedef struct begin_wait {
    rb_await *w;
    rb_store *s;
    lua_store *st;
    int store_ref;          /* the store userdata: the tx object keeps it alive */
} begin_wait;

/* The tx object is made here, in the callback: a waiting coroutine resumes straight into its
 * caller with these results. */
static void on_begun(void *ud, const char *err, rb_tx *tx)
{
    begin_wait *b = ud;
    rb_store *s = b->s;
    lua_store *st = b->st;
    rb_await *w = b->w;
    int store_ref = b->store_ref;
    free(b);
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (!T) {
        if (tx) s->vt->rollback(tx, NULL, NULL);    /* the waiter was aborted */
    } else if (err) {
        nres = push_err(T, err);
    } else {
        lua_rawgeti(T, LUA_REGISTRYINDEX, store_ref);
        rb_push_tx(T, s, tx, 1, lua_gettop(T));
        lua_remove(T, -2);
        lua_tx *t = lua_touserdata(T, -1);
        t->owner = st;
        st->tx_thread = T;
        st->transactions++;
        nres = 1;
    }
    if (!st->m->closing) luaL_unref(st->m->L, LUA_REGISTRYINDEX, store_ref);
    rb_await_resolve(w, nres);
}

/* store:_begin() -> tx object, or nil, err (the prelude's store:transaction uses it) */
static int l_store_begin(lua_State *L)
{
    lua_store *st = check_lua_store(L, 1);
    rb_store *s = st->s;
    if (!s->vt->begin) return push_err(L, "transactions are not supported by this store");
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    begin_wait *b = rb_malloc(sizeof *b);
    if (!b) {
        free(w);
        return luaL_error(L, "relaybus: out of memory");
    }
    b->w = w;
    b->s = s;
    b->st = st;
    lua_pushvalue(L, 1);
    b->store_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    s->vt->begin(s, on_begun, b);
    return rb_await_finish(L, w);
}

static void close_store(lua_store *st)
{
    st->closed = 1;
    st->close_pending = 0;
    if (!st->s) return;
    st->s->vt->close(st->s);
    st->s = NULL;
}

/* store:close(): refused while a dispatcher runs on the store or a transaction of it is open
 * (they would be left with a freed store under them). After a stop, runs abandoned at its
 * timeout may still be settling: the store is closed to callers at once and closes itself
 * when they are done. Operations in flight end with "store closed". */
static int l_store_close(lua_State *L)
{
    lua_store *st = luaL_checkudata(L, 1, RB_STORE_MT);
    if (st->closed) return 0;
    if (st->running > 0)
        return rb_misuse(L, "close: the store is in use by a running dispatcher (stop it first)");
    if (st->transactions > 0)
        return rb_misuse(L, "close: the store has an open transaction");
    if (st->users > 0) {
        st->closed = 1;
        st->close_pending = 1;
        return 0;
    }
    close_store(st);
    return 0;
}

/* Collected: nothing can use it any more (dispatchers and transactions keep it alive). */
static int l_store_gc(lua_State *L)
{
    lua_store *st = luaL_checkudata(L, 1, RB_STORE_MT);
    if (st->s) close_store(st);
    return 0;
}

static int l_store_tostring(lua_State *L)
{
    lua_store *st = luaL_checkudata(L, 1, RB_STORE_MT);
    if (st->closed) lua_pushliteral(L, "relaybus.store (closed)");
    else lua_pushfstring(L, "relaybus.store (%s: %s)", st->s->vt->name, st->s->table);
    return 1;
}

static int l_store_name(lua_State *L)
{
    rb_store *s = check_lua_store(L, 1)->s;
    lua_pushstring(L, s->vt->name);
    return 1;
}

static const char *const open_opts[] = {"table", "migrate", NULL};

int rb_lua_open_store(lua_State *L)
{
    if (lua_type(L, 1) != LUA_TSTRING) return rb_misuse(L, "open: the store URL must be a string");
    const char *url = lua_tostring(L, 1);
    rb_check_options(L, 2, "open", open_opts);
    rb_store_options o = {NULL, 1};
    if (lua_istable(L, 2)) {
        lua_getfield(L, 2, "table");
        if (!lua_isnil(L, -1) && lua_type(L, -1) != LUA_TSTRING)
            rb_misuse(L, "open: table must be a string");
        o.table = lua_tostring(L, -1);
        lua_getfield(L, 2, "migrate");
        if (!lua_isnil(L, -1) && !lua_isboolean(L, -1)) rb_misuse(L, "open: migrate must be a boolean");
        if (!lua_isnil(L, -1)) o.migrate = lua_toboolean(L, -1);
        lua_pop(L, 1);
    }
    rb_module *m = rb_module_get(L);
    char err[512] = "";
    rb_store *s = rb_store_open(m->loop, url, &o, err, sizeof err);
    if (!s) return push_err(L, err[0] ? err : "cannot open store");
    lua_store *st = lua_newuserdatauv(L, sizeof *st, 0);
    memset(st, 0, sizeof *st);
    st->s = s;
    st->m = m;
    luaL_setmetatable(L, RB_STORE_MT);
    return 1;
}

/* ---- wrapping stores (the specs' fault wrapper, testing/lua_testing.c) -------------------------------------------------- */
/* The closed flag of the store object at idx: nonzero once it is closed. Valid while that
 * object lives (a wrapper made by rb_lua_push_wrapping_store keeps it alive). */
const int *rb_lua_store_closed_flag(lua_State *L, int idx)
{
    return &check_lua_store(L, idx)->closed;
}

/* Pushes a store object for s, a store wrapping the one of the object at inner_idx, which the
 * new object keeps alive. */
void rb_lua_push_wrapping_store(lua_State *L, rb_store *s, int inner_idx)
{
    inner_idx = lua_absindex(L, inner_idx);
    lua_store *st = lua_newuserdatauv(L, sizeof *st, 1);
    memset(st, 0, sizeof *st);
    st->s = s;
    st->m = rb_module_get(L);
    luaL_setmetatable(L, RB_STORE_MT);
    lua_pushvalue(L, inner_idx);
    lua_setiuservalue(L, -2, 1);
}

/* ---- transactions --------------------------------------------------------------------------- */
static lua_tx *check_tx(lua_State *L, int idx)
{
    lua_tx *t = luaL_checkudata(L, idx, RB_TX_MT);
    if (t->closed) rb_misuse(L, "transaction is closed");
    return t;
}

void rb_push_tx(lua_State *L, rb_store *s, rb_tx *tx, int owned, int store_idx)
{
    store_idx = lua_absindex(L, store_idx);
    lua_tx *t = lua_newuserdatauv(L, sizeof *t, 1);
    t->tx = tx;
    t->s = s;
    t->owner = NULL;
    t->closed = 0;
    t->owned = owned;
    luaL_setmetatable(L, RB_TX_MT);
    lua_pushvalue(L, store_idx);
    lua_setiuservalue(L, -2, 1);    /* the store outlives its transactions */
}

void rb_tx_invalidate_object(void *tx_object) { ((lua_tx *)tx_object)->closed = 1; }

static int l_tx_enqueue(lua_State *L)
{
    lua_tx *t = check_tx(L, 1);
    return do_enqueue(L, t->s, t->tx, 0);
}

static int l_tx_enqueue_json(lua_State *L)
{
    lua_tx *t = check_tx(L, 1);
    return do_enqueue(L, t->s, t->tx, 1);
}

static int l_tx_enqueue_many(lua_State *L)
{
    lua_tx *t = check_tx(L, 1);
    return do_enqueue_many(L, t->s, t->tx);
}

static rb_value *read_params(lua_State *L, int first, size_t *n)
{
    int top = lua_gettop(L);
    *n = top >= first ? (size_t)(top - first + 1) : 0;
    if (*n == 0) return NULL;
    rb_value *v = lua_newuserdatauv(L, *n * sizeof *v, 0);
    for (size_t i = 0; i < *n; i++) {
        int idx = first + (int)i;
        memset(&v[i], 0, sizeof v[i]);
        switch (lua_type(L, idx)) {
        case LUA_TNIL: v[i].type = RB_VNULL; break;
        case LUA_TBOOLEAN: v[i].type = RB_VBOOL; v[i].i = lua_toboolean(L, idx); break;
        case LUA_TNUMBER:
            if (lua_isinteger(L, idx)) { v[i].type = RB_VINT; v[i].i = lua_tointeger(L, idx); }
            else { v[i].type = RB_VFLOAT; v[i].f = lua_tonumber(L, idx); }
            break;
        case LUA_TSTRING:
            v[i].type = RB_VTEXT;
            v[i].s = lua_tolstring(L, idx, &v[i].len);
            break;
        default:
            rb_misuse(L, "parameter %d: %s cannot be bound (nil, boolean, number or string)",
                      (int)i + 1, luaL_typename(L, idx));
        }
    }
    return v;
}


static void on_rows(void *ud, const char *err, rb_rowset *rs)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T && rs) {
        lua_createtable(T, (int)rs->nrows, 0);
        for (size_t r = 0; r < rs->nrows; r++) {
            lua_createtable(T, 0, rs->ncols);
            for (int c = 0; c < rs->ncols; c++) {
                const rb_value *v = &rs->vals[r * (size_t)rs->ncols + (size_t)c];
                switch (v->type) {
                case RB_VNULL: continue;
                case RB_VINT: lua_pushinteger(T, v->i); break;
                case RB_VFLOAT: lua_pushnumber(T, v->f); break;
                case RB_VBOOL: lua_pushboolean(T, (int)v->i); break;
                case RB_VTEXT: lua_pushlstring(T, v->s, v->len); break;
                }
                lua_setfield(T, -2, rs->names[c]);
            }
            lua_rawseti(T, -2, (lua_Integer)r + 1);
        }
        nres = 1;
    } else if (T) {
        lua_newtable(T);
        nres = 1;
    }
    rb_rowset_free(rs);
    rb_await_resolve(w, nres);
}

/* tx:exec (answers the count of rows changed) and tx:query (the rows). */
static int tx_sql(lua_State *L, int rows)
{
    lua_tx *t = check_tx(L, 1);
    const char *sql = luaL_checkstring(L, 2);
    if (rows ? !t->s->vt->tx_query : !t->s->vt->tx_exec)
        return rb_misuse(L, "tx:%s is not available on %s (use tx:collection)",
                         rows ? "query" : "exec", t->s->vt->name);
    size_t n;
    rb_value *params = read_params(L, 3, &n);
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    if (rows) t->s->vt->tx_query(t->tx, sql, params, n, on_rows, w);
    else t->s->vt->tx_exec(t->tx, sql, params, n, on_count, w);
    return rb_await_finish(L, w);
}

static int l_tx_exec(lua_State *L) { return tx_sql(L, 0); }
static int l_tx_query(lua_State *L) { return tx_sql(L, 1); }

static void on_doc(void *ud, const char *err, const char *doc_json, int64_t count)
{
    rb_await *w = ud;
    lua_State *T = rb_await_target(w);
    int nres = 0;
    if (T && err) nres = push_err(T, err);
    else if (T) {
        if (doc_json) lua_pushstring(T, doc_json);
        else lua_pushnil(T);
        lua_pushinteger(T, (lua_Integer)count);
        nres = 2;
    }
    rb_await_resolve(w, nres);
}

/* tx:_doc(op, collection, filter_json, doc_json) -> doc_json|nil, count  (prelude wraps it) */
static int l_tx_doc(lua_State *L)
{
    lua_tx *t = check_tx(L, 1);
    static const char *const ops[] = {"insert_one", "update_one", "delete_one", "find_one", NULL};
    int op = luaL_checkoption(L, 2, NULL, ops);
    const char *coll = luaL_checkstring(L, 3);
    const char *filter = luaL_optstring(L, 4, NULL);
    const char *doc = luaL_optstring(L, 5, NULL);
    if (!t->s->vt->tx_doc) return rb_misuse(L, "tx:collection is only available on MongoDB (use tx:exec / tx:query)");
    rb_await *w = rb_await_begin(L);
    if (!w) return 2;
    t->s->vt->tx_doc(t->tx, (rb_doc_op)op, coll, filter, doc, on_doc, w);
    return rb_await_finish(L, w);
}

static int l_tx_end(lua_State *L, int commit)
{
    lua_tx *t = check_tx(L, 1);
    if (!t->owned) return rb_misuse(L, "a handler's transaction commits when the handler returns");
    rb_await *w = rb_await_begin(L);        /* first: it may raise */
    rb_tx *tx = t->tx;
    t->closed = 1;
    if (t->owner) {
        if (t->owner->tx_thread == L) t->owner->tx_thread = NULL;
        RB_ASSERT(t->owner->transactions > 0);
        t->owner->transactions--;
    }
    if (!w) {
        /* aborted before we could commit: roll back, report aborted */
        t->s->vt->rollback(tx, NULL, NULL);
        return 2;
    }
    if (commit) t->s->vt->commit(tx, NULL, on_done, w);
    else t->s->vt->rollback(tx, on_done, w);
    return rb_await_finish(L, w);
}

static int l_tx_commit(lua_State *L) { return l_tx_end(L, 1); }
static int l_tx_rollback(lua_State *L) { return l_tx_end(L, 0); }

static int l_tx_gc(lua_State *L)
{
    lua_tx *t = luaL_checkudata(L, 1, RB_TX_MT);
    /* A store:transaction tx dropped without commit (its coroutine was abandoned). */
    if (!t->closed && t->owned) {
        t->closed = 1;
        if (t->owner) {
            t->owner->tx_thread = NULL;
            RB_ASSERT(t->owner->transactions > 0);
            t->owner->transactions--;
        }
        rb_module *m = rb_module_get(L);
        if (!m->closing) t->s->vt->rollback(t->tx, NULL, NULL);
    }
    return 0;
}

static const luaL_Reg store_methods[] = {
    {"enqueue", l_store_enqueue},
    {"enqueue_json", l_store_enqueue_json},
    {"enqueue_many", l_store_enqueue_many},
    {"get", l_store_get},
    {"list", l_store_list},
    {"stats", l_store_stats},
    {"_topic_stats", l_store_topic_stats},
    {"kick", l_store_kick},
    {"purge", l_store_purge},
    {"pause", l_store_pause},
    {"cancel", l_store_cancel},
    {"resume", l_store_resume},
    {"paused", l_store_paused},
    {"limit", l_store_limit},
    {"limits", l_store_limits},
    {"schedule", l_store_schedule},
    {"unschedule", l_store_unschedule},
    {"schedules", l_store_schedules},
    {"try_acquire", rb_lua_try_acquire},
    {"close", l_store_close},
    {"kind", l_store_name},
    {"_begin", l_store_begin},
    {NULL, NULL}
};

static const luaL_Reg tx_methods[] = {
    {"enqueue", l_tx_enqueue},
    {"enqueue_json", l_tx_enqueue_json},
    {"enqueue_many", l_tx_enqueue_many},
    {"exec", l_tx_exec},
    {"query", l_tx_query},
    {"_doc", l_tx_doc},
    {"_commit", l_tx_commit},
    {"_rollback", l_tx_rollback},
    {NULL, NULL}
};

void rb_lua_store_register(lua_State *L)
{
    rb_register_class(L, RB_STORE_MT, store_methods, NULL, l_store_gc);
    luaL_getmetatable(L, RB_STORE_MT);
    lua_pushcfunction(L, l_store_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);
    rb_register_class(L, RB_TX_MT, tx_methods, NULL, l_tx_gc);
}
