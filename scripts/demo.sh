#!/usr/bin/env bash
# The on-device demo on the embedded default model: sets up .venv, exports the engine
# folder when it is missing, then runs examples/on_device_demo.py (extra args pass through).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/env.sh
py=${DSPARK_VENV:-$root/.venv}/bin/python
engine=${DSPARK_ENGINE:-engines/smollm2-135m}
if [ ! -f "$engine/manifest.json" ]; then
  # int4 from the GGUF's own blocks computes FP32's output; --precision auto races it against FP32.
  echo "[demo] exporting the embedded default model to $engine (about 3 minutes)" >&2
  "$py" -m export target --source default --output "$engine" --precisions fp32,int8,int4
fi
weights=${DSPARK_DRAFTER_WEIGHTS:-drafters/smollm2-135m}
if [ -f "$weights/drafter.json" ] && ! "$py" -c "import sys, dspark_edge; sys.exit(dspark_edge.read_manifest('$engine').drafter is None)"; then
  echo "[demo] adding the shipped DSpark drafter ($weights) to $engine" >&2
  "$py" -m export drafter --target "$engine" --weights "$weights"
fi
table=${DSPARK_NGRAM_TABLE:-drafters/smollm2-135m-ngram.npz}
# Installed when the engine folder has none, or has one older than the shipped file that
# differs from it (the project shipped a newer table since); a table built later is kept.
if [ -f "$table" ] && { [ ! -f "$engine/ngram_table.npz" ] || \
     { [ "$table" -nt "$engine/ngram_table.npz" ] && ! cmp -s "$table" "$engine/ngram_table.npz"; }; }; then
  echo "[demo] adding the shipped n-gram table ($table) to $engine" >&2
  "$py" -m export ngram-table --target "$engine" --from "$table"
fi
exec "$py" examples/on_device_demo.py --engine "$engine" "$@"
