#!/usr/bin/env bash
# The CUDA checks of issue 11 in one pass, for a session lent a GPU (see bench/cuda/README.md).
# Writes every result under $OUT (default: bench/cuda/out): the allocator replays event by
# event, the dynamically padded runs, and the accuracy grid measured on this GPU.
#   bash bench/cuda/run.sh [grid seconds] [grid jobs]
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/cuda/out}; mkdir -p "$OUT"
GRID_S=${1:-300}; JOBS=${2:-10}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
{
  for conf in "" "expandable_segments:True"; do
    tag=${conf:+-expandable}
    python3 bench/allocator/replay_cuda.py --model llama-3.2-1b --micro-batch-size 4 --seq-len 1024 \
      --alloc-conf "$conf" --name "llama1b-b4s1024$tag"
    python3 bench/allocator/replay_cuda.py --model qwen2.5-7b --method lora --micro-batch-size 2 --seq-len 2048 \
      --gradient-checkpointing full --alloc-conf "$conf" --name "qwen7b-lora-b2s2048-gc$tag"
  done
  python3 bench/allocator/replay_cuda.py --model llama-3.2-1b --micro-batch-size 4 --seq-len 1024 \
    --alloc-conf "max_split_size_mb:128" --name "llama1b-b4s1024-split128"
  python3 bench/allocator/lengths_cuda.py --spec bench/cuda/lengths-qwen1.5b.yaml --name qwen1.5b
} > "$OUT/allocator.log" 2>&1
python3 - "$OUT" <<'PY'
import glob, json, os, sys
rows = {}
for f in sorted(glob.glob("bench/allocator/results-cuda-*.json")):
    rows[os.path.basename(f)] = r = json.load(open(f))
    print(os.path.basename(f), {k: r.get(k) for k in ("events", "events_matching", "first_divergence",
          "worst_reserved_gap_bytes", "max_memory_reserved", "max_memory_allocated", "max_reserved",
          "first_differing_step")})
json.dump(rows, open(os.path.join(sys.argv[1], "allocator-replays.json"), "w"), indent=1)
print("allocator results:", list(rows))
PY
timeout "$GRID_S" python3 bench/accuracy/grid.py --device cuda --jobs "$JOBS" --out "$OUT/results-cuda-grid.json" \
  > "$OUT/grid.log" 2>&1
echo "grid exit $?"; tail -40 "$OUT/grid.log"
# Catalog-size steps, one at a time (the device-level NVML figure is then this case's alone).
timeout "${SCALE_S:-380}" python3 bench/accuracy/grid.py --device cuda --cases bench/cuda/scale_cases.yaml --jobs 1 \
  --out "$OUT/results-cuda-scale.json" > "$OUT/scale.log" 2>&1
echo "scale exit $?"; tail -30 "$OUT/scale.log"
