#!/usr/bin/env bash
# The dispatch part of a device-machine call: world-1 rows of the Dispatcher beside the copy floor, a
# per-kernel profile of one call, then tests/test_dispatch.py on ranks sharing the GPU, both transports.
# Carry the nvshmem4py wheel as .whl; run from the repo root:
#   bash tests/run_gpu_dispatch.sh [bench] [tests]       (default: both)
# Env: TILECOMM_TEST_ITERS (random-loop iterations, default 200 here), TRANSPORTS (default "nvlink nvshmem"),
#      TEST_K / TEST_K2 (pytest -k for the first / second transport).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/tilecomm-gpu}"; mkdir -p "$OUT"
PHASES="${*:-bench tests}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
echo "commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +dirty)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
has() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }

if has bench; then
  timeout 300 python3 - "$OUT/dispatch_self.json" <<'EOF' 2>&1 | grep -v "named symbol not found" | tee "$OUT/bench.log"
import json, sys, torch, tilecomm
from tilecomm.bench import dispatch as bd
from tilecomm.dispatch import Dispatcher
tilecomm.init(backend="cuda", heap_bytes=bd.self_heap_bytes(True) + (256 << 20))
rows = bd.self_rows(iters=50)
print(f"{'op':22s} {'us/call':>9s} {'floor':>8s} {'ratio':>6s} {'host us':>8s} {'gpu us':>8s} {'krn':>4s} {'syn':>4s}  bar")
for r in rows:
    print(f"{r['op']:22s} {r['us']:9.1f} {r['floor_us']:8.1f} {r['ratio']:6.2f} {r['host_us']:8.1f} {r['gpu_us']:8.1f} "
          f"{r['kernels']:4d} {r['syncs']:4d}  {r['bar']} {'MET' if r['meets_bar'] else 'missed'} graph={r.get('graph')}")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
import dataclasses, cProfile, pstats, io, warnings
from tilecomm.bench import measure
s = bd.SELF_SIZES[True]
print("event sync flagged by sync debug mode:", bd._debug_mode_sees_event_syncs())
d = Dispatcher(s["experts"], s["hidden"], s["tokens"], s["topk"], s["dtype"])
x = torch.randn(s["tokens"], s["hidden"], device="cuda").to(s["dtype"])
idx = torch.rand(s["tokens"], s["experts"], device="cuda").topk(s["topk"], dim=1).indices
w = torch.rand(s["tokens"], s["topk"], device="cuda")
with torch.no_grad():
    d.dispatch(x, idx, w); torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always"); torch.cuda.set_sync_debug_mode("warn")
        d.dispatch(x, idx, w)
        torch.cuda.set_sync_debug_mode("default")
    print("normal dispatch sync warnings:", [(w_.filename.split("/")[-1], w_.lineno, str(w_.message)[:60]) for w_ in caught])
d.free()
T = s["ll_tokens"]
d = Dispatcher(s["experts"], s["hidden"], T, s["topk"], s["dtype"], mode="low_latency")
x = torch.randn(T, s["hidden"], device="cuda").to(s["dtype"])
idx = torch.rand(T, s["experts"], device="cuda").topk(s["topk"], dim=1).indices
w = torch.rand(T, s["topk"], device="cuda")
with torch.no_grad():
    res = d.dispatch(x, idx, w); y = res.x.clone()
    base = d._engine.cfg
    for c in (1, 2, 4, 7, 14):
        d._engine.cfg = dataclasses.replace(base, col_programs=c)
        print(f"LL col_programs={c:2d}: dispatch {measure.per_call_us(lambda: d.dispatch(x, idx, w), 100):7.1f} us, "
              f"combine {measure.per_call_us(lambda: d.combine(y, res.handle), 100):7.1f} us, gpu us "
              f"{measure.kernels_per_call(lambda: d.dispatch(x, idx, w))[1]:6.1f} / "
              f"{measure.kernels_per_call(lambda: d.combine(y, res.handle))[1]:6.1f}")
    d._engine.cfg = base
    prof = cProfile.Profile(); prof.enable()
    for _ in range(200):
        d.dispatch(x, idx, w)
    prof.disable(); torch.cuda.synchronize()
    out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14); print(out.getvalue()[-3500:])
d.free()
from torch.profiler import profile, ProfilerActivity
s = bd.SELF_SIZES[True]
for mode, T in (("normal", s["tokens"]), ("low_latency", s["ll_tokens"])):
    d = Dispatcher(s["experts"], s["hidden"], T, s["topk"], s["dtype"], mode=mode)
    x = torch.randn(T, s["hidden"], device="cuda").to(s["dtype"])
    idx = torch.rand(T, s["experts"], device="cuda").topk(s["topk"], dim=1).indices
    w = torch.rand(T, s["topk"], device="cuda")
    with torch.no_grad():
        res = d.dispatch(x, idx, w); y = res.x.clone(); d.combine(y, res.handle); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            res = d.dispatch(x, idx, w); d.combine(y, res.handle); torch.cuda.synchronize()
    print(f"-- {mode}: kernels of one dispatch + combine (device us)")
    for e in prof.key_averages():
        if e.device_time_total > 0:
            print(f"   {e.key[:60]:60s} {e.device_time_total:9.1f} x{e.count}")
    d.free()
tilecomm.finalize()
EOF
fi

if has tests; then
  for transport in ${TRANSPORTS:-nvlink nvshmem}; do
    echo "== test_dispatch on ranks sharing the GPU, transport $transport"
    TILECOMM_TEST_ITERS="${TILECOMM_TEST_ITERS:-200}" TILECOMM_TEST_BACKEND=cuda TILECOMM_TEST_SHARE_GPUS=1 \
      TILECOMM_TRANSPORT=$transport timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -x -p no:cacheprovider \
      --durations=5 ${TEST_K:+-k "$TEST_K"} tests/test_dispatch.py 2>&1 | tee -a "$OUT/tests_$transport.log" | tail -25
    TILECOMM_TEST_ITERS=6 TEST_K="${TEST_K2:-${TEST_K:-}}"  # the second transport: shorter
  done
fi
