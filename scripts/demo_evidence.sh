#!/usr/bin/env bash
# Capture the live demo in a real terminal (tmux, 150x45) and its timeline plot into docs/demo/:
# panel.txt (the final screen as text), panel.ansi (with colours: `cat` it in a terminal),
# timeline.png and rounds.jsonl. Extra arguments pass to the demo (default: --race).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
command -v tmux >/dev/null || { echo "[evidence] needs tmux (apt-get install tmux)" >&2; exit 2; }
bash scripts/env.sh
py=${DSPARK_VENV:-$root/.venv}/bin/python
engine=${DSPARK_ENGINE:-engines/smollm2-135m}
[ -f "$engine/manifest.json" ] || { echo "[evidence] no engine at $engine: run bash scripts/demo.sh once" >&2; exit 2; }
out=docs/demo
mkdir -p "$out"
sock=$(mktemp -u /tmp/dspark-tmux.XXXXXX)
done_file=$(mktemp -u /tmp/dspark-done.XXXXXX)
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--race)
cmd="$py examples/on_device_demo.py --engine $engine --max-new-tokens 96 --plot $out/timeline.png --trace $out/rounds.jsonl ${args[*]}"
tmux -S "$sock" new-session -d -x 150 -y 45 "$cmd; echo \$? > $done_file; sleep 600"
trap 'tmux -S "$sock" kill-server 2>/dev/null || true; rm -f "$done_file"' EXIT
for _ in $(seq 1 600); do [ -f "$done_file" ] && break; sleep 1; done
[ -f "$done_file" ] || { echo "[evidence] the demo did not finish in 10 minutes" >&2; exit 1; }
tmux -S "$sock" capture-pane -p -S -200 | sed -e :a -e '/^\n*$/{$d;N;ba' -e '}' > "$out/panel.txt"
tmux -S "$sock" capture-pane -p -e -S -200 > "$out/panel.ansi"
echo "[evidence] demo exit $(cat "$done_file"); wrote $out/panel.txt, panel.ansi, timeline.png, rounds.jsonl" >&2
