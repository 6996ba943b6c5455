# Nsight Compute reports of the sampled plan against a full plan of its capacity (bench_sampled.py's pairs):
# the two launches of each pair's fourth call. GPU machine, after tools/gpu_env.sh.
# Usage: bash tools/gpu_sampled_profile.sh OUTDIR [PAIR ...]   (default pairs: bs4096 bs256)
out=${1:-/tmp/profiles}; shift; mkdir -p "$out"
pairs=${*:-bs4096 bs256}
cd benchmarks
for pair in $pairs; do
  for kind in sampled full; do
    echo "### $pair $kind"
    timeout 120 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
      -k regex:canary_plan --launch-skip 6 --launch-count 2 python3 profile_sampled.py "$pair" "$kind" 2>&1 \
      | grep -v "^==PROF==\|^==WARNING=="
  done
done > "$out/sampled-ncu.txt"
