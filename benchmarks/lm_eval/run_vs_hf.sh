#!/bin/bash
# The runs behind docs/eval.md's table: weld serve (f32, then Q4_1) and transformers through lm-eval.
# Run from the repository root; results and samples go under $OUT.
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BIN=.venv/bin
OUT=${OUT:-/tmp/eval_runs}; mkdir -p $OUT
GGUF_DIR=$($BIN/python -c 'from weld.weights import default_model_path as p; print(p().parent)')
run_weld() {  # $1: label, rest: weld serve flags
  label=$1; shift
  WELD_PROGRESS=0 $BIN/weld serve --port 18432 "$@" > $OUT/serve_$label.log 2>&1 &
  pid=$!
  until curl -sf localhost:18432/health > /dev/null; do
    kill -0 $pid 2> /dev/null || { echo "weld serve failed: $OUT/serve_$label.log"; exit 1; }
    sleep 2
  done
  $BIN/lm_eval --model local-completions --model_args model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:18432/v1/completions \
    --include_path tests/data/lm_eval --tasks weld_capitals,weld_arithmetic --output_path $OUT/$label-shipped --log_samples > $OUT/$label-shipped.log 2>&1
  $BIN/lm_eval --model local-completions --model_args model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:18432/v1/completions \
    --include_path benchmarks/lm_eval --tasks weld_world,weld_arithmetic30 --output_path $OUT/$label-bench --log_samples > $OUT/$label-bench.log 2>&1
  $BIN/lm_eval --model local-chat-completions --model_args model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:18432/v1/chat/completions \
    --apply_chat_template --include_path benchmarks/lm_eval --tasks weld_arithmetic30 --output_path $OUT/$label-chat --log_samples > $OUT/$label-chat.log 2>&1
  kill $pid; wait $pid
}
date; run_weld weld-f32 --quantization none
date; run_weld weld-q4_1
date
HF="pretrained=$GGUF_DIR,gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf,dtype=float32"
$BIN/lm_eval --model hf --model_args $HF --device cpu --include_path tests/data/lm_eval --tasks weld_capitals,weld_arithmetic --output_path $OUT/hf-shipped --log_samples > $OUT/hf-shipped.log 2>&1
$BIN/lm_eval --model hf --model_args $HF --device cpu --include_path benchmarks/lm_eval --tasks weld_world,weld_arithmetic30 --output_path $OUT/hf-bench --log_samples > $OUT/hf-bench.log 2>&1
$BIN/lm_eval --model hf --model_args $HF --device cpu --apply_chat_template --include_path benchmarks/lm_eval --tasks weld_arithmetic30 --output_path $OUT/hf-chat --log_samples > $OUT/hf-chat.log 2>&1
date; echo done
