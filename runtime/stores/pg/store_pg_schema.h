/* store_pg_schema.h -- the PostgreSQL store's SQL and schema (store_pg_schema.c), for
 * store_pg.c; not installed. SQL texts say "@T" for the table name (rb_pg_subst_table). */
#ifndef RB_STORE_PG_SCHEMA_H
#define RB_STORE_PG_SCHEMA_H
#include <stddef.h>
#include <libpq-fe.h>

#pragma GCC visibility push(hidden)

/* The prepared statements, by number: their names and their texts. */
enum { ST_ENQ, ST_CLAIM, ST_SETTLE, ST_GET, ST_LACQ, ST_LEXT, ST_LREL, ST_ENQ_AFTER, ST_COUNT };
extern const char *const rb_pg_stmt_names[ST_COUNT];
extern const char *const rb_pg_stmt_templates[ST_COUNT];
/* The statements run unprepared (one-off parameters or rare). */
extern const char rb_pg_sql_list[], rb_pg_sql_list_page[], rb_pg_sql_bury_one[],
    rb_pg_sql_delete_one[], rb_pg_sql_topic_stats[], rb_pg_sql_pending_topics[],
    rb_pg_sql_pause[], rb_pg_sql_resume[], rb_pg_sql_paused[], rb_pg_sql_limit_set[],
    rb_pg_sql_limit_clear[], rb_pg_sql_limits[], rb_pg_sql_stats[], rb_pg_sql_kick[],
    rb_pg_sql_purge[], rb_pg_sql_cancel_one[], rb_pg_sql_progress[], rb_pg_sql_schedule_set[],
    rb_pg_sql_unschedule[], rb_pg_sql_schedules[], rb_pg_sql_schedule_fire[],
    rb_pg_sql_cancel_all[], rb_pg_sql_table_large[], rb_pg_sql_topic_stats_large[];

/* "postgresql: " + msg on one line: libpq's messages carry newlines and tabs. */
void rb_pg_one_line(char *out, size_t outlen, const char *msg);
/* A result's error as one line (malloc'd; NULL out of memory). */
char *rb_pg_result_error(const PGresult *r);
/* tpl with every "@T" replaced by table; NULL out of memory. */
char *rb_pg_subst_table(const char *tpl, const char *table);
int rb_pg_check_names(PGconn *pq, const char *table, char *err, size_t errlen);
char *rb_pg_subst_qualified(const char *tpl, const char *schema, const char *table);
int rb_pg_table_schema(PGconn *pq, const char *table, char *out, size_t outlen, char *err,
                       size_t errlen);

/* Brings the schema of `table` up to date in one transaction (serialised by an advisory lock
 * across processes); 1, or 0 with err set. */
int rb_pg_migrate(PGconn *pq, const char *table, char *err, size_t errlen);
/* 1 when the schema of `table` is there and current; 0 with err ("no relaybus schema here
 * (run relaybus migrate)" and the like) otherwise. Creates nothing. */
int rb_pg_check_schema(PGconn *pq, const char *table, char *err, size_t errlen);

#pragma GCC visibility pop
#endif
