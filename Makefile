# relaybus -- build the command, the Lua module and the C library.
#   make            build/relaybus, build/relaybus.so and the optional parts beside them
#                   (build/relaybus_{pg,mongo,http,serve}.so), build/librelaybus.{a,so},
#                   build/relaybus.pc
#   make test       the specs (scripts/test.sh)
#   make bench      benchmarks that print figures (bench/run.sh)
#   make asan       the same artefacts with AddressSanitizer/UBSan in build-asan/
#   make tsan       the library and build-tsan/threads_host with ThreadSanitizer
#   make fuzz       libFuzzer targets (fuzz/*_fuzz.c) in build-fuzz/fuzz/ (scripts/fuzz.sh runs them)
#   make ctest      the C tests (spec/c/*_test.c, cmocka) in $(BUILD)/ctest/; with
#                   BUILD=build-asan they get the sanitizer flags of `make asan`
PREFIX  ?= /usr/local
BUILD   ?= build
CC      ?= cc
# The core's libraries, then each optional part's (runtime/plugin/plugin.h): the command and the Lua
# module load those parts from relaybus_NAME.so on first use; the C libraries link them in.
CORE_PKGS  = lua5.4 sqlite3 jansson
PG_PKGS    = libpq
MONGO_PKGS = libmongoc-1.0
HTTP_PKGS  = libcurl libcrypto
SERVE_PKGS = libmicrohttpd
PKGS     = $(CORE_PKGS) $(PG_PKGS) $(MONGO_PKGS) $(HTTP_PKGS) $(SERVE_PKGS)
ASAN_SANITIZE = -fsanitize=address,undefined -fno-omit-frame-pointer
ASAN_OPT      = -O1 -g
# build-asan always holds the sanitized build, whichever target makes it.
ifeq ($(BUILD),build-asan)
SANITIZE ?= $(ASAN_SANITIZE)
OPT      ?= $(ASAN_OPT)
DEBUG_DEFS = -DRB_DEBUG           # internal checks (the run state machine) that abort
endif
OPT     ?= -O2 -g
CFLAGS  ?=
# pkg-config runs once per make, not once per object (:=).
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS))
LDLIBS     := $(shell pkg-config --libs $(PKGS)) -lev -lm -lpthread
CORE_LDLIBS := $(shell pkg-config --libs $(CORE_PKGS)) -lev -lm -lpthread -ldl
# -MMD -MP: each object depends on the headers it includes (build/**/*.d), nothing more.
ALL_CFLAGS = $(OPT) $(CFLAGS) $(DEBUG_DEFS) -std=c11 -D_GNU_SOURCE -Wall -Wextra -fPIC -MMD -MP \
             -Iruntime -Ibindings -I$(BUILD) -I/usr/include/postgresql $(PKG_CFLAGS)
SANITIZE ?=
ALL_CFLAGS += $(SANITIZE)
# A generator that fails (say lua5.4 not installed yet) must not leave an empty header behind
# that the next make would trust.
.DELETE_ON_ERROR:
LDFLAGS += $(SANITIZE)

# runtime/ is in folders by layer (docs/c.md, "The layers"); each optional part is a folder
# of its own and becomes relaybus_NAME.so: stores/pg, stores/mongo, http (its transport;
# http_text.c, the texts, stays in the core) and serve.
# plugin_dlopen.c is the command's and the Lua module's; the libraries have plugin_static.c.
RUNTIME_SRC  = $(filter-out runtime/plugin/plugin_dlopen.c,$(wildcard runtime/*/*.c runtime/*/*/*.c))
BINDING_SRC  = $(wildcard bindings/*.c)
RUNTIME_OBJ  = $(RUNTIME_SRC:%.c=$(BUILD)/%.o)
BINDING_OBJ  = $(BINDING_SRC:%.c=$(BUILD)/%.o)
# The optional parts' objects, and the core the command and the Lua module are made of.
PG_OBJ       = $(patsubst %.c,$(BUILD)/%.o,$(wildcard runtime/stores/pg/*.c))
MONGO_OBJ    = $(patsubst %.c,$(BUILD)/%.o,$(wildcard runtime/stores/mongo/*.c))
HTTP_OBJ     = $(BUILD)/runtime/http/http.o
SERVE_OBJ    = $(patsubst %.c,$(BUILD)/%.o,$(wildcard runtime/serve/*.c))
PLUGIN_OBJ   = $(PG_OBJ) $(MONGO_OBJ) $(HTTP_OBJ) $(SERVE_OBJ)
CORE_OBJ     = $(filter-out $(PLUGIN_OBJ) $(BUILD)/runtime/plugin/plugin_static.o,$(RUNTIME_OBJ)) \
               $(BUILD)/runtime/plugin/plugin_dlopen.o $(BINDING_OBJ)
PLUGINS      = $(BUILD)/relaybus_pg.so $(BUILD)/relaybus_mongo.so $(BUILD)/relaybus_http.so \
               $(BUILD)/relaybus_serve.so
# ar keeps one member per file name: two sources of one name would lose one of them.
ifneq ($(words $(notdir $(RUNTIME_SRC) $(BINDING_SRC))),$(words $(sort $(notdir $(RUNTIME_SRC) $(BINDING_SRC)))))
$(error two sources in runtime/ and bindings/ share a file name; the archive would keep one)
endif
# The dependency files -MMD wrote (absent on a first build).
-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

all: $(BUILD)/relaybus $(BUILD)/relaybus.so $(PLUGINS) $(BUILD)/librelaybus.a \
     $(BUILD)/librelaybus.so $(BUILD)/relaybus.pc

# What luarocks builds (relaybus-scm-1.rockspec): the Lua module and its optional parts.
lua-module: $(BUILD)/relaybus.so $(PLUGINS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

# The command's CLI is a Lua script compiled into the binary.
$(BUILD)/cli_lua.h: cmd/cli.lua scripts/embed.lua
	@mkdir -p $(BUILD)
	lua5.4 scripts/embed.lua cli_lua $< > $@

# The module's Lua parts are compiled in as well.
$(BUILD)/prelude_lua.h: bindings/lua/prelude.lua scripts/embed.lua
	@mkdir -p $(BUILD)
	lua5.4 scripts/embed.lua prelude_lua $< > $@

$(BUILD)/webhook_lua.h: bindings/lua/webhook.lua scripts/embed.lua
	@mkdir -p $(BUILD)
	lua5.4 scripts/embed.lua webhook_lua $< > $@

# The dashboard's page, compiled in: nothing is fetched from anywhere else.
DASHBOARD_ASSETS = runtime/serve/dashboard/index.html runtime/serve/dashboard/app.js runtime/serve/dashboard/app.css
$(BUILD)/dashboard_assets.h: $(DASHBOARD_ASSETS) scripts/embed.lua
	@mkdir -p $(BUILD)
	{ lua5.4 scripts/embed.lua dashboard_html runtime/serve/dashboard/index.html && \
	  lua5.4 scripts/embed.lua dashboard_js runtime/serve/dashboard/app.js && \
	  lua5.4 scripts/embed.lua dashboard_css runtime/serve/dashboard/app.css; } > $@

$(BUILD)/runtime/serve/dashboard.o: runtime/serve/dashboard.c $(BUILD)/dashboard_assets.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/bindings/module.o: bindings/module.c $(BUILD)/prelude_lua.h $(BUILD)/webhook_lua.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/cmd/main.o: cmd/main.c $(BUILD)/cli_lua.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/librelaybus.a: $(RUNTIME_OBJ) $(BINDING_OBJ)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/librelaybus.so: $(RUNTIME_OBJ) $(BINDING_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(LDLIBS)

# The Lua module: the host interpreter provides the Lua symbols.
$(BUILD)/relaybus.so: $(CORE_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(filter-out -llua5.4,$(CORE_LDLIBS))

# -E: the plugins (and Lua C modules) call the command's own functions.
$(BUILD)/relaybus: $(BUILD)/cmd/main.o $(CORE_OBJ)
	$(CC) $(LDFLAGS) -Wl,-E -o $@ $^ $(CORE_LDLIBS)

# The optional parts: what they call of relaybus itself comes from the command or the module
# that loads them.
$(BUILD)/relaybus_pg.so: $(PG_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(shell pkg-config --libs $(PG_PKGS))
$(BUILD)/relaybus_mongo.so: $(MONGO_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(shell pkg-config --libs $(MONGO_PKGS))
$(BUILD)/relaybus_http.so: $(HTTP_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(shell pkg-config --libs $(HTTP_PKGS))
$(BUILD)/relaybus_serve.so: $(SERVE_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(shell pkg-config --libs $(SERVE_PKGS))

# pkg-config files: the prefix is the one given to the make that writes them, so install
# writes them again for its own PREFIX. The libraries relaybus needs are listed as linker
# flags, not as Requires.private: pkg-config --static would ask for libpq's own private
# archives (-lpgport, -lgssapi_krb5), which Debian does not ship.
VERSION      = $(shell sed -n 's/^\#define RB_VERSION "\(.*\)"/\1/p' runtime/relaybus.h)
PRIVATE_LIBS = $(filter-out -llua5.4,$(LDLIBS))
define write_pc
	sed -e 's|@PREFIX@|$(1)|g' -e 's|@VERSION@|$(VERSION)|g' -e 's|@PRIVATE_LIBS@|$(PRIVATE_LIBS)|g' $(2) > $(3)
endef

$(BUILD)/relaybus.pc: relaybus.pc.in runtime/relaybus.h Makefile
	$(call write_pc,$(PREFIX),$<,$@)

$(BUILD)/embed_host: examples/embed_host.c $(BUILD)/librelaybus.a
	$(CC) $(ALL_CFLAGS) -o $@ $< $(BUILD)/librelaybus.a $(LDFLAGS) $(LDLIBS)

# A small HTTP server the specs and benchmarks talk to.
$(BUILD)/http_receiver: spec/support/http_receiver.c
	@mkdir -p $(BUILD)
	$(CC) $(OPT) -std=c11 -Wall -Wextra -o $@ $< -lev

# Spec helpers on libmongoc: one lists a database's collections (specs that check nothing was
# created), one plants documents behind the MongoDB store's back (spec/mongo_tickets_spec.lua),
# one enqueues as an application's own driver would (spec/mongo_native_spec.lua).
$(BUILD)/mongo_collections: spec/support/mongo_collections.c
	@mkdir -p $(BUILD)
	$(CC) $(OPT) -std=c11 -D_GNU_SOURCE -Wall -Wextra $(shell pkg-config --cflags libmongoc-1.0) -o $@ $< \
	  $(shell pkg-config --libs libmongoc-1.0)

$(BUILD)/mongo_insert: spec/support/mongo_insert.c
	@mkdir -p $(BUILD)
	$(CC) $(OPT) -std=c11 -D_GNU_SOURCE -Wall -Wextra $(shell pkg-config --cflags libmongoc-1.0) -o $@ $< \
	  $(shell pkg-config --libs libmongoc-1.0)

$(BUILD)/mongo_enqueue: spec/support/mongo_enqueue.c
	@mkdir -p $(BUILD)
	$(CC) $(OPT) -std=c11 -D_GNU_SOURCE -Wall -Wextra $(shell pkg-config --cflags libmongoc-1.0) -o $@ $< \
	  $(shell pkg-config --libs libmongoc-1.0)

# What only the tests use, and nothing of relaybus ships (testing/): the fault-injecting
# store as a library for C (librelaybus_testing.a), and the Lua module relaybus_testing the
# specs load. The module calls relaybus's own functions, which the command or the module that
# loaded it provides, as for the optional parts.
# The allocation calls with a failure to inject (testing/alloc_faults.c) take the place of
# util/alloc.c's: in C by coming first on the link line, in Lua as relaybus_allocfail.so,
# which the specs load globally before relaybus.so (runtime/util/alloc.h says why that works).
TESTING_OBJ = $(BUILD)/testing/lua_testing.o $(BUILD)/testing/store_faults.o
$(BUILD)/librelaybus_testing.a: $(BUILD)/testing/store_faults.o $(BUILD)/testing/alloc_faults.o
	rm -f $@ && ar rcs $@ $^

$(BUILD)/relaybus_allocfail.so: $(BUILD)/testing/alloc_faults.o
	$(CC) -shared $(LDFLAGS) -o $@ $^

# -z nodelete: a Lua state closing unloads its C modules, and what the fault store's
# registry still holds would then count as leaked.
$(BUILD)/relaybus_testing.so: $(TESTING_OBJ)
	$(CC) -shared $(LDFLAGS) -Wl,-z,nodelete -o $@ $^

testing: $(BUILD)/relaybus_testing.so $(BUILD)/relaybus_allocfail.so $(BUILD)/librelaybus_testing.a

# Checks the contract checks of the fault-injecting store against a store that breaks them.
$(BUILD)/faults_contract: spec/support/faults_contract.c $(BUILD)/librelaybus_testing.a $(BUILD)/librelaybus.a
	$(CC) $(ALL_CFLAGS) -Itesting -o $@ $< $(BUILD)/librelaybus_testing.a $(BUILD)/librelaybus.a \
	  $(LDFLAGS) $(LDLIBS)

# Hosts that drive the pollable runtime from loops of their own (docs/c.md, "Stepping"):
# a poll() frame loop, libuv, and four threads with a runtime each. They run
# examples/workload.lua; examples/luv_host.lua and examples/cqueues_host.lua need no build.
HOST_DEPS = examples/workload_host.h $(BUILD)/librelaybus.a
$(BUILD)/frame_host: examples/frame_host.c $(HOST_DEPS)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(BUILD)/librelaybus.a $(LDFLAGS) $(LDLIBS)

$(BUILD)/uv_host: examples/uv_host.c $(HOST_DEPS)
	$(CC) $(ALL_CFLAGS) $(shell pkg-config --cflags libuv) -o $@ $< $(BUILD)/librelaybus.a $(LDFLAGS) \
	  $(LDLIBS) $(shell pkg-config --libs libuv)

$(BUILD)/threads_host: examples/threads_host.c $(HOST_DEPS)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(BUILD)/librelaybus.a $(LDFLAGS) $(LDLIBS)

HOSTS = $(BUILD)/frame_host $(BUILD)/uv_host $(BUILD)/threads_host

examples: $(BUILD)/embed_host $(BUILD)/http_receiver $(BUILD)/mongo_collections $(BUILD)/mongo_insert \
          $(BUILD)/mongo_enqueue $(BUILD)/faults_contract $(HOSTS) testing

# The headers a host includes, installed side by side in include/relaybus/ (relaybus.h includes
# them as relaybus/NAME.h, and they one another as NAME.h); nothing internal.
PUBLIC_HEADERS = runtime/stores/delivery.h runtime/stores/store.h runtime/util/clock.h runtime/dispatch/dispatcher.h \
                 runtime/stores/leases.h runtime/http/http.h \
                 runtime/dispatch/metrics.h runtime/util/buf.h runtime/serve/dashboard.h

# C tests: each spec/c/NAME_test.c is one cmocka program, linked with the shared harness and
# the static library. scripts/test.sh runs them with TAP output.
CTEST_SRC  = $(wildcard spec/c/*_test.c)
CTEST_BINS = $(CTEST_SRC:spec/c/%.c=$(BUILD)/ctest/%)
CTEST_LIBS := $(shell pkg-config --libs cmocka 2>/dev/null || echo -lcmocka)

ctest: $(CTEST_BINS)

# alloc_pg_test is alloc_test.c built for PostgreSQL.
$(BUILD)/ctest/alloc_pg_test: spec/c/alloc_test.c

$(BUILD)/ctest/harness.o: spec/c/harness.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itesting -c $< -o $@

$(BUILD)/ctest/%: spec/c/%.c spec/c/harness.h $(BUILD)/ctest/harness.o $(BUILD)/librelaybus_testing.a \
                 $(BUILD)/librelaybus.a
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itesting -o $@ $< $(BUILD)/ctest/harness.o $(BUILD)/librelaybus_testing.a \
	  $(BUILD)/librelaybus.a $(LDFLAGS) $(LDLIBS) $(CTEST_LIBS)

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig \
	  $(DESTDIR)$(PREFIX)/include/relaybus $(DESTDIR)$(PREFIX)/lib/lua/5.4
	install -m755 $(BUILD)/relaybus $(DESTDIR)$(PREFIX)/bin/
	install -m644 $(BUILD)/librelaybus.a $(BUILD)/librelaybus.so $(DESTDIR)$(PREFIX)/lib/
	install -m644 $(BUILD)/relaybus.so $(PLUGINS) $(DESTDIR)$(PREFIX)/lib/lua/5.4/
	$(call write_pc,$(PREFIX),relaybus.pc.in,$(DESTDIR)$(PREFIX)/lib/pkgconfig/relaybus.pc)
	$(call write_pc,$(PREFIX),relaybus-static.pc.in,$(DESTDIR)$(PREFIX)/lib/pkgconfig/relaybus-static.pc)
	sed 's|^#include "\([a-z]*/\)*\(.*\)"|#include "relaybus/\2"|' runtime/relaybus.h \
	  > $(DESTDIR)$(PREFIX)/include/relaybus.h
	for h in $(PUBLIC_HEADERS); do \
	  sed 's|^#include "\([a-z]*/\)*\(.*\)"|#include "\2"|' $$h > $(DESTDIR)$(PREFIX)/include/relaybus/$$(basename $$h) || exit 1; \
	done

test: all examples ctest
	scripts/test.sh

bench: all examples $(BUILD)/bench_jansson.so
	bench/run.sh

# Jansson's own encoder as a Lua module, for bench/json.lua's comparison only.
$(BUILD)/bench_jansson.so: bench/jansson_lua.c
	@mkdir -p $(BUILD)
	$(CC) $(ALL_CFLAGS) -shared $(LDFLAGS) -o $@ $< -ljansson

asan:
	$(MAKE) BUILD=build-asan SANITIZE="$(ASAN_SANITIZE)" OPT="$(ASAN_OPT)" all examples ctest

# ThreadSanitizer: the library and threads_host (several runtimes on threads of one process)
# in build-tsan/; scripts/test.sh runs it. It runs clean without suppressions.
TSAN_SANITIZE = -fsanitize=thread -fno-omit-frame-pointer
tsan:
	$(MAKE) BUILD=build-tsan SANITIZE="$(TSAN_SANITIZE)" OPT="-O1 -g" DEBUG_DEFS=-DRB_DEBUG \
	  build-tsan/librelaybus.a build-tsan/threads_host

# Fuzz targets: each fuzz/NAME_fuzz.c links against the library built by clang with the
# fuzzer's coverage and ASan/UBSan; its seed corpus is fuzz/corpus/NAME/.
FUZZ_SAN   = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_SRC   = $(wildcard fuzz/*_fuzz.c)
FUZZ_BINS  = $(FUZZ_SRC:fuzz/%_fuzz.c=build-fuzz/fuzz/%)

# The targets may include cli_lua.h (the command's CLI, for its parser).
fuzz:
	$(MAKE) BUILD=build-fuzz CC=clang OPT="-O1 -g" DEBUG_DEFS=-DRB_DEBUG SANITIZE="-fsanitize=fuzzer-no-link $(FUZZ_SAN)" \
	  build-fuzz/librelaybus.a build-fuzz/cli_lua.h
	$(MAKE) $(FUZZ_BINS)

build-fuzz/fuzz/%: fuzz/%_fuzz.c build-fuzz/librelaybus.a build-fuzz/cli_lua.h
	@mkdir -p $(dir $@)
	clang -O1 -g -std=c11 -D_GNU_SOURCE -Wall -Wextra -fsanitize=fuzzer $(FUZZ_SAN) -Iruntime \
	  -Ibindings -Ibuild-fuzz $(shell pkg-config --cflags $(PKGS)) -o $@ $< build-fuzz/librelaybus.a \
	  $(LDLIBS)

clean:
	rm -rf build build-asan build-fuzz build-tsan

.PHONY: all lua-module examples testing ctest install test bench asan tsan fuzz clean
