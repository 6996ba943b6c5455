# The GPU suites as eight parallel pytest processes (GPU tests are host-bound: the H200 has 16 cores), then a
# summary line per process. Usage on the GPU machine: bash tools/gpu_suite.sh OUTDIR
out=${1:-/tmp/gpu-suite}; mkdir -p "$out"
. tools/gpu_env.sh
export KV_CANARY_REQUIRE_GPU=1
run() { name=$1; shift; python3 -m pytest -q -p no:cacheprovider -m "not sim and not slow" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; }
run records tests/records &
run plan_cupy tests/plan/test_plan_backends.py &
run plan_numba tests/plan/test_plan_numba.py tests/plan/test_plan_widths.py &
run plan_rest tests/plan --ignore tests/plan/test_plan_backends.py --ignore tests/plan/test_plan_numba.py \
    --ignore tests/plan/test_plan_widths.py &
run interop_usage tests/interop tests/usage &
run replay tests/replay &
run kernels_integrations tests/kernels tests/integrations &
run manager tests/manager &
wait
for f in "$out"/*.log; do echo "== $(basename "$f"): $(grep -E '^[0-9]+ (passed|failed)|^rc=' "$f" | tr '\n' ' ')"; done
grep -h "^FAILED\|^ERROR" "$out"/*.log | head -40
