#!/usr/bin/env bash
# A third pass on a GPU (bench/cuda/README.md), sized for one ~8-minute device call:
#  1. the accuracy grid's cases no GPU has measured yet (`--not-in` the H100's results),
#     side by side in the background (their device-level NVML figure is then not compared);
#  2. the published rows' job shapes as HF steps (published_shape_cases.yaml), one at a time;
#  3. PyTorch's own allocation traces of two of them (trace_cuda.py), for trace_compare.py;
#  4. the user's path: `vramplan measure --device cuda --trace --json` on a small LoRA job.
# Everything lands under OUTDIR; the last step packs it into OUTDIR/shapes.tar.gz.
#   bash bench/cuda/shapes.sh OUTDIR
export PYTHONUNBUFFERED=1
W=${1:-bench/cuda/out}; mkdir -p "$W/traces"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
H100=bench/accuracy/results-cuda-nvidia-h100-80gb-hbm3.json
timeout "${GRID_S:-420}" python3 bench/accuracy/grid.py --device cuda --jobs "${JOBS:-6}" --not-in "$H100" \
  --out "$W/results-cuda-grid-new.json" > "$W/grid.log" 2>&1 &
grid=$!
SHAPES=bench/cuda/published_shape_cases.yaml
timeout "${SHAPES_S:-300}" python3 bench/accuracy/grid.py --device cuda --cases "$SHAPES" --jobs 1 \
  --out "$W/results-cuda-shapes.json" > "$W/shapes.log" 2>&1
echo "shapes exit $?"; tail -12 "$W/shapes.log"
i=0
for c in "meta-llama/Llama-2-7b-hf/b2s512/bf16/lora-r8-q+v/adamw-foreach/sdpa/gc/accum4" \
         "google-bert/bert-large-uncased/b4s512/fp32/full/adamw-forloop/eager/nogc/sequence-classification"; do
  timeout 100 python3 bench/cuda/trace_cuda.py --cases "$SHAPES" --case "$c" --steps 2 \
    --out "$W/traces/trace-$i.json" > "$W/traces/trace-$i.log" 2>&1
  echo "trace $i exit $?"; tail -2 "$W/traces/trace-$i.log"; i=$((i + 1))
done
timeout 90 python3 -m vramplan measure qwen2.5-0.5b --method lora --precision bf16 --micro-batch-size 4 \
  --seq-len 1024 --device cuda --trace --json > "$W/measure-cli.json" 2> "$W/measure-cli.err"
echo "measure --trace exit $?"; head -c 600 "$W/measure-cli.err"
python3 - "$W/measure-cli.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    print({k: v for k, v in d.items() if not isinstance(v, (dict, list))}, d.get("allocator"))
except Exception as e:
    print("measure-cli.json unreadable:", e)
PY
wait $grid; echo "grid exit $?"; tail -25 "$W/grid.log"
tar -czf "$W/shapes.tar.gz" -C "$W" --exclude shapes.tar.gz .
ls -la "$W" "$W/traces"
