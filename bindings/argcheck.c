/* argcheck.c -- argument checks for the binding whose errors start with "relaybus:" (the
 * mark of misuse, docs/lua.md "Errors"), with the same wording as Lua's own: which argument
 * of which function, what was expected, what came. internal.h points the luaL_check* names
 * here. */
#include <string.h>
#include "internal.h"

static int arg_error(lua_State *L, int arg, const char *expected)
{
    lua_Debug ar;
    const char *fname = "?";
    if (lua_getstack(L, 0, &ar)) {
        lua_getinfo(L, "n", &ar);
        if (ar.name) fname = ar.name;
        if (ar.namewhat && strcmp(ar.namewhat, "method") == 0) {
            arg--;      /* do not count self */
            if (arg == 0) return rb_misuse(L, "calling '%s' on a bad self (%s expected, got %s)",
                                           fname, expected, luaL_typename(L, 1));
        }
    }
    return rb_misuse(L, "bad argument #%d to '%s' (%s expected, got %s)", arg, fname, expected,
                     lua_isnone(L, arg) ? "no value" : luaL_typename(L, arg));
}

const char *rb_checklstring(lua_State *L, int arg, size_t *len)
{
    const char *s = lua_tolstring(L, arg, len);
    if (!s) arg_error(L, arg, "string");
    return s;
}

lua_Number rb_checknumber(lua_State *L, int arg)
{
    int ok;
    lua_Number n = lua_tonumberx(L, arg, &ok);
    if (!ok) arg_error(L, arg, "number");
    return n;
}

lua_Integer rb_checkinteger(lua_State *L, int arg)
{
    int ok;
    lua_Integer n = lua_tointegerx(L, arg, &ok);
    if (!ok) arg_error(L, arg, lua_isnumber(L, arg) ? "integer" : "number");
    return n;
}

void rb_checktype(lua_State *L, int arg, int t)
{
    if (lua_type(L, arg) != t) arg_error(L, arg, lua_typename(L, t));
}

void *rb_checkudata(lua_State *L, int arg, const char *tname)
{
    void *p = luaL_testudata(L, arg, tname);
    if (!p) arg_error(L, arg, tname);
    return p;
}

lua_Number rb_optnumber(lua_State *L, int arg, lua_Number def)
{
    return lua_isnoneornil(L, arg) ? def : rb_checknumber(L, arg);
}

const char *rb_optlstring(lua_State *L, int arg, const char *def, size_t *len)
{
    if (lua_isnoneornil(L, arg)) {
        if (len) *len = def ? strlen(def) : 0;
        return def;
    }
    return rb_checklstring(L, arg, len);
}

/* A topic as enqueue takes it: a non-empty string without NUL (stores take C strings: a NUL
 * would cut it short, and a handler's topic would then be another one than enqueued). */
const char *rb_check_topic(lua_State *L, int idx, const char *what)
{
    if (lua_type(L, idx) != LUA_TSTRING || lua_rawlen(L, idx) == 0)
        rb_misuse(L, "%s: topic must be a non-empty string", what);
    const char *topic = lua_tostring(L, idx);
    if (strlen(topic) != lua_rawlen(L, idx)) rb_misuse(L, "%s: topic must not contain a NUL byte", what);
    return topic;
}

int rb_checkoption(lua_State *L, int arg, const char *def, const char *const lst[])
{
    const char *name = def ? rb_optlstring(L, arg, def, NULL) : rb_checklstring(L, arg, NULL);
    for (int i = 0; lst[i]; i++)
        if (strcmp(lst[i], name) == 0) return i;
    return rb_misuse(L, "bad argument #%d (invalid option '%s')", arg, name);
}
