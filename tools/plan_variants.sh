# Time variants of kernels/plan.cu that leave one stage of a sampled step out (benchmarks/bench_sampled.py; their
# checks fail by design). Usage on the GPU machine, after tools/gpu_env.sh: bash tools/plan_variants.sh NAME 'SED' ...
base=$PWD
while [ $# -ge 2 ]; do
  name=$1; expr=$2; shift 2
  rm -rf /tmp/var && cp -r "$base" /tmp/var && sed -i "$expr" /tmp/var/kernels/plan.cu
  grep -c . /tmp/var/kernels/plan.cu > /dev/null
  echo "### $name"; (cd /tmp/var && PYTHONPATH=/tmp/site:/tmp/var python3 benchmarks/bench_sampled.py --backends cupy --out /tmp 2>&1 | grep "C=")
done
