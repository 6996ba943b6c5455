# Nsight Compute summaries of the workloads whose issue-14 targets are not met (GPU machine, after
# tools/gpu_env.sh). Usage: bash tools/gpu_profiles.sh OUTDIR. One text report per kernel launch profiled.
out=${1:-/tmp/profiles}; mkdir -p "$out"
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis"
prof() { name=$1; shift; ncu --clock-control none $sections --launch-skip 2 --launch-count 1 "$@" > "$out/$name.txt" 2>&1; echo "$name rc=$?"; }
cd benchmarks
prof plan_bs256 -k regex:canary_plan_fused python3 profile_one.py bs256_decode
prof plan_swa -k regex:canary_plan_fused python3 profile_one.py swa_bs256
prof plan_bs4096_rows -k regex:canary_plan_rows python3 profile_one.py bs4096

prof verify_bs1_none -k regex:canary_verify python3 profile_canary.py bs1_decode_ctx4k NONE
prof verify_bs1_all -k regex:canary_verify python3 profile_canary.py bs1_decode_ctx4k ALL
prof verify_bs256_all -k regex:canary_verify python3 profile_canary.py bs256_decode_ctx1k ALL

