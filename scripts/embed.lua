-- embed.lua NAME FILE: prints FILE as a C string constant NAME, so the command carries its
-- Lua code inside the binary.
local name, path = arg[1], arg[2]
local f = assert(io.open(path, "rb"))
local src = f:read("a")
f:close()
io.write("static const char ", name, "[] = {\n")
local n = 0
for i = 1, #src do
  io.write(string.byte(src, i), ",")
  n = n + 1
  if n % 24 == 0 then io.write("\n") end
end
io.write("0};\n")
