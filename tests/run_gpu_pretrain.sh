#!/usr/bin/env bash
# The pretraining preset on one GPU, before/after: one device-machine call, a table last.
#   bash tests/run_gpu_pretrain.sh [RUN ...]      RUN: base eager compile rerun tests (default: base eager compile tests)
# Trees (each imported through a symlinked package folder, no install):
#   .base/  the commit to compare with (git archive <commit> | tar -x -C .base; carried, git-ignored)
#   .new/   the code to measure (git archive HEAD; default: this tree)
# Runs `examples/pretrain_moe.py --preset h200x4 --steps $STEPS --no-checkpoint`; the loss curves and
# logs land in $OUT; the table gives tokens/s and MFU over steps 10.. and the loss's largest relative
# difference from the base run over the first 20 steps.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/tilecomm-gpu}"; mkdir -p "$OUT"
RUNS="${*:-base tests eager compile}"
STEPS="${STEPS:-30}"
ROOT="$PWD"
NEW="${NEW:-$ROOT}"; [ -d "$ROOT/.new" ] && NEW="$ROOT/.new"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
pkg() {  # pkg TREE DIR: DIR/tilecomm = TREE's comm/ files + overlap, dispatch, moe
  mkdir -p "$2/tilecomm"
  for f in "$1"/comm/*; do ln -sfn "$f" "$2/tilecomm/"; done
  for d in overlap dispatch moe; do ln -sfn "$1/$d" "$2/tilecomm/$d"; done
}
pkg "$ROOT/.base" /tmp/pkg_base; pkg "$NEW" /tmp/pkg_new
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
has() { case " $RUNS " in *" $1 "*) return 0;; esac; return 1; }

train() {  # train NAME TREE PKG FLAGS...
  local name=$1 tree=$2 pkgdir=$3; shift 3
  echo "== $name: pretrain_moe --preset h200x4 --steps $STEPS $*"
  rm -rf "/tmp/run_$name"
  PYTHONPATH="$pkgdir:/tmp/site" timeout "${TRAIN_TIMEOUT:-420}" torchrun --standalone --nproc-per-node 1 \
    "$tree/examples/pretrain_moe.py" --preset h200x4 --steps "$STEPS" --out "/tmp/run_$name" "$@" \
    > "$OUT/train_$name.log" 2>&1
  echo "exit $?"
  tr '\r' '\n' < "$OUT/train_$name.log" | grep -v "^\s*$" | grep -v "named symbol not found" | tail -${TAIL:-4}
  cp "/tmp/run_$name/log.jsonl" "$OUT/$name.jsonl" 2>/dev/null
}

has base && train base "$ROOT/.base" /tmp/pkg_base
has eager && TAIL=50 train eager "$NEW" /tmp/pkg_new --no-checkpoint --profile  # profiles steps 5-7 (before 10)
has compile && train compile "$NEW" /tmp/pkg_new --no-checkpoint --compile
has rerun && STEPS=20 train rerun "$ROOT/.base" /tmp/pkg_base  # the base again: its own run-to-run spread
if has tests; then
  echo "== GPU tests: fused ops, compiled blocks"
  (cd "$NEW" && PYTHONPATH=/tmp/pkg_new:/tmp/site timeout 400 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_moe_ops.py tests/test_pretrain.py -k "${TEST_K:-not ep2 and not checkpoint and not context_parallel and not example and not dtype0}" \
    2>&1 | tee "$OUT/tests.log" | tail -4)
  (cd "$NEW" && PYTHONPATH=/tmp/pkg_new:/tmp/site timeout 200 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_moe_layer.py -k "compiled_moe_layer and dtype1" 2>&1 | tee -a "$OUT/tests.log" | tail -2)
fi

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, f"{name}.jsonl")
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else None
base = load("base") or load("rerun")
print(f"{'run':8s} {'steps':>5s} {'tok/s':>8s} {'ms/step':>8s} {'MFU':>6s} {'TFLOP/s':>8s} {'loss0':>7s} {'loss19':>7s} {'max rel dloss (0-19)':>20s}")
for name in ("base", "eager", "compile", "rerun"):
    rows = load(name)
    if not rows:
        continue
    win = rows[10:] or rows
    secs = sum(r["seconds"] for r in win)
    tok_s = sum(r["tokens_per_s"] * r["seconds"] for r in win) / secs
    mfu = (win[0]["mfu"] or 0) / win[0]["tokens_per_s"] * tok_s
    dl = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rows[:20], base[:20])) if base else float("nan")
    l19 = rows[19]["loss"] if len(rows) > 19 else float("nan")
    print(f"{name:8s} {len(rows):5d} {tok_s:8.0f} {1e3 * secs / len(win):8.1f} {100 * mfu:5.1f}% {989 * mfu:8.0f} "
          f"{rows[0]['loss']:7.3f} {l19:7.3f} {dl:20.4f}")
EOF
