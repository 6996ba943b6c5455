# Every benchmark in benchmarks/ on the GPU machine, one after another (they share the GPU), each writing
# benchmarks/results/<benchmark>.json, a log per benchmark in OUTDIR and a line "bench_NAME rc=N" each.
# Copy benchmarks/results/ back and commit it. Usage: bash tools/gpu_bench.sh OUTDIR [NAME ...]
# The GPU machine gets the working tree without its .git history (its git shows an older HEAD): pass the
# commit from the machine that sent the tree, KV_CANARY_COMMIT=<commit> bash tools/gpu_bench.sh OUTDIR.
# (NAME: plan, records, ...; default: every benchmarks/bench_*.py).
out=${1:-/tmp/bench}; shift; mkdir -p "$out"
. tools/gpu_env.sh
rc=0
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
for name in ${*:-$(cd benchmarks && ls bench_*.py | sed 's/^bench_//; s/\.py$//')}; do
  extra=()
  if [ "$name" = agree ]; then  # the ranks' agreement on the GPU: NCCL, one GPU a rank (its CPU figures: gloo)
    if [ "$gpus" -lt 2 ]; then echo "bench_agree skipped: needs 2 GPUs, got $gpus"; continue; fi
    extra=(--device cuda --name agree-nccl)
  fi
  timeout 900 python3 "benchmarks/bench_$name.py" "${extra[@]}" > "$out/bench_$name.log" 2>&1; r=$?
  echo "bench_$name rc=$r"; [ $r -eq 0 ] || rc=1
done
exit $rc
