-- Headless Neovim: open a file with the cursor on a line and leave it there while the daemon
-- starts and attaches; the plugin tells the daemon where the cursor rests at attach
-- (codecomplete/didMoveCursor, no motion needed), and the daemon prefills the prompt there.
-- Writes the daemon's stats to $CC_OUT as JSON.
local env = vim.env
vim.opt.rtp:prepend(env.CC_PLUGIN)
local cc = require('codecomplete')
cc.setup({ cmd = vim.json.decode(env.CC_CMD), builtin = env.CC_BUILTIN == '1', cursor_ms = 50 })

local helpers = dofile(debug.getinfo(1, 'S').source:sub(2):match('(.*/)') .. 'helpers.lua')

local function stats()
  return helpers.stats(cc.client(0))
end

local result = {}
vim.cmd('edit +' .. env.CC_ROW .. ' ' .. env.CC_FILE)
helpers.poll(function()
  local client = cc.client(0)
  result.stats = client and stats()
  -- a warm-up stopped after a piece (another one came) counts too: wait for the prompt's tokens
  return result.stats and result.stats.engine and result.stats.engine.warm_prefills > 0
    and result.stats.engine.warm_tokens > 100
end, function()
  result.attached = cc.client(0) ~= nil
  result.row = vim.api.nvim_win_get_cursor(0)[1]
  helpers.finish(result)
end, 60000, 50)
