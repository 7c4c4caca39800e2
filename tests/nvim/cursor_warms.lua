-- Headless Neovim: open a file, move the cursor to a line in normal mode and leave it there;
-- the plugin tells the daemon (codecomplete/didMoveCursor), which prefills the prompt at the
-- cursor. Writes the daemon's stats to $CC_OUT as JSON.
local env = vim.env
vim.opt.rtp:prepend(env.CC_PLUGIN)
local cc = require('codecomplete')
cc.setup({ cmd = vim.json.decode(env.CC_CMD), builtin = env.CC_BUILTIN == '1', cursor_ms = 50 })

local helpers = dofile(debug.getinfo(1, 'S').source:sub(2):match('(.*/)') .. 'helpers.lua')
local function poll(cond, done, timeout)
  helpers.poll(cond, done, timeout, 50)
end

local function stats()
  return helpers.stats(cc.client(0))
end

local result = {}
local function finish()
  helpers.finish(result)
end

vim.cmd('edit ' .. env.CC_FILE)
poll(function()
  local client = cc.client(0)
  local s = client and stats()
  return s and s.engine and s.engine.ready
end, function(ready)
  result.attached = cc.client(0) ~= nil
  if not ready then
    return finish()
  end
  vim.api.nvim_win_set_cursor(0, { tonumber(env.CC_ROW), 4 })
  vim.api.nvim_exec_autocmds('CursorMoved', { buffer = 0 }) -- as a user's motion fires it
  poll(function()
    result.stats = stats()
    -- a warm-up the user's next move stops after a piece counts too: wait for the prompt's tokens
    return result.stats and result.stats.engine.warm_prefills > 0 and result.stats.engine.warm_tokens > 100
  end, function()
    finish()
  end, 60000)
end, 60000)
