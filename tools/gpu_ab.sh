# Two trees alternated on one GPU machine, one benchmark each turn: the figures of bench_transformers (and
# other host-bound benchmarks) move 30 % from one process to the next, so only alternated runs compare.
#
#   here:  rm -rf .ab && mkdir .ab && git archive <old commit> canary kernels benchmarks docs | tar -x -C .ab
#          (carry ".ab" with ".whl" and ".lb"; .ab is in .git/info/exclude)
#   there: bash tools/gpu_ab.sh OUTDIR TURNS BENCH [its arguments...]
#          e.g. bash tools/gpu_ab.sh $OUT 3 bench_transformers.py --device cuda --cuda-graphs --rounds 3
#
# Each turn runs the old tree (.ab, first on the path, its own benchmarks/) then the working tree, each in a
# fresh process under `timeout 170`, and prints the figure lines of both; the logs and results files land in
# OUTDIR/old<turn> and OUTDIR/new<turn>.
set -u
out=$1; turns=$2; bench=$3; shift 3
mkdir -p "$out"
if command -v nvidia-smi > /dev/null; then . tools/gpu_env.sh; fi  # a CPU machine: the dry runs only
for i in $(seq 1 "$turns"); do
    for tree in old new; do
        if [ "$tree" = old ]; then
            root=$PWD/.ab
        else
            root=$PWD
        fi
        (cd "$root" && PYTHONPATH=$root:${PYTHONPATH:-} timeout 170 python3 "benchmarks/$bench" "$@" \
            --out "$out/$tree$i" > "$out/$tree$i.log" 2>&1)
        echo "== $tree$i rc=$?"
        grep -E "^[a-z].*  +-?[0-9.]+ [a-z%]+$" "$out/$tree$i.log"
    done
done
