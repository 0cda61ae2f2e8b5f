#!/usr/bin/env bash
# The drafter campaign's joined answers file, rebuilt from the folders committed under drafters/
# (drafters/README.md records each step as it was first made): runs/answers-all11.npz, 71,383
# answers whose indices every campaign run's --data-from and held-out draw refer to. A fresh
# machine needs it before the next run; each step's file is kept in runs/ and reused when present.
#   bash scripts/campaign_answers.sh [ENGINE]     (default engines/smollm2-135m; exported if missing)
# Do not run it while `python -m export data` writes to drafters/smollm2-135m-data or -openers.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/env.sh
py=${DSPARK_VENV:-$root/.venv}/bin/python
engine=${1:-engines/smollm2-135m}
if [ ! -f "$engine/manifest.json" ]; then
  "$py" -m export target --source default --output "$engine" --precisions fp32,int8,int4
fi
mkdir -p runs
data=drafters/smollm2-135m-data

step() {  # step OUTPUT EXPECTED COMMAND...: run COMMAND unless OUTPUT exists, then check its count
  local out=$1 want=$2
  shift 2
  if [ ! -f "$out" ]; then
    echo "[campaign] $out" >&2
    "$@"
  fi
  local got
  got=$("$py" -c "import numpy as np, sys; print(len(np.load(sys.argv[1])['offsets']) - 1)" "$out")
  if [ "$got" != "$want" ]; then
    echo "[campaign] error: $out holds $got answers, not $want: the committed folders changed; see drafters/README.md" >&2
    exit 1
  fi
}

pack() {  # pack N OUTPUT: the data folder's first N answers
  "$py" -m export data --target "$engine" --work "$data" --answers 1 --pack-first "$1" --output "$2"
}

pack_openers() {  # pack_openers N OUTPUT: the openers folder's first N answers (needs the options it was made with)
  "$py" -m export data --target "$engine" --work drafters/smollm2-135m-openers --prompts 0 --copy-prompts 0 \
    --openers --answers 1 --pack-first "$1" --output "$2"
}

merge() {  # merge OUTPUT FILE...: later files' answers whose prompts an earlier one has are dropped
  local out=$1
  shift
  "$py" -m export answers --target "$engine" --merge "$@" --output "$out"
}

step runs/answers-9216.npz 9216 pack 9216 runs/answers-9216.npz
step runs/answers-all.npz 32753 merge runs/answers-all.npz runs/answers-9216.npz drafters/smollm2-135m-gpu/answers.npz
step runs/answers-tasks.npz 2304 "$py" -m export data --target "$engine" --work drafters/smollm2-135m-tasks \
  --prompts 0 --copy-prompts 0 --tasks 2560 --passages runs/answers-all.npz --answers 2304 --output runs/answers-tasks.npz
step runs/answers-all2.npz 35057 merge runs/answers-all2.npz runs/answers-all.npz runs/answers-tasks.npz
step runs/answers-data-full.npz 13056 pack 13056 runs/answers-data-full.npz
step runs/answers-all3.npz 38892 merge runs/answers-all3.npz runs/answers-all2.npz runs/answers-data-full.npz
step runs/answers-data-full2.npz 15616 pack 15616 runs/answers-data-full2.npz
step runs/answers-all4.npz 41449 merge runs/answers-all4.npz runs/answers-all3.npz runs/answers-data-full2.npz
step runs/answers-data-full3.npz 17663 pack 17663 runs/answers-data-full3.npz
step runs/answers-all5.npz 43496 merge runs/answers-all5.npz runs/answers-all4.npz runs/answers-data-full3.npz
step runs/answers-data-full4.npz 21247 pack 21247 runs/answers-data-full4.npz
step runs/answers-all6.npz 47080 merge runs/answers-all6.npz runs/answers-all5.npz runs/answers-data-full4.npz
step runs/answers-data-full5.npz 27135 pack 27135 runs/answers-data-full5.npz
step runs/answers-all7.npz 52964 merge runs/answers-all7.npz runs/answers-all6.npz runs/answers-data-full5.npz
step runs/answers-data-full6.npz 30463 pack 30463 runs/answers-data-full6.npz
step runs/answers-all8.npz 56289 merge runs/answers-all8.npz runs/answers-all7.npz runs/answers-data-full6.npz
step runs/answers-data-full7.npz 31487 pack 31487 runs/answers-data-full7.npz
step runs/answers-openers.npz 1792 pack_openers 1792 runs/answers-openers.npz
step runs/answers-all9.npz 59100 merge runs/answers-all9.npz runs/answers-all8.npz runs/answers-data-full7.npz \
  runs/answers-openers.npz
step runs/answers-openers2.npz 10495 pack_openers 10495 runs/answers-openers2.npz
step runs/answers-all10.npz 67800 merge runs/answers-all10.npz runs/answers-all9.npz runs/answers-openers2.npz
step runs/answers-openers3.npz 14079 pack_openers 14079 runs/answers-openers3.npz
step runs/answers-all11.npz 71383 merge runs/answers-all11.npz runs/answers-all10.npz runs/answers-openers3.npz
echo "[campaign] runs/answers-all11.npz: 71,383 answers; a next run merges both folders' newer answers after it" >&2
