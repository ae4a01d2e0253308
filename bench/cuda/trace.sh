#!/usr/bin/env bash
# PyTorch's own allocation trace of real CUDA steps (bench/cuda/trace_cuda.py), four at a
# time; compared offline by bench/allocator/trace_compare.py.
#   bash bench/cuda/trace.sh OUTDIR [CASE ...]     # CASE: a grid case name, scale:NAME or alloc:NAME
# Without cases: the grid cases whose allocator replay was furthest under the measured
# max_memory_reserved on the H100 (bench/cuda/README.md) and one catalog-size step.
OUT=${1:-bench/cuda/out/traces}; mkdir -p "$OUT"; shift
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(
  "llama/b2s512/fp32/full/adamw-foreach/sdpa/nogc"
  "llama/b2s512/fp32/full/adamw-foreach/sdpa/gc"
  "llama/b1s2048/bf16/lora-r16-all-linear/adamw-foreach/sdpa/gc"
  "mistral/b4s256/bf16/full/sgd-momentum/sdpa/nogc"
  "llama/b8s128/fp32/full/adamw-foreach/sdpa/nogc"
  "qwen3/b2s512/bf16/lora-r8-all-linear/adamw-foreach/sdpa/nogc"
  "gpt2/b1s1024/amp-bf16/full/adafactor/sdpa/nogc"
  "qwen2_moe/b2s512/amp-bf16/full/adamw-foreach/sdpa/gc"
  "scale:llama-3.2-1b/b4s2048/bf16/full/adamw-foreach/sdpa/gc"
)
i=0
for c in "${cases[@]}"; do
  file=bench/accuracy/grid_cases.yaml
  [[ $c == scale:* ]] && { file=bench/cuda/scale_cases.yaml; c=${c#scale:}; }
  [[ $c == alloc:* ]] && { file=bench/cuda/alloc_conf_cases.yaml; c=${c#alloc:}; }
  python3 bench/cuda/trace_cuda.py --cases "$file" --case "$c" --out "$OUT/trace-$i.json" > "$OUT/trace-$i.log" 2>&1 &
  i=$((i + 1)); (( i % 4 == 0 )) && wait
done
wait
tail -n 2 "$OUT"/*.log
