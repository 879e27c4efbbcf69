#!/usr/bin/env bash
# Run the test suite in a fresh or reused virtual environment.
#   bash scripts/test.sh            # everything (CPU, about 20 minutes on a fresh 2-core machine, two workers)
#   bash scripts/test.sh --fast     # skip the slow end-to-end tests
#   bash scripts/test.sh tests/test_config.py -k yaml   # any pytest arguments
# At the end it prints the 15 slowest tests and the wall time (venv and installs included).
set -euo pipefail
start=$(date +%s)
trap 'echo "[test.sh] wall time $(( $(date +%s) - start )) s (venv, install, ruff and pytest)"' EXIT
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh" test
cd "$ROOT"
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
ruff check grpo_ascend reward_models tests bench recipes examples
# Two workers by default (GRPO_TEST_WORKERS=0 runs in this process): each test pins one OpenMP thread,
# so a single worker leaves a core idle. Whole files go to one worker, keeping module fixtures built
# once; the longest files start first (tests/conftest.py) so neither worker waits behind the other.
python -m pytest -n "${GRPO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "${args[@]}"
