/* plugin_dlopen.c -- the optional parts for the relaybus command and the Lua module: each is
 * loaded on first use from relaybus_NAME.so (see plugin.h for why), looked for beside the
 * object that holds this code (build/relaybus, a tree's lib/lua/5.4/relaybus.so) and beside
 * the executable, and in ../lib/lua/5.4/ from each (an installed bin/relaybus). A part is
 * never unloaded; one that could not be loaded is looked for again on the next call. */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "plugin/plugin.h"

static const struct {
    const char *file, *symbol, *what;
} parts[RB_PLUGIN_COUNT] = {
    [RB_PLUGIN_PG] = {"relaybus_pg.so", "rb_plugin_pg", "the PostgreSQL store"},
    [RB_PLUGIN_MONGO] = {"relaybus_mongo.so", "rb_plugin_mongo", "the MongoDB store"},
    [RB_PLUGIN_HTTP] = {"relaybus_http.so", "rb_plugin_http", "the HTTP client"},
    [RB_PLUGIN_SERVE] = {"relaybus_serve.so", "rb_plugin_serve", "the dashboard's server"},
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static const void *loaded[RB_PLUGIN_COUNT];
static int promoted;

/* The directory of path (resolved), into dir; 0 when it cannot be resolved. */
static int dir_of(const char *path, char dir[PATH_MAX])
{
    char real[PATH_MAX];
    if (!path || !strchr(path, '/') || !realpath(path, real)) return 0;
    char *slash = strrchr(real, '/');
    *slash = '\0';
    return snprintf(dir, PATH_MAX, "%s", real[0] ? real : "/") < PATH_MAX;
}

/* The first existing candidate for file into out; 0 when there is none, with where it looked
 * in `looked`. */
static int find(const char *file, char out[PATH_MAX], char *looked, size_t lookedlen)
{
    Dl_info info;
    const char *bases[2] = {NULL, "/proc/self/exe"};
    if (dladdr((void *)rb_plugin_get, &info) && info.dli_fname) bases[0] = info.dli_fname;
    static const char *const subdirs[] = {"", "/../lib/lua/5.4"};
    looked[0] = '\0';
    for (int b = 0; b < 2; b++) {
        char dir[PATH_MAX];
        if (!dir_of(bases[b], dir)) continue;
        if (b == 1 && bases[0]) {      /* the executable's directory again: nothing new */
            char first[PATH_MAX];
            if (dir_of(bases[0], first) && strcmp(first, dir) == 0) continue;
        }
        for (size_t s = 0; s < sizeof subdirs / sizeof *subdirs; s++) {
            if (snprintf(out, PATH_MAX, "%s%s/%s", dir, subdirs[s], file) < PATH_MAX &&
                access(out, R_OK) == 0)
                return 1;
        }
        size_t used = strlen(looked);      /* a list cut short is still a clue */
        if (used + 1 < lookedlen &&
            snprintf(looked + used, lookedlen - used, "%s%s", used ? ", " : "", dir) < 0)
            looked[used] = '\0';
    }
    return 0;
}

/* The parts resolve relaybus's own functions in the global scope: the command exports them
 * (linked with -E), but a Lua interpreter loads the module with RTLD_LOCAL, so the module
 * makes itself global before the first part comes. */
static void promote_self(void)
{
    Dl_info info;
    if (promoted) return;
    promoted = 1;
    if (dladdr((void *)rb_plugin_get, &info) && info.dli_fname && strchr(info.dli_fname, '/'))
        dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD | RTLD_GLOBAL);
}

const void *rb_plugin_get(rb_plugin_id id, char *err, size_t errlen)
{
    if ((unsigned)id >= RB_PLUGIN_COUNT) {
        if (errlen) snprintf(err, errlen, "no such part of relaybus");
        return NULL;
    }
    pthread_mutex_lock(&lock);
    const void *table = loaded[id];
    if (!table) {
        char path[PATH_MAX], looked[512];
        if (!find(parts[id].file, path, looked, sizeof looked)) {
            if (errlen)
                snprintf(err, errlen,
                         "%s is not installed: %s is not beside relaybus (looked in %s)",
                         parts[id].what, parts[id].file, looked[0] ? looked : "no directory");
        } else {
            promote_self();
            void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (!h) {
                const char *why = dlerror();
                if (errlen) snprintf(err, errlen, "%s cannot be loaded: %s", parts[id].what,
                                     why ? why : path);
            } else if (!(table = dlsym(h, parts[id].symbol))) {
                if (errlen) snprintf(err, errlen, "%s cannot be loaded: %s has no %s",
                                     parts[id].what, path, parts[id].symbol);
            }
            loaded[id] = table;
        }
    }
    pthread_mutex_unlock(&lock);
    return table;
}
