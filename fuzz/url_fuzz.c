/* url_fuzz.c -- libFuzzer target for store URLs: rb_store_parse_url (the scheme and the SQLite
 * path, found without opening or connecting), rb_redact_url and rb_redact_secrets. Checks: a
 * URL parses to a kind (for SQLite, a path inside the URL that is not empty and not the
 * refused //) or to a one-line error; no password or secret parameter of the URL is left
 * after redaction, neither in the URL nor in a message that quotes it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "stores/store.h"
#include "util/text.h"

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A secret is looked for only where the check means something: long enough for the
 * redaction to promise anything, no '*' (the mask itself), and once in the URL. */
static int checkable(const char *url, const char *secret)
{
    size_t n = strlen(secret);
    if (n < 3 || strchr(secret, '*')) return 0;
    const char *first = strstr(url, secret);
    return first && !strstr(first + 1, secret);
}

static void check_absent(const char *url, const char *secret, const char *text)
{
    if (checkable(url, secret)) CHECK(!strstr(text, secret));
}

static void check_one_line(const char *s)
{
    CHECK(*s);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) CHECK(*p >= 0x20 && *p != 0x7f);
}

/* The secret as a library would quote it, and percent-decoded; both must be taken out of a
 * message that holds them. */
static void check_secret(const char *url, const char *raw, size_t len)
{
    char *secret = malloc(len + 1), *decoded = malloc(len + 1);
    char *msg = malloc(2 * len + 64), *out = malloc(2 * len + 64);
    if (!secret || !decoded || !msg || !out) goto done;
    memcpy(secret, raw, len);
    secret[len] = 0;
    size_t d = 0;
    for (size_t i = 0; i < len; i++) {
        if (raw[i] == '%' && i + 2 < len && hexval(raw[i + 1]) >= 0 && hexval(raw[i + 2]) >= 0) {
            decoded[d++] = (char)(hexval(raw[i + 1]) * 16 + hexval(raw[i + 2]));
            i += 2;
        } else {
            decoded[d++] = raw[i];
        }
    }
    decoded[d] = 0;
    size_t cap = 2 * len + 64;

    char redacted[4096];
    if (strlen(url) * 4 + 4 <= sizeof redacted) {
        rb_redact_url(redacted, sizeof redacted, url);
        check_absent(url, secret, redacted);
    }
    strcpy(msg, "invalid token: \"");
    strcat(msg, secret);
    strcat(msg, "\"");
    rb_redact_secrets(out, cap, msg, url);
    check_absent(url, secret, out);
    if (strlen(decoded) == d) {   /* no NUL decoded */
        strcpy(msg, "bad ");
        strcat(msg, decoded);
        rb_redact_secrets(out, cap, msg, url);
        if (strlen(decoded) >= 3 && !strchr(decoded, '*') && !strstr(url, decoded) &&
            !strstr("bad ", decoded))
            CHECK(!strstr(out, decoded));
    }
done:
    free(secret);
    free(decoded);
    free(msg);
    free(out);
}

static void check_parse(const char *url)
{
    char err[256] = "";
    const char *path = (const char *)1;
    rb_store_kind kind = rb_store_parse_url(url, &path, err, sizeof err);
    if (kind == RB_STORE_SQLITE) {
        CHECK(path == url + 7);
        CHECK(*path && strncmp(path, "//", 2) != 0);
    } else if (kind == RB_STORE_PG || kind == RB_STORE_MONGO) {
        CHECK(path == NULL && strstr(url, "://"));
    } else {
        CHECK(kind == 0 && path == NULL);
        check_one_line(err);
        /* the URL appears redacted in the message */
        const char *scheme_end = strstr(url, "://"), *at = scheme_end ? strrchr(scheme_end, '@') : NULL;
        const char *colon = at ? memchr(scheme_end + 3, ':', (size_t)(at - scheme_end - 3)) : NULL;
        if (colon) {
            char pw[128];
            size_t n = (size_t)(at - colon - 1);
            if (n < sizeof pw) {
                memcpy(pw, colon + 1, n);
                pw[n] = 0;
                /* rb_one_line rewrites control bytes and spaces; the message's own words
                 * and quotes around the URL are not the password */
                static const char fixed[] =
                    "unsupported store URL '' (expected sqlite:PATH, postgresql://... or "
                    "mongodb://...) sqlite: a sqlite:// URL is ambiguous; write sqlite:PATH "
                    "(sqlite: for a path relative to the current directory, sqlite:/ for an "
                    "absolute one) empty store URL";
                int plain = 1;
                for (size_t i = 0; i < n; i++)
                    if ((unsigned char)pw[i] <= 0x20 || pw[i] == 0x7f || pw[i] == '\'' ||
                        pw[i] == '\\')
                        plain = 0;
                if (plain && !strstr(fixed, pw)) check_absent(url, pw, err);
            }
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *url = malloc(size + 1);
    if (!url) return 0;
    memcpy(url, data, size);
    url[size] = 0;
    check_parse(url);
    /* the user-info password: from the first ':' after :// to the last '@' */
    const char *scheme_end = strstr(url, "://");
    if (scheme_end) {
        const char *auth = scheme_end + 3, *at = strrchr(auth, '@');
        const char *colon = at ? memchr(auth, ':', (size_t)(at - auth)) : NULL;
        if (colon) check_secret(url, colon + 1, (size_t)(at - colon - 1));
        /* secret parameters of the query */
        const char *q = strchr(url, '?');
        for (const char *p = q ? q + 1 : NULL; p && *p;) {
            size_t len = strcspn(p, "&#");
            const char *eq = memchr(p, '=', len);
            if (eq && (size_t)(eq - p) == 8 && strncasecmp(p, "password", 8) == 0)
                check_secret(url, eq + 1, len - (size_t)(eq + 1 - p));
            p += len;
            if (*p) p++;
        }
    }
    free(url);
    return 0;
}
