# Shared by scripts/*.sh: create or reuse a virtual environment with grpo-ascend installed.
#
# If the invoking python already imports torch (e.g. an Ascend CANN environment with torch +
# torch_npu), the venv sees it through --system-site-packages and no torch is installed.
# Otherwise torch is installed from $GRPO_TORCH_SPEC (default: the CPU build torch==2.13.0).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRPO_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-test}"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "[env] using the torch already installed for $PYTHON (venv with --system-site-packages)"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[env] installing ${GRPO_TORCH_SPEC:-torch==2.13.0}"
  python -m pip install -q "${GRPO_TORCH_SPEC:-torch==2.13.0}"
fi
stamp="$VENV/.grpo-ascend-$EXTRAS-$(cat "$ROOT/pyproject.toml" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  echo "[env] installing grpo-ascend[$EXTRAS]"
  python -m pip install -q -e "$ROOT[$EXTRAS]"
  touch "$stamp"
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
