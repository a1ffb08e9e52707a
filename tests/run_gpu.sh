#!/usr/bin/env bash
# One device-machine call: install, then the named phases (default: all), a short table last.
# Carry the nvshmem4py wheel as .whl (see the device tool's notes), then run from the repo root:
#   bash tests/run_gpu.sh                    # gemm tests bench train, on all GPUs of the machine
#   bash tests/run_gpu.sh gemm tests         # some phases
# Phases:
#   gemm   tilecomm's GEMMs (matmul, ag_gemm/gemm_rs at world 1, grouped_mm) beside cuBLAS /
#          torch._grouped_mm, after a config sweep (one GPU; GEMM_ARGS adds flags) -> $OUT/gemm.json
#   probe  tests/host_probe.py and tests/gemm_probe.py (diagnostics, one GPU) -> $OUT/*_probe.log
#   dispatchprobe  tests/dispatch_probe.py and tests/ll_probe.py: the normal / low-latency Dispatcher's config
#          sweeps at world 1 (one GPU; DISPATCH_CONFIGS: dispatch_probe's --configs) -> $OUT/{dispatch,ll}_probe.log
#   tests  the CPU suite's GPU-capable test bodies on GPU ranks, both transports; with one GPU the
#          ranks share it (TILECOMM_TEST_SHARE_GPUS=1: correctness only; TEST_SHARE); TEST_STOP="" runs on
#          past a failure (default -x), TEST_FILES picks files; TEST_WORKERS=N runs N test files at a time
#          (TEST_DIST=load: N test cases) (pytest-xdist: the suite is bound by Triton compiling each kernel in every rank; their ranks then
#          share the GPUs); TEST_K: pytest's -k expression (TEST_FILES is split on spaces: no quoted -k there); TEST_HEAP=1GiB gives the ranks the default GPU layout of the collectives (two
#          programs per SM; the tests' 64 MiB heaps get one); TEST_AT_ONCE=1 runs the transports side by side
#          -> $OUT/tests_<transport>.log
#   bench  every tilecomm.bench op against NCCL, the MoE layer's three paths, torch's NVSHMEM all_to_all_vdev
#          (torch_a2av: its own process) (needs 2+ GPUs; BENCH_RUNS: a ";"-separated subset, e.g.
#          "ag_gemm;dispatch --mode low_latency;torch_a2av --uneven")  -> $OUT/bench_*.json
#   train  examples/pretrain_moe.py --preset h200x4 on all GPUs, each of TRAIN_DISPATCHERS (one GPU: tilecomm; more: tilecomm
#          nccl fused), TRAIN_STEPS steps; TRAIN_ARGS (default --no-checkpoint: the preset's final checkpoint, 33 GB at 4 GPUs,
#          outlasted the phase's limit on 2026-11-26) -> $OUT/train_*.jsonl
#   moe    MoE layer fwd+bwd, dispatcher fused beside tilecomm (its experts as impl="auto" picks: tilecomm's grouped_mm
#          on Hopper, and on torch._grouped_mm: "torch gemm"), world 1, one GPU (MOE_ARGS: e.g. "--layers deepseek_v3")
#          -> $OUT/moe_layer.json
#   commprofile  tests/comm_profile.py: wall / host / kernel time of the collectives beside NCCL's (2+ GPUs)
#          -> $OUT/comm_profile.log
#   sweep  tests/collective_sweep.py: the collectives under other CollectiveState knobs (programs per SM, chunk,
#          step; SWEEP_CONFIGS), each beside NCCL (every GPU; at world 1 NCCL's call is a device copy; SWEEP_HEAP=1: also on
#          heap tensors); SWEEP_SNAPSHOT=S: a call still running after S s
#          prints its state words (a hang's diagnosis) -> $OUT/sweep.log
#   overlapprofile  tests/overlap_profile.py: GPU timeline of one fused ag_gemm / gemm_rs call (2+ GPUs;
#          OVERLAP_PROFILE_ARGS: its flags, e.g. "--shown 3 --ops gemm_rs" for three calls back to back)
#          -> $OUT/overlap_profile.log
#   llncu  ncu of the third low-latency dispatch and combine kernel at world 1 (tests/ll_probe.py --once; one GPU):
#          duration, occupancy, warp stall reasons; the report and its SASS-level source page -> $OUT/ll_*.ncu-rep, *_sass.csv
#   wgradprobe  tests/wgrad_probe.py: the expert weight-gradient kernel beside torch._grouped_mm and the write ceiling
#          (zero_ / copy_ of the same bytes), one GPU (WGRAD_CONFIGS / WGRAD_SHAPES: its --configs / --shapes; WGRAD_ARGS:
#          more flags, e.g. --store-tiles)
#          -> $OUT/wgrad_probe.log
#   smallgemm  tests/small_gemm_probe.py: overlap.matmul on small shapes (1000^3 ...), each config's kernel / host /
#          wall / do_bench time beside cuBLAS's (one GPU) -> $OUT/small_gemm_probe.log
#   wgradncu  ncu of the DeepSeek-like gate_up weight-gradient kernel (tests/wgrad_probe.py --once): throughput of
#          DRAM / L2 / SM, warp stall reasons -> $OUT/wgrad.ncu-rep
#   llworld  tests/ll_probe.py --default on every GPU (one rank each): low-latency dispatch / combine at world W, the send
#          and receive roles apart (2+ GPUs; LL_WORLD_ARGS replaces --default, e.g. "" for the whole sweep, or --trace:
#          every rank's last dispatch launch program by program, LowLatencyConfig.trace) -> $OUT/ll_world.log
#   dispatchworld  tests/dispatch_probe.py on every GPU (one rank each): normal dispatch / combine at world W, their
#          kernels and the GPU's idle time, per NormalConfig variant (DISPATCH_WORLD_CONFIGS) -> $OUT/dispatch_world.log
#   a2aengine  tests/a2a_engine_probe.py: one all_to_all's bytes by the copy engine (one stream, a stream per peer)
#          and by bare SM and TMA pushes, beside tilecomm's all_to_all (default, on the TMA knobs, and DIRECT on heap
#          tensors: CollectiveState(direct=True), with and without TMA) and NCCL's
#          (2+ GPUs) -> $OUT/a2a_engine.log
#   copyprobe  tests/copy_push_probe.py: ag_gemm / gemm_rs with the copy push beside cuBLAS's whole GEMM, its row blocks
#          alone, tilecomm's matmul of the whole product, the op with its copies skipped, and the host's µs per call
#          (any GPUs; on one, PROBE_TP=4 for the bar shapes at TP = 4, not run on one GPU yet) -> $OUT/copy_push_probe.log
#   agncu  ncu of ag_gemm's persistent GEMM (OWN_SHARD "copied" with no copies, then "in_place") beside tilecomm's
#          matmul of the same product, ag_gemm's small bar shape at TP = PROBE_TP (default 4), one GPU
#          (tests/copy_push_probe.py, PROBE_ONCE) -> $OUT/ag_*.ncu-rep
#   collncu  ncu of the staged (ordinary-tensor) all_gather / reduce_scatter 8192^2 at world 1 (tests/staged_once.py; one
#          GPU), the default CollectiveState and each of COLL_NCU_CONFIGS (collective_sweep's format; default: 2/32/32/2/1/1,
#          a 16.5 MiB ring with L2 hints; 2/128/32/2/1/0/0/1, the default ring with its read chunks dropped from L2,
#          CollectiveState.ring_discard; both), after a copy of the same bytes (the floor): DRAM / L2 throughput and hit
#          rates, warp stalls -> $OUT/coll_*.ncu-rep
#   rstrace  tests/rs_trace.py on every GPU (one rank each): where reduce_scatter 8192^2's time goes, program by program
#          (waits for the writers' ready signals and for ring slots, push and reduce steps; CollectiveState.trace),
#          ordinary then heap tensors (RS_TRACE_CONFIG: collective_sweep's config format) -> $OUT/rs_trace.log
#   signal tests/signal_probe.py: which signal ops reach which rank, each transport (2+ GPUs) -> $OUT/signal_probe.log
#   moeprofile  tests/fused_moe_profile.py: both layers' kernels, fused config variants checked against the
#          unfused path and timed beside it (MOE_PRESETS: layers; MOE_VARIANTS: layers that run them; MOE_ONLY: ";"-separated
#          variant names; MOE_GAPS=1: where the GPU waits, host calls and traces; MOE_PROFILE_GPUS=N: at world N, expert
#          parallelism over N GPUs, rank 0's kernels)  -> $OUT/profile.{txt,json}
set -uo pipefail
PHASES="${*:-gemm tests bench train}"
TRAIN_STEPS="${TRAIN_STEPS:-30}"
source tests/gpu_env.sh
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# the device copy's .git can be stale: the source hash (the same command in a checkout) names the tree that ran
SOURCE_HASH=$(find comm dispatch overlap moe examples -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)
echo "GPUs: $NGPU  commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +dirty)  source: $SOURCE_HASH"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

has() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }

if has self; then
  timeout "${SELF_TIMEOUT:-300}" python3 -m tilecomm.bench self --json "$OUT/self.json" 2>&1 | sed -u "s/.*named symbol not found//" | tee "$OUT/self.log"
fi

if has probe; then  # diagnostics, not benchmarks: host time per stage, the slow GEMM shapes' kernels
  timeout "${PROBE_TIMEOUT:-150}" python3 tests/host_probe.py 2>&1 | sed -u "s/.*named symbol not found//" | tee "$OUT/host_probe.log"
  timeout "${GEMM_PROBE_TIMEOUT:-300}" torchrun --standalone --nproc-per-node 1 tests/gemm_probe.py 2>&1 \
    | sed -u "s/.*named symbol not found//" | tee "$OUT/gemm_probe.log" | tail -40
fi

if has dispatchprobe; then  # each variant checked bit for bit against the first, then timed
  timeout "${DISPATCH_PROBE_TIMEOUT:-240}" python3 tests/dispatch_probe.py ${DISPATCH_CONFIGS:+--configs "$DISPATCH_CONFIGS"} 2>&1 \
    | grep -v "named symbol not found\|UserWarning\|_warn_once" | tee "$OUT/dispatch_probe.log"
  timeout "${LL_PROBE_TIMEOUT:-200}" python3 tests/ll_probe.py 2>&1 | grep -v "named symbol not found\|UserWarning\|_warn_once" \
    | tee "$OUT/ll_probe.log"
fi

if has llncu; then  # one low-latency dispatch and combine kernel of world 1 under ncu (where their latency goes)
  for k in dispatch_kernel combine_kernel; do
    timeout "${LL_NCU_TIMEOUT:-150}" ncu --clock-control none --set full --import-source yes -k "regex:$k" --launch-skip 2 \
      --launch-count 1 -o "$OUT/ll_$k" python3 tests/ll_probe.py --once > "$OUT/ll_ncu_$k.log" 2>&1
    ncu --import "$OUT/ll_$k.ncu-rep" --page details 2>&1 | grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|Warp Cycles Per Issued|Stall|One or More|No Eligible" | head -30
    ncu --import "$OUT/ll_$k.ncu-rep" --page source --csv --print-source sass 2>/dev/null > "$OUT/ll_${k}_sass.csv" || true
  done
fi

if has smallgemm; then
  timeout "${SMALL_GEMM_TIMEOUT:-240}" python3 tests/small_gemm_probe.py 2>&1 \
    | grep -v "named symbol not found\|UserWarning\|_warn_once" | tee "$OUT/small_gemm_probe.log"
fi

if has wgradprobe; then
  timeout "${WGRAD_PROBE_TIMEOUT:-240}" python3 tests/wgrad_probe.py ${WGRAD_ARGS:-} ${WGRAD_CONFIGS:+--configs "$WGRAD_CONFIGS"} \
    ${WGRAD_SHAPES:+--shapes "$WGRAD_SHAPES"} 2>&1 \
    | grep -v "named symbol not found\|UserWarning\|_warn_once" | tee "$OUT/wgrad_probe.log"
fi

if has wgradncu; then
  timeout "${WGRAD_NCU_TIMEOUT:-240}" ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section Occupancy -k "regex:wgrad" --launch-count 1 \
    -o "$OUT/wgrad" python3 tests/wgrad_probe.py --once > "$OUT/wgrad_ncu.log" 2>&1
  ncu --import "$OUT/wgrad.ncu-rep" --page details 2>&1 | grep -E "Duration|Throughput|Registers|Occupancy|Stall|Busy|Hit Rate|Bandwidth|Issued|Block Limit" | head -40
fi

if has llworld && [ "$NGPU" -ge 2 ]; then
  timeout "${LL_WORLD_TIMEOUT:-150}" torchrun --standalone --nproc-per-node "$NGPU" tests/ll_probe.py ${LL_WORLD_ARGS---default} 2>&1 \
    | grep -v "named symbol not found\|UserWarning\|_warn_once\|^W1" | tee "$OUT/ll_world.log"
fi

if has dispatchworld && [ "$NGPU" -ge 2 ]; then  # tests/dispatch_probe.py on every GPU: normal dispatch / combine at world W
  timeout "${DISPATCH_WORLD_TIMEOUT:-240}" torchrun --standalone --nproc-per-node "$NGPU" tests/dispatch_probe.py \
    --configs "${DISPATCH_WORLD_CONFIGS:-;send_programs=0;send_programs=128;send_programs=192,send_block_h=512}" 2>&1 \
    | grep -v "named symbol not found\|UserWarning\|_warn_once\|^W1" | tee "$OUT/dispatch_world.log"
fi

if has rstrace; then  # tests/rs_trace.py: reduce_scatter's programs' own step timings
  for heap in "" --heap; do
    timeout "${RS_TRACE_TIMEOUT:-120}" torchrun --standalone --nproc-per-node "$NGPU" tests/rs_trace.py \
      --config "${RS_TRACE_CONFIG:-2/128/32}" $heap 2>&1 | grep -v "named symbol not found\|UserWarning\|_warn_once\|^W1" \
      | tee -a "$OUT/rs_trace.log"
  done
fi

if has signal && [ "$NGPU" -ge 2 ]; then  # tests/signal_probe.py: every (op, source, target) signal, both transports
  for transport in ${TRANSPORTS:-nvlink nvshmem}; do
    echo "== signal probe, transport $transport"
    TILECOMM_TRANSPORT=$transport timeout "${SIGNAL_TIMEOUT:-90}" torchrun --standalone --nproc-per-node "$NGPU" \
      tests/signal_probe.py 2>&1 | tee -a "$OUT/signal_probe.log" | grep -E "rank|Error|error" | grep -v "named symbol\|^W1"
  done
fi

if has a2aengine && [ "$NGPU" -ge 2 ]; then
  timeout "${A2A_ENGINE_TIMEOUT:-120}" torchrun --standalone --nproc-per-node "$NGPU" tests/a2a_engine_probe.py 2>&1 \
    | sed -u "s/.*named symbol not found//" | tee "$OUT/a2a_engine.log" | grep -E "world|Error"
fi

if has copyprobe; then
  timeout "${COPY_PROBE_TIMEOUT:-200}" torchrun --standalone --nproc-per-node "$NGPU" tests/copy_push_probe.py 2>&1 \
    | sed -u "s/.*named symbol not found//" | tee "$OUT/copy_push_probe.log" | grep -E "world|Error"
fi

if has agncu; then  # the kernels' limits side by side: matmul, the "copied" form (no copies), "in_place"
  for ks in _matmul_kernel:2 _gemm_kernel:2 _gemm_kernel:5; do
    k=${ks%:*}; skip=${ks#*:}
    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 PROBE_TP=${PROBE_TP:-4} PROBE_ONCE=1 \
      timeout "${AG_NCU_TIMEOUT:-200}" ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats -k "regex:^$k" \
      --launch-skip "$skip" --launch-count 1 -o "$OUT/ag$k$skip" python3 tests/copy_push_probe.py > "$OUT/ag_ncu$k$skip.log" 2>&1
    echo "== $k, launch-skip $skip"
    ncu --import "$OUT/ag$k$skip.ncu-rep" --page details 2>&1 | grep -E "Duration|Throughput|Registers|Occupancy|Issued|Eligible" | head -20
  done
fi

if has collncu; then  # where a staged collective's two copies' time goes: HBM traffic, L2 passes, or the per-chunk steps
  for op in copy all_gather reduce_scatter; do  # copy: the same bytes by an elementwise kernel, the floor (L2 / DRAM rates)
    k=$([ $op = all_gather ] && echo _pairs_kernel || { [ $op = copy ] && echo elementwise || echo _reduce_kernel; })
    skip=$([ $op = copy ] && echo 3 || echo 2)
    for config in "" $([ $op = copy ] || echo ${COLL_NCU_CONFIGS-2/32/32/2/1/1 2/128/32/2/1/0/0/1 2/32/32/2/1/1/0/1}); do
      name="coll_${op}_$(echo "${config:-default}" | tr / -)"
      timeout "${COLL_NCU_TIMEOUT:-150}" ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section LaunchStats --section Occupancy \
        -k "regex:$k" --launch-skip "$skip" --launch-count 1 \
        -o "$OUT/$name" python3 tests/staged_once.py --op $op ${config:+--config $config} > "$OUT/$name.log" 2>&1
      echo "== $op ${config:-default}"
      ncu --import "$OUT/$name.ncu-rep" --page details 2>&1 | grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|Registers|Achieved Occupancy|Warp Cycles Per Issued|Stall" | head -24
    done
  done
fi

if has commprofile && [ "$NGPU" -ge 2 ]; then
  timeout "${COMM_PROFILE_TIMEOUT:-150}" torchrun --standalone --nproc-per-node "$NGPU" tests/comm_profile.py 2>&1 \
    | sed -u "s/.*named symbol not found//" | tee "$OUT/comm_profile.log" | grep -E "world|wall|Error"
fi

if has sweep; then  # tests/collective_sweep.py: the collectives' knobs beside NCCL (SWEEP_CONFIGS)
  timeout "${SWEEP_TIMEOUT:-300}" torchrun --standalone --nproc-per-node "$NGPU" tests/collective_sweep.py \
    ${SWEEP_CONFIGS:+--configs "$SWEEP_CONFIGS"} ${SWEEP_SNAPSHOT:+--snapshot "$SWEEP_SNAPSHOT"} ${SWEEP_HEAP:+--heap} 2>&1 \
    | sed -u "s/.*named symbol not found//" | tee "$OUT/sweep.log" | grep -E "world|chunk|snapshot|Error"
fi

if has overlapprofile && [ "$NGPU" -ge 2 ]; then
  timeout "${OVERLAP_PROFILE_TIMEOUT:-150}" torchrun --standalone --nproc-per-node "$NGPU" tests/overlap_profile.py \
    ${OVERLAP_PROFILE_ARGS:-} 2>&1 \
    | sed -u "s/.*named symbol not found//" > "$OUT/overlap_profile.log"; grep -E "^==|Error" "$OUT/overlap_profile.log"
fi

if has moe; then
  timeout "${MOE_TIMEOUT:-420}" python3 -m tilecomm.bench moe_layer ${MOE_ARGS:-} --json "$OUT/moe_layer.json" 2>&1 \
    | sed -u "s/.*named symbol not found//" | tee "$OUT/moe_layer.log"
fi

if has moeprofile; then
  timeout "${MOE_PROFILE_TIMEOUT:-420}" torchrun --standalone --nproc-per-node "${MOE_PROFILE_GPUS:-1}" tests/fused_moe_profile.py --presets "${MOE_PRESETS:-pretrain,deepseek_v3}" --variants "${MOE_VARIANTS:-pretrain,deepseek_v3}" --only "${MOE_ONLY:-}" ${MOE_GAPS:+--gaps} \
    --steps 2 --iters 20 --out "$OUT" 2>&1 | sed -u "s/.*named symbol not found//" | grep -v "µs .*x  " | grep -v "^\s*$"
fi

if has gemm; then
  timeout "${GEMM_TIMEOUT:-420}" torchrun --standalone --nproc-per-node 1 -m tilecomm.bench.gemm ${GEMM_ARGS:---sweep} \
    --json "$OUT/gemm.json" 2>&1 | sed -u "s/.*named symbol not found//" | tee "$OUT/gemm.log" | grep -vE "^  sweep"
fi

if has tests; then
  # SIGINT at TEST_TIMEOUT: pytest stops and still prints the tracebacks of the failures so far
  # one GPU: ranks share it (2-4 ranks); more GPUs: one rank per GPU, cases with more ranks skipped (on 2 H100s,
  # 3 ranks sharing 2 GPUs stalled in the first such test, 2026-11-25, and again on 2 H200s, 2026-11-27, while 4 ranks
  # two per GPU passed); TEST_SHARE=1 shares anyway. TEST_WORKERS > 1 shares unless TEST_SHARE=0: on 2 GPUs pass it
  share=${TEST_SHARE:-$([ "$NGPU" -eq 1 ] || [ "${TEST_WORKERS:-1}" -gt 1 ] && echo 1 || echo 0)}
  gpu_tests() {  # one transport: the tail of its log
    echo "== GPU tests, transport $transport (ranks share GPUs: $share)"
    TILECOMM_TEST_HEAP_BYTES=${TEST_HEAP:-64MiB} TILECOMM_TEST_BACKEND=cuda TILECOMM_TEST_SHARE_GPUS=$share TILECOMM_TRANSPORT=$transport timeout -s INT -k 30 "${TEST_TIMEOUT:-400}" \
      python3 -m pytest -v ${TEST_STOP--x} -p no:cacheprovider --timeout "${TEST_CASE_TIMEOUT:-150}" ${TEST_K:+-k "$TEST_K"} \
      ${TEST_WORKERS:+-n $TEST_WORKERS --dist ${TEST_DIST:-loadfile}} ${TEST_FILES:-tests/test_language.py tests/test_collectives.py tests/test_collective_state.py tests/test_dispatch.py tests/test_low_latency.py \
      tests/test_overlap.py tests/test_overlap_groups.py tests/test_tensor_parallel.py tests/test_grouped_mm.py tests/test_fused_moe.py \
      tests/test_moe_layer.py} 2>&1 | tee -a "$OUT/tests_$transport.log" \
      | grep -E "PASSED|FAILED|ERROR|Timeout|passed|failed" | tail -25
  }
  rm -f /tmp/tests_table_*
  for transport in ${TRANSPORTS:-nvlink nvshmem}; do  # TEST_AT_ONCE=1: the transports side by side, tables after
    if [ -n "${TEST_AT_ONCE:-}" ]; then gpu_tests > "/tmp/tests_table_$transport" & else gpu_tests; fi
  done
  wait; [ -n "${TEST_AT_ONCE:-}" ] && cat /tmp/tests_table_*
fi

if has bench && [ "$NGPU" -ge 2 ]; then  # BENCH_RUNS: ";"-separated "op flags" (default: every op of the issue)
  IFS=';' read -ra runs <<< "${BENCH_RUNS:-all_to_all;all_to_all --symmetric;all_to_all --uneven;all_to_all --uneven --symmetric;\
dispatch;dispatch --mode low_latency;ag_gemm;gemm_rs;all_gather;all_gather --symmetric;reduce_scatter;reduce_scatter --symmetric;\
moe_layer;torch_a2av;torch_a2av --uneven}"
  for run in "${runs[@]}"; do
    name=$(echo "$run" | sed 's/ --/_/g; s/ /_/g')
    echo "== bench $run on $NGPU GPUs"
    module=tilecomm.bench; [ "${run%% *}" = torch_a2av ] && { module=tilecomm.bench.torch_a2av; run=${run#torch_a2av}; }
    timeout "${BENCH_TIMEOUT:-150}" torchrun --standalone --nproc-per-node "$NGPU" -m $module $run \
      --json "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "rc $?"; grep -v "named symbol not found" "$OUT/bench_$name.log" | grep -v "^W1\|Warning\|symm_mem_for_group" | tail -6
  done
fi

if has train; then
  for d in ${TRAIN_DISPATCHERS:-tilecomm $([ "$NGPU" -gt 1 ] && echo nccl fused)}; do  # one GPU: both are the local path
    echo "== pretrain_moe --preset h200x4 --dispatcher $d on $NGPU GPU(s), $TRAIN_STEPS steps"
    timeout "${TRAIN_TIMEOUT:-300}" torchrun --standalone --nproc-per-node "$NGPU" examples/pretrain_moe.py \
      --preset h200x4 --dispatcher $d --steps "$TRAIN_STEPS" --out "/tmp/run_$d" ${TRAIN_ARGS---no-checkpoint} \
      > "$OUT/train_$d.log" 2>&1
    tr '\r' '\n' < "$OUT/train_$d.log" | grep -v "^\s*$" | tail -4
    cp "/tmp/run_$d/log.jsonl" "$OUT/train_$d.jsonl" 2>/dev/null && tail -2 "$OUT/train_$d.jsonl"
  done
fi

# what this run wrote under $OUT in one archive (the device tool brings back a handful of files per call): run_N.tgz,
# N counting the runs of this call, earlier runs' archives left as they are (not nested: a command that runs several
# phases in turn gets one archive each; deleting one loses only that run's logs)
runs=$(find "$OUT" -maxdepth 1 -name 'run_*.tgz' | wc -l)
tar czf /tmp/tilecomm_out.tgz --exclude='./run_*.tgz' -C "$OUT" . \
  && find "${OUT:?}" -mindepth 1 -maxdepth 1 ! -name 'run_*.tgz' -exec rm -rf {} + \
  && mv /tmp/tilecomm_out.tgz "$OUT/run_$runs.tgz"
