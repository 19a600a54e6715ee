/* json_fuzz.c -- libFuzzer target for relaybus.json (bindings/json.c) in a Lua state with the
 * module loaded. Each input is decoded; when it decodes it is encoded, decoded again, and the
 * two values must be deeply equal (types and math.type included, floats to the bit) while the
 * text must be stable: encode(decode(encode(v))) == encode(v) byte for byte. A decoded value
 * always encodes, and rb_json_check agrees with decode. The input as a Lua string must encode
 * exactly when it is valid UTF-8, and then decode back to the same bytes. */
#include <stdint.h>
#include <string.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include "internal.h"
#include "relaybus.h"
#include "util/text.h"

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static lua_State *L;

/* Values at a and b: the same JSON value exactly. Tables: the same keys (raw), values equal,
 * and the same metatable (the array mark). */
static int same(lua_State *S, int a, int b)
{
    a = lua_absindex(S, a);
    b = lua_absindex(S, b);
    int t = lua_type(S, a);
    if (t != lua_type(S, b)) return 0;
    switch (t) {
    case LUA_TNIL: return 1;
    case LUA_TBOOLEAN: return lua_toboolean(S, a) == lua_toboolean(S, b);
    case LUA_TLIGHTUSERDATA: return lua_touserdata(S, a) == lua_touserdata(S, b);
    case LUA_TNUMBER: {
        if (lua_isinteger(S, a) != lua_isinteger(S, b)) return 0;
        if (lua_isinteger(S, a)) return lua_tointeger(S, a) == lua_tointeger(S, b);
        lua_Number x = lua_tonumber(S, a), y = lua_tonumber(S, b);
        CHECK(x == x);                       /* JSON has no NaN */
        return memcmp(&x, &y, sizeof x) == 0;
    }
    case LUA_TSTRING: {
        size_t n, m;
        const char *x = lua_tolstring(S, a, &n), *y = lua_tolstring(S, b, &m);
        return n == m && memcmp(x, y, n) == 0;
    }
    case LUA_TTABLE: {
        CHECK(lua_checkstack(S, 8));
        int ma = lua_getmetatable(S, a), mb = lua_getmetatable(S, b);
        int mt_ok = ma == mb && (!ma || lua_rawequal(S, -1, -2));
        lua_pop(S, ma + mb);
        if (!mt_ok) return 0;
        lua_Integer na = 0, nb = 0;
        lua_pushnil(S);
        while (lua_next(S, a)) {
            na++;
            lua_pushvalue(S, -2);
            lua_rawget(S, b);
            int eq = same(S, -1, -2);
            lua_pop(S, 2);
            if (!eq) {
                lua_pop(S, 1);
                return 0;
            }
        }
        lua_pushnil(S);
        while (lua_next(S, b)) {
            nb++;
            lua_pop(S, 1);
        }
        return na == nb;
    }
    }
    return 0;
}

static void check_json_text(const char *s, size_t len)
{
    char msg[400];
    int base = lua_gettop(L);
    int ok = rb_json_decode(L, s, len);
    CHECK(ok == rb_json_check(s, len, msg, sizeof msg));
    if (!ok) {
        CHECK(lua_type(L, -1) == LUA_TSTRING);
        CHECK(!strchr(lua_tostring(L, -1), '\n'));
        lua_settop(L, base);
        return;
    }
    int v1 = lua_gettop(L);
    CHECK(rb_json_encode(L, v1));               /* anything that decodes encodes */
    size_t n1;
    const char *e1 = lua_tolstring(L, -1, &n1);
    CHECK(rb_json_decode(L, e1, n1));
    int v2 = lua_gettop(L);
    CHECK(same(L, v1, v2));
    CHECK(rb_json_encode(L, v2));
    size_t n2;
    const char *e2 = lua_tolstring(L, -1, &n2);
    CHECK(n1 == n2 && memcmp(e1, e2, n1) == 0);
    lua_settop(L, base);
}

static void check_string_value(const char *s, size_t len)
{
    int base = lua_gettop(L);
    lua_pushlstring(L, s, len);
    int ok = rb_json_encode(L, -1);
    CHECK(ok == rb_utf8_valid(s, len));
    if (ok) {
        size_t n;
        const char *e = lua_tolstring(L, -1, &n);
        CHECK(rb_json_decode(L, e, n));
        size_t m;
        const char *back = lua_tolstring(L, -1, &m);
        CHECK(lua_type(L, -1) == LUA_TSTRING && m == len && memcmp(back, s, len) == 0);
    } else {
        CHECK(!strchr(lua_tostring(L, -1), '\n'));
    }
    lua_settop(L, base);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!L) {
        L = luaL_newstate();
        luaL_openlibs(L);
        luaL_requiref(L, "relaybus", luaopen_relaybus, 0);
        lua_settop(L, 0);
    }
    check_json_text((const char *)data, size);
    check_string_value((const char *)data, size);
    /* Free this input's garbage now: libFuzzer runs LeakSanitizer after every input whose
     * mallocs and frees do not balance, which Lua's collector would make nearly all of them
     * (a hundred inputs a second). A json_t tree that leaked would still be caught. */
    lua_gc(L, LUA_GCCOLLECT);
    return 0;
}
