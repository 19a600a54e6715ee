/* plugin_static.c -- the optional parts linked in (librelaybus.a and librelaybus.so, for C
 * hosts): every table is there already. The command and the Lua module use plugin_dlopen.c
 * instead. */
#include <stdio.h>
#include "plugin/plugin.h"

const void *rb_plugin_get(rb_plugin_id id, char *err, size_t errlen)
{
    switch (id) {
    case RB_PLUGIN_PG: return &rb_plugin_pg;
    case RB_PLUGIN_MONGO: return &rb_plugin_mongo;
    case RB_PLUGIN_HTTP: return &rb_plugin_http;
    case RB_PLUGIN_SERVE: return &rb_plugin_serve;
    default: break;
    }
    if (errlen) snprintf(err, errlen, "no such part of relaybus");
    return NULL;
}
