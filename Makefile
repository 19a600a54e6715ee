# relaybus -- build the command, the Lua module and the C library.
#   make            build/relaybus, build/relaybus.so, build/librelaybus.{a,so}, build/relaybus.pc
#   make test       the specs (scripts/test.sh)
#   make bench      benchmarks that print figures (bench/run.sh)
#   make asan       the same artefacts with AddressSanitizer/UBSan in build-asan/
PREFIX  ?= /usr/local
BUILD   ?= build
CC      ?= cc
PKGS     = lua5.4 sqlite3 libpq libmongoc-1.0 libcurl libcrypto
OPT     ?= -O2 -g
CFLAGS  ?=
ALL_CFLAGS = $(OPT) $(CFLAGS) -std=c11 -D_GNU_SOURCE -Wall -Wextra -fPIC -Iruntime -Ibindings -I$(BUILD) \
           -I/usr/include/postgresql $(shell pkg-config --cflags $(PKGS))
LDLIBS   = $(shell pkg-config --libs $(PKGS)) -lev -lm -lpthread
SANITIZE ?=
ALL_CFLAGS += $(SANITIZE)
# A generator that fails (say lua5.4 not installed yet) must not leave an empty header behind
# that the next make would trust.
.DELETE_ON_ERROR:
LDFLAGS += $(SANITIZE)

RUNTIME_SRC  = $(wildcard runtime/*.c)
BINDING_SRC  = $(wildcard bindings/*.c)
RUNTIME_OBJ  = $(RUNTIME_SRC:%.c=$(BUILD)/%.o)
BINDING_OBJ  = $(BINDING_SRC:%.c=$(BUILD)/%.o)
HEADERS      = $(wildcard runtime/*.h bindings/*.h)

all: $(BUILD)/relaybus $(BUILD)/relaybus.so $(BUILD)/librelaybus.a $(BUILD)/librelaybus.so \
     $(BUILD)/relaybus.pc

$(BUILD)/%.o: %.c $(HEADERS)
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

$(BUILD)/bindings/module.o: bindings/module.c $(BUILD)/prelude_lua.h $(BUILD)/webhook_lua.h $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/cmd/main.o: cmd/main.c $(BUILD)/cli_lua.h $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/librelaybus.a: $(RUNTIME_OBJ) $(BINDING_OBJ)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/librelaybus.so: $(RUNTIME_OBJ) $(BINDING_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(LDLIBS)

# The Lua module: the host interpreter provides the Lua symbols.
$(BUILD)/relaybus.so: $(RUNTIME_OBJ) $(BINDING_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(filter-out -llua5.4,$(LDLIBS))

$(BUILD)/relaybus: $(BUILD)/cmd/main.o $(RUNTIME_OBJ) $(BINDING_OBJ)
	$(CC) $(LDFLAGS) -Wl,-E -o $@ $^ $(LDLIBS)

$(BUILD)/relaybus.pc: relaybus.pc.in
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@PKGS@|$(PKGS)|g' $< > $@

$(BUILD)/embed_host: examples/embed_host.c $(BUILD)/librelaybus.a
	$(CC) $(ALL_CFLAGS) -o $@ $< $(BUILD)/librelaybus.a $(LDFLAGS) $(LDLIBS)

# A small HTTP server the specs and benchmarks talk to.
$(BUILD)/http_receiver: spec/support/http_receiver.c
	@mkdir -p $(BUILD)
	$(CC) $(OPT) -std=c11 -Wall -Wextra -o $@ $< -lev

examples: $(BUILD)/embed_host $(BUILD)/http_receiver

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig \
	  $(DESTDIR)$(PREFIX)/include/relaybus $(DESTDIR)$(PREFIX)/lib/lua/5.4
	install -m755 $(BUILD)/relaybus $(DESTDIR)$(PREFIX)/bin/
	install -m644 $(BUILD)/librelaybus.a $(BUILD)/librelaybus.so $(DESTDIR)$(PREFIX)/lib/
	install -m644 $(BUILD)/relaybus.so $(DESTDIR)$(PREFIX)/lib/lua/5.4/
	install -m644 $(BUILD)/relaybus.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/
	install -m644 runtime/relaybus.h $(DESTDIR)$(PREFIX)/include/
	install -m644 runtime/*.h bindings/*.h $(DESTDIR)$(PREFIX)/include/relaybus/

test: all examples
	scripts/test.sh

bench: all
	bench/run.sh

asan:
	$(MAKE) BUILD=build-asan SANITIZE="-fsanitize=address,undefined -fno-omit-frame-pointer" OPT="-O1 -g" all examples

clean:
	rm -rf build build-asan

.PHONY: all examples install test bench asan clean
