# Source on the GPU machine (see docs/gpu-runs.md): numpy 2.4 for numba-cuda, the tree on sys.path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
