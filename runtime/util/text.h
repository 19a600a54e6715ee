/* text.h -- texts that leave relaybus: one-line messages, valid UTF-8 for the stores, and
 * store URLs with their secrets taken out. */
#ifndef RB_TEXT_H
#define RB_TEXT_H

#include <stddef.h>
#include <stdint.h>

/* Copies msg into out (cap bytes, always terminated) as one line: every run of whitespace
 * becomes one space, leading and trailing ones are dropped, and other control bytes are
 * written as \xNN, so a server's multi-line message or a terminal escape stays one inert
 * line. Returns out. */
char *rb_one_line(char *out, size_t cap, const char *msg);

/* 1 when s[0..len) is valid UTF-8 (no overlong forms, no surrogates, at most U+10FFFF). */
int rb_utf8_valid(const char *s, size_t len);

/* Length of the valid UTF-8 sequence that starts at s (at most left bytes, by the same rules),
 * or 0 when none starts there: for callers that scan and need the offset of a bad byte. */
size_t rb_utf8_seq(const char *s, size_t left);

/* A copy of s[0..len) that any store accepts as text: each byte that is not part of valid
 * UTF-8, and each NUL, becomes U+FFFD; longer than max bytes, it keeps at most max bytes, cut
 * at a character boundary, followed by " [truncated]" (so up to max + 12 bytes). NULL when out
 * of memory (free() the result). */
char *rb_text_clean(const char *s, size_t len, size_t max);

struct rb_buf;
/* Appends s[0..len) to b as a JSON string, quotes included: each byte that is not part of
 * valid UTF-8 becomes \ufffd, and quotes, backslashes, control bytes and DEL are escaped, so
 * the text is always JSON whatever s holds. The writer of JSON texts relaybus makes by hand
 * (the JSON log, MongoDB documents as JSON); the Lua encoder (bindings/json.c) raises on
 * bad UTF-8 instead, and the dashboard writes through Jansson. */
void rb_json_string(struct rb_buf *b, const char *s, size_t len);

/* The URL (or libpq keyword string) with its secrets replaced by "***": the password of the
 * user-info (scheme://user:***@host; the user-info ends at the URL's last '@', so a password
 * with an unescaped '/' is hidden too), the values of parameters whose name holds password,
 * secret, token, passwd, pwd, key, sig, credential or session, and all of libpq's options
 * (its "-c name=value" settings may carry any secret). Always terminated; cut to cap.
 * Returns out. */
char *rb_redact_url(char *out, size_t cap, const char *url);

/* Copies msg into out (cap bytes, always terminated) with each secret of url (those
 * rb_redact_url hides; of options, each setting's value, so that a server's message naming a
 * setting stays readable) replaced by "***" wherever it appears: as written in the URL,
 * percent-decoded, and each piece of it between URL delimiters, as a library that misreads
 * the URL may quote it ("invalid port number: ..."), and the start of one that ends msg (a
 * message cut to its buffer). Pieces shorter than 3 bytes stay.
 * For the errors of opening a store, whose message may quote its URL. Returns out. */
char *rb_redact_secrets(char *out, size_t cap, const char *msg, const char *url);

/* tmpl with every occurrence of marker replaced by value (the stores' SQL templates name their
 * table so); NULL out of memory. The caller frees it. */
char *rb_text_subst(const char *tmpl, const char *marker, const char *value);

/* Numbers as JSON text, written the one way relaybus writes them (bindings/json.c, the MongoDB
 * store's payloads): into out of RB_NUM_TEXT bytes (21 do for an integer), terminated;
 * returns the length. */
#define RB_NUM_TEXT 48
size_t rb_json_int(char *out, int64_t v);
/* The shortest text that reads back to the same bits, always recognisably a float: an
 * integral value below 2^63 gets ".0" and no exponent (PostgreSQL's jsonb prints 1e+15 as
 * 1000000000000000, which would come back as an integer). 0 for NaN and infinities, which
 * JSON cannot hold. '.' whatever the locale. */
size_t rb_json_float(char *out, double x);

/* The number a server wrote as text ("1764755123.123456", "-0.5", "1e+30", "Infinity"), as
 * strtod reads it: the correctly rounded double. A plain decimal of at most 15 or so digits
 * (below 2^53 without its point, at most 22 after it) is read without strtod: that integer
 * over a power of ten is two exact doubles and one correctly rounded division, the same bits
 * at a tenth of the cost. Anything else, and text with more after the number, goes to strtod.
 * *end, when end is not NULL, is set as strtod sets it. */
double rb_decimal_read(const char *s, char **end);

/* A macro's value as a string literal: RB_TEXT_OF(RB_ERRORS_KEPT) is "10" (for SQL texts). */
#define RB_TEXT_OF_(x) #x
#define RB_TEXT_OF(x) RB_TEXT_OF_(x)

#endif
