# The issue-14 workloads that tools/gpu_profiles.sh does not cover: the segmented write (a 32k-token request, a
# decode step), the bs=256 decode verify on both backends, the Numba plan's entries kernel; then the Numba plan's
# timings and a cProfile of the eager manager and plan calls. GPU machine, after tools/gpu_env.sh.
# Usage: bash tools/gpu_profiles2.sh OUTDIR (three text files).
out=${1:-/tmp/profiles}; mkdir -p "$out"
cd benchmarks
timeout 150 python3 bench_plan.py --impls cupy,numba --out /tmp > "$out/bench_plan.txt" 2>&1
n() { echo "### $*"; timeout 60 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --launch-skip 2 --launch-count 1 "$@" 2>&1 | grep -v "^==PROF==\|^==WARNING=="; }
{
  n -k regex:canary_write python3 profile_canary.py bs1_prefill_32k NONE
  n -k regex:canary_write python3 profile_canary.py bs1_decode_ctx4k NONE
  n -k regex:canary_verify python3 profile_canary.py bs256_decode_ctx1k ALL
  n -k regex:canary_verify python3 profile_canary.py bs256_decode_ctx1k ALL numba
  n -k regex:canary_plan_entries python3 profile_one.py bs4096 --impl=numba
} > "$out/ncu.txt"
{ timeout 40 python3 bench_host.py --profile "manager bs1" --repeats 2000; timeout 30 python3 bench_host.py --profile "plan bs1" --repeats 3000; } > "$out/host_profile.txt" 2>&1
