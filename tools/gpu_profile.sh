# Nsight Compute reports of the kernels docs/performance.md discusses, and a cProfile of the eager manager and
# plan calls. GPU machine, after `. tools/gpu_env.sh`. Usage: bash tools/gpu_profile.sh OUTDIR [NAME ...]
# (default: every NAME below; one text report per NAME in OUTDIR). NCU_SECTIONS replaces the default sections.
out=${1:-/tmp/profiles}; shift; mkdir -p "$out"
sections=${NCU_SECTIONS:---section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis}
t=benchmarks/profile_target.py
prof() {  # NAME KERNEL_REGEX SKIP COUNT TARGET_ARGS...
  name=$1 k=$2 skip=$3 count=$4; shift 4
  case " ${SELECT:-all} " in *" all "*|*" $name "*) ;; *) return ;; esac
  timeout 150 ncu --clock-control none $sections -k "regex:$k" --launch-skip "$skip" --launch-count "$count" \
    python3 "$t" "$@" 2>&1 | grep -v "^==PROF==\|^==WARNING==" > "$out/$name.txt"; echo "$name rc=${PIPESTATUS[0]}"
}
SELECT="$*"
prof plan_bs256 canary_plan_fused 2 1 plan bs256_decode
for form in req_to_token block_table page_list; do  # the index forms at bs=1 (SPEC 3.8; the 1.5x of issue 26)
  prof "plan_bs1_$form" canary_plan 2 1 plan bs1 cupy "$form"
done
prof plan_swa canary_plan_fused 2 1 plan swa_bs256
prof plan_bs4096_rows canary_plan_rows 2 1 plan bs4096
prof plan_bs4096_entries_numba canary_plan_entries 2 1 plan bs4096 numba
prof verify_bs1_none canary_verify 2 1 records bs1_decode_ctx4k NONE
prof verify_bs1_all canary_verify 2 1 records bs1_decode_ctx4k ALL
prof verify_bs256_all canary_verify 2 1 records bs256_decode_ctx1k ALL
prof verify_bs256_all_numba canary_verify 2 1 records bs256_decode_ctx1k ALL numba
prof write_32k canary_write 2 1 records bs1_prefill_32k NONE
prof write_bs1 canary_write 2 1 records bs1_decode_ctx4k NONE
prof write_bs32 canary_write 2 1 records bs32_prefill NONE
prof write_bs256 canary_write 2 1 records bs256_decode_ctx1k NONE
for kind in sampled full; do  # a sampled step against the full plan of its capacity: the fourth call's launches
  prof "sampled_bs4096_$kind" canary_plan 6 2 sampled bs4096 "$kind"
  prof "sampled_bs256_$kind" canary_plan 3 1 sampled bs256_decode "$kind"
done
case " ${SELECT:-all} " in *" all "*|*" host "*)
  { timeout 60 python3 benchmarks/bench_host.py --profile "manager bs1" --rounds 2000 --out /tmp
    timeout 60 python3 benchmarks/bench_host.py --profile "plan bs1" --rounds 3000 --out /tmp; } > "$out/host.txt" 2>&1
  echo "host rc=$?";;
esac
