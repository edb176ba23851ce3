#!/usr/bin/env bash
# GPU check of lagom's NCCL side on a single-GPU machine (written for one H200; any CUDA GPU works).
#
#   scripts/gpu/check.sh OUT_DIR              the real run (a CUDA GPU; at most TOTAL_S = 690 s)
#   scripts/gpu/check.sh --rehearse OUT_DIR   the same steps and command lines without a GPU
#   PYTHON=/path/to/python scripts/gpu/check.sh OUT_DIR   (a Python with CUDA torch and triton)
#
# Steps, each with its own time limit (seconds); a failed step is recorded and the next one still runs:
#   1. environment: GPU, driver, torch, CUDA, NCCL, triton versions (30)    -> env.txt
#   2. build the tuner plugin with gcc (60)                                -> plugin/libnccl-tuner-lagom.so
#   3. real NCCL: 1-rank process group with the pool's options, the tuner plugin loaded
#      (NCCL_DEBUG=INFO), a per-communicator NCCL_ALGO (90)               -> nccl.json, nccl_debug.*.log
#   4. plugin status read in-process after a real all-reduce, the capabilities probe, a
#      ProcessGroupNCCL.Options group, Work._get_duration() (80)          -> plugin_probe.json
#   5. contention probe: compute kernels beside an N-CTA channel kernel
#      (contention_probe.py --budget-s 300; 360)                          -> contention/contention.csv
#   6. lagom calibrate contention on that CSV (60)                         -> contention/contention.fit.yaml
# Every step's own budget plus STARTUP_S fits its limit, and the limits add up to at most TOTAL_S
# (checked before anything runs), so the whole run fits a 12-minute slot on one GPU; every step's
# limit is also cut to what is left of TOTAL_S. Everything lands in OUT_DIR, with summary.md on top.
#
# --rehearse runs every step's exact command line with the GPU-only parts replaced by stand-ins
# (the Python steps get --rehearse: nccl_check.py and plugin_probe.py check the plugin library and
# the plan table they are given and write their JSON with the NCCL checks marked not run;
# contention_probe.py writes its CSV with times from the simulator's rule and known constants, which
# step 6 must give back), so argument errors, budgets longer than limits and outputs the next step
# cannot read fail without a GPU. Only NCCL's own debug logs (nccl_debug.*.log) are not written.
# Exit status: 0 when every step passed, 1 when a step failed, 2 on bad usage.
set -u -o pipefail

usage() {
  echo "usage: $0 [--rehearse] OUT_DIR"
  echo
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}
REHEARSE=0
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --rehearse) REHEARSE=1; shift ;;
esac
if [ $# -ne 1 ] || [[ "$1" == -* ]]; then
  echo "usage: $0 [--rehearse] OUT_DIR   ($0 --help for the steps)" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "$0: cannot create OUT_DIR $1" >&2; exit 2; }
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

TOTAL_S=690
STARTUP_S=60      # a step's Python, CUDA context, Triton compile and 1.5 GiB of buffers before its budget starts
CONTENTION_BUDGET_S=300
declare -A LIMIT=([environment]=30 [build]=60 [nccl]=90 [probe]=80 [contention]=360 [calibrate]=60)
declare -A BUDGET=([contention]=$CONTENTION_BUDGET_S)
sum=0
for step in "${!LIMIT[@]}"; do
  sum=$(( sum + LIMIT[$step] ))
  if [ -n "${BUDGET[$step]:-}" ] && [ $(( BUDGET[$step] + STARTUP_S )) -gt "${LIMIT[$step]}" ]; then
    echo "$0: step $step: budget ${BUDGET[$step]} s + start-up $STARTUP_S s exceeds its limit ${LIMIT[$step]} s" >&2
    exit 2
  fi
done
if [ "$sum" -gt "$TOTAL_S" ]; then
  echo "$0: the step limits add up to $sum s, more than TOTAL_S = $TOTAL_S s" >&2
  exit 2
fi

pick_python() {
  local candidates=("$REPO/.venv/bin/python" python3 python)
  [ -n "${PYTHON:-}" ] && candidates=("$PYTHON")  # an explicit PYTHON is the only one tried
  for py in "${candidates[@]}"; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || continue
    if [ $REHEARSE = 1 ]; then
      timeout 30 "$py" -c "import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)" >/dev/null 2>&1 && { echo "$py"; return 0; }
    elif timeout 30 "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

declare -a STATUS=()
record() { STATUS+=("| $1 | $2 | $3 |"); echo "== $1: $2 ($3)"; }
REH=()
[ $REHEARSE = 1 ] && REH=(--rehearse)

START=$(date +%s)
# cap STEP: the step's limit, or what is left of TOTAL_S when less; 1 when under 10 s are left
# (never 0: `timeout 0` would mean no limit)
cap() {
  local left=$(( TOTAL_S - ($(date +%s) - START) )) want=${LIMIT[$1]}
  if [ "$left" -lt 10 ]; then echo 1; elif [ "$want" -lt "$left" ]; then echo "$want"; else echo "$left"; fi
}

# 1. environment
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname)"
  [ $REHEARSE = 1 ] && echo "rehearsal: stand-ins for the GPU parts (check.sh --rehearse)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi unavailable"
  gcc --version 2>&1 | head -1 || echo "gcc unavailable"
} > "$OUT/env.txt"
PY=$(pick_python) || PY=""
if [ -z "$PY" ]; then
  record "python with CUDA torch" "FAILED" "${PYTHON:-.venv/bin/python, python3, python}: no CUDA device seen by torch"
else
  timeout "$(cap environment)" "$PY" - "$REHEARSE" >> "$OUT/env.txt" 2>&1 <<'EOF'
import sys
import torch, torch.distributed as dist
print("python torch", torch.__version__, "cuda", torch.version.cuda)
if sys.argv[1] == "0":
    print("device", torch.cuda.get_device_name(0), "sms", torch.cuda.get_device_properties(0).multi_processor_count)
    print("nccl available", dist.is_nccl_available(), "nccl runtime", torch.cuda.nccl.version())
try:
    import triton; print("triton", triton.__version__)
except ImportError as exc:
    print("triton missing:", exc)
EOF
  record "environment" "$([ $? -eq 0 ] && echo ok || echo FAILED)" "$PY; see env.txt"
fi

# 2. plugin
LIB=""
if timeout "$(cap build)" "${PY:-${PYTHON:-python3}}" -c "from lagom_megatron.nccl.plugin import build_tuner; print(build_tuner('$OUT/plugin'))" \
    > "$OUT/build.log" 2>&1; then
  LIB="$OUT/plugin/libnccl-tuner-lagom.so"
  record "build tuner plugin" "ok" "$(nm -D "$LIB" 2>/dev/null | grep -c ncclTunerPlugin_v) ABI structs exported"
else
  record "build tuner plugin" "FAILED" "see build.log"
fi

# 3. real NCCL with the pool options and the tuner plugin
if [ -n "$PY" ] && [ -n "$LIB" ]; then
  cat > "$OUT/plan_table.csv" <<'EOF'
# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff,chunkSize,commTag
allreduce,0,-1,ring,simple,4,-1,1,-1,-1,131072,pool_plugin
allreduce,0,-1,ring,-1,-1,-1,-1,-1,-1,-1,world
EOF
  rm -f "$OUT"/nccl_debug.*.log "$OUT/filestore"
  if env -u NCCL_ALGO -u NCCL_PROTO -u NCCL_MIN_CTAS -u NCCL_MAX_CTAS -u NCCL_MIN_NCHANNELS -u NCCL_MAX_NCHANNELS \
       -u NCCL_CGA_CLUSTER_SIZE -u NCCL_CTA_POLICY -u NCCL_NVLS_NCHANNELS \
       NCCL_TUNER_PLUGIN="$LIB" LAGOM_TUNER_CONFIG="$OUT/plan_table.csv" \
       NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,TUNING NCCL_DEBUG_FILE="$OUT/nccl_debug.%p.log" \
       timeout "$(cap nccl)" "$PY" "$REPO/scripts/gpu/nccl_check.py" "$OUT" "${REH[@]}" > "$OUT/nccl_check.log" 2>&1; then
    record "NCCL pool + tuner plugin" "ok" "nccl.json; LAGOM/tuner lines: $(cat "$OUT"/nccl_debug.*.log 2>/dev/null | grep -c 'LAGOM/tuner:')"
  else
    record "NCCL pool + tuner plugin" "FAILED" "see nccl.json, nccl_check.log, nccl_debug.*.log"
  fi
else
  record "NCCL pool + tuner plugin" "skipped" "needs a GPU python and the plugin"
fi

# 4. plugin status in-process, capabilities, ProcessGroupNCCL options, Work._get_duration()
if [ -n "$PY" ] && [ -n "$LIB" ] && [ "$(cap probe)" -gt 1 ]; then
  cat > "$OUT/probe_table.csv" <<'EOF'
# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff,chunkSize,commTag
allreduce,4194304,4194304,ring,simple,4,-1,-1,-1,-1,131072,*
allreduce,67108864,67108864,ring,simple,8,-1,-1,-1,-1,-1,*
EOF
  rm -f "$OUT/probe_filestore"
  if env -u NCCL_ALGO -u NCCL_PROTO -u NCCL_MIN_CTAS -u NCCL_MAX_CTAS -u LAGOM_TUNER_COMM_TAG \
       NCCL_TUNER_PLUGIN="$LIB" NCCL_PROFILER_PLUGIN="$LIB" LAGOM_TUNER_CONFIG="$OUT/probe_table.csv" TORCH_NCCL_ENABLE_TIMING=1 \
       timeout "$(cap probe)" "$PY" "$REPO/scripts/gpu/plugin_probe.py" "$OUT" "${REH[@]}" > "$OUT/plugin_probe.log" 2>&1; then
    record "plugin status + capabilities" "ok" \
      "$("$PY" -c "import json;r=json.load(open('$OUT/plugin_probe.json'));s=r.get('plugin_status') or {};print('ABI v%s, %s init(s), all-reduce %.3f ms' % (s.get('abi_version'), s.get('init_count'), r.get('all_reduce_64MiB_duration_ms') or 0))" 2>/dev/null || echo 'plugin_probe.json')"
  else
    record "plugin status + capabilities" "FAILED" "see plugin_probe.json, plugin_probe.log"
  fi
else
  record "plugin status + capabilities" "skipped" "needs a GPU python, the plugin and time left"
fi

# 5. contention probe, 6. its calibration (what `lagom calibrate contention` reads and writes)
CSV="$OUT/contention/contention.csv"
FIT="$OUT/contention/contention.fit.yaml"
mkdir -p "$OUT/contention"
rm -f "$CSV" "$FIT"
if [ -n "$PY" ] && [ "$(cap contention)" -gt 1 ]; then
  if timeout "$(cap contention)" "$PY" "$REPO/scripts/gpu/contention_probe.py" --out "$CSV" \
       --budget-s "$CONTENTION_BUDGET_S" "${REH[@]}" > "$OUT/contention.log" 2>&1 && [ -s "$CSV" ]; then
    record "contention probe" "ok" "contention/contention.csv ($(( $(wc -l < "$CSV") - 1 )) rows), contention.log"
  else
    record "contention probe" "FAILED (rc $?)" "see contention.log"
  fi
else
  record "contention probe" "skipped" "no GPU python or no time left"
fi
if [ -s "$CSV" ] && [ "$(cap calibrate)" -gt 1 ]; then
  if timeout "$(cap calibrate)" "$PY" -m lagom_megatron.cli calibrate contention "$CSV" --out "$FIT" \
       > "$OUT/calibrate.log" 2>&1; then
    record "lagom calibrate contention" "ok" "$(head -1 "$OUT/calibrate.log")"
  else
    record "lagom calibrate contention" "FAILED" "see calibrate.log"
  fi
else
  record "lagom calibrate contention" "skipped" "no contention CSV or no time left"
fi

if [ $REHEARSE = 1 ]; then  # every file a real run writes (NCCL's own debug logs aside), and the fit's constants
  missing=""
  for f in env.txt build.log plugin/libnccl-tuner-lagom.so plan_table.csv nccl.json nccl_check.log probe_table.csv \
           plugin_probe.json plugin_probe.log contention/contention.csv contention.log contention/contention.fit.yaml \
           calibrate.log; do
    [ -s "$OUT/$f" ] || missing="$missing $f"
  done
  record "rehearsal outputs" "$([ -z "$missing" ] && echo ok || echo FAILED)" "${missing:-every file of a real run but nccl_debug.*.log}"
fi

ELAPSED=$(( $(date +%s) - START ))
{
  echo "# lagom GPU check$([ $REHEARSE = 1 ] && echo ' (rehearsal: stand-ins, not measurements)')"
  echo
  echo "GPU: $(sed -n '/^name/{n;p;q}' "$OUT/env.txt")"
  echo
  echo "| step | result | details |"
  echo "|---|---|---|"
  printf '%s\n' "${STATUS[@]}"
  echo
  echo "Total: ${ELAPSED} s (limit $TOTAL_S s)."
  if [ -f "$FIT" ]; then
    echo
    echo "## Contention constants (contention/contention.fit.yaml)"
    echo
    echo '```'
    cat "$FIT"
    echo '```'
  fi
  for name in plugin_probe nccl; do
    [ -f "$OUT/$name.json" ] || continue
    echo
    echo "## $name.json"
    echo
    "${PY:-python3}" - "$OUT/$name.json" <<'EOF' 2>/dev/null || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"torch {r.get('torch')}, NCCL {r.get('nccl_runtime')}; status {r.get('status')} {r.get('reason', '')}")
for key in ("plugin_status", "hit_summary", "capabilities", "all_reduce_64MiB_duration_ms", "nccl_config_fields"):
    if key in r:
        print(f"- {key}: {r[key]}")
for k, v in {**r.get("checks", {}), **r.get("rehearsal_checks", {})}.items():
    print(f"- {k}: {v}")
if r.get("error"):
    print(f"- error: {r['error']}")
EOF
  done
} > "$OUT/summary.md"
cat "$OUT/summary.md"
case "${STATUS[*]}" in *FAILED*) exit 1 ;; *) exit 0 ;; esac
