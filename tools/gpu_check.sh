#!/usr/bin/env bash
# The whole TensorRT path on a machine with a GPU and TensorRT (it cannot run on the machines
# tfgraph is developed on): for gpt2-tiny, llama-tiny and t5-tiny — export for the tensorrt
# target with the static KV cache, build the engines, re-check parity on the engine (prefill
# and decode, against eager PyTorch) and generate with it. Prints one table; exits 1 if any
# step failed. Usage: tools/gpu_check.sh [OUT_DIR] [TARGET] (default: a temp dir, tensorrt)
set -uo pipefail
out=${1:-$(mktemp -d -t tfgraph-gpu-XXXX)}
target=${2:-tensorrt}
mkdir -p "$out"
python -c "import tensorrt, torch; assert torch.cuda.is_available(), 'no CUDA GPU'" || {
  echo "needs TensorRT's Python package and a CUDA GPU" >&2; exit 2; }
status=0
rows=()
for preset in gpt2-tiny llama-tiny t5-tiny; do
  dir="$out/$preset"
  row="$preset"
  for step in export engine parity generate; do
    case $step in
      export) cmd=(python -m tfgraph export "$preset" --target "$target" --kv-cache -o "$dir") ;;
      engine) cmd=(python -m tfgraph engine "$dir") ;;
      parity) cmd=(python -m tfgraph parity "$dir") ;;
      generate) cmd=(python -m tfgraph generate "$dir" --input-ids "5 17 3 9" --max-new-tokens 16) ;;
    esac
    if "${cmd[@]}" >"$dir.$step.log" 2>&1; then
      row+=" | ok"
    else
      row+=" | FAIL ($dir.$step.log)"
      status=1
    fi
  done
  rows+=("$row")
done
echo "preset | export | engine | parity (engine vs eager) | generate"
printf '%s\n' "${rows[@]}"
exit $status
