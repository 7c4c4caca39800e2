--- Ghost text for Neovim without vim.lsp.inline_completion (0.10, 0.11), or when the
--- user sets `builtin = false`: request textDocument/inlineCompletion after a pause in
--- typing, draw the item with extmarks (inline text at the cursor, virtual lines below),
--- accept all of it, its next word or the rest of its line, or dismiss it; cycle through
--- the daemon's alternatives (an invoked request, as VS Code's Alt+]). Shown, accepted
--- and rejected items are reported to the daemon. On Neovim 0.12's built-in client, which
--- only asks while typing, cycling draws the alternatives here too.
local M = {}

local ns = vim.api.nvim_create_namespace('codecomplete_ghost')
local state = {} -- bufnr -> { client_id, item, row, col, text, request_id, timer, items, index }

local function cfg()
  return require('codecomplete').config
end

local function call(client, method, ...)
  -- Neovim 0.11 added method syntax (client:request); 0.10 has client.request.
  if vim.fn.has('nvim-0.11') == 1 then
    return client[method](client, ...)
  end
  return client[method](...)
end
M.call = call -- for init.lua's notifications

--- Byte column of an LSP character offset in `line`, for the client's encoding.
local function byte_col(line, character, encoding)
  if encoding == 'utf-8' then
    return math.min(character, #line)
  end
  local units, i = 0, 1
  while i <= #line and units < character do
    local c = line:byte(i)
    local len = c < 0x80 and 1 or c < 0xE0 and 2 or c < 0xF0 and 3 or 4
    units = units + ((encoding == 'utf-16' and len == 4) and 2 or 1)
    i = i + len
  end
  return i - 1
end

local function clear(bufnr)
  local s = state[bufnr]
  if s then
    s.item, s.text, s.cover = nil, nil, nil
  end
  if vim.api.nvim_buf_is_valid(bufnr) then
    vim.api.nvim_buf_clear_namespace(bufnr, ns, 0, -1)
  end
end

local function completion_id(item)
  local args = item and item.command and item.command.arguments
  return args and args[1] and args[1].completionId or nil
end

local function notify(client, method, item, extra)
  local id = completion_id(item)
  if client and id then
    call(client, 'notify', method, vim.tbl_extend('force', { completionId = id }, extra or {}))
  end
end

local PAIRS = { ['('] = ')', ['['] = ']', ['{'] = '}', ['"'] = '"', ["'"] = "'", ['`'] = '`' }

--- The closers of the brackets and quotes `typed` leaves open, innermost first (`foo(bar("` ->
--- `")`), as the daemon's stops.open_pairs: inside quotes only the quote (not after a backslash)
--- closes.
function M.open_pairs(typed)
  local stack, escaped = {}, false
  for ch in typed:gmatch('.') do -- bytes: no byte of a multibyte character is a bracket
    local top = stack[#stack]
    if top and (top == '"' or top == "'" or top == '`') then
      if escaped then
        escaped = false
      elseif ch == '\\' then
        escaped = true
      elseif ch == top then
        stack[#stack] = nil
      end
    elseif PAIRS[ch] then
      stack[#stack + 1] = ch
    elseif top and ch == PAIRS[top] then
      stack[#stack] = nil
    end
  end
  local closers = {}
  for i = #stack, 1, -1 do
    closers[#closers + 1] = PAIRS[stack[i]]
  end
  return table.concat(closers)
end

--- The code after the cursor that an item replaces, from the line after the cursor as it was
--- for the item (`was`: the daemon's `replaces`, the code its range covered, and `after`, what
--- followed): that code, and before it the closers an editor that closes pairs has put there
--- since, of brackets the `typed` text opened (`foo(|)` -> `)`); nil when the text after the
--- cursor (`now`) is anything else.  The item may be older than the last keystrokes (Neovim's own
--- client asks 200 ms after them), so its range alone cannot tell.
function M.covered_since(typed, now, was)
  if type(was) ~= 'table' or type(was.replaces) ~= 'string' or type(was.after) ~= 'string' then
    return nil
  end
  local tail = was.replaces .. was.after
  local k = #now - #tail
  if k < 0 or now:sub(k + 1) ~= tail then
    return nil
  end
  local added = now:sub(1, k)
  if M.open_pairs(typed):sub(1, k) ~= added then
    return nil
  end
  return added .. was.replaces
end

--- An item's `text` at byte `col` of the cursor's `line`, its range starting at byte `start` of
--- that line and ending at byte `stop` (nil: on another row): the text minus what is typed since
--- `start` (nil when the user typed past what the item proposes), and the code after the cursor
--- that the item replaces: what its range covers, or as `covered_since` finds it from `was`
--- (the line after the cursor as it was for the item).
local function at_cursor(line, text, start, stop, col, was)
  local typed = line:sub(start + 1, col)
  local cover = M.covered_since(typed, line:sub(col + 1), was)
    or (stop and stop > col and line:sub(col + 1, stop) or '')
  if text:sub(1, #typed) ~= typed then
    return nil, cover
  end
  return text:sub(#typed + 1), cover
end

--- The line after the cursor as it was for the item, from the daemon's accept command.
local function was_of(item)
  local args = item.command and item.command.arguments
  return type(args) == 'table' and type(args[1]) == 'table' and args[1] or nil
end

--- What the item adds at the cursor (`at_cursor`), for an item as the daemon sent it.
local function remainder(bufnr, item, encoding, row, col)
  local text = type(item.insertText) == 'string' and item.insertText or item.insertText.value
  if not item.range then
    return text, ''
  end
  local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ''
  if item.range.start.line ~= row then
    return nil
  end
  local stop = item.range['end'].line == row and byte_col(line, item.range['end'].character, encoding) or nil
  local rest, cover = at_cursor(line, text, byte_col(line, item.range.start.character, encoding), stop, col,
    was_of(item))
  if not rest then
    return nil
  end
  return rest, cover
end

--- How to draw and insert `text` where the item replaces `cover`, the code right after the
--- cursor (the daemon's range covers it where the completion rewrote that code, or where the
--- editor closed a bracket the completion closes later): a text that ends with that code is
--- drawn and inserted without it, the code staying; any other replaces it when accepted
--- whole (`delete`: the bytes after the cursor to remove first).
function M.fit(text, cover)
  if cover == '' then
    return text, 0
  end
  if #text >= #cover and text:sub(-#cover) == cover then
    return text:sub(1, #text - #cover), 0
  end
  return text, #cover
end

--- How to draw a one-line `text` that replaces `cover` (the code right after the cursor) and
--- does not end with it: the part before the last `cover` in it, drawn at the cursor, and the part
--- after, drawn after that code (`RuntimeError):` over `)`: `RuntimeError` and `:`, so the line
--- reads as accepting makes it); nil when the text does not hold `cover`.
function M.around(text, cover)
  if cover == '' or text:find('\n') then
    return nil
  end
  local at, from = nil, 1
  while true do
    local i = text:find(cover, from, true)
    if not i then
      break
    end
    at, from = i, i + 1
  end
  if not at then
    return nil
  end
  return text:sub(1, at - 1), text:sub(at + #cover)
end

--- Draw `text` as ghost text at byte `col` of `row` (0-based), where it replaces `cover` (the
--- code after the cursor; `delete` > 0: the text does not end with it), with an optional `hint`.
function M.draw(bufnr, row, col, text, cover, delete, hint)
  clear(bufnr)
  local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ''
  local before, after
  if delete > 0 then
    before, after = M.around(text, cover)
  end
  local shape = M.layout(before or text, line:sub(1, col), line:sub(col + 1))
  local virt_lines = {}
  for _, l in ipairs(shape.lines) do
    virt_lines[#virt_lines + 1] = { { l, 'Comment' } }
  end
  local opts = { virt_lines = #virt_lines > 0 and virt_lines or nil, hl_mode = 'combine' }
  if shape.above then
    opts.virt_lines_above = true
    if hint then
      opts.virt_text, opts.virt_text_pos = { { hint, 'NonText' } }, 'eol'
    end
  else
    opts.virt_text = { { shape.inline, 'Comment' } }
    if hint then
      opts.virt_text[2] = { hint, 'NonText' }
    end
    opts.virt_text_pos = 'inline'
  end
  vim.api.nvim_buf_set_extmark(bufnr, ns, row, col, opts)
  if opts.virt_lines_above and row == 0 then
    -- lines above the first line are filler a window shows only when scrolled to them (topfill)
    for _, win in ipairs(vim.fn.win_findbuf(bufnr)) do
      if vim.fn.line('w0', win) == 1 then
        vim.api.nvim_win_call(win, function()
          vim.fn.winrestview({ topfill = #virt_lines })
        end)
      end
    end
  end
  if after and after ~= '' then
    vim.api.nvim_buf_set_extmark(bufnr, ns, row, col + #cover,
      { virt_text = { { after, 'Comment' } }, virt_text_pos = 'inline', hl_mode = 'combine' })
  end
end

local function show(bufnr, client, item, hint)
  local win = vim.api.nvim_get_current_win()
  if vim.api.nvim_win_get_buf(win) ~= bufnr or not vim.api.nvim_get_mode().mode:match('^i') then
    return
  end
  local row, col = unpack(vim.api.nvim_win_get_cursor(win))
  row = row - 1
  local text, cover = remainder(bufnr, item, client.offset_encoding, row, col)
  if not text then
    return
  end
  local delete
  text, delete = M.fit(text, cover)
  if text == '' then
    return
  end
  M.draw(bufnr, row, col, text, cover, delete, hint)
  local s = state[bufnr]
  s.item, s.text, s.row, s.col, s.client_id = item, text, row, col, client.id
  s.cover = delete > 0 and cover or nil
  notify(client, 'codecomplete/didShowCompletion', item)
end

--- Ask for completions at the cursor; `on_items` gets the items (none: not called).
--- Automatic (2) while typing; Invoked (1) when the user asks, which the daemon answers
--- with its alternatives too.
local function request(bufnr, client, kind, on_items)
  local s = state[bufnr]
  if s.request_id then
    call(client, 'cancel_request', s.request_id)
    s.request_id = nil
  end
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  params.context = { triggerKind = kind or 2 }
  local ok, id = call(client, 'request', 'textDocument/inlineCompletion', params, function(err, result)
    s.request_id = nil
    if err or not result then
      return
    end
    local items = result.items or result
    if items[1] then
      on_items(items)
    end
  end, bufnr)
  if ok then
    s.request_id = id
  end
end

local function schedule(bufnr, client)
  local s = state[bufnr]
  if s.item then
    notify(client, 'codecomplete/didRejectCompletion', s.item)
  end
  clear(bufnr)
  if s.timer then
    s.timer:stop()
  end
  s.timer = s.timer or vim.uv.new_timer()
  s.timer:start(cfg().debounce_ms, 0, vim.schedule_wrap(function()
    if vim.api.nvim_buf_is_valid(bufnr) and vim.api.nvim_get_mode().mode:match('^i') then
      request(bufnr, client, 2, function(items)
        s.items, s.index = nil, nil -- the alternatives are asked for when the user cycles
        show(bufnr, client, items[1])
      end)
    end
  end))
end

--- The autocmds both paths need: `moved()` when one of `events` finds the cursor away
--- from where the shown item is, a dismissal when insert mode ends, and the buffer's
--- state dropped when it unloads. Returns the group.
local function track(bufnr, name, events, moved)
  local group = vim.api.nvim_create_augroup(name .. bufnr, { clear = true })
  vim.api.nvim_create_autocmd(events, {
    group = group,
    buffer = bufnr,
    callback = function()
      local s = state[bufnr]
      local row, col = unpack(vim.api.nvim_win_get_cursor(0))
      if s and s.item and (row - 1 ~= s.row or col ~= s.col) then
        moved()
      end
    end,
  })
  vim.api.nvim_create_autocmd({ 'InsertLeave', 'BufLeave' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      M.dismiss(bufnr)
    end,
  })
  vim.api.nvim_create_autocmd('BufUnload', {
    group = group,
    buffer = bufnr,
    callback = function()
      local s = state[bufnr]
      if s and s.timer then
        s.timer:close()
      end
      state[bufnr] = nil
    end,
  })
  return group
end

--- Whether the user is typing in `bufnr` now (keys typed before the daemon attached fired
--- no request on either path: nothing listened yet).
local function typing_in(bufnr)
  return vim.api.nvim_get_current_buf() == bufnr and vim.api.nvim_get_mode().mode:match('^i') ~= nil
end

function M.attach(client, bufnr)
  if state[bufnr] then
    return
  end
  state[bufnr] = {}
  local group = track(bufnr, 'codecomplete_ghost_', 'CursorMovedI', function()
    schedule(bufnr, client)
  end)
  vim.api.nvim_create_autocmd({ 'InsertEnter', 'TextChangedI' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      schedule(bufnr, client)
    end,
  })
  if typing_in(bufnr) then
    schedule(bufnr, client) -- as the keystroke that came before the daemon attached would have
  end
end

--- For Neovim 0.12's built-in client: drop ghost text drawn here (an alternative) when
--- the cursor moves or insert mode ends, as the attached path does.
local function watch(bufnr)
  if state[bufnr] then
    return
  end
  state[bufnr] = {}
  track(bufnr, 'codecomplete_cycle_', { 'TextChangedI', 'CursorMovedI' }, function()
    M.dismiss(bufnr)
  end)
end

--- Show `items[index]` in place of what is shown (passed over), with its place among them.
local function present(bufnr, client, items, index)
  local s = state[bufnr]
  if s.item then
    notify(client, 'codecomplete/didRejectCompletion', s.item)
  end
  show(bufnr, client, items[index], #items > 1 and (' (%d/%d)'):format(index, #items) or nil)
  s.items, s.index = items, index
end

--- Show the next (count > 0) or previous completion at the cursor. The first time at a
--- position it asks the daemon as the user's own request (Invoked), which brings its
--- alternatives; then it cycles through them, wrapping around. Returns false when no
--- daemon is attached to the buffer.
function M.cycle(client, count)
  local bufnr = vim.api.nvim_get_current_buf()
  if not client then
    return false
  end
  watch(bufnr)
  local s = state[bufnr]
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  if s.items and s.row == row - 1 and s.col == col and #s.items > 1 then
    present(bufnr, client, s.items, (s.index - 1 + count) % #s.items + 1)
    return true
  end
  request(bufnr, client, 1, function(items)
    local r, c = unpack(vim.api.nvim_win_get_cursor(0))
    if r ~= row or c ~= col then
      return -- the user went on typing
    end
    local n = #items
    present(bufnr, client, items, n == 1 and 1 or (count > 0 and 2 or n))
  end)
  return true
end

--- For Neovim 0.12's built-in client, once the daemon has attached to `bufnr`: if the user is
--- already typing there, ask as a keystroke would and draw the answer here (the built-in
--- client asks only on its own events, which came before it listened).
function M.attached(client, bufnr)
  if not typing_in(bufnr) then
    return
  end
  watch(bufnr)
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  request(bufnr, client, 2, function(items)
    local r, c = unpack(vim.api.nvim_win_get_cursor(0))
    if r == row and c == col and typing_in(bufnr) then
      show(bufnr, client, items[1])
    end
  end)
end

--- How to draw `text` at a cursor with `before` and `after` on its row: `inline` at the cursor
--- and `lines` below it; or, where the text is whole lines to insert above code the cursor
--- stands in front of (only indentation before it, the text ending in a line break and
--- indentation: the daemon's answer there), those `lines` above the row (`above`), each as
--- it will read, so the code after the cursor is not drawn as if joined to the text.
function M.layout(text, before, after)
  local lines = vim.split(text, '\n', { plain = true })
  if #lines > 1 and before:match('^%s*$') and after:match('%S') and lines[#lines]:match('^%s*$') then
    local above = {}
    for i = 1, #lines - 1 do
      above[i] = (i == 1 and before or '') .. lines[i]
    end
    return { above = true, inline = '', lines = above }
  end
  return { above = false, inline = lines[1], lines = vim.list_slice(lines, 2) }
end

--- The part of `text` to take: everything, the next word, or up to the end of its line.
function M.take(text, part)
  if part == 'word' then
    local ws, rest = text:match('^(%s*)(.*)$')
    local word = rest:match('^[%w_]+') or rest:match('^[^%w_%s]+') or ''
    return ws .. word
  elseif part == 'line' then
    local first, nl = text:match('^([^\n]*)(\n?)')
    if first:match('^%s*$') and nl == '\n' then
      return first .. nl .. (text:sub(#first + 2):match('^[^\n]*') or '')
    end
    return first
  end
  return text
end

local function insert_at_cursor(text)
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  local lines = vim.split(text, '\n', { plain = true })
  vim.api.nvim_buf_set_text(0, row - 1, col, row - 1, col, lines)
  local last = lines[#lines]
  local new_row = row + #lines - 1
  local new_col = (#lines == 1 and col or 0) + #last
  vim.api.nvim_win_set_cursor(0, { new_row, new_col })
end

--- Insert `take`, all or part of the item's `text`, at the cursor and tell the daemon: its accept
--- command counts a whole acceptance, a part is reported with its length.  Accepting the whole
--- first removes `cover` (nil: none), the code after the cursor the item replaces (a bracket the
--- editor closed), where it still stands there.
local function accept_at_cursor(bufnr, client, item, text, take, cover)
  if cover and take == text then
    local row, col = unpack(vim.api.nvim_win_get_cursor(0))
    local line = vim.api.nvim_buf_get_lines(0, row - 1, row, false)[1] or ''
    if line:sub(col + 1, col + #cover) == cover then
      vim.api.nvim_buf_set_text(0, row - 1, col, row - 1, col + #cover, { '' })
    end
  end
  insert_at_cursor(take)
  if client and take == text and item.command then
    call(client, 'request', 'workspace/executeCommand',
      { command = item.command.command, arguments = item.command.arguments }, function() end, bufnr)
  elseif client then
    notify(client, 'textDocument/didPartiallyAcceptCompletion', item, { acceptedLength = #take })
  end
end

function M.accept(part)
  local bufnr = vim.api.nvim_get_current_buf()
  local s = state[bufnr]
  if not s or not s.item then
    return false
  end
  local item, text, cover = s.item, s.text, s.cover
  local client = vim.lsp.get_client_by_id(s.client_id)
  clear(bufnr)
  local take = M.take(text, part)
  vim.schedule(function()
    accept_at_cursor(bufnr, client, item, text, take, cover)
  end)
  return true
end

--- For the built-in client's on_accept: insert all or part of its current item at the cursor.
--- The item may be older than the last keystrokes (Neovim asks again 200 ms after them, and its
--- own accept then applies the old range, inserting what was typed since a second time): what was
--- typed since its range started is not inserted again; where its range covers code after the
--- cursor (a bracket the editor closed), accepting it whole replaces that code.
function M.insert_partial(item, part)
  local bufnr = vim.api.nvim_get_current_buf()
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  local client = vim.lsp.get_client_by_id(item.client_id)
  local text = type(item.insert_text) == 'string' and item.insert_text or tostring(item.insert_text.value)
  local cover = ''
  if item.range then
    -- a vim.Range: rows 0-based, columns in bytes; a range starting on another row: nothing typed
    local start, stop = item.range.start, item.range.end_
    local line = vim.api.nvim_buf_get_lines(bufnr, row - 1, row, false)[1] or ''
    local rest
    rest, cover = at_cursor(line, text, start.row == row - 1 and start.col or col,
      stop.row == row - 1 and stop.col or nil, col, was_of(item))
    text = rest or text
  end
  local delete
  text, delete = M.fit(text, cover)
  accept_at_cursor(bufnr, client, item, text, M.take(text, part), delete > 0 and cover or nil)
end

function M.dismiss(bufnr)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  local s = state[bufnr]
  if not s or not s.item then
    return false
  end
  local client = vim.lsp.get_client_by_id(s.client_id)
  notify(client, 'codecomplete/didRejectCompletion', s.item)
  clear(bufnr)
  return true
end

function M.dismiss_builtin()
  local ns_ids = vim.api.nvim_get_namespaces()
  local id = ns_ids['nvim.lsp.inline_completion']
  if not id then
    return false
  end
  local marks = vim.api.nvim_buf_get_extmarks(0, id, 0, -1, {})
  vim.api.nvim_buf_clear_namespace(0, id, 0, -1)
  return #marks > 0
end

--- Which of the daemon's completions is shown (1-based) and how many there are, after
--- cycling; nil when none or not cycled (for tests and statuslines).
function M.position(bufnr)
  local s = state[bufnr == nil or bufnr == 0 and vim.api.nvim_get_current_buf() or bufnr]
  if not s or not s.item or not s.items then
    return nil
  end
  return s.index, #s.items
end

--- Whether ghost text is shown in a buffer (for tests and statuslines).
function M.visible(bufnr)
  if bufnr == nil or bufnr == 0 then
    bufnr = vim.api.nvim_get_current_buf()
  end
  local s = state[bufnr]
  return s ~= nil and s.item ~= nil
end

return M
