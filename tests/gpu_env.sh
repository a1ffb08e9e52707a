# Sourced by the one-GPU scripts: the environment every device run needs (no NVLink multicast) and
# nvshmem4py from the carried wheel (.whl, see tests/run_gpu.sh), then tilecomm itself.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/tilecomm-gpu}"; mkdir -p "$OUT"
# one install at a time: two scripts started side by side raced on the same dist-info (2026-11-27)
exec 9>/tmp/tilecomm-install.lock && flock 9
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
flock -u 9; exec 9>&-
