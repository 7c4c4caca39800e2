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
-- around: a one-line text that replaces the closer after the cursor and goes on past it is drawn
-- in two parts, before and after that closer
local a, b = ghost.around('RuntimeError):', ')')
check('around header', a .. '|' .. b, 'RuntimeError|:')
a, b = ghost.around('f(x), g(y)) {', ')')
check('around last', a .. '|' .. b, 'f(x), g(y)| {')
check('around none', tostring(ghost.around("'nof\"", ')')), 'nil')
check('around lines', tostring(ghost.around('x\n});', '})')), 'nil')
-- draw: `class Exit(|)` with `RuntimeError):` over the `)`: `RuntimeError` at the cursor, `:` after the `)`
local buf = vim.api.nvim_create_buf(false, true)
vim.api.nvim_buf_set_lines(buf, 0, -1, false, { 'class Exit()' })
ghost.draw(buf, 0, 11, 'RuntimeError):', ')', 1)
local drawn = {}
for _, m in ipairs(vim.api.nvim_buf_get_extmarks(buf, -1, 0, -1, { details = true })) do
  drawn[#drawn + 1] = m[3] .. '=' .. m[4].virt_text[1][1]
end
check('draw around', table.concat(drawn, ' '), '11=RuntimeError 12=:')
ghost.draw(buf, 0, 11, "'nof\"", ')', 1) -- does not hold the closer: drawn whole at the cursor
drawn = {}
for _, m in ipairs(vim.api.nvim_buf_get_extmarks(buf, -1, 0, -1, { details = true })) do
  drawn[#drawn + 1] = m[3] .. '=' .. m[4].virt_text[1][1]
end
check('draw whole', table.concat(drawn, ' '), "11='nof\"")
-- draw above the first line: the window scrolls to show those lines (filler above line 1 is
-- hidden unless the view's topfill covers it)
local top = vim.api.nvim_create_buf(false, true)
vim.api.nvim_win_set_buf(0, top)
vim.api.nvim_buf_set_lines(top, 0, -1, false, { 'from x import y', 'z = 1' })
vim.api.nvim_win_set_cursor(0, { 1, 0 })
ghost.draw(top, 0, 0, 'import os\nimport re\n', '', 0)
vim.cmd('redraw')
local screen = {}
for r = 1, 3 do
  local chars = {}
  for c = 1, 15 do
    chars[#chars + 1] = vim.fn.screenstring(r, c)
  end
  screen[#screen + 1] = vim.trim(table.concat(chars))
end
check('draw above the first line', table.concat(screen, '|'), 'import os|import re|from x import y')
-- open_pairs: the daemon's stops.open_pairs on the cases the test sends (typed, its closers)
for i, case in ipairs(vim.json.decode(vim.env.CC_PAIRS_CASES or '[]')) do
  check('open_pairs ' .. i .. ' ' .. case[1], ghost.open_pairs(case[1]), case[2])
end
-- covered_since: what an item replaces after the cursor, given the line after the cursor as it
-- was for the item (replaces: the code its range covered; after: what followed)
local was = { replaces = '', after = '' }
check('since closer', ghost.covered_since('    self.group(', ')', was), ')')
check('since two', ghost.covered_since('x = f(g[', '])', was), '])')
check('since unchanged', ghost.covered_since('x = f(', '', was), '')
check('since not a closer', tostring(ghost.covered_since('x = f(', ']', was)), 'nil')
-- a `)` that was there already is not taken for one the editor put there
was = { replaces = '', after = ')' }
check('since was there', ghost.covered_since('print(len(', ')', was), '')
check('since was there, closed', ghost.covered_since('print(len(', '))', was), ')')
-- the code the range covered stays covered, after the new closers
was = { replaces = ');', after = '' }
check('since covered', ghost.covered_since('foo(x, [', ']);', was), ']);')
check('since fresh', ghost.covered_since('foo(', ');', was), ');')
check('since changed', tostring(ghost.covered_since('foo(', ')', was)), 'nil')
check('since no line', tostring(ghost.covered_since('foo(', ')', nil)), 'nil')
require('codecomplete').setup({ cmd = { vim.env.CC_DAEMON } })
vim.cmd('checkhealth codecomplete')
local health = table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\n')
results[#results + 1] = { name = 'health', ok = health:find('codecomplete%-daemon %d') ~= nil, got = health }
local f = assert(io.open(vim.env.CC_OUT, 'w'))
f:write(vim.json.encode(results))
f:close()
vim.cmd('qa!')
