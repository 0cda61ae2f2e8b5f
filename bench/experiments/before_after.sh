#!/usr/bin/env bash
# Before/after a change: the same `bench` under an older commit (a git worktree at OLD) and the
# checkout, alternating processes three times, every run with an empty profile folder (so both
# measure their cost curves at load). Usage: bash bench/experiments/before_after.sh OLD_WORKTREE
# (e.g. `git worktree add /tmp/old 918ace1`); results in /tmp/ba/{old,new}-N.json.
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=$root/.venv/bin/python
args="bench --engine $root/engines/smollm2-135m --precision fp32 --drafter ngram+self --draft-tokens 5 --max-new-tokens 64 --limit 12 --repeats 3 --depth 64"
mkdir -p /tmp/ba
for i in 1 2 3; do
  (cd "$1" && PYTHONPATH="$1" DSPARK_PROFILES=/tmp/ba/prof $py -m dspark_edge $args > /tmp/ba/old-$i.json 2>/tmp/ba/old-$i.err)
  (cd "$root" && DSPARK_PROFILES=/tmp/ba/prof $py -m dspark_edge $args > /tmp/ba/new-$i.json 2>/tmp/ba/new-$i.err)
done
echo done
