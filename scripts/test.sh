#!/usr/bin/env bash
# Run the test suite in a fresh or reused virtual environment.
#   bash scripts/test.sh            # everything: on a fresh clone of a quiet 2-core AMD EPYC (AVX-512), 8 min 7 s wall
#                                   # (2026-12-07: 4 min 58 s of tests in two workers, 2 min 55 s of vLLM tests);
#                                   # a quiet 2-core Intel Xeon took 7 min 14 s for a smaller suite earlier
#   bash scripts/test.sh --fast     # skip the slow end-to-end tests
#   bash scripts/test.sh tests/config/test_config.py -k yaml   # any pytest arguments
#   bash scripts/test.sh tests/rollout   # one package's tests (tests/ mirrors grpo_ascend/'s folders)
# A whole run (no test paths given) also runs the vLLM tests (tests/rollout/vllm_backend/) in a second venv, .venv-vllm:
# vLLM's CPU build pins transformers <5.20, so it cannot share the main venv. GRPO_TEST_VLLM=0 skips them.
# At the end it prints the 15 slowest tests and the wall time (venv and installs included).
set -euo pipefail
start=$(date +%s)
trap 'echo "[test.sh] wall time $(( $(date +%s) - start )) s (venv, install, ruff and pytest)"' EXIT
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_PYTHON="$(command -v "${PYTHON:-python3}")"  # before the main venv is activated: the vLLM venv's base
source "$ROOT/scripts/env.sh" test
cd "$ROOT"
args=()
vllm_args=()
with_vllm="${GRPO_TEST_VLLM:-1}"
for a in "$@"; do
  if [ "$a" = "--fast" ]; then args+=(-m "not slow"); vllm_args+=(-m "not slow"); else args+=("$a"); fi
  case "$a" in tests/*|*.py|*::*) with_vllm=0 ;; esac
done
if [ "$with_vllm" = 1 ]; then
  # Installing vLLM is mostly waiting on the disk and the index: do it while the main suite runs.
  ( GRPO_VENV="$ROOT/.venv-vllm" PYTHON="$BASE_PYTHON" bash -c 'source "$0/scripts/env.sh" test,vllm' "$ROOT" \
      > "$ROOT/.venv-vllm.log" 2>&1 ) &
  vllm_install=$!
fi
ruff check grpo_ascend reward_models tests bench recipes examples
# Two workers by default (GRPO_TEST_WORKERS=0 runs in this process): each test pins one OpenMP thread,
# so a single worker leaves a core idle. Whole files go to one worker, keeping module fixtures built
# once; the longest files start first (tests/conftest.py) so neither worker waits behind the other.
python -m pytest -n "${GRPO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "${args[@]}"
if [ "$with_vllm" = 1 ]; then
  if ! wait "$vllm_install"; then cat "$ROOT/.venv-vllm.log"; echo "[test.sh] installing vLLM failed"; exit 1; fi
  echo "[test.sh] the vLLM tests, in .venv-vllm"
  # Two workers, whole files each: every worker process holds at most one in-process vLLM engine at a time.
  "$ROOT/.venv-vllm/bin/python" -m pytest -p no:cacheprovider -n "${GRPO_TEST_WORKERS:-2}" --dist loadfile \
    --durations=5 tests/rollout/vllm_backend "${vllm_args[@]}"
fi
