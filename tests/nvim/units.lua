-- Unit checks of the plugin's pure pieces and its health check, in headless Neovim.
vim.opt.rtp:prepend(vim.env.CC_PLUGIN)
local ghost = require('codecomplete.ghost')
local results = {}
local function check(name, got, want)
  results[#results + 1] = { name = name, ok = got == want, got = got, want = want }
end
check('word', ghost.take('foo(bar)', 'word'), 'foo')
check('word leading space', ghost.take('  bar.baz', 'word'), '  bar')
check('word punctuation', ghost.take('(x)', 'word'), '(')
check('line', ghost.take('a = 1\nb = 2', 'line'), 'a = 1')
check('line from newline', ghost.take('\n    b = 2\nc', 'line'), '\n    b = 2')
check('all', ghost.take('a\nb', 'all'), 'a\nb')
-- layout: a line to insert above the code after the cursor is drawn above the row
local l = ghost.layout('x = 1\n    ', '    ', 'return x')
check('above', l.above, true)
check('above lines', table.concat(l.lines, '|'), '    x = 1')
l = ghost.layout('import os\nimport re\n', '', 'from x import y')
check('above two', table.concat(l.lines, '|'), 'import os|import re')
l = ghost.layout('(a, b)\n    return c', 'f', '')
check('inline', l.above, false)
check('inline text', l.inline .. '|' .. table.concat(l.lines, '|'), '(a, b)|    return c')
l = ghost.layout('x, \n', 'foo(', 'y)')  -- code before the cursor: drawn inline as before
check('mid-line inline', l.above, false)
-- fit: an item whose range covers code after the cursor (the daemon's rewrite of it, or a bracket
-- the editor closed) is drawn without that code when it ends with it, else replaces it on accept
local t, d = ghost.fit('path);', ');')
check('fit rewrite', t .. '|' .. d, 'path|0')
t, d = ghost.fit('(v) => v * 2);', ')')
check('fit replace', t .. '|' .. d, '(v) => v * 2);|1')
t, d = ghost.fit('x = 1', '')
check('fit none', t .. '|' .. d, 'x = 1|0')
require('codecomplete').setup({ cmd = { vim.env.CC_DAEMON } })
vim.cmd('checkhealth codecomplete')
local health = table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\n')
results[#results + 1] = { name = 'health', ok = health:find('codecomplete%-daemon %d') ~= nil, got = health }
local f = assert(io.open(vim.env.CC_OUT, 'w'))
f:write(vim.json.encode(results))
f:close()
vim.cmd('qa!')
