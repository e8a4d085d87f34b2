#!/usr/bin/env bash
# The same card, two commits: sixfold's step of this tree and of OLD, another commit's tree, in turns (which goes
# first swaps each round), each a fresh process of about 35 s on an H200, both run by this tree's bench/gpu.py
# (--tree), so that only sixfold differs. Overrides after CONFIG go to both (data.source=DIR: the same files,
# which two versions of the reader may otherwise cut differently).
# Here, before the call:  mkdir -p .old && git archive COMMIT | tar -x -C .old   (.old ignored by
# .git/info/exclude, then named in the call's carry).
#     bash bench/gpu_ab.sh .old [SEQ] [ROUNDS] [MICRO] [CONFIG] [KEY=VALUE ...]
# A line a run: tree, ms/step (median), the first loss, the losses of steps 5, 9 and 13.
set -u
old=$(cd "${1:?usage: bash bench/gpu_ab.sh OLD_TREE [SEQ] [ROUNDS] [MICRO] [CONFIG] [KEY=VALUE ...]}" && pwd)
seq=${2:-2048}
rounds=${3:-3}
micro=${4:-1}
config=${5:-configs/llama3-1b.yaml}
shift $(($# < 5 ? $# : 5))
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
        (cd "$tree" && timeout 150 python3 "$new/bench/gpu.py" --worker sixfold --tree "$tree" --seq "$seq" \
            --micro "$micro" --config "$config" --result "$result" ${1:+--set "$@"} > "$log" 2>&1) || tail -5 "$log"
        python3 -c "import json, statistics, sys; r = json.load(open(sys.argv[1])); losses = r['losses']
print(sys.argv[2], f\"{statistics.median(r['times']) * 1000:.1f} ms\", f\"loss {losses[0]:.4f}\",
      ' '.join(f'{x:.4f}' for x in losses[4:13:4]))" "$result" "$side (round $round)" 2> /dev/null \
            || echo "$side (round $round): no result"
    done
done
