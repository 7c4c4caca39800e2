-- Headless Neovim: type at the end of a line, wait for ghost text from the daemon,
-- accept it with a key, and write what happened to $CC_OUT as JSON.
local env = vim.env
vim.opt.rtp:prepend(env.CC_PLUGIN)
if env.CC_BUILTIN ~= '1' then
  -- as on Neovim 0.10/0.11, whose default client capabilities have no inlineCompletion
  local make = vim.lsp.protocol.make_client_capabilities
  vim.lsp.protocol.make_client_capabilities = function()
    local caps = make()
    caps.textDocument.inlineCompletion = nil
    return caps
  end
end
local cc = require('codecomplete')
cc.setup({
  cmd = vim.json.decode(env.CC_CMD),
  builtin = env.CC_BUILTIN == '1',
  debounce_ms = 10,
  keymaps = { accept = '<Tab>', accept_word = '<M-Right>', next = '<M-]>' },
})

local helpers = dofile(debug.getinfo(1, 'S').source:sub(2):match('(.*/)') .. 'helpers.lua')
local poll = helpers.poll

local function builtin_visible()
  if not cc.use_builtin() then
    return false
  end
  local ns = vim.api.nvim_get_namespaces()['nvim.lsp.inline_completion']
  return ns ~= nil and #vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, {}) > 0
end

local function ghost_visible()
  if require('codecomplete.ghost').visible(0) then
    return true -- the plugin's own drawing (on 0.12 too: alternatives, the first request after attach)
  end
  return builtin_visible()
end

local result = { builtin = cc.use_builtin() }
local function finish()
  local client = cc.client(0)
  if client then
    result.stats = helpers.stats(client)
    -- what a completion-menu plugin (nvim-cmp) attached to the same client would get
    local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
    local menu = vim.fn.has('nvim-0.11') == 1 and client:request_sync('textDocument/completion', params, 5000, 0)
      or client.request_sync('textDocument/completion', params, 5000, 0)
    local list = menu and menu.result
    result.menu_items = list and #(list.items or list) or -1
  end
  helpers.finish(result)
end

vim.cmd('edit ' .. env.CC_FILE)
local function type_keys()
  vim.api.nvim_win_set_cursor(0, { tonumber(env.CC_ROW), 0 })
  vim.api.nvim_feedkeys('A' .. env.CC_TYPE, 'n', false)
end
if env.CC_EARLY == '1' then
  type_keys() -- before the daemon has answered initialize: the user types as the editor opens
end
poll(function()
  return cc.client(0) ~= nil
end, function(attached)
  result.attached = attached
  if not attached then
    return finish()
  end
  if env.CC_EARLY ~= '1' then
    type_keys()
  end
  poll(ghost_visible, function(shown)
    result.shown = shown
    result.typed_line = vim.api.nvim_get_current_line()
    if not shown then
      return finish()
    end
    local function accept()
      vim.api.nvim_feedkeys(vim.keycode(env.CC_ACCEPT or '<Tab>'), 'm', false)
      poll(function()
        return vim.api.nvim_get_current_line() ~= result.typed_line
      end, function()
        vim.defer_fn(finish, 300) -- let the accept command reach the daemon
      end, 5000)
    end
    if env.CC_PAIRS then
      -- type the completion up to its bracket with pairs closed as autopairs plugins do (`(` brings
      -- `)`, the cursor between): the daemon types through, its item covering that `)`
      vim.keymap.set('i', '(', '()<Left>')
      local want = result.typed_line .. env.CC_PAIRS .. (env.CC_PAIRS:sub(-1) == '(' and ')' or '')
      if env.CC_PAIRS_NOW == '1' then
        -- accept at once, before Neovim's own client asks again: its item is the one from before
        -- the typing, and the `)` the mapping put after the cursor is not in its range
        local want = result.typed_line .. env.CC_PAIRS .. ')'
        local ghost = require('codecomplete.ghost')
        local insert_partial = ghost.insert_partial
        ghost.insert_partial = function(item, part)
          -- the item Neovim accepts: its range ends before the cursor when it predates the typing
          result.item_end_col = item.range and item.range.end_.col
          result.cursor_col = vim.api.nvim_win_get_cursor(0)[2]
          return insert_partial(item, part)
        end
        -- the ghost text shown may be the plugin's own (its request when the client attached while
        -- typing, perhaps answered late): dismiss it, and wait for Neovim's item, the one this is
        -- about, with none of the plugin's for 300 ms
        local clean = 0
        return poll(function()
          if ghost.visible(0) then
            ghost.dismiss(0)
            clean = 0
          end
          clean = builtin_visible() and clean + 1 or 0
          return clean >= 15
        end, function(builtin_item)
          result.builtin_item = builtin_item
          if not builtin_item then
            return finish()
          end
          vim.api.nvim_feedkeys(env.CC_PAIRS, 'm', false)
          poll(function()
            return vim.api.nvim_get_current_line() == want
          end, function()
            result.paired_line = vim.api.nvim_get_current_line()
            result.typed_line = result.paired_line
            accept()
          end, 5000, 5)
        end, 30000)
      end
      vim.api.nvim_feedkeys(env.CC_PAIRS, 'm', false)
      -- accept once the daemon has answered a request made after the typing (Neovim's own client
      -- asks 200 ms after the last key; until then its item is the one from before)
      local through, asking = 0, false
      return poll(function()
        if vim.api.nvim_get_current_line() ~= want or not ghost_visible() then
          return false
        end
        local client = cc.client(0)
        if not asking and client then
          asking = true
          local function got(_, res)
            through, asking = res and res.counters.typed_through or through, false
          end
          if vim.fn.has('nvim-0.11') == 1 then
            client:request('codecomplete/stats', {}, got, 0)
          else
            client.request('codecomplete/stats', {}, got, 0)
          end
        end
        return through >= 1
      end, function(again)
        result.paired_line, result.shown_again = vim.api.nvim_get_current_line(), again
        if not again then
          return finish()
        end
        result.typed_line = result.paired_line
        vim.defer_fn(accept, 150)
      end, 30000)
    end
    if env.CC_CYCLE ~= '1' then
      return accept()
    end
    -- ask for the alternatives (the next key), then accept the one shown
    vim.api.nvim_feedkeys(vim.keycode('<M-]>'), 'm', false)
    poll(function()
      return require('codecomplete.ghost').position(0) ~= nil
    end, function(cycled)
      result.position = { require('codecomplete.ghost').position(0) }
      if not cycled then
        return finish()
      end
      accept()
    end, 30000)
  end, 60000)
end, 60000)
