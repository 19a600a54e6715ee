/* check.h -- RB_ASSERT(cond): an invariant of relaybus's own code, checked at run time in the
 * debug builds (RB_DEBUG: build-asan, build-tsan, build-fuzz), where a broken one prints its
 * place and expression and aborts, so the bug shows where it happens and not later as a use
 * after free. The release build compiles the condition away (it still type-checks it). Not
 * for what a user or a server may get wrong: those get an error. */
#ifndef RB_CHECK_H
#define RB_CHECK_H

#ifdef RB_DEBUG
#define RB_ASSERT(cond) \
    ((cond) ? (void)0 : rb_assert_failed(#cond, __FILE__, __LINE__, __func__))
#else
#define RB_ASSERT(cond) ((void)sizeof(!(cond)))
#endif

/* Prints "relaybus: FILE:LINE: FUNC: invariant broken: EXPR" on stderr and aborts. */
_Noreturn void rb_assert_failed(const char *expr, const char *file, int line, const char *func);

#endif
