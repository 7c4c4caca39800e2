--- :checkhealth codecomplete
local M = {}

function M.check()
  local h = vim.health
  h.start('codecomplete')
  if vim.fn.has('nvim-0.10') == 1 then
    h.ok('Neovim ' .. tostring(vim.version()))
  else
    h.error('Neovim 0.10 or newer is required')
  end
  local cc = require('codecomplete')
  local cmd = cc.config.cmd[1]
  if vim.fn.executable(cmd) == 1 then
    local out = vim.fn.system({ cmd, '--version' })
    if vim.v.shell_error == 0 then
      h.ok(vim.trim(out) .. ' (' .. vim.fn.exepath(cmd) .. ')')
    else
      h.error(cmd .. ' --version failed: ' .. vim.trim(out))
    end
  else
    h.error(cmd .. ' is not on PATH', { 'pip install codecomplete-daemon (see its README)', 'or set cmd in setup()' })
  end
  if cc.use_builtin() then
    h.ok('ghost text: built-in vim.lsp.inline_completion')
  else
    h.ok('ghost text: the plugin\'s own (extmarks)')
  end
  local client = cc.client(0)
  if client then
    h.ok(('daemon attached to this buffer (client %d, %s)'):format(client.id, client.offset_encoding))
  else
    h.info('no daemon attached to the current buffer')
  end
end

return M
