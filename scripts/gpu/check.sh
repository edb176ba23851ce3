#!/usr/bin/env bash
# GPU check of lagom's NCCL side on one GPU (written for an H200; any CUDA GPU works).
#
#   scripts/gpu/check.sh OUT_DIR              the real run (a CUDA GPU; at most TOTAL_S = 400 s)
#   scripts/gpu/check.sh --rehearse OUT_DIR   the same steps and command lines without a GPU
#   PYTHON=/path/to/python scripts/gpu/check.sh OUT_DIR   (a Python with CUDA torch and Triton)
#
# OUT_DIR must be new or empty: a folder that holds anything, an earlier run's results included,
# is refused before anything runs, and nothing in it is replaced or removed.
# First the Python is checked for everything the steps import: torch, numpy, PyYAML, lagom_megatron
# and, for a real run, Triton and a CUDA device. One line names what is missing, and nothing runs.
# Then the steps, each under its own `timeout` (seconds); a failed step is recorded and the next one
# still runs. summary.md is rewritten (a temporary file, then a rename) after every step, so a run
# that is killed leaves one:
#   1. environment: GPU, driver, torch, CUDA, NCCL, Triton versions (25)   -> env.txt
#   2. contention probe: compute kernels alone and beside an N-CTA channel-like kernel, the
#      slowdown lagom's cost model needs (contention_probe.py --budget-s 120; 180)
#                                                                          -> contention/contention.csv
#   3. lagom calibrate contention on that CSV (30)                         -> contention/contention.fit.yaml
#   4. build the tuner plugin with gcc (40)                                -> plugin/libnccl-tuner-lagom.so
#   5. real NCCL: a 1-rank process group and pool entries with the pool's options, the tuner plugin
#      loaded (NCCL_DEBUG=INFO), a per-communicator NCCL_ALGO (45)        -> nccl.json, nccl_debug.*.log
#   6. the plugin's status read in-process, the capabilities probe, a ProcessGroupNCCL.Options group,
#      and collective timing turned on as lagom does it: enable_comm_timing
#      (ProcessGroup._enable_collectives_timing) on the existing group, then Work._get_duration() (40)
#                                                                          -> plugin_probe.json
# The import check has 30 s, the steps 360 s and the summary's details 10 s: TOTAL_S = 400 s, under
# the 540 s that leave time for a rerun in a 15-minute GPU slot (checked before anything runs, with
# each step's budget plus STARTUP_S against its limit). Each step's limit is also cut to what is left.
#
# What one GPU cannot show: NCCL refuses two ranks on one device (src/init.cc:974 @v2.29.7; from
# 2.30.3 only without NCCL_MULTI_RANK_GPU_ENABLE=1, src/init.cc:1055-1059 @v2.30.7, which this check
# leaves unset), and it runs a 1-rank collective as a local copy without consulting the tuner
# (src/enqueue.cc:3039-3040, cost table :1993-1996 @v2.30.7). So this check shows loading, options,
# timing and contention; per-call decisions (getCollInfo, getChunkSize), the observed check's results
# (profiler task and kernelCh events) and timing across ranks need two or more GPUs.
#
# --rehearse runs every step's exact command line with the GPU-only parts replaced by stand-ins (the
# Python steps get --rehearse: nccl_check.py and plugin_probe.py check the plugin library and the
# plan table they are given, and plugin_probe.py drives the timing calls against a stand-in with
# torch's API; contention_probe.py writes its CSV with times from the simulator's rule and known
# constants, which step 3 must give back), so argument errors, budgets longer than limits and outputs
# the next step cannot read fail without a GPU. Only NCCL's own debug logs (nccl_debug.*.log) are
# not written.
# Exit status: 0 when every step passed, 1 when a step failed (or an import is missing), 2 on bad
# usage or a refused OUT_DIR.
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
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

TOTAL_S=400
IMPORTS_S=30      # the import check, before the first step
SUMMARY_S=10      # the summary's details at the end
STARTUP_S=60      # a step's Python, CUDA context, Triton compile and 1.5 GiB of buffers before its budget starts
CONTENTION_BUDGET_S=120
STEPS=(environment contention calibrate build nccl probe)
declare -A LIMIT=([environment]=25 [contention]=180 [calibrate]=30 [build]=40 [nccl]=45 [probe]=40)
declare -A BUDGET=([contention]=$CONTENTION_BUDGET_S)
declare -A TITLE=([environment]="environment" [contention]="contention probe" [calibrate]="lagom calibrate contention"
  [build]="build tuner plugin" [nccl]="NCCL pool + tuner plugin" [probe]="plugin status, options, timing")
sum=$(( IMPORTS_S + SUMMARY_S ))
for step in "${STEPS[@]}"; do
  sum=$(( sum + LIMIT[$step] ))
  if [ -n "${BUDGET[$step]:-}" ] && [ $(( BUDGET[$step] + STARTUP_S )) -gt "${LIMIT[$step]}" ]; then
    echo "$0: step $step: budget ${BUDGET[$step]} s + start-up $STARTUP_S s exceeds its limit ${LIMIT[$step]} s" >&2
    exit 2
  fi
done
if [ "$sum" -gt "$TOTAL_S" ] || [ "$TOTAL_S" -ge 540 ]; then
  echo "$0: the import check, the step limits and the summary add up to $sum s; TOTAL_S = $TOTAL_S s must hold them and stay under 540 s" >&2
  exit 2
fi

# OUT_DIR: new or empty (lagom_megatron.preflight.files.output_folder_problem, standard library only)
for FOLDER_PY in "${PYTHON:-}" python3 python ""; do [ -n "$FOLDER_PY" ] && command -v "$FOLDER_PY" >/dev/null && break; done
[ -n "$FOLDER_PY" ] || { echo "$0: no Python found (PYTHON=${PYTHON:-unset}, python3, python)" >&2; exit 2; }
problem=$("$FOLDER_PY" -m lagom_megatron.preflight.files "$1" 2>&1)
case $? in
  0) ;;
  1) echo "$0: OUT_DIR $problem" >&2; exit 2 ;;
  *) echo "$0: cannot check OUT_DIR $1 with $FOLDER_PY: $problem" >&2; exit 2 ;;
esac
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "$0: cannot create OUT_DIR $1" >&2; exit 2; }

declare -A RESULT=() DETAIL=()
START=$(date +%s)
PY=""
IMPORTS="not run"
IMPORTS_DETAIL=""
FINAL=0

# summary.md, rewritten after every step: a temporary file, then a rename
write_summary() {
  local tmp="$OUT/.summary.md.tmp" step
  {
    echo "# lagom GPU check$([ $REHEARSE = 1 ] && echo ' (rehearsal: stand-ins, not measurements)')"
    echo
    echo "GPU: $(sed -n '/^name/{n;p;q}' "$OUT/env.txt" 2>/dev/null)"
    echo
    echo "| step | result | details |"
    echo "|---|---|---|"
    echo "| imports | $IMPORTS | $IMPORTS_DETAIL |"
    for step in "${STEPS[@]}" rehearsal; do
      [ "$step" = rehearsal ] && [ -z "${RESULT[rehearsal]:-}" ] && continue
      echo "| ${TITLE[$step]:-rehearsal outputs} | ${RESULT[$step]:-not run} | ${DETAIL[$step]:-} |"
    done
    echo
    echo "$([ $FINAL = 1 ] && echo Total || echo 'So far'): $(( $(date +%s) - START )) s (limit TOTAL_S = $TOTAL_S s)."
    echo
    echo "What one GPU cannot show: NCCL refuses two ranks on one device, and for a 1-rank communicator it"
    echo "runs each collective as a local copy without consulting the tuner. So this check shows loading,"
    echo "options, timing and contention; per-call decisions (getCollInfo, getChunkSize), the observed"
    echo "check's results and timing across ranks are not shown (they need two or more GPUs)."
    if [ $FINAL = 1 ]; then details; fi
  } > "$tmp" && mv -f "$tmp" "$OUT/summary.md"
}
record() { RESULT[$1]=$2; DETAIL[$1]=$3; echo "== ${TITLE[$1]:-$1}: $2 ($3)"; write_summary; }
# cap STEP: the step's limit, or what is left of TOTAL_S when less; 1 when under 10 s are left
# (never 0: `timeout 0` would mean no limit)
cap() {
  local left=$(( TOTAL_S - SUMMARY_S - ($(date +%s) - START) )) want=${LIMIT[$1]:-$1}
  if [ "$left" -lt 10 ]; then echo 1; elif [ "$want" -lt "$left" ]; then echo "$want"; else echo "$left"; fi
}

# 0. imports: the first Python with every module the steps import (and CUDA for a real run)
NEED=torch,numpy,yaml,lagom_megatron
[ $REHEARSE = 0 ] && NEED=$NEED,triton
check_imports() {  # prints what PYTHON $1 lacks, nothing when it has it all
  timeout "$2" "$1" - "$NEED" "$REHEARSE" <<'EOF' 2>/dev/null || echo "did not answer within $2 s"
import importlib, sys
pip = {"yaml": "PyYAML"}
missing = []
for name in sys.argv[1].split(","):
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - an import that fails for any reason is missing
        missing.append(f"{pip.get(name, name)} ({type(exc).__name__})")
if missing:
    print("missing " + ", ".join(missing))
elif sys.version_info < (3, 10):
    print(f"Python {sys.version.split()[0]} (3.10 or later needed)")
elif sys.argv[2] == "0":
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device seen by torch " + torch.__version__)
EOF
}
candidates=("$REPO/.venv/bin/python" python3 python)
[ -n "${PYTHON:-}" ] && candidates=("$PYTHON")  # an explicit PYTHON is the only one tried
deadline=$(( $(date +%s) + IMPORTS_S ))
lacks=()
for py in "${candidates[@]}"; do
  command -v "$py" >/dev/null 2>&1 || { [ -n "${PYTHON:-}" ] && lacks+=("$py: not found"); continue; }
  left=$(( deadline - $(date +%s) ))
  [ "$left" -ge 1 ] || { lacks+=("$py: not checked (the $IMPORTS_S s of the import check are spent)"); continue; }
  why=$(check_imports "$py" "$left")
  if [ -z "$why" ]; then PY=$py; break; fi
  lacks+=("$py: $why")
done
if [ -z "$PY" ]; then
  IMPORTS=FAILED
  IMPORTS_DETAIL=$(printf '%s; ' "${lacks[@]:-no python found}")
  IMPORTS_DETAIL=${IMPORTS_DETAIL%; }
  echo "$0: no Python has what the steps import ($IMPORTS_DETAIL); give one with PYTHON=... (pip install torch numpy PyYAML$([ $REHEARSE = 0 ] && echo ' triton'))" >&2
  FINAL=1
  details() { :; }
  write_summary
  exit 1
fi
IMPORTS=ok
IMPORTS_DETAIL="$PY: ${NEED//,/, }$([ $REHEARSE = 0 ] && echo ', CUDA')"
echo "== imports: ok ($IMPORTS_DETAIL)"
write_summary
REH=()
[ $REHEARSE = 1 ] && REH=(--rehearse)

# 1. environment
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname)"
  [ $REHEARSE = 1 ] && echo "rehearsal: stand-ins for the GPU parts (check.sh --rehearse)"
  timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi unavailable"
  timeout 5 gcc --version 2>&1 | head -1 || echo "gcc unavailable"
} > "$OUT/env.txt"
timeout "$(cap $(( LIMIT[environment] - 10 )))" "$PY" - "$REHEARSE" >> "$OUT/env.txt" 2>&1 <<'EOF'
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
record environment "$([ $? -eq 0 ] && echo ok || echo FAILED)" "$PY; see env.txt"

# 2. contention probe, 3. its calibration (what `lagom calibrate contention` reads and writes)
CSV="$OUT/contention/contention.csv"
FIT="$OUT/contention/contention.fit.yaml"
mkdir -p "$OUT/contention"
timeout "$(cap contention)" "$PY" "$REPO/scripts/gpu/contention_probe.py" --out "$CSV" \
  --budget-s "$CONTENTION_BUDGET_S" "${REH[@]}" > "$OUT/contention.log" 2>&1
rc=$?
if [ $rc -eq 0 ] && [ -s "$CSV" ]; then
  record contention ok "contention/contention.csv ($(( $(wc -l < "$CSV") - 1 )) rows), contention.log"
else
  record contention "FAILED (rc $rc$([ $rc -eq 124 ] && echo ': time limit'))" "see contention.log"
fi
if [ -s "$CSV" ] && [ "$(cap calibrate)" -gt 1 ]; then
  if timeout "$(cap calibrate)" "$PY" -m lagom_megatron.cli calibrate contention "$CSV" --out "$FIT" \
       > "$OUT/calibrate.log" 2>&1; then
    record calibrate ok "$(head -1 "$OUT/calibrate.log")"
  else
    record calibrate FAILED "see calibrate.log"
  fi
else
  record calibrate skipped "no contention CSV or no time left"
fi

# 4. plugin
LIB=""
if timeout "$(cap build)" "$PY" -c "from lagom_megatron.nccl.plugin import build_tuner; print(build_tuner('$OUT/plugin'))" \
    > "$OUT/build.log" 2>&1; then
  LIB="$OUT/plugin/libnccl-tuner-lagom.so"
  record build ok "$(nm -D "$LIB" 2>/dev/null | grep -c ncclTunerPlugin_v) ABI structs exported"
else
  record build FAILED "see build.log"
fi

# 5. real NCCL with the pool options and the tuner plugin
if [ -n "$LIB" ] && [ "$(cap nccl)" -gt 1 ]; then
  cat > "$OUT/plan_table.csv" <<'EOF'
# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff,chunkSize,commTag
allreduce,0,-1,ring,simple,4,-1,1,-1,-1,131072,pool_plugin
allreduce,0,-1,ring,-1,-1,-1,-1,-1,-1,-1,world
EOF
  if env -u NCCL_ALGO -u NCCL_PROTO -u NCCL_MIN_CTAS -u NCCL_MAX_CTAS -u NCCL_MIN_NCHANNELS -u NCCL_MAX_NCHANNELS \
       -u NCCL_CGA_CLUSTER_SIZE -u NCCL_CTA_POLICY -u NCCL_NVLS_NCHANNELS -u NCCL_MULTI_RANK_GPU_ENABLE \
       NCCL_TUNER_PLUGIN="$LIB" LAGOM_TUNER_CONFIG="$OUT/plan_table.csv" \
       NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,TUNING NCCL_DEBUG_FILE="$OUT/nccl_debug.%p.log" \
       timeout "$(cap nccl)" "$PY" "$REPO/scripts/gpu/nccl_check.py" "$OUT" "${REH[@]}" > "$OUT/nccl_check.log" 2>&1; then
    record nccl ok "nccl.json; LAGOM/tuner lines: $(cat "$OUT"/nccl_debug.*.log 2>/dev/null | grep -c 'LAGOM/tuner:')"
  else
    record nccl FAILED "see nccl.json, nccl_check.log, nccl_debug.*.log"
  fi
else
  record nccl skipped "needs the plugin and time left"
fi

# 6. plugin status in-process, capabilities, ProcessGroupNCCL options, collective timing as lagom turns it on
if [ -n "$LIB" ] && [ "$(cap probe)" -gt 1 ]; then
  cat > "$OUT/probe_table.csv" <<'EOF'
# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff,chunkSize,commTag
allreduce,4194304,4194304,ring,simple,4,-1,-1,-1,-1,131072,*
allreduce,67108864,67108864,ring,simple,8,-1,-1,-1,-1,-1,*
EOF
  if env -u NCCL_ALGO -u NCCL_PROTO -u NCCL_MIN_CTAS -u NCCL_MAX_CTAS -u LAGOM_TUNER_COMM_TAG -u TORCH_NCCL_ENABLE_TIMING \
       -u NCCL_MULTI_RANK_GPU_ENABLE NCCL_TUNER_PLUGIN="$LIB" NCCL_PROFILER_PLUGIN="$LIB" LAGOM_TUNER_CONFIG="$OUT/probe_table.csv" \
       timeout "$(cap probe)" "$PY" "$REPO/scripts/gpu/plugin_probe.py" "$OUT" "${REH[@]}" > "$OUT/plugin_probe.log" 2>&1; then
    record probe ok \
      "$(timeout 5 "$PY" -c "import json;r=json.load(open('$OUT/plugin_probe.json'));s=r.get('plugin_status') or {};print('ABI v%s, %s init(s), all-reduce %.3f ms' % (s.get('abi_version'), s.get('init_count'), r.get('all_reduce_64MiB_duration_ms') or 0))" 2>/dev/null || echo 'plugin_probe.json')"
  else
    record probe FAILED "see plugin_probe.json, plugin_probe.log"
  fi
else
  record probe skipped "needs the plugin and time left"
fi

if [ $REHEARSE = 1 ]; then  # every file a real run writes (NCCL's own debug logs aside)
  missing=""
  for f in env.txt build.log plugin/libnccl-tuner-lagom.so plan_table.csv nccl.json nccl_check.log probe_table.csv \
           plugin_probe.json plugin_probe.log contention/contention.csv contention.log contention/contention.fit.yaml \
           calibrate.log; do
    [ -s "$OUT/$f" ] || missing="$missing $f"
  done
  record rehearsal "$([ -z "$missing" ] && echo ok || echo FAILED)" "${missing:-every file of a real run but nccl_debug.*.log}"
fi

# the summary's details: the fitted constants and what the two JSON files say
details() {
  if [ -f "$FIT" ]; then
    echo
    echo "## Contention constants (contention/contention.fit.yaml)"
    echo
    echo '```'
    cat "$FIT"
    echo '```'
  fi
  local name
  for name in plugin_probe nccl; do
    [ -f "$OUT/$name.json" ] || continue
    echo
    echo "## $name.json"
    echo
    timeout 5 "$PY" - "$OUT/$name.json" <<'EOF' 2>/dev/null || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"torch {r.get('torch')}, NCCL {r.get('nccl_runtime')}; status {r.get('status')} {r.get('reason', '')}")
for key in ("plugin_status", "hit_summary", "capabilities", "all_reduce_64MiB_duration_ms", "timing", "nccl_config_fields"):
    if key in r:
        print(f"- {key}: {r[key]}")
for k, v in {**r.get("checks", {}), **r.get("rehearsal_checks", {})}.items():
    print(f"- {k}: {v}")
if r.get("error"):
    print(f"- error: {r['error']}")
EOF
  done
}
FINAL=1
write_summary
cat "$OUT/summary.md"
case "${RESULT[*]}" in *FAILED*) exit 1 ;; *) exit 0 ;; esac
