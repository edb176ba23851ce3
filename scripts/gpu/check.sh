#!/usr/bin/env bash
# GPU check of lagom's NCCL side on a single-GPU machine (written for one H200; any CUDA GPU works).
#
#   scripts/gpu/check.sh OUT_DIR            (about 2-4 minutes; hard cap under 8)
#   PYTHON=/path/to/python scripts/gpu/check.sh OUT_DIR   (a Python with CUDA torch; triton for step 3)
#
# Steps, each with its own time limit; a failed step is recorded and the next one still runs:
#   1. environment: GPU, driver, torch, CUDA, NCCL versions           -> env.txt
#   2. build the tuner plugin with gcc                                 -> plugin/libnccl-tuner-lagom.so
#   3. overlap sweep: GEMM / element-wise loop beside a copy kernel
#      holding N CTAs, for several N and copy rates (CUDA events)      -> overlap.csv, overlap.json
#   4. real NCCL: 1-rank process group with the pool's options, the
#      tuner plugin loaded (NCCL_DEBUG=INFO), per-communicator NCCL_ALGO -> nccl.json, nccl_debug.*.log
#   5. plugin status read in-process after a real all-reduce with NCCL_TUNER_PLUGIN set, the
#      capabilities probe, a real ProcessGroupNCCL.Options group, Work._get_duration() on a timed
#      all-reduce (TORCH_NCCL_ENABLE_TIMING=1)                         -> plugin_probe.json
#   6. scripts/gpu/contention_probe.py, when the checkout has it       -> contention/
# Time guard: every step's timeout is cut to what is left of 470 s (7 min 50 s) since the start,
# and steps 5-6 with under 10 s left are recorded as skipped (others fail in 1 s), so the whole run stays under 8 minutes.
# Everything lands in OUT_DIR, with summary.md on top. Exit status: 0 when every step passed,
# 1 when a step failed, 2 on bad usage.
set -u -o pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

pick_python() {
  local candidates=("$REPO/.venv/bin/python" python3 python)
  [ -n "${PYTHON:-}" ] && candidates=("$PYTHON")  # an explicit PYTHON is the only one tried
  for py in "${candidates[@]}"; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || continue
    if timeout 30 "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

declare -a STATUS=()
record() { STATUS+=("| $1 | $2 | $3 |"); echo "== $1: $2 ($3)"; }

START=$(date +%s)
DEADLINE_S=470
# cap N: N seconds, or what is left before the deadline when less; 1 when under 10 s are left
# (never 0: `timeout 0` would mean no limit)
cap() {
  local left=$(( DEADLINE_S - ($(date +%s) - START) ))
  if [ "$left" -lt 10 ]; then echo 1; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi unavailable"
  gcc --version 2>&1 | head -1 || echo "gcc unavailable"
} > "$OUT/env.txt"

PY=$(pick_python) || PY=""
if [ -z "$PY" ]; then
  record "python with CUDA torch" "FAILED" "${PYTHON:-.venv/bin/python, python3, python}: no CUDA device seen by torch"
else
  timeout 30 "$PY" - >> "$OUT/env.txt" 2>&1 <<'EOF'
import torch, torch.distributed as dist
print("python torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0), "sms", torch.cuda.get_device_properties(0).multi_processor_count)
print("nccl available", dist.is_nccl_available(), "nccl runtime", torch.cuda.nccl.version())
try:
    import triton; print("triton", triton.__version__)
except ImportError as exc:
    print("triton missing:", exc)
EOF
  record "environment" "ok" "$PY; see env.txt"
fi

# 2. plugin
LIB=""
if timeout "$(cap 60)" "${PY:-${PYTHON:-python3}}" -c "from lagom_megatron.nccl.plugin import build_tuner; print(build_tuner('$OUT/plugin'))" \
    > "$OUT/build.log" 2>&1; then
  LIB="$OUT/plugin/libnccl-tuner-lagom.so"
  record "build tuner plugin" "ok" "$(nm -D "$LIB" 2>/dev/null | grep -c ncclTunerPlugin_v) ABI structs exported"
else
  record "build tuner plugin" "FAILED" "see build.log"
fi

# 3. overlap sweep
if [ -n "$PY" ]; then
  # budget: the whole script stays under 8 minutes (probe <= 90 s, NCCL step <= 100 s)
  SWEEP_BUDGET=$(( 200 - ($(date +%s) - START) ))
  [ "$SWEEP_BUDGET" -lt 30 ] && SWEEP_BUDGET=30
  if timeout "$(cap $(( SWEEP_BUDGET + 30 )))" "$PY" "$REPO/scripts/gpu/overlap_sweep.py" "$OUT" --budget-s "$SWEEP_BUDGET" \
      > "$OUT/overlap.log" 2>&1; then
    record "overlap sweep" "$("$PY" -c "import json;print(json.load(open('$OUT/overlap.json'))['status'])" 2>/dev/null || echo '?')" \
      "overlap.csv, overlap.json, overlap.log"
  else
    record "overlap sweep" "FAILED (rc $?)" "see overlap.log"
  fi
else
  record "overlap sweep" "skipped" "no GPU python"
fi

# 4. real NCCL with the pool options and the tuner plugin
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
       timeout "$(cap 90)" "$PY" "$REPO/scripts/gpu/nccl_check.py" "$OUT" > "$OUT/nccl_check.log" 2>&1; then
    record "NCCL pool + tuner plugin" "ok" "nccl.json; LAGOM/tuner lines: $(cat "$OUT"/nccl_debug.*.log 2>/dev/null | grep -c 'LAGOM/tuner:')"
  else
    record "NCCL pool + tuner plugin" "FAILED" "see nccl.json, nccl_check.log, nccl_debug.*.log"
  fi
else
  record "NCCL pool + tuner plugin" "skipped" "needs a GPU python and the plugin"
fi

# 5. plugin status in-process, capabilities, ProcessGroupNCCL options, Work._get_duration()
if [ -n "$PY" ] && [ -n "$LIB" ] && [ "$(cap 80)" -gt 1 ]; then
  cat > "$OUT/probe_table.csv" <<'EOF'
# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff,chunkSize,commTag
allreduce,4194304,4194304,ring,simple,4,-1,-1,-1,-1,131072,*
allreduce,67108864,67108864,ring,simple,8,-1,-1,-1,-1,-1,*
EOF
  rm -f "$OUT/probe_filestore"
  if env -u NCCL_ALGO -u NCCL_PROTO -u NCCL_MIN_CTAS -u NCCL_MAX_CTAS -u LAGOM_TUNER_COMM_TAG \
       NCCL_TUNER_PLUGIN="$LIB" LAGOM_TUNER_CONFIG="$OUT/probe_table.csv" TORCH_NCCL_ENABLE_TIMING=1 \
       timeout "$(cap 80)" "$PY" "$REPO/scripts/gpu/plugin_probe.py" "$OUT" > "$OUT/plugin_probe.log" 2>&1; then
    record "plugin status + capabilities" "ok" \
      "$("$PY" -c "import json;r=json.load(open('$OUT/plugin_probe.json'));s=r.get('plugin_status') or {};print('ABI v%s, %s init(s), all-reduce %.3f ms' % (s.get('abi_version'), s.get('init_count'), r.get('all_reduce_64MiB_duration_ms') or 0))" 2>/dev/null || echo 'plugin_probe.json')"
  else
    record "plugin status + capabilities" "FAILED" "see plugin_probe.json, plugin_probe.log"
  fi
else
  record "plugin status + capabilities" "skipped" "needs a GPU python, the plugin and time left"
fi

# 6. contention probe (scripts/gpu/contention_probe.py), when present
if [ ! -f "$REPO/scripts/gpu/contention_probe.py" ]; then
  record "contention probe" "skipped" "scripts/gpu/contention_probe.py not in this checkout"
elif [ -n "$PY" ] && [ "$(cap 90)" -gt 1 ]; then
  mkdir -p "$OUT/contention"
  if timeout "$(cap 90)" "$PY" "$REPO/scripts/gpu/contention_probe.py" "$OUT/contention" > "$OUT/contention.log" 2>&1; then
    record "contention probe" "ok" "contention/, contention.log"
  else
    record "contention probe" "FAILED (rc $?)" "see contention.log"
  fi
else
  record "contention probe" "skipped" "no GPU python or no time left"
fi

ELAPSED=$(( $(date +%s) - START ))
{
  echo "# lagom GPU check"
  echo
  echo "GPU: $(sed -n '/^name/{n;p;q}' "$OUT/env.txt")"
  echo
  echo "| step | result | details |"
  echo "|---|---|---|"
  printf '%s\n' "${STATUS[@]}"
  echo
  echo "Total: ${ELAPSED} s."
  if [ -f "$OUT/overlap.json" ]; then
    echo
    echo "## s(x) fit per compute kind (overlap.json)"
    echo
    "${PY:-python3}" - "$OUT/overlap.json" <<'EOF' 2>/dev/null || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"status {r.get('status')}; {r.get('reason', '')}")
print(f"GPU {r.get('gpu')}, {r.get('sms')} SMs, HBM copy {r.get('hbm_copy_gbps')} GB/s")
for name, f in (r.get("fits") or {}).items():
    if f.get("a_sm") is None:
        print(f"- {name}: too few points ({f['points']})")
        continue
    print(f"- {name}: s = {f['a_sm']:.3f} * sm_share + {f['b_hbm']:.3f} * hbm_share; "
          f"max s {f['max_slowdown']:.3f}; fit MAPE {f['mape_percent']}% over {f['points']} points")
EOF
  fi
  if [ -f "$OUT/plugin_probe.json" ]; then
    echo
    echo "## Plugin status, capabilities, options, timing (plugin_probe.json)"
    echo
    "${PY:-python3}" - "$OUT/plugin_probe.json" <<'EOF' 2>/dev/null || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"torch {r.get('torch')}, NCCL {r.get('nccl_runtime')}; status {r.get('status')}")
print(f"- plugin status: {r.get('plugin_status')}")
print(f"- {r.get('hit_summary', 'no hit summary')}")
print(f"- capabilities: {r.get('capabilities')}")
print(f"- Work._get_duration() of a 64 MiB all-reduce: {r.get('all_reduce_64MiB_duration_ms')} ms")
for k, v in r.get("checks", {}).items():
    print(f"- {k}: {v}")
if r.get("error"):
    print(f"- error: {r['error']}")
EOF
  fi
  if [ -f "$OUT/nccl.json" ]; then
    echo
    echo "## NCCL checks (nccl.json)"
    echo
    "${PY:-python3}" - "$OUT/nccl.json" <<'EOF' 2>/dev/null || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"torch {r.get('torch')}, NCCL {r.get('nccl_runtime')}, NCCLConfig fields {r.get('nccl_config_fields')}")
for k, v in r.get("checks", {}).items():
    print(f"- {k}: {v}")
if r.get("error"):
    print(f"- error: {r['error']}")
EOF
  fi
} > "$OUT/summary.md"
cat "$OUT/summary.md"
case "${STATUS[*]}" in *FAILED*) exit 1 ;; *) exit 0 ;; esac
