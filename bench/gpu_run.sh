#!/usr/bin/env bash
# One device call per part, on the GPU machines (no Ray installed there: carry .raybundle, built by
# ../shared/gpu/make-ray-bundle.sh .raybundle). Results go to $OUT (fetch them, then commit the
# ones that matter under bench/results/). Each part is sized to end well inside a 10-minute call.
#
#   single  (nvidia-h100-x1 or nvidia-h200): GPU tests (HF equality with both attention backends),
#           Triton kernels vs the reference at real shapes and their timings, static vs continuous
#           batching at the Qwen3-0.6B shape, offline throughput (nano-vllm workload) vs HF
#           transformers with decode steps vs the memory floor, prefill utilization at Llama-3.1-8B.
#   pair    (nvidia-h200-x2): NCCL transport tests, 1P1D over NCCL vs colocated (tokens, TTFT,
#           KV push bandwidth vs raw NCCL send/recv) at the Qwen3-0.6B and Llama-3.1-8B shapes.
#
#   usage (device tool, carry [".raybundle"]):  bash bench/gpu_run.sh single
set -uo pipefail
part=${1:?usage: gpu_run.sh single|pair}
out=${OUT:-/tmp/out}
mkdir -p "$out"
tar -xJf .raybundle/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
run() { echo "== $*"; timeout "$1" "${@:2}" 2>&1 | tee -a "$out/log.txt" | tail -40; }
case "$part" in
  single)
    run 300 python3 -m pytest -q -p no:cacheprovider --durations=8 tests/gpu
    run 150 python3 -m bench.attention_gpu --out "$out"
    run 60 python3 -m bench.batching --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16 --out "$out"
    run 330 python3 -m bench.offline_throughput --model bench/shapes/qwen3-0.6b --load-format dummy \
      --dtype bfloat16 --attention-backend triton --prefill-model bench/shapes/llama-3.1-8b --out "$out"
    ;;
  pair)
    run 120 env TORCH_NCCL_ASYNC_ERROR_HANDLING=0 TORCH_NCCL_DUMP_ON_TIMEOUT=0 TORCH_NCCL_ENABLE_MONITORING=0 \
      python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/unit/kvtransfer -m gpu tests/unit/kvtransfer
    run 420 python3 -m bench.disagg --out "$out"
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
