#!/usr/bin/env bash
# The same card, two commits: sixfold's step (bench/gpu.py's sixfold side) of this tree and of OLD, another
# commit's tree, in turns (which goes first swaps each round), each a fresh process of about 35 s on an H200.
# Here, before the call:  mkdir -p .old && git archive COMMIT | tar -x -C .old   (.old ignored by
# .git/info/exclude, then named in the call's carry).
#     bash bench/gpu_ab.sh .old [SEQ] [ROUNDS] [MICRO] [CONFIG]   # a line a run: tree, ms/step (median), last loss
set -u
old=$(cd "${1:?usage: bash bench/gpu_ab.sh OLD_TREE [SEQ] [ROUNDS] [MICRO] [CONFIG]}" && pwd)
seq=${2:-2048}
rounds=${3:-3}
micro=${4:-1}
config=${5:-configs/llama3-1b.yaml}
new=$PWD
tmp=$(mktemp -d)
export PYTHONUNBUFFERED=1
for round in $(seq 1 "$rounds"); do
    order="new old"
    [ $((round % 2)) -eq 0 ] && order="old new"
    for side in $order; do
        tree=$new
        [ "$side" = old ] && tree=$old
        result="$tmp/$side-$round.json"
        log="$tmp/$side-$round.log"
        (cd "$tree" && PYTHONPATH="$tree" timeout 150 python3 bench/gpu.py --worker sixfold --seq "$seq" \
            --micro "$micro" --config "$config" --result "$result" > "$log" 2>&1) || tail -5 "$log"
        python3 -c "import json, statistics, sys; r = json.load(open(sys.argv[1]))
print(sys.argv[2], f\"{statistics.median(r['times']) * 1000:.1f} ms\", f\"loss {r['loss_last']:.4f}\")" \
            "$result" "$side (round $round)" 2> /dev/null || echo "$side (round $round): no result"
    done
done
