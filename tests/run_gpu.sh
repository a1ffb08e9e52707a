#!/usr/bin/env bash
# One device-machine call: install, GPU tests, benchmarks, a short table last.
# Carry the nvshmem4py wheel as .whl (see the device tool's notes), then run from the repo root:
#   bash tests/run_gpu.sh            # all GPUs of the machine
# Output: $OUT/tests.log, $OUT/bench_*.json (when OUT is set), the bench tables on stdout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/tilecomm-gpu}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $NGPU"; nvidia-smi topo -m 2>/dev/null | head -8

# The same test bodies as the CPU suite, on GPU ranks (one per GPU), both transports.
for transport in nvlink nvshmem; do
  TILECOMM_TEST_BACKEND=cuda TILECOMM_TRANSPORT=$transport timeout 900 python3 -m pytest -q -x \
    tests/test_language.py tests/test_collectives.py tests/test_dispatch.py 2>&1 | tee -a "$OUT/tests.log" | tail -3
done

if [ "$NGPU" -ge 2 ]; then
  for op in all_to_all all_gather reduce_scatter dispatch; do
    for sym in "" "--symmetric"; do
      [ "$op" = dispatch ] && [ -n "$sym" ] && continue
      timeout 600 torchrun --standalone --nproc-per-node "$NGPU" -m tilecomm.bench $op $sym \
        --json "$OUT/bench_${op}${sym:+_sym}.json" 2>&1 | tail -6
    done
  done
fi
