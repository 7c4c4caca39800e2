-- Shared by the headless Neovim test scripts (loaded with dofile).
local M = {}

--- Call `cond` every `every` ms until it is true or `timeout` ms have passed, then `done(ok)`.
function M.poll(cond, done, timeout, every)
  every = every or 20
  local start, t = vim.uv.now(), vim.uv.new_timer()
  t:start(every, every, vim.schedule_wrap(function()
    local ok = cond()
    if ok or vim.uv.now() - start > timeout then
      t:stop()
      t:close()
      done(ok)
    end
  end))
end

--- The daemon's codecomplete/stats through `client` (nil if it did not answer in 5 s).
function M.stats(client)
  local res = vim.fn.has('nvim-0.11') == 1 and client:request_sync('codecomplete/stats', {}, 5000, 0)
    or client.request_sync('codecomplete/stats', {}, 5000, 0)
  return res and res.result
end

--- Write `result` (with the buffer's lines) to $CC_OUT as JSON, and quit.
function M.finish(result)
  result.lines = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  local f = assert(io.open(vim.env.CC_OUT, 'w'))
  f:write(vim.json.encode(result))
  f:close()
  vim.cmd('qa!')
end

return M
