/* log.h -- one-line diagnostics on stderr. RELAYBUS_LOG=debug|info|warn|error|off picks the
 * level (default warn); hosts may replace the sink with rb_log_set_sink. */
#ifndef RB_LOG_H
#define RB_LOG_H

typedef enum { RB_LOG_DEBUG, RB_LOG_INFO, RB_LOG_WARN, RB_LOG_ERROR, RB_LOG_OFF } rb_log_level;

void rb_log(rb_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void rb_log_set_sink(void (*sink)(rb_log_level level, const char *line, void *ud), void *ud);
int rb_log_enabled(rb_log_level level);

#endif
