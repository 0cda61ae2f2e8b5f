#!/usr/bin/env bash
# The test suite: sets up .venv, then runs pytest (extra args pass through, e.g. -m "not slow").
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/env.sh
exec "${DSPARK_VENV:-$root/.venv}/bin/python" -m pytest "$@"
