/* update.c -- the MongoDB store's filters and update documents that the operations share:
 * what "due" means, and the $set a delivery gets when it leaves `processing`. */
#include <stdio.h>
#include <string.h>
#include "stores/mongo/mstore.h"

void mg_append_range(bson_t *b, const char *field, const char *op, double v)
{
    bson_t r;
    BSON_APPEND_DOCUMENT_BEGIN(b, field, &r);
    BSON_APPEND_DOUBLE(&r, op, v);
    bson_append_document_end(b, &r);
}

/* Due: pending with run_at <= now, or processing with an expired lease. */
void mg_append_due(bson_t *f, double now)
{
    bson_t or, a, b;
    BSON_APPEND_ARRAY_BEGIN(f, "$or", &or);
    BSON_APPEND_DOCUMENT_BEGIN(&or, "0", &a);
    BSON_APPEND_UTF8(&a, "status", "pending");
    mg_append_range(&a, "run_at", "$lte", now);
    bson_append_document_end(&or, &a);
    BSON_APPEND_DOCUMENT_BEGIN(&or, "1", &b);
    BSON_APPEND_UTF8(&b, "status", "processing");
    mg_append_range(&b, "lease_expires_at", "$lte", now);
    bson_append_document_end(&or, &b);
    bson_append_array_end(f, &or);
}

/* The update that takes a delivery out of `processing` (or buries a due one), leaving its
 * lease's expiry at lease_end (0: none). */
static bson_t *upd_leave(const bson_t *cur, const char *status, double now, double lease_end)
{
    bson_t *u = bson_new(), set;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    BSON_APPEND_UTF8(&set, "status", status);
    BSON_APPEND_NULL(&set, "lease_token");
    BSON_APPEND_DOUBLE(&set, "lease_expires_at", lease_end);
    BSON_APPEND_INT64(&set, "v", mg_doc_int(cur, "v") + 1);
    if (strcmp(status, "completed") == 0 || strcmp(status, "buried") == 0 ||
        strcmp(status, "cancelled") == 0)
        BSON_APPEND_DOUBLE(&set, "settled_at", now);
    bson_append_document_end(u, &set);
    return u;
}

bson_t *mg_upd_leave(const bson_t *cur, const char *status, double now)
{
    return upd_leave(cur, status, now, 0);
}

/* Adds to the update's $set (kept open by the caller via a rebuilt doc) a field. */
bson_t *mg_upd_with(bson_t *u, const char *field, const char *str, double num, int isnum)
{
    /* Rebuild: $set gets the extra field; other operators are copied as they are. */
    bson_t *n = bson_new();
    bson_iter_t it;
    bson_iter_init(&it, u);
    while (bson_iter_next(&it)) {
        if (strcmp(bson_iter_key(&it), "$set") == 0) {
            bson_t set, old;
            uint32_t len;
            const uint8_t *data;
            bson_iter_document(&it, &len, &data);
            bson_init_static(&old, data, len);
            BSON_APPEND_DOCUMENT_BEGIN(n, "$set", &set);
            bson_concat(&set, &old);
            if (isnum) BSON_APPEND_DOUBLE(&set, field, num);
            else if (str) BSON_APPEND_UTF8(&set, field, str);
            else BSON_APPEND_NULL(&set, field);
            bson_append_document_end(n, &set);
        } else {
            bson_append_iter(n, NULL, 0, &it);
        }
    }
    bson_destroy(u);
    return n;
}

/* Adds to the update's $set the field `errors`: the last RB_ERRORS_KEPT - 1 entries of cur's
 * and {attempt, at, error} of this failure, oldest first. cur must be the whole document (not
 * the version cache's few fields). */
static bson_t *upd_with_error(bson_t *u, const bson_t *cur, const char *error, double now)
{
    bson_iter_t it, sub;
    uint32_t have = 0;
    if (bson_iter_init_find(&it, cur, "errors") && BSON_ITER_HOLDS_ARRAY(&it) &&
        bson_iter_recurse(&it, &sub))
        while (bson_iter_next(&sub)) have++;
    uint32_t skip = have >= RB_ERRORS_KEPT ? have - (RB_ERRORS_KEPT - 1) : 0, k = 0, i = 0;
    bson_t *n = bson_new();
    bson_iter_t top;
    bson_iter_init(&top, u);
    while (bson_iter_next(&top)) {
        if (strcmp(bson_iter_key(&top), "$set") != 0) {
            bson_append_iter(n, NULL, 0, &top);
            continue;
        }
        bson_t set, old, arr, e;
        uint32_t len;
        const uint8_t *data;
        bson_iter_document(&top, &len, &data);
        bson_init_static(&old, data, len);
        BSON_APPEND_DOCUMENT_BEGIN(n, "$set", &set);
        bson_concat(&set, &old);
        BSON_APPEND_ARRAY_BEGIN(&set, "errors", &arr);
        if (have && bson_iter_init_find(&it, cur, "errors") && bson_iter_recurse(&it, &sub))
            while (bson_iter_next(&sub))
                if (i++ >= skip) {
                    char key[16];
                    snprintf(key, sizeof key, "%u", k++);
                    bson_append_iter(&arr, key, -1, &sub);
                }
        char key[16];
        snprintf(key, sizeof key, "%u", k);
        BSON_APPEND_DOCUMENT_BEGIN(&arr, key, &e);
        BSON_APPEND_INT64(&e, "attempt", mg_doc_int(cur, "attempts"));
        BSON_APPEND_DOUBLE(&e, "at", now);
        BSON_APPEND_UTF8(&e, "error", error);
        bson_append_document_end(&arr, &e);
        bson_append_array_end(&set, &arr);
        bson_append_document_end(n, &set);
    }
    bson_destroy(u);
    return n;
}

int mg_settle_needs_doc(const rb_settle_op *op)
{
    return (op->kind == RB_OP_RESCHEDULE || op->kind == RB_OP_BURY) && op->error;
}

bson_t *mg_upd_unset_dedupe(bson_t *u)
{
    bson_t un;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$unset", &un);
    BSON_APPEND_UTF8(&un, "dedupe", "");
    bson_append_document_end(u, &un);
    return u;
}

bson_t *mg_upd_bury(const bson_t *cur, const char *error, double now)
{
    bson_t *u = mg_upd_leave(cur, "buried", now);
    if (error) u = mg_upd_with(u, "last_error", error, 0, 0);
    return mg_upd_unset_dedupe(u);
}

/* The operator's bury or cancel (status): a running delivery's lease loses its token (the
 * run's later writes are refused) and keeps its expiry, which a kick makes it due no earlier
 * than (admin.c); so does a pending one that a kick left waiting for it. */
bson_t *mg_upd_end_live(const bson_t *cur, const char *status, const char *error, double now)
{
    bson_t *u = upd_leave(cur, status, now, mg_doc_num(cur, "lease_expires_at"));
    if (error) u = mg_upd_with(u, "last_error", error, 0, 0);
    return mg_upd_unset_dedupe(u);
}

/* An extension never shortens: the later of the current expiry and now + s. */
double mg_extended(const bson_t *cur, const char *field, double now, double s)
{
    double e = mg_doc_num(cur, field);
    return e > now + s ? e : now + s;
}

/* The fence: the delivery is processing under this token. */
int mg_holds_lease(const bson_t *d, const char *token)
{
    const char *st = mg_doc_str(d, "status"), *tk = mg_doc_str(d, "lease_token");
    return d && st && tk && token && strcmp(st, "processing") == 0 && strcmp(tk, token) == 0;
}

/* The change a settle op makes to the delivery cur. */
bson_t *mg_upd_settle(const bson_t *cur, const rb_settle_op *op, double now)
{
    switch (op->kind) {
    case RB_OP_COMPLETE:
        return mg_upd_unset_dedupe(mg_upd_leave(cur, "completed", now));
    case RB_OP_BURY: {
        bson_t *u = mg_upd_bury(cur, op->error, now);
        return op->error ? upd_with_error(u, cur, op->error, now) : u;
    }
    case RB_OP_RESCHEDULE: {
        bson_t *u = mg_upd_with(mg_upd_leave(cur, "pending", now), "run_at", NULL, now + op->delay, 1);
        return op->error ? upd_with_error(mg_upd_with(u, "last_error", op->error, 0, 0), cur,
                                          op->error, now) : u;
    }
    case RB_OP_RELEASE: {
        bson_t *u = mg_upd_with(mg_upd_leave(cur, "pending", now), "run_at", NULL, now + op->delay, 1);
        int64_t a = mg_doc_int(cur, "attempts");
        return mg_upd_with(u, "attempts", NULL, (double)(a > 0 ? a - 1 : 0), 1);
    }
    case RB_OP_EXTEND:
    default: {
        bson_t *u = bson_new(), set;
        BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
        BSON_APPEND_DOUBLE(&set, "lease_expires_at", mg_extended(cur, "lease_expires_at", now, op->delay));
        BSON_APPEND_INT64(&set, "v", mg_doc_int(cur, "v") + 1);
        bson_append_document_end(u, &set);
        return u;
    }
    }
}

/* One round: ops[idx[0..m)] touch distinct deliveries. */
