#!/usr/bin/env bash
# Run HERE (not on the device) before a GPU session: the default model's GGUF is ~98 MB and a
# device call carries at most 64 MiB with the tracked tree, so it travels xz-compressed in
# parts (.dev/p1, .dev/p2, ...), one per call, each sized to fit beside the tracked files.
# Also writes .dev/texts.json.xz (layerskip's texts) and .whl/ (wheels the device lacks).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EXCL="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCL")"
for d in /.dev/ /.whl/; do grep -qxF "$d" "$EXCL" 2>/dev/null || echo "$d" >> "$EXCL"; done
mkdir -p .dev .whl
G=$(python3 -c "from codecomplete.model.loader import default_model_path; print(default_model_path())")
[ -f .dev/g.xz ] || xz -6 -T2 -c "$G" > .dev/g.xz
[ -f .dev/texts.json.xz ] || python3 -m codecomplete.model.layerskip --out .dev/texts.json.xz --export-texts 30000000
for pkg in gguf platformdirs; do
  python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "$pkg==$(python3 -m pip show "$pkg" | sed -n 's/^Version: //p')"
done
python3 - <<'PY'
import subprocess
from pathlib import Path
tree = sum(Path(f).stat().st_size for f in subprocess.run(["git", "ls-files"], capture_output=True, text=True,
           check=True).stdout.split("\n") if f and Path(f).is_file())
room = 64 * 2**20 - tree - 8 * 2**20  # 8 MiB for the texts, wheels and scripts of the first call
data = Path(".dev/g.xz").read_bytes()
for i in range(0, len(data), room):
    d = Path(f".dev/p{i // room + 1}")
    d.mkdir(exist_ok=True)
    (d / f"g.xz.{i // room}").write_bytes(data[i:i + room])
print(f"tracked tree {tree / 1e6:.1f} MB; GGUF in {-(-len(data) // room)} parts of <= {room / 1e6:.1f} MB")
PY
sha256sum .dev/g.xz
