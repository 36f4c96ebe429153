#!/usr/bin/env bash
# The one script a session sends to a lent GPU (run from the repository root):
#   tools/gpu_check.sh           kernel tests (GPU tests at full size) + bench_kernels --quick
#   tools/gpu_check.sh --tune    first regenerate the launch table ($OUT/launch_table.json,
#                                quick candidate set) and run the tests and the bench with it
# Everything printed is also kept under $OUT (default ./gpu_out): env.txt, tune.log,
# launch_table.json, pytest.log, bench.log, bench.json. Needs python3 with torch, triton,
# numpy, numba and safetensors (the package's imports); nothing is installed or downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"  # inkling_quant, inkling_kernels
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
rc=0
{
  date -u
  nvidia-smi --query-gpu=name,compute_cap,memory.total,clocks.max.sm --format=csv 2>&1 || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import inkling_kernels as K; print(K.backend(), K.select_path('cuda'), K.select_path('cuda', 1))"
} 2>&1 | tee "$OUT/env.txt"
python3 -c "import inkling_kernels" || { echo "gpu_check: inkling_kernels does not import here" | tee -a "$OUT/env.txt"; exit 3; }

if [ "${1:-}" = "--tune" ]; then
  timeout 420 python3 -m inkling_kernels.autotune --quick --out "$OUT/launch_table.json" 2>&1 | tee "$OUT/tune.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] && export INKLING_KERNEL_TABLE="$OUT/launch_table.json" || rc=1
fi

timeout 300 python3 -m pytest tests/test_kernels.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
timeout 240 python3 tools/bench_kernels.py --quick --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
grep -E "^(PASS|FAIL|NOT RUN)" "$OUT/bench.log" | tee "$OUT/verdicts.txt"
exit $rc
