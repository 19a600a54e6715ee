/* leases.h -- named leases: one holder at a time for a named piece of work, for at most a
 * bounded time. Placeholder interface; see CONTRACT.md "Named leases". */
#ifndef RB_LEASES_H
#define RB_LEASES_H
#include "store.h"
#endif
