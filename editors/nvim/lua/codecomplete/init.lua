--- codecomplete.nvim: inline (ghost-text) completions from codecomplete-daemon.
---
--- require('codecomplete').setup({ ... }) starts the daemon as an LSP client for the
--- buffers it covers. On Neovim 0.12+ the built-in vim.lsp.inline_completion draws and
--- accepts completions; on 0.10/0.11 (or with `builtin = false`) this plugin requests
--- textDocument/inlineCompletion itself and draws ghost text with extmarks.
local M = {}

M.defaults = {
  cmd = { 'codecomplete-daemon' }, -- the daemon; the workspace root is sent in initialize
  args = {}, -- extra daemon arguments, e.g. { '--dtype', 'bfloat16' }
  model = nil, -- --model NAME_OR_PATH
  filetypes = nil, -- nil: every buffer with a file
  root_markers = { '.git', 'pyproject.toml', 'package.json', 'go.mod', 'Cargo.toml' },
  settings = {}, -- daemon settings (see the daemon's README), sent as initializationOptions
  builtin = nil, -- nil: use vim.lsp.inline_completion when Neovim has it
  debounce_ms = 75, -- fallback client: wait this long after a keystroke
  cursor_ms = 150, -- tell the daemon where the cursor rests this long (it prefills there); 0: never
  keymaps = {
    accept = '<Tab>',
    accept_word = '<M-Right>',
    accept_line = '<M-C-Right>',
    dismiss = '<C-]>',
    next = '<M-]>', -- ask for the daemon's alternatives and cycle through them
    prev = '<M-[>',
  },
}

M.config = vim.deepcopy(M.defaults)

local function has_builtin()
  return vim.lsp.inline_completion ~= nil and vim.lsp.inline_completion.enable ~= nil
end

function M.use_builtin()
  if M.config.builtin == nil then
    return has_builtin()
  end
  return M.config.builtin and has_builtin()
end

local function command()
  local cmd = vim.list_extend(vim.deepcopy(M.config.cmd), M.config.args or {})
  if M.config.model then
    vim.list_extend(cmd, { '--model', M.config.model })
  end
  return cmd
end

--- The LSP client of the daemon attached to a buffer, if any.
function M.client(bufnr)
  local get = vim.lsp.get_clients or vim.lsp.get_active_clients
  return get({ bufnr = bufnr or 0, name = 'codecomplete' })[1]
end

--- codecomplete/didMoveCursor where the cursor rests (in normal mode for `cursor_ms`, or on
--- entering insert mode) on another line than last time: the daemon prefills the prompt
--- there, so the first keystroke's completion after navigating does not wait for it.
local function track_cursor(client, bufnr)
  local wait = M.config.cursor_ms
  if not wait or wait <= 0 then
    return
  end
  local seq, last = 0, nil
  local function send()
    if not vim.api.nvim_buf_is_valid(bufnr) or vim.api.nvim_get_current_buf() ~= bufnr then
      return
    end
    local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
    if last == params.position.line then
      return
    end
    last = params.position.line
    require('codecomplete.ghost').call(client, 'notify', 'codecomplete/didMoveCursor', params)
  end
  local function send_once_still()
    seq = seq + 1
    local mine = seq
    vim.defer_fn(function()
      if mine == seq then
        send()
      end
    end, wait)
  end
  local group = vim.api.nvim_create_augroup('codecomplete_cursor_' .. bufnr, { clear = true })
  vim.api.nvim_create_autocmd({ 'CursorMoved', 'BufEnter' }, {
    group = group,
    buffer = bufnr,
    callback = send_once_still,
  })
  vim.api.nvim_create_autocmd('InsertEnter', { group = group, buffer = bufnr, callback = send })
  -- and where it rests as the daemon attaches (the file was opened there, before the daemon
  -- answered): no motion tells it until the user moves, and the first completion there would
  -- wait for a cold prompt
  send_once_still()
end

local function on_attach(client, bufnr)
  local ghost = require('codecomplete.ghost')
  if not M.use_builtin() then
    ghost.attach(client, bufnr) -- asks at once if the user is already typing
  else
    -- after the built-in client's own attach (scheduled by Neovim): typing that began before
    -- the daemon answered gets its completion now, not at the next key
    vim.schedule(function()
      if vim.api.nvim_buf_is_valid(bufnr) then
        ghost.attached(client, bufnr)
      end
    end)
  end
  track_cursor(client, bufnr)
end

local function client_config()
  return {
    name = 'codecomplete',
    cmd = command(),
    filetypes = M.config.filetypes,
    root_markers = M.config.root_markers,
    -- Inline completions are this plugin's (or 0.12's built-in client's) job: saying so
    -- keeps the daemon from also answering textDocument/completion (nvim-cmp and the
    -- like), which would run the model twice per keystroke.
    capabilities = vim.tbl_deep_extend('force', vim.lsp.protocol.make_client_capabilities(),
      { textDocument = { inlineCompletion = { dynamicRegistration = false } } }),
    init_options = { codecomplete = M.config.settings },
    settings = { codecomplete = M.config.settings },
    on_attach = on_attach,
  }
end

local function start_legacy(bufnr)
  -- Neovim 0.10: no vim.lsp.config; start (or reuse) a client per root.
  if vim.bo[bufnr].buftype ~= '' or vim.api.nvim_buf_get_name(bufnr) == '' then
    return
  end
  local fts = M.config.filetypes
  if fts and not vim.tbl_contains(fts, vim.bo[bufnr].filetype) then
    return
  end
  local cfg = client_config()
  cfg.root_dir = vim.fs.root(bufnr, M.config.root_markers) or vim.fn.getcwd()
  vim.lsp.start(cfg, { bufnr = bufnr })
end

--- Accept the shown completion: all of it, the next word, or the rest of its line.
--- Returns false when nothing is shown (so a mapping can fall back to the key).
function M.accept(part)
  local ghost = require('codecomplete.ghost')
  if M.use_builtin() and not ghost.visible(0) then
    -- inserted by the plugin, not by Neovim's accept: the item may predate the last keystrokes
    return vim.lsp.inline_completion.get({
      on_accept = function(item)
        require('codecomplete.ghost').insert_partial(item, part or 'all')
      end,
    })
  end
  return require('codecomplete.ghost').accept(part)
end

--- Show the next (count 1) or previous (-1) completion: the first time at a position it
--- asks the daemon for its alternatives (an invoked request), then cycles through them.
function M.cycle(count)
  local client = M.client(0)
  if not client then
    return false
  end
  if M.use_builtin() then
    -- the built-in client asks only while typing (one completion): draw the others here
    require('codecomplete.ghost').dismiss_builtin()
  end
  return require('codecomplete.ghost').cycle(client, count or 1)
end

function M.dismiss()
  if M.use_builtin() and not require('codecomplete.ghost').visible(0) then
    -- Leaving nothing shown: the built-in client clears on the next request.
    return require('codecomplete.ghost').dismiss_builtin()
  end
  return require('codecomplete.ghost').dismiss()
end

local function map(lhs, fn, fallback)
  if not lhs or lhs == '' then
    return
  end
  vim.keymap.set('i', lhs, function()
    if not fn() then
      return vim.keycode(fallback or lhs)
    end
    return ''
  end, { expr = true, silent = true, desc = 'codecomplete: ' .. lhs })
end

function M.setup(opts)
  M.config = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts or {})
  if vim.lsp.config and vim.lsp.enable then
    vim.lsp.config('codecomplete', client_config())
    vim.lsp.enable('codecomplete')
  else
    vim.api.nvim_create_autocmd({ 'BufReadPost', 'BufNewFile' }, {
      group = vim.api.nvim_create_augroup('codecomplete_start', { clear = true }),
      callback = function(ev)
        start_legacy(ev.buf)
      end,
    })
  end
  if M.use_builtin() then
    vim.lsp.inline_completion.enable(true)
  end
  local k = M.config.keymaps or {}
  map(k.accept, function()
    return M.accept('all')
  end)
  map(k.accept_word, function()
    return M.accept('word')
  end)
  map(k.accept_line, function()
    return M.accept('line')
  end)
  map(k.dismiss, M.dismiss)
  map(k.next, function()
    return M.cycle(1)
  end)
  map(k.prev, function()
    return M.cycle(-1)
  end)
  vim.api.nvim_create_user_command('CodecompleteStats', function()
    local client = M.client(0)
    if not client then
      vim.notify('codecomplete: no daemon attached to this buffer', vim.log.levels.WARN)
      return
    end
    local res = client.request_sync and client.request_sync('codecomplete/stats', {}, 5000, 0)
      or client:request_sync('codecomplete/stats', {}, 5000, 0)
    vim.print(res and res.result or res)
  end, { desc = "Show codecomplete-daemon's counters" })
end

return M
