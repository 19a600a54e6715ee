/* text_fuzz.c -- libFuzzer target for text.c: one-line messages, UTF-8 cleaning and URL
 * redaction. Checks what callers rely on: one line with no control byte, valid UTF-8 with no
 * NUL within the size asked for, and a URL's password never in the redacted text. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "util/text.h"

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static void check_one_line(const char *s, size_t cap)
{
    char out[300];
    if (cap > sizeof out) cap = sizeof out;
    rb_one_line(out, cap, s);
    size_t n = strlen(out);
    CHECK(n < cap);
    for (size_t i = 0; i < n; i++) CHECK((unsigned char)out[i] >= 0x20 && out[i] != 0x7f);
    CHECK(n == 0 || (out[0] != ' ' && out[n - 1] != ' '));
}

static void check_clean(const uint8_t *data, size_t len, size_t max)
{
    char *c = rb_text_clean((const char *)data, len, max);
    CHECK(c);
    size_t n = strlen(c);
    CHECK(rb_utf8_valid(c, n));
    CHECK(n <= max + sizeof " [truncated]" - 1);
    /* valid text that fits comes back unchanged */
    if (len <= max && rb_utf8_valid((const char *)data, len) && !memchr(data, 0, len))
        CHECK(n == len && memcmp(c, data, len) == 0);
    free(c);
}

static void check_redact(const char *url)
{
    char out[512];
    rb_redact_url(out, sizeof out, url);
    CHECK(strlen(out) < sizeof out);
    /* scheme://user:PASSWORD@host: the password must not survive */
    const char *auth = strstr(url, "://");
    if (!auth) return;
    auth += 3;
    size_t alen = strcspn(auth, "/?#");
    const char *at = NULL;
    for (const char *p = auth; p < auth + alen; p++) if (*p == '@') at = p;
    if (!at) return;
    const char *colon = memchr(auth, ':', (size_t)(at - auth));
    if (!colon || at - colon - 1 < 6) return;
    char pw[64];
    size_t pl = (size_t)(at - colon - 1);
    if (pl >= sizeof pw) return;
    memcpy(pw, colon + 1, pl);
    pw[pl] = 0;
    /* only meaningful when the password appears in the URL just once */
    if (strstr(strstr(url, pw) + 1, pw)) return;
    if (strlen(url) < 400) CHECK(!strstr(out, pw));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = 0;
    check_one_line(s, size % 64 + 1);
    check_one_line(s, 300);
    check_clean(data, size, size % 40);
    check_clean(data, size, 4096);
    check_redact(s);
    free(s);
    return 0;
}
