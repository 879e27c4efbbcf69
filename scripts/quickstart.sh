#!/usr/bin/env bash
# The main job: GRPO on the built-in tiny model and synthetic arithmetic task (offline, CPU OK),
# then a plot. Outputs in outputs/default/: metrics.jsonl, samples.jsonl, plot.png, checkpoints,
# and the exported LoRA adapter in adapter/.
#   bash scripts/quickstart.sh                      # the default recipe
#   bash scripts/quickstart.sh --max_steps 20       # any recipe key can be overridden
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh" plot
# The built-in model is tiny: one thread is as fast as several and does not thrash when the CPU is
# shared. Export OMP_NUM_THREADS yourself for larger models.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$ROOT"
OUT="outputs/default"
for ((i = 1; i <= $#; i++)); do
  if [ "${!i}" = "--output_dir" ]; then j=$((i + 1)); OUT="${!j}"; fi
done
rm -rf "$OUT"
grpo-ascend train recipes/default.yaml "$@"
grpo-ascend plot "$OUT" --smooth 5
