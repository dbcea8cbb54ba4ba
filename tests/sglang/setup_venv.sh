#!/usr/bin/env bash
# Builds (once) the virtualenv of the CPU SGLang test lane and prints its path.
#
# The lane runs the real SGLang 0.5.23 engine on CPU (SGLANG_USE_CPU_ENGINE=1) in a virtualenv of
# its own, so that SGLang's pins (transformers 5.19.0, ...) never change the main environment.
# - torch: the CPU build 2.13.0 through tools/install.py (PyPI's CPU wheel index, else the plain
#   pin where that cannot be reached); every later step runs under a constraint that keeps it.
# - everything else: tests/sglang/requirements-cpu.lock, exact versions, --no-deps.
# - two stand-ins for CUDA-only pieces SGLang imports but never calls on CPU (docs/engines.md):
#   tests/sglang/standins/sgl_kernel (its functions record the call and raise) is copied in, and
#   torchvision's two unguarded CUDA-op meta registrations get the `_has_ops()` guard the rest of
#   that file already uses.
# The venv lives in ${MEGAPPO_SGLANG_VENV:-~/.cache/megappo/sglang-cpu-<hash of these inputs>} and
# is reused while the inputs are unchanged (a .ready file marks a finished build).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
torch_spec="torch==2.13.0"
key=$(cat "$0" "$here/../../tools/install.py" "$here/requirements-cpu.lock" "$here"/standins/sgl_kernel/*.py | sha256sum | cut -c1-12)
venv="${MEGAPPO_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megappo/sglang-cpu-$key}"
if [ -f "$venv/.ready" ]; then echo "$venv"; exit 0; fi

log() { echo "setup_venv: $*" >&2; }
log "building the CPU SGLang lane's virtualenv in $venv (once; about 2 minutes)"
rm -rf "$venv"
"$python" -m venv "$venv"
py="$venv/bin/python"
pip() {  # quiet unless it fails
  local log; log=$(mktemp)
  if ! "$py" -m pip --disable-pip-version-check -q "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}

"$python" "$here/../../tools/install.py" --python "$py" --torch "$torch_spec" --flavour cpu --torch-only >&2
"$py" - <<'PY'
import torch, sys
if torch.version.cuda is not None:
    sys.exit(f"setup_venv: got a CUDA torch ({torch.__version__}); the lane needs the CPU build")
PY
"$py" -c "import torch; print(f'torch=={torch.__version__}')" > "$venv/constraints.txt"
pip install --no-deps -c "$venv/constraints.txt" -r "$here/requirements-cpu.lock"

site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp -r "$here/standins/sgl_kernel" "$site/"
"$py" - "$site/torchvision/_meta_registrations.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
for op in ("nms", "qnms"):
    old = f'@torch.library.register_fake("torchvision::{op}")'
    new = f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f))'
    if text.count(old) != 1:
        sys.exit(f"setup_venv: torchvision's {path} changed; expected one '{old}'")
    text = text.replace(old, new + "  # megappo CPU lane")
open(path, "w").write(text)
PY
SGLANG_USE_CPU_ENGINE=1 "$py" -c "import sglang.srt.entrypoints.engine, sgl_kernel, torchvision, megatron.core, transformers" >&2
touch "$venv/.ready"
log "ready"
echo "$venv"
