/* jansson_lua.c -- Jansson's own encoder and parser as a Lua module, only for bench/json.lua
 * to compare against relaybus.json: encode(v) builds a json_t tree from the Lua value and
 * dumps it (JSON_REAL_PRECISION(17), the precision that round-trips); parse(s) parses and
 * frees the tree (the part of relaybus.json's decode that is Jansson's); allocs() counts
 * Jansson's allocations in this process (relaybus.json's decode included). Not part of the
 * library: it replaces Jansson's allocator for the whole process. */
#include <stdlib.h>
#include <string.h>
#include <jansson.h>
#include <lua.h>
#include <lauxlib.h>

static unsigned long long nallocs;

static void *counting_malloc(size_t n)
{
    nallocs++;
    return malloc(n);
}

static json_t *to_json(lua_State *L, int idx, int depth)
{
    if (depth > 1000) luaL_error(L, "too deep");
    switch (lua_type(L, idx)) {
    case LUA_TNIL: return json_null();
    case LUA_TBOOLEAN: return json_boolean(lua_toboolean(L, idx));
    case LUA_TNUMBER:
        if (lua_isinteger(L, idx)) return json_integer(lua_tointeger(L, idx));
        return json_real(lua_tonumber(L, idx));
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        return json_stringn(s, n);
    }
    case LUA_TTABLE: {
        idx = lua_absindex(L, idx);
        luaL_checkstack(L, 4, NULL);
        lua_Unsigned n = lua_rawlen(L, idx);
        if (n > 0) {
            json_t *a = json_array();
            for (lua_Unsigned i = 1; i <= n; i++) {
                lua_rawgeti(L, idx, (lua_Integer)i);
                json_array_append_new(a, to_json(L, -1, depth + 1));
                lua_pop(L, 1);
            }
            return a;
        }
        json_t *o = json_object();
        lua_pushnil(L);
        while (lua_next(L, idx)) {
            if (lua_type(L, -2) == LUA_TSTRING) {
                size_t kl;
                const char *k = lua_tolstring(L, -2, &kl);
                json_object_setn_new(o, k, kl, to_json(L, -1, depth + 1));
            }
            lua_pop(L, 1);
        }
        return o;
    }
    }
    return json_null();
}

static int l_encode(lua_State *L)
{
    json_t *j = to_json(L, 1, 0);
    char *s = json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(17));
    json_decref(j);
    if (!s) return luaL_error(L, "json_dumps failed");
    lua_pushstring(L, s);
    free(s);
    return 1;
}

static int l_parse(lua_State *L)
{
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    json_error_t e;
    json_t *j = json_loadb(s, n, JSON_DECODE_ANY, &e);
    if (!j) return luaL_error(L, "%s", e.text);
    json_decref(j);
    return 0;
}

static int l_allocs(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)nallocs);
    return 1;
}

int luaopen_bench_jansson(lua_State *L)
{
    static const luaL_Reg fns[] = {{"encode", l_encode}, {"parse", l_parse}, {"allocs", l_allocs},
                                   {NULL, NULL}};
    json_set_alloc_funcs(counting_malloc, free);
    luaL_newlib(L, fns);
    return 1;
}
