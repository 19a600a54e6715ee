/* base64.h -- standard base64 (RFC 4648, section 4), for webhook signatures and their keys. */
#ifndef RB_BASE64_H
#define RB_BASE64_H

#include <stddef.h>

/* Bytes rb_base64_encode writes for n input bytes, the terminating NUL included. */
#define RB_BASE64_ENCODED_SIZE(n) (((n) + 2) / 3 * 4 + 1)

/* Writes src[0..n) as base64 with '=' padding and a NUL into out (RB_BASE64_ENCODED_SIZE(n)
 * bytes). Returns the length written, the NUL not counted. */
size_t rb_base64_encode(const unsigned char *src, size_t n, char *out);

/* Decodes s[0..n) into out (room for n / 4 * 3 + 3 bytes) and sets *outlen. Padding is
 * optional, but when present it must complete the last quantum; any other byte outside the
 * alphabet (whitespace included) makes the text invalid. Returns 0, or -1 when invalid. */
int rb_base64_decode(const char *s, size_t n, unsigned char *out, size_t *outlen);

#endif
