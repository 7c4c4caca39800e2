-- codecomplete.nvim is configured with require('codecomplete').setup({...}); nothing
-- starts until then.
if vim.g.loaded_codecomplete then
  return
end
vim.g.loaded_codecomplete = true
