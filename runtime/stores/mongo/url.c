/* url.c -- the MongoDB store's own URL option: dialect=mongodb|ferretdb picks the code path
 * (mstore.h's `ferret`) instead of detecting it from the server. It is taken out before
 * libmongoc reads the URL, which would warn of an option it does not know. */
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"

static int dialect_value(const char *v, size_t n, mg_dialect *dialect)
{
    if (n == 7 && strncasecmp(v, "mongodb", 7) == 0) *dialect = MG_MONGODB;
    else if (n == 8 && strncasecmp(v, "ferretdb", 8) == 0) *dialect = MG_FERRETDB;
    else return 0;
    return 1;
}

int mg_url_take_dialect(const char *url, char **out, mg_dialect *dialect, char *err,
                        size_t errlen)
{
    *dialect = MG_DETECT;
    *out = NULL;
    const char *scheme = strstr(url, "://");
    const char *query = strchr(scheme ? scheme + 3 : url, '?');
    size_t len = strlen(url), head = query ? (size_t)(query - url) : len, n = head;
    char *o = rb_malloc(len + 1);   /* each option kept brings at most its own separator */
    if (!o) {
        snprintf(err, errlen, MG_OOM);
        return 0;
    }
    memcpy(o, url, head);
    for (const char *p = query ? query + 1 : NULL; p && *p;) {
        size_t plen = strcspn(p, "&;");
        if (plen >= 8 && strncasecmp(p, "dialect=", 8) == 0) {
            if (!dialect_value(p + 8, plen - 8, dialect)) {
                snprintf(err, errlen, "mongodb: bad URL: dialect must be mongodb or ferretdb, "
                         "not \"%.*s\"", (int)(plen - 8 > 40 ? 40 : plen - 8), p + 8);
                free(o);
                return 0;
            }
        } else if (plen) {
            char sep = n == head ? '?' : p[-1];
            o[n++] = sep;
            memcpy(o + n, p, plen);
            n += plen;
        }
        p += plen;
        if (*p) p++;
    }
    o[n] = '\0';
    *out = o;
    return 1;
}
