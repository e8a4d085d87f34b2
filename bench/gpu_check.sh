#!/usr/bin/env bash
# A GPU session's checks in one call, about 8 minutes on an H200 (the timeouts sum to under a call's 10): the CUDA
# cases of the tests, the throughput table at sequence 2048 and 8192 with 1 and 4 micro-batches (bench/gpu.py, both
# sides), a profile of two steps (kernels, the device's idle gaps, the Chrome trace as OUT/trace.json.gz).
#     bash bench/gpu_check.sh OUT        # then here: python bench/gpu.py --report OUT/table/gpu.json --write
set -u
out=${1:?usage: bash bench/gpu_check.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 50 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_fused.py tests/test_fast_paths.py \
    tests/test_context.py tests/test_optim.py -k "cuda or gpu" 2>&1 | tail -3
timeout 450 python3 bench/gpu.py --seq 2048 8192 --micro 1 4 --out "$out/table"
[ -f "$out/table/gpu.json" ] && rm -f "$out"/table/*-*.json  # each run's file, in gpu.json (at most 8 files come back)
timeout 70 python3 bench/gpu.py --worker sixfold --seq 2048 --steps 3 --profile --result "$out/profile.json" \
    --trace "$out/trace.json" > "$out/profile.log" 2>&1
gzip -f "$out/trace.json"
grep -v "^-" "$out/profile.log" | cut -c1-160 | head -45
grep -A16 "^idle gaps" "$out/profile.log"
python3 - "$out/table/gpu.json" "$out/profile.json" <<'PY'
import json, sys
table, profiled = (json.load(open(p)) for p in sys.argv[1:])
same = next(r for r in table["results"] if (r["side"], r["seq"], r["micro"]) == ("sixfold", 2048, 1))
n = 6  # its warmup and timed steps (train.steps): the same learning rates
print(f"first {n} losses, table's run:", " ".join(f"{x:.6f}" for x in same["losses"][:n]))
print(f"first {n} losses, profiled run:", " ".join(f"{x:.6f}" for x in profiled["losses"][:n]))
sys.path.insert(0, "bench")
from gpu import mfu
logged = same["logged_mfu"][3:13]  # its timed steps, as the trainer's log line gave them
print("the log line gave no MFU on this device" if None in logged else f"MFU of that run: the table's "
      f"{mfu(same, table['device'])[1]:.1%}, the log line's (median) {sorted(logged)[len(logged) // 2]:.1%}")
PY
