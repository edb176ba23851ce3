#!/usr/bin/env bash
# nccl-tests over channel counts, thread counts and protocols, saved for `lagom calibrate bandwidth`.
#
#   scripts/gpu/nccl_sweep.sh [options] OUT_DIR
#   lagom calibrate bandwidth OUT_DIR --cluster <your cluster file or name>
#
# Runs NVIDIA/nccl-tests' binaries (build them first: `make` in a nccl-tests checkout, MPI=1 for
# several nodes):
#   all_gather_perf, reduce_scatter_perf, all_reduce_perf: NCCL_ALGO=Ring, for each protocol
#     (NCCL_PROTO), channel count (NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS, and NCCL_MIN_CTAS =
#     NCCL_MAX_CTAS for NCCL 2.17+) and thread count (NCCL_NTHREADS; LL128 ignores it and runs once
#     per channel count with NCCL_LL128_NTHREADS' default 640);
#   alltoall_perf, sendrecv_perf: for each channel count (point-to-point picks its own protocol by
#     size and runs 640 threads, so neither is swept).
# Every run has NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV so NCCL's own lines ("N coll channels",
# "NCCL_PROTO set by environment to ...") show what it ran; `lagom calibrate bandwidth` checks them.
# Each run lands in OUT_DIR/<op>.<protocol or P2P>.c<channels>.t<threads>.txt: first the settings line
#   # lagom-sweep op=all_gather algorithm=Ring protocol=Simple channels=8 threads=256 nodes=1
# then "# command: ..." and the run's stdout and stderr. A run that fails or times out is kept as
# <name>.failed (the calibration reads *.txt only) and the sweep goes on.
#
# Options (lists are comma-separated):
#   --tests-dir DIR     folder with the *_perf binaries (default: $NCCL_TESTS_DIR, else ./build)
#   --launcher "CMD"    prefix of every run, e.g. "srun -N 2 --ntasks-per-node 8" or
#                       "mpirun -np 16 -N 8" (Open MPI: "-x NAME" is added for each NCCL variable)
#   --gpus N            nccl-tests -g: GPUs per process (default 8 without --launcher, 1 with one)
#   --nodes N           nodes the launcher spans (written in the settings line; default 1)
#   --ops LIST          default all_gather,reduce_scatter,all_reduce,alltoall,sendrecv
#   --channels LIST     integers in 1..64 (default 1,2,4,8,16,32)
#   --threads LIST      multiples of 32 in 64..512 (default 128,256,512)
#   --protocols LIST    of LL, LL128, Simple (default LL,LL128,Simple; NCCL enables LL128 by default
#                       only on some paths: forcing it elsewhere can give wrong data, which -c 1
#                       catches and the calibration refuses)
#   -b SIZE -e SIZE     nccl-tests sizes (default -b 1M -e 512M; suffixes K, M, G)
#   -f N -n N -w N -c N nccl-tests step factor, iterations, warm-up iterations, checks (2, 20, 5, 1)
#   --timeout S         seconds per run (default 600)
#   --overwrite         replace run files an earlier sweep left in OUT_DIR (OUT_DIR must otherwise be new
#                       or empty; anything else in it stops the sweep, untouched)
#   --dry-run           print every command and its output file; run and write nothing
#   -h, --help          this text
# Exit status: 0 every run passed, 1 a run failed, 2 bad usage (nothing run).
set -u -o pipefail

usage() { sed -n '2,/^# Exit status/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
die() { echo "nccl_sweep.sh: $1 (see --help)" >&2; exit 2; }

TESTS_DIR=${NCCL_TESTS_DIR:-./build}
LAUNCHER="" GPUS="" NODES=1 DRY=0 OVERWRITE=0 TIMEOUT=600 OUT=""
OPS=all_gather,reduce_scatter,all_reduce,alltoall,sendrecv
CHANNELS=1,2,4,8,16,32 THREADS=128,256,512 PROTOCOLS=LL,LL128,Simple
MINB=1M MAXB=512M STEP=2 ITERS=20 WARMUP=5 CHECK=1
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY=1; shift; continue ;;
    --overwrite) OVERWRITE=1; shift; continue ;;
    --tests-dir|--launcher|--gpus|--nodes|--ops|--channels|--threads|--protocols|--timeout|-b|-e|-f|-n|-w|-c)
      [ $# -ge 2 ] || die "$1 needs a value" ;;
    -*) die "unknown option $1" ;;
    *) [ -z "$OUT" ] || die "one OUT_DIR only; got $OUT and $1"; OUT=$1; shift; continue ;;
  esac
  case "$1" in
    --tests-dir) TESTS_DIR=$2 ;; --launcher) LAUNCHER=$2 ;; --gpus) GPUS=$2 ;; --nodes) NODES=$2 ;;
    --ops) OPS=$2 ;; --channels) CHANNELS=$2 ;; --threads) THREADS=$2 ;; --protocols) PROTOCOLS=$2 ;;
    --timeout) TIMEOUT=$2 ;; -b) MINB=$2 ;; -e) MAXB=$2 ;; -f) STEP=$2 ;; -n) ITERS=$2 ;; -w) WARMUP=$2 ;; -c) CHECK=$2 ;;
  esac
  shift 2
done
[ -n "$OUT" ] || die "give OUT_DIR, the folder for the run files"
[ -n "$GPUS" ] || { [ -n "$LAUNCHER" ] && GPUS=1 || GPUS=8; }

is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }
in_list() { local x; for x in $2; do [ "$x" = "$1" ] && return 0; done; return 1; }
split() { tr ',' ' ' <<<"$1"; }
for v in $(split "$OPS"); do
  in_list "$v" "all_gather reduce_scatter all_reduce alltoall sendrecv" ||
    die "--ops: $v is not one of all_gather, reduce_scatter, all_reduce, alltoall, sendrecv"
done
for v in $(split "$CHANNELS"); do
  is_int "$v" && [ "$v" -ge 1 ] && [ "$v" -le 64 ] || die "--channels: $v is not an integer in 1..64 (NCCL's MAXCHANNELS)"
done
for v in $(split "$THREADS"); do
  is_int "$v" && [ "$v" -ge 64 ] && [ "$v" -le 512 ] && [ $((v % 32)) -eq 0 ] ||
    die "--threads: $v is not a multiple of 32 in 64..512 (NCCL_NTHREADS)"
done
for v in $(split "$PROTOCOLS"); do in_list "$v" "LL LL128 Simple" || die "--protocols: $v is not one of LL, LL128, Simple"; done
for pair in "--gpus:$GPUS" "--nodes:$NODES" "--timeout:$TIMEOUT" "-f:$STEP" "-n:$ITERS" "-w:$WARMUP" "-c:$CHECK"; do
  is_int "${pair#*:}" || die "${pair%%:*}: ${pair#*:} is not a non-negative integer"
done
[ "$NODES" -ge 1 ] && [ "$GPUS" -ge 1 ] || die "--nodes and --gpus must be >= 1"
for pair in "-b:$MINB" "-e:$MAXB"; do
  [[ "${pair#*:}" =~ ^[0-9]+[KMG]?$ ]] || die "${pair%%:*}: ${pair#*:} is not a size (bytes, or with K, M, G)"
done
if [ "$DRY" -eq 0 ]; then
  for op in $(split "$OPS"); do
    [ -x "$TESTS_DIR/${op}_perf" ] || die "$TESTS_DIR/${op}_perf: missing or not executable (--tests-dir: nccl-tests' build folder)"
  done
  # OUT_DIR: new or empty; with --overwrite it may hold an earlier sweep's run files, which are replaced
  # (lagom_megatron.preflight.files.output_folder_problem; anything else there stops the sweep, untouched)
  REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  if [ "$OVERWRITE" -eq 1 ]; then
    own=("# lagom-sweep " "give a new or empty folder: --overwrite replaces only an earlier sweep's run files (first line '# lagom-sweep'), nothing else")
  else
    own=("" "give a new or empty folder, or --overwrite to replace an earlier sweep's run files (nothing else is replaced or removed)")
  fi
  problem=$(PYTHONPATH="$REPO" "${PYTHON:-python3}" -m lagom_megatron.preflight.files "$OUT" "${own[@]}" 2>&1)
  case $? in
    0) ;;
    1) die "OUT_DIR $problem" ;;
    *) die "cannot check OUT_DIR $OUT with ${PYTHON:-python3}: $problem" ;;
  esac
  mkdir -p "$OUT" || die "cannot create $OUT"
fi

read -r -a LAUNCH <<<"$LAUNCHER"
MPI_X=0
[ ${#LAUNCH[@]} -gt 0 ] && case "$(basename "${LAUNCH[0]}")" in mpirun|mpiexec|orterun) MPI_X=1 ;; esac

RUNS=0 FAILED=()
# one_run OP ALGORITHM PROTOCOL CHANNELS THREADS: builds the environment and command, runs or prints it
one_run() {
  local op=$1 alg=$2 proto=$3 ch=$4 thr=$5
  local -a env=(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV "NCCL_MIN_NCHANNELS=$ch" "NCCL_MAX_NCHANNELS=$ch"
                "NCCL_MIN_CTAS=$ch" "NCCL_MAX_CTAS=$ch")
  if [ "$alg" = Ring ]; then
    env+=(NCCL_ALGO=Ring "NCCL_PROTO=$proto")
    [ "$proto" = LL128 ] || env+=("NCCL_NTHREADS=$thr")
  fi
  local -a launch=("${LAUNCH[@]}")
  if [ "$MPI_X" -eq 1 ]; then local kv; for kv in "${env[@]}"; do launch+=(-x "${kv%%=*}"); done; fi
  local -a cmd=(env "${env[@]}" "${launch[@]}" "$TESTS_DIR/${op}_perf" -b "$MINB" -e "$MAXB" -f "$STEP" -g "$GPUS"
                -n "$ITERS" -w "$WARMUP" -c "$CHECK")
  local name="$OUT/$op.$([ "$alg" = P2P ] && echo P2P || echo "$proto").c$ch.t$thr"
  RUNS=$((RUNS + 1))
  if [ "$DRY" -eq 1 ]; then
    echo "${cmd[*]} > $name.txt"
    return
  fi
  {
    echo "# lagom-sweep op=$op algorithm=$alg protocol=$proto channels=$ch threads=$thr nodes=$NODES"
    echo "# command: ${cmd[*]}"
  } > "$name.partial"
  if timeout "$TIMEOUT" "${cmd[@]}" >> "$name.partial" 2>&1; then
    mv "$name.partial" "$name.txt"
    echo "ok     $name.txt"
  else
    mv "$name.partial" "$name.failed"
    FAILED+=("$name.failed")
    echo "FAILED $name.failed (exit status or timeout; its output is kept)"
  fi
}

for op in $(split "$OPS"); do
  case "$op" in
    alltoall|sendrecv)
      for ch in $(split "$CHANNELS"); do one_run "$op" P2P Simple "$ch" 640; done ;;
    *)
      for proto in $(split "$PROTOCOLS"); do
        for ch in $(split "$CHANNELS"); do
          if [ "$proto" = LL128 ]; then one_run "$op" Ring LL128 "$ch" 640; continue; fi
          for thr in $(split "$THREADS"); do one_run "$op" Ring "$proto" "$ch" "$thr"; done
        done
      done ;;
  esac
done

if [ "$DRY" -eq 1 ]; then
  echo "# dry run: $RUNS runs, nothing run or written"
  exit 0
fi
echo "$RUNS runs, ${#FAILED[@]} failed; next: lagom calibrate bandwidth $OUT --cluster <your cluster>"
[ ${#FAILED[@]} -eq 0 ]
