/* metrics_test.c -- the metrics' series by topic (runtime/dispatch/metrics.c): whatever the
 * topics (not UTF-8, longer than a label keeps, more than RB_METRICS_MAX_TOPICS, one named
 * like the overflow's "_other"), no two series of /metrics share their labels. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include "dispatch/metrics.h"
#include "util/buf.h"

static void settle(rb_metrics *m, const char *topic)
{
    rb_delivery dv;
    memset(&dv, 0, sizeof dv);
    dv.id = "1";
    dv.topic = (char *)topic;
    rb_event ev = {.kind = RB_EV_SETTLED, .delivery = &dv, .outcome = RB_OUT_COMPLETED};
    rb_metrics_on_event(NULL, &ev, m);
}

static int by_text(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void no_two_series_share_their_labels(void **state)
{
    (void)state;
    for (int other_first = 0; other_first < 2; other_first++) {
        rb_metrics *m = rb_metrics_new();
        assert_non_null(m);
        if (other_first) settle(m, "_other");
        char topic[300];
        for (int i = 0; i < RB_METRICS_MAX_TOPICS + 50; i++) {
            snprintf(topic, sizeof topic, "t%d", i);
            settle(m, topic);
        }
        settle(m, "bad\xff" "topic");
        settle(m, "bad\xfe" "topic");           /* the same label once cleaned */
        memset(topic, 'L', 250);
        topic[250] = 0;
        settle(m, topic);
        settle(m, "_other");
        rb_buf b = {0};
        rb_metrics_write(m, &b);
        assert_false(rb_buf_failed(&b));
        /* every sample line without its value, sorted: no two alike */
        char **lines = calloc(400000, sizeof *lines);
        size_t n = 0;
        for (char *line = strtok(b.data, "\n"); line; line = strtok(NULL, "\n")) {
            if (line[0] == '#') continue;
            char *sp = strrchr(line, ' ');
            if (sp) *sp = 0;
            assert_true(n < 400000);
            lines[n++] = line;
        }
        assert_true(n > 0);
        qsort(lines, n, sizeof *lines, by_text);
        for (size_t i = 1; i < n; i++)
            if (!strcmp(lines[i - 1], lines[i])) fail_msg("a series twice: %s", lines[i]);
        free(lines);
        rb_buf_free(&b);
        rb_metrics_free(m);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        {"no two series share their labels, a topic named _other past the topic limit too",
         no_two_series_share_their_labels, NULL, NULL, NULL},
    };
    return cmocka_run_group_tests_name("metrics", tests, NULL, NULL);
}
