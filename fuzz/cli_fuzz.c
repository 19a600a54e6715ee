/* cli_fuzz.c -- libFuzzer target for the command's argument parser (parse in cmd/cli.lua):
 * the input, split at NUL bytes, is argv. parse must return a command table, or nil and a
 * usage message of exactly one line with no control character in valid UTF-8; raising
 * anything else is a bug. Nothing runs: parse touches no store, file or terminal. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include "relaybus.h"
#include "util/text.h"
#include "cli_lua.h"

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static lua_State *L;
static int parse_ref;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    L = luaL_newstate();
    CHECK(L);
    luaL_openlibs(L);
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    lua_pushcfunction(L, luaopen_relaybus);
    lua_setfield(L, -2, "relaybus");
    lua_pop(L, 1);
    CHECK(luaL_loadbufferx(L, cli_lua, sizeof cli_lua - 1, "=relaybus", "t") == LUA_OK);
    lua_pushliteral(L, "module");
    if (lua_pcall(L, 1, 1, 0) != LUA_OK) {
        fprintf(stderr, "cli_fuzz: %s\n", lua_tostring(L, -1));
        __builtin_trap();
    }
    lua_getfield(L, -1, "parse");
    CHECK(lua_isfunction(L, -1));
    parse_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_settop(L, 0);
    return 0;
}

static void check_usage(const char *msg, size_t len)
{
    CHECK(msg && len > 0);
    CHECK(strlen(msg) == len);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)msg[i];
        CHECK(c >= 0x20 && c != 0x7f);
        /* C1 controls as UTF-8 (U+0080..U+009F) */
        CHECK(!(c == 0xc2 && i + 1 < len && (unsigned char)msg[i + 1] < 0xa0));
    }
    CHECK(rb_utf8_valid(msg, len));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    lua_settop(L, 0);
    lua_rawgeti(L, LUA_REGISTRYINDEX, parse_ref);
    lua_newtable(L);
    lua_Integer n = 0;
    if (size > 0) {
        const char *s = (const char *)data, *end = s + size;
        for (;;) {
            const char *nul = memchr(s, 0, (size_t)(end - s));
            const char *stop = nul ? nul : end;
            lua_pushlstring(L, s, (size_t)(stop - s));
            lua_rawseti(L, -2, ++n);
            if (!nul) break;
            s = nul + 1;
        }
    }
    lua_pushinteger(L, n);
    lua_setfield(L, -2, "n");
    if (lua_pcall(L, 1, 2, 0) != LUA_OK) {
        fprintf(stderr, "cli_fuzz: parse raised: %s\n", lua_tostring(L, -1));
        __builtin_trap();
    }
    if (lua_istable(L, 1)) {
        CHECK(lua_getfield(L, 1, "name") == LUA_TSTRING);
    } else {
        CHECK(lua_isnil(L, 1));
        size_t len = 0;
        const char *msg = lua_tolstring(L, 2, &len);
        check_usage(msg, len);
    }
    lua_settop(L, 0);
    return 0;
}
