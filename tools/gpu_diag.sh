#!/usr/bin/env bash
# Diagnose failing GPU tests: the named test ids with long tracebacks, then a directory verbosely (so a crash names its test).
# Usage: bash tools/gpu_diag.sh OUTDIR "test ids..." "dir for -v"
set -u
out=$1; ids=$2; vdir=$3
mkdir -p "$out"
timeout 200 python3 -m pytest -p no:cacheprovider -m "not sim and not slow" --tb=long -rA $ids > "$out/fail.log" 2>&1
echo "ids rc $?" >> "$out/fail.log"
timeout 300 python3 -m pytest -p no:cacheprovider -m "not sim and not slow" -v --tb=short $vdir > "$out/verbose.log" 2>&1
echo "verbose rc $?" >> "$out/verbose.log"
