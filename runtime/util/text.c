/* text.c -- one-line messages, UTF-8 cleaning and URL redaction (text.h). */
#include <ctype.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include "util/alloc.h"
#include "util/buf.h"
#include "util/text.h"

char *rb_one_line(char *out, size_t cap, const char *msg)
{
    if (!cap) return out;
    size_t n = 0;
    int space = 0;
    for (const unsigned char *p = (const unsigned char *)(msg ? msg : ""); *p; p++) {
        if (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == '\v' || *p == '\f') {
            space = n > 0;
            continue;
        }
        /* control bytes are written as \xNN, a byte that is no UTF-8 as U+FFFD (as rb_text_clean
         * does): a line is text, for a terminal and a log shipper alike */
        char esc[5];
        const char *from = esc;
        size_t k = *p < 0x80 ? 1 : rb_utf8_seq((const char *)p, strnlen((const char *)p, 4));
        if (*p < 0x20 || *p == 0x7f) k = (size_t)snprintf(esc, sizeof esc, "\\x%02x", *p);
        else if (k == 0) k = (size_t)snprintf(esc, sizeof esc, "\xef\xbf\xbd");
        else if (k == 1) esc[0] = (char)*p;
        else from = (const char *)p;     /* a whole UTF-8 sequence, never cut */
        if (n + space + k + 1 > cap) break;
        if (space) out[n++] = ' ';
        space = 0;
        memcpy(out + n, from, k);
        n += k;
        if (from == (const char *)p) p += k - 1;
    }
    out[n] = 0;
    return out;
}

/* Length of the valid UTF-8 sequence at s (at most left bytes), or 0 when it is not one. */
static size_t utf8_seq(const unsigned char *s, size_t left)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t n;
    uint32_t cp, min;
    if (c >= 0xc2 && c <= 0xdf) { n = 2; cp = c & 0x1f; min = 0x80; }
    else if (c >= 0xe0 && c <= 0xef) { n = 3; cp = c & 0x0f; min = 0x800; }
    else if (c >= 0xf0 && c <= 0xf4) { n = 4; cp = c & 0x07; min = 0x10000; }
    else return 0;
    if (left < n) return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return n;
}

size_t rb_utf8_seq(const char *s, size_t left)
{
    return left ? utf8_seq((const unsigned char *)s, left) : 0;
}

int rb_utf8_valid(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        size_t k = utf8_seq(p + i, len - i);
        if (!k) return 0;
        i += k;
    }
    return 1;
}

char *rb_text_clean(const char *s, size_t len, size_t max)
{
    static const char repl[] = "\xef\xbf\xbd", cut[] = " [truncated]";
    const unsigned char *p = (const unsigned char *)s;
    /* Each input byte becomes at most 3 output bytes. */
    size_t room = len * 3 < max ? len * 3 : max;
    char *out = rb_malloc(room + sizeof cut);
    if (!out) return NULL;
    size_t n = 0, i = 0;
    while (i < len) {
        size_t k = p[i] ? utf8_seq(p + i, len - i) : 0;
        const char *piece = k ? s + i : repl;
        size_t plen = k ? k : 3;
        if (n + plen > room) break;
        memcpy(out + n, piece, plen);
        n += plen;
        i += k ? k : 1;
    }
    if (i < len) {
        memcpy(out + n, cut, sizeof cut);   /* room + sizeof cut was allocated */
        n += sizeof cut - 1;
    }
    out[n] = 0;
    return out;
}

/* What a parameter's value is, by the parameter's name. */
enum { NOT_SECRET, SECRET, SETTINGS };

/* A parameter named like a secret is one; libpq's options ("-c name=value ...") is SETTINGS:
 * any of those settings may be a secret whatever its name, so all of it is. */
static int secret_name(const char *name, size_t len)
{
    /* "key" covers api_key, apikey, access_key...; a redacted harmless value costs nothing */
    static const char *const words[] = {"password", "secret", "token", "passwd", "pwd", "key",
                                        "sig", "credential", "session", NULL};
    if (len == 7 && strncasecmp(name, "options", 7) == 0) return SETTINGS;
    for (const char *const *w = words; *w; w++) {
        size_t wl = strlen(*w);
        for (size_t i = 0; i + wl <= len; i++)
            if (strncasecmp(name + i, *w, wl) == 0) return SECRET;
    }
    return NOT_SECRET;
}

/* Appends s[0..len) to out, never past cap - 1. */
static void put(char *out, size_t cap, size_t *n, const char *s, size_t len)
{
    if (*n + 1 >= cap) return;
    if (len > cap - 1 - *n) len = cap - 1 - *n;
    memcpy(out + *n, s, len);
    *n += len;
    out[*n] = 0;
}

/* The user-info of a URL (scheme://USER:PASSWORD@host...): where its password starts and
 * ends, or 0. The user-info ends at the last '@' of the whole URL, not of the authority: a
 * password with an unescaped '/', '?' or '#' in it (base64 ones often have a '/') must not
 * leak because the URL is malformed, and hiding too much of a URL is harmless. */
static int userinfo_password(const char *url, const char **pw, const char **pw_end)
{
    const char *scheme_end = strstr(url, "://");
    if (!scheme_end) return 0;
    const char *auth = scheme_end + 3;
    const char *at = strrchr(auth, '@');
    if (!at) return 0;
    const char *colon = memchr(auth, ':', (size_t)(at - auth));
    if (!colon) return 0;
    *pw = colon + 1;
    *pw_end = at;
    return 1;
}

#define NAME_SEPS "/?&#;= \t\r\n"

/* The next secret parameter of url at or after *at: a name (after the start or one of
 * NAME_SEPS) named like a secret and followed by '='. Its value runs to '&' or '#' in a URL,
 * to whitespace outside single quotes in a libpq keyword string. Wherever such a pair
 * stands, in the query or not (a URL may be malformed), its value is a secret. Sets
 * [*v, *v_end), *kind (SECRET or SETTINGS) and moves *at past it; 0 when there is none. */
static int next_secret_param(const char *url, const char **at, const char **v,
                             const char **v_end, int *kind)
{
    int keywords = !strstr(url, "://");
    const char *p = *at;
    while (*p) {
        size_t name = strcspn(p, NAME_SEPS);
        if (p[name] != '=' || !(*kind = secret_name(p, name))) {
            p += name;
            if (*p) p++;
            continue;
        }
        const char *q = p + name + 1;
        *v = q;
        if (!keywords) {
            q += strcspn(q, "&#");
        } else if (*q == '\'') {
            for (q++; *q && *q != '\''; q++)
                if (*q == '\\' && q[1]) q++;
            if (*q) q++;
        } else {
            q += strcspn(q, " \t\r\n");
        }
        *v_end = q;
        *at = q;
        return 1;
    }
    *at = p;
    return 0;
}

char *rb_redact_url(char *out, size_t cap, const char *url)
{
    if (!cap) return out;
    out[0] = 0;
    size_t n = 0;
    if (!url) return out;
    /* The hidden spans: the user-info password, and each secret parameter's value. The
     * parameters come in order; the password may come before, between or inside them. */
    const char *pw = NULL, *pw_end = NULL;
    int have_pw = userinfo_password(url, &pw, &pw_end);
    const char *copied = url, *scan = url, *v, *v_end;
    int kind;
    for (;;) {
        int more = next_secret_param(url, &scan, &v, &v_end, &kind);
        if (have_pw && (!more || pw <= v)) {
            if (pw > copied) put(out, cap, &n, copied, (size_t)(pw - copied));
            put(out, cap, &n, "***", 3);
            if (pw_end > copied) copied = pw_end;
            have_pw = 0;
        }
        if (!more) break;
        if (v_end <= copied && v < copied) continue;    /* inside the password */
        if (v > copied) put(out, cap, &n, copied, (size_t)(v - copied));
        put(out, cap, &n, "***", 3);
        if (v_end > copied) copied = v_end;
    }
    put(out, cap, &n, copied, strlen(copied));
    return out;
}

/* ---- secrets in messages ------------------------------------------------------------------ */

/* Bytes that split a URL into the parts a library may quote back on their own. */
static int url_delim(int c)
{
    return c && strchr(":/?#@&=,; \t'\"", c) != NULL;
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The next byte of raw[0..len) from *i: the byte itself, or with decode a %XX decoded. */
static int secret_byte(const char *raw, size_t len, size_t *i, int decode)
{
    if (decode && raw[*i] == '%' && *i + 2 < len && hexval(raw[*i + 1]) >= 0 &&
        hexval(raw[*i + 2]) >= 0) {
        int v = hexval(raw[*i + 1]) * 16 + hexval(raw[*i + 2]);
        *i += 3;
        return v;
    }
    return (unsigned char)raw[(*i)++];
}

/* Calls fn for the value of each setting in libpq options raw[0..len) ("-c a=x -c b=y",
 * "-ca=x", "--a=x", quoted in a keyword string): the text after the first '=' of each word,
 * words split at whitespace (percent-encoded in a URL), a backslash keeping the next byte in
 * its word as the server reads it. The settings' names are no secret: a server's message
 * quoting one ("invalid value for parameter ...") stays readable. */
static void each_setting(const char *raw, size_t len, int decode,
                         void (*fn)(const char *raw, size_t len, void *ctx), void *ctx)
{
    size_t i = len && raw[0] == '\'' ? 1 : 0, value = 0;
    int in_value = 0;
    while (i < len) {
        size_t at = i;
        int c = secret_byte(raw, len, &i, decode);
        if (c == '\\' && i < len) {
            secret_byte(raw, len, &i, decode);
        } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\'') {
            if (in_value && at > value) fn(raw + value, at - value, ctx);
            in_value = 0;
        } else if (c == '=' && !in_value) {
            in_value = 1;
            value = i;
        }
    }
    if (in_value && len > value) fn(raw + value, len - value, ctx);
}

/* Calls fn for each secret of url as written there: the user-info password, the value of
 * each parameter named like a secret (those rb_redact_url hides), and of options each
 * setting's value. */
static void each_secret(const char *url, void (*fn)(const char *raw, size_t len, void *ctx),
                        void *ctx)
{
    const char *pw, *pw_end, *at = url, *v, *v_end;
    int kind, decode = strstr(url, "://") != NULL;
    if (userinfo_password(url, &pw, &pw_end)) fn(pw, (size_t)(pw_end - pw), ctx);
    while (next_secret_param(url, &at, &v, &v_end, &kind)) {
        if (kind != SETTINGS) {
            fn(v, (size_t)(v_end - v), ctx);
            continue;
        }
        each_setting(v, (size_t)(v_end - v), decode, fn, ctx);
        at = v;     /* and a secret-named pair inside it ("password=x") is one as well */
    }
}

typedef struct {
    const char *at;     /* the position in the message being looked at */
    size_t best;        /* the longest secret found there, in bytes of the message */
} secret_scan;

/* A secret (or a piece of one) shorter than this is left in messages: replacing every "ab"
 * would destroy the message, and URLs themselves always go through rb_redact_url. */
#define SECRET_MIN 3

/* A match may also be cut short by the end of the message: a message truncated to its
 * buffer may end inside a secret. */
static void match_piece(secret_scan *sc, const char *raw, size_t len, int decode)
{
    size_t i = 0, m = 0;
    while (i < len) {
        int c = secret_byte(raw, len, &i, decode);
        if (!sc->at[m]) break;
        if ((unsigned char)sc->at[m] != c) return;
        m++;
    }
    if (m >= SECRET_MIN && m > sc->best) sc->best = m;
}

/* The whole secret, as written and percent-decoded, and each of its pieces between URL
 * delimiters: a library that misreads a URL quotes such pieces back ("invalid port
 * number: ..."). */
static void match_secret(const char *raw, size_t len, void *ctx)
{
    secret_scan *sc = ctx;
    for (int decode = 0; decode < 2; decode++) {
        match_piece(sc, raw, len, decode);
        size_t start = 0, i = 0;
        while (i < len) {
            size_t at = i;
            if (url_delim(secret_byte(raw, len, &i, decode))) {
                match_piece(sc, raw + start, at - start, decode);
                start = i;
            }
        }
        if (start > 0) match_piece(sc, raw + start, len - start, decode);
    }
}

char *rb_redact_secrets(char *out, size_t cap, const char *msg, const char *url)
{
    if (!cap) return out;
    out[0] = 0;
    size_t n = 0;
    if (!msg) return out;
    for (const char *p = msg; *p && n + 1 < cap;) {
        secret_scan sc = {p, 0};
        if (url) each_secret(url, match_secret, &sc);
        if (sc.best) {
            put(out, cap, &n, "***", 3);
            p += sc.best;
        } else {
            put(out, cap, &n, p++, 1);
        }
    }
    return out;
}

/* ---- numbers as JSON text -------------------------------------------------------------- */
size_t rb_json_int(char *out, int64_t v)
{
    char tmp[24];
    size_t n = 0, len = 0;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        tmp[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) out[len++] = '-';
    while (n) out[len++] = tmp[--n];
    out[len] = 0;
    return len;
}

/* printf writes the locale's decimal point: JSON wants '.'. */
static size_t c_locale_point(char *s, size_t n)
{
    size_t i = strspn(s, "0123456789+-eE.");
    if (i >= n) return n;
    size_t m = strcspn(s + i, "0123456789+-eE");   /* the locale's point, maybe several bytes */
    s[i] = '.';
    memmove(s + i + 1, s + i + m, n - i - m + 1);
    return n - m + 1;
}

size_t rb_json_float(char *out, double x)
{
    if (!isfinite(x)) {
        out[0] = 0;
        return 0;
    }
    if (x == floor(x) && fabs(x) < 0x1p63) {
        if (x == 0) return (size_t)snprintf(out, RB_NUM_TEXT, "%s", signbit(x) ? "-0.0" : "0.0");
        size_t n = rb_json_int(out, (int64_t)x);
        memcpy(out + n, ".0", 3);
        return n + 2;
    }
    /* For a normal double, 15 digits that read back are also the fewest that do; a subnormal
     * has fewer significant bits (5e-324, not 4.94065645841247e-324). */
    int k = 0;
    for (int prec = fabs(x) < DBL_MIN ? 1 : 15; prec <= 17; prec++) {
        k = snprintf(out, RB_NUM_TEXT, "%.*g", prec, x);
        if (prec == 17 || strtod(out, NULL) == x) break;
    }
    return c_locale_point(out, (size_t)k);
}

char *rb_text_subst(const char *tmpl, const char *marker, const char *value)
{
    size_t ml = strlen(marker), vl = strlen(value), n = 0;
    for (const char *p = tmpl; (p = strstr(p, marker)); p += ml) n++;
    char *out = rb_malloc(strlen(tmpl) + n * vl + 1), *o = out;
    if (!out) return NULL;
    for (const char *p = tmpl; *p;) {
        if (strncmp(p, marker, ml) == 0) { memcpy(o, value, vl); o += vl; p += ml; }
        else *o++ = *p++;
    }
    *o = 0;
    return out;
}

double rb_decimal_read(const char *s, char **end)
{
    static const double pow10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                                   1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21,
                                   1e22};
    const char *p = s;
    int neg = *p == '-';
    if (neg) p++;
    uint64_t m = 0;
    int ndigits = 0, nfrac = 0, dot = 0;
    for (;; p++) {
        if (*p >= '0' && *p <= '9') {
            if (++ndigits > 19) return strtod(s, end);     /* m could overflow */
            m = m * 10 + (uint64_t)(*p - '0');
            nfrac += dot;
        } else if (*p == '.' && !dot) {
            dot = 1;
        } else {
            break;
        }
    }
    /* the whole text must be the number: an exponent, a letter or anything else is strtod's */
    if (*p != '\0' || ndigits == 0 || m >= (UINT64_C(1) << 53) || nfrac > 22)
        return strtod(s, end);
    if (end) *end = (char *)p;
    double x = (double)m / pow10[nfrac];
    return neg ? -x : x;
}

void rb_json_string(rb_buf *b, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    rb_buf_add(b, "\"", 1);
    size_t plain = 0;   /* start of the run of bytes written as they are */
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)s[i];
        size_t k = c >= 0x80 ? rb_utf8_seq(s + i, len - i) : 1;
        char esc[6] = {'\\', (char)c};
        size_t n = 0;
        if (c >= 0x80 && !k) {
            memcpy(esc, "\\ufffd", 6);
            n = 6;
            k = 1;
        } else if (c == '"' || c == '\\') {
            n = 2;
        } else if (c < 0x20 || c == 0x7f) {
            memcpy(esc, "\\u00", 4);
            esc[4] = hex[c >> 4];
            esc[5] = hex[c & 15];
            n = 6;
        }
        if (n) {
            rb_buf_add(b, s + plain, i - plain);
            rb_buf_add(b, esc, n);
            plain = i + k;
        }
        i += k;
    }
    rb_buf_add(b, s + plain, len - plain);
    rb_buf_add(b, "\"", 1);
}
