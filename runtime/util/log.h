/* log.h -- one-line diagnostics on stderr. RELAYBUS_LOG=debug|info|warn|error|off picks the
 * level (default warn; the relaybus command raises it to info); RELAYBUS_LOG=json (or, with a
 * level, json,debug) writes each line as one JSON object for log shippers: time (UTC, RFC
 * 3339), level, message, and delivery_id and topic when the line is about one delivery. Internal: `make install` does
 * not install this header, so rb_log_set_sink (replacing the sink) serves hosts built inside
 * this tree only. Every line is made one line (rb_one_line) before it is written, whatever
 * the message carried.
 *
 * A condition that can repeat at the rate of the loop (a store that refuses every write)
 * logs through a limiter: at most RB_LOG_BURST lines per RB_LOG_WINDOW seconds per limiter,
 * then one line saying how many similar lines were left out (rb_log_flush writes the count
 * still open when the runtime closes or the process exits). */
#ifndef RB_LOG_H
#define RB_LOG_H

typedef enum { RB_LOG_DEBUG, RB_LOG_INFO, RB_LOG_WARN, RB_LOG_ERROR, RB_LOG_OFF } rb_log_level;

void rb_log(rb_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void rb_log_set_sink(void (*sink)(rb_log_level level, const char *line, void *ud), void *ud);
int rb_log_enabled(rb_log_level level);
/* Sets the level as RELAYBUS_LOG would (the relaybus command raises it to info). */
void rb_log_set_level(rb_log_level level);

int rb_log_json(void);              /* 1 when lines are JSON objects */

#define RB_LOG_BURST 5
#define RB_LOG_WINDOW 10.0
typedef struct rb_log_limit {
    double window_start;    /* monotonic s */
    int lines;              /* written in this window */
    long dropped;           /* left out since the last line written */
    /* The last line left out, written by rb_log_flush so that no count is lost at exit. */
    rb_log_level level;
    int listed;             /* on the list rb_log_flush walks */
    struct rb_log_limit *next;
    /* as long as a line written at once keeps them (log.c: the text 1,024 bytes, a JSON field
     * 2,048), so the count's line says what the others said; a topic a little over, for the
     * cut at a character's boundary to happen there */
    char last[1024], id[64], topic[2048 + 8];
} rb_log_limit;
/* One static limiter per call site: `static rb_log_limit lim; rb_log_limited(&lim, ...)`. */
void rb_log_limited(rb_log_limit *lim, rb_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void rb_log_limited_d(rb_log_limit *lim, rb_log_level level, const char *id, const char *topic,
                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Writes, for each limiter that has left lines out since its last line, the last of them
 * with the count of the others ("(N similar lines left out) LINE"). Called when a Lua runtime
 * closes and when the process exits (atexit, set up by the first line left out). */
void rb_log_flush(void);

#endif
