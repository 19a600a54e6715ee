/* http_headers_fuzz.c -- libFuzzer target for what http.c reads and refuses: the response
 * header lines of a transfer (rb_http_header_line, as curl's header callback feeds it) and the
 * request checks (rb_http_check), plus base64 (webhook keys and signatures). Checks that every
 * kept header is "token: value" with a trimmed value free of CR, LF and NUL, that the limits
 * hold, that a request the checks accept has no byte that could end a line, and that base64
 * decodes what it encoded. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "util/base64.h"
#include "http/http.h"

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static void check_response(const rb_http_response *r, const rb_http_header_parser *p)
{
    CHECK(r->nheaders <= RB_HTTP_MAX_HEADERS);
    CHECK(p->bytes <= RB_HTTP_MAX_HEADER_BYTES);
    CHECK(r->nheaders <= p->cap);
    for (size_t i = 0; i < r->nheaders; i++) {
        const char *h = r->headers[i];
        const char *colon = strchr(h, ':');
        CHECK(colon && rb_http_valid_header_name(h, (size_t)(colon - h)));
        CHECK(colon[1] == ' ');
        const char *v = colon + 2;
        size_t vl = strlen(v);
        CHECK(rb_http_valid_header_value(v, vl));
        CHECK(vl == 0 || (v[0] != ' ' && v[0] != '\t' && v[vl - 1] != ' ' && v[vl - 1] != '\t'));
    }
}

/* Feeds the input as header lines, split after each LF as curl does. */
static void check_headers(const uint8_t *data, size_t size)
{
    rb_http_response r;
    rb_http_header_parser p;
    memset(&r, 0, sizeof r);
    memset(&p, 0, sizeof p);
    size_t start = 0;
    for (size_t i = 0; i <= size; i++) {
        if (i == size || data[i] == '\n') {
            size_t end = i < size ? i + 1 : i;
            if (end > start) {
                int rc = rb_http_header_line(&p, &r, (const char *)data + start, end - start);
                CHECK(rc == 0 || rc == -2);     /* -1 only when out of memory */
                check_response(&r, &p);
            }
            start = end;
        }
    }
    rb_http_response_clear(&r);
}

static void check_request(const char *s, size_t n)
{
    /* the input is a method, a URL and one header line, split at the first two NULs */
    const char *method = s, *url = s + strlen(s) + 1;
    if ((size_t)(url - s) > n) return;
    const char *line = url + strlen(url) + 1;
    if ((size_t)(line - s) > n) return;
    const char *headers[1] = {line};
    rb_http_request req = {.method = method, .url = url, .headers = headers, .nheaders = 1};
    char err[256];
    if (rb_http_check(&req, err, sizeof err) == 0) {
        CHECK(!strpbrk(method, " \t\r\n:/") && *method && strlen(method) <= 32);
        CHECK(!strpbrk(url, " \t\r\n\x7f") && *url);
        CHECK(!strpbrk(line, "\r\n"));
        CHECK(strncasecmp(line, "content-length:", 15) != 0);
    } else {
        CHECK(!strpbrk(err, "\r\n"));
    }
}

static void check_base64(const uint8_t *data, size_t size)
{
    char *enc = malloc(RB_BASE64_ENCODED_SIZE(size));
    unsigned char *dec = malloc(size / 4 * 3 + 3);
    if (!enc || !dec) goto out;
    size_t n = rb_base64_encode(data, size, enc);
    CHECK(n == RB_BASE64_ENCODED_SIZE(size) - 1 && strlen(enc) == n);
    size_t got = 0;
    unsigned char *back = malloc(n / 4 * 3 + 3);
    if (back) {
        CHECK(rb_base64_decode(enc, n, back, &got) == 0 && got == size);
        CHECK(size == 0 || memcmp(back, data, size) == 0);
        free(back);
    }
    /* any text: decodes into the room promised, or is refused */
    if (rb_base64_decode((const char *)data, size, dec, &got) == 0) CHECK(got <= size / 4 * 3 + 2);
out:
    free(enc);
    free(dec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check_headers(data, size);
    char *s = malloc(size + 3);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = s[size + 1] = s[size + 2] = 0;
    check_request(s, size + 2);
    free(s);
    check_base64(data, size);
    return 0;
}
