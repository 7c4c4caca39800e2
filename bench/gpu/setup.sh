# sourced on the device machine, in the repository's copy (bench/gpu/README.md): makes codecomplete importable
# (the subpackages are mapped by pyproject.toml; here by links) and installs carried wheels
for d in daemon lsp indexer model; do [ -e codecomplete/$d ] || ln -s ../$d codecomplete/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
