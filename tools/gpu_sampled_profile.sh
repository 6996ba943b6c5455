# Nsight Compute reports of the sampled plan against a full plan of its capacity (bench_sampled.py's pairs):
# the launches of one call of each pair (rows + entries at bs=4096, else the fused one). GPU machine, after
# tools/gpu_env.sh. NCU_SECTIONS replaces the default sections.
# Usage: bash tools/gpu_sampled_profile.sh OUTDIR [PAIR ...]   (default pairs: bs4096 bs256)
out=${1:-/tmp/profiles}; shift; mkdir -p "$out"
pairs=${*:-bs4096 bs256}
cd benchmarks
for pair in $pairs; do
  for kind in sampled full; do
    echo "### $pair $kind"
    launches="--launch-skip 6 --launch-count 2"  # the rows and entries launches of the fourth call
    [ "$pair" = bs4096 ] || launches="--launch-skip 3 --launch-count 1"  # fused: one launch a call
    timeout 120 ncu --clock-control none ${NCU_SECTIONS:---section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters} \
      -k regex:canary_plan $launches python3 profile_sampled.py "$pair" "$kind" 2>&1 \
      | grep -v "^==PROF==\|^==WARNING=="
  done
done > "$out/sampled-ncu.txt"
