#!/usr/bin/env bash
# The test suite: sets up .venv, runs ruff's static checks, then pytest (extra args pass through, e.g. -m "not slow").
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/env.sh
venv=${DSPARK_VENV:-$root/.venv}
# Static check first (undefined names, unused imports, syntax errors): cheap and loud.
"$venv/bin/ruff" check --select F,E9 dspark_edge dspark_export export tests examples bench
exec "$venv/bin/python" -m pytest "$@"
