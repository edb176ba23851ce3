#!/usr/bin/env bash
# One-GPU check of the Megatron-LM patch path: patch a copy of a Megatron-LM checkout, then train a
# tiny GPT for a few iterations with --lagom (local layers, mock data, NullTokenizer, TP 1).
#
#   scripts/gpu/megatron_lm_check.sh MEGATRON_LM_DIR OUT_DIR              the real run (hard cap LIMIT_S, 300 s)
#   scripts/gpu/megatron_lm_check.sh --rehearse OUT_DIR [MEGATRON_LM_DIR] the same steps without a GPU
#   PYTHON=/path/to/python scripts/gpu/megatron_lm_check.sh ...              (a Python with CUDA torch)
#
# Steps:
#   1. lagom doctor --megatron-lm on the exact flag line, for the checkout's release (without a
#      checkout: for core_v0.16.1, core_v0.17.1 and core_v0.18.2), so a line the release would
#      stop on (no --eval-interval, fused kernels without APEX, missing packages) fails here
#   2. copy the checkout, apply the patch that applies (git apply --check); the checkout is never modified
#   3. torchrun pretrain_gpt.py with that line (LIMIT_S)                  -> megatron_lm.log, plan.json
# MEGATRON_LM_DIR is a Megatron-LM checkout (core_v0.16 to core_v0.19 and main's 0.20; later releases are
# outside the tested megatron-core range and need LAGOM_ALLOW_UNTESTED_VERSIONS=1). Its Python needs
# Megatron-LM's own dependencies (pip install 'lagom-megatron[megatron-lm]'; triton comes with CUDA torch).
# --rehearse replaces the GPU-only parts: step 3 starts through python -m lagom_megatron.launch.megatron_lm_cpu
# (Megatron-LM's loop on CPU) with --distributed-backend gloo added; without a checkout
# ($MEGATRON_LM_DIR or the argument) steps 2-3 are skipped.
# Writes OUT_DIR/doctor.log, OUT_DIR/megatron_lm.log, OUT_DIR/plan.json and OUT_DIR/summary.md; OUT_DIR
# must be new or empty (a folder holding anything is refused, nothing in it touched). Exit status: 0 when
# every step that ran passed (the run reached its last iteration with lagom's hooks installed and wrote a
# plan), 1 otherwise, 2 on bad usage or a refused OUT_DIR.
set -u -o pipefail

usage() {
  echo "usage: $0 MEGATRON_LM_DIR OUT_DIR | --rehearse OUT_DIR [MEGATRON_LM_DIR]"
  echo
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}
REHEARSE=0
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --rehearse) REHEARSE=1; shift ;;
esac
if [ $REHEARSE = 1 ]; then
  [ $# -ge 1 ] && [ $# -le 2 ] && [[ "$1" != -* ]] || { echo "usage: $0 --rehearse OUT_DIR [MEGATRON_LM_DIR]" >&2; exit 2; }
  OUT_ARG=$1
  SRC_ARG=${2:-${MEGATRON_LM_DIR:-}}
else
  [ $# -eq 2 ] || { echo "usage: $0 MEGATRON_LM_DIR OUT_DIR  ($0 --help for the steps)" >&2; exit 2; }
  SRC_ARG=$1
  OUT_ARG=$2
fi
if [ -n "$SRC_ARG" ] && [ ! -f "$SRC_ARG/pretrain_gpt.py" ]; then
  echo "$0: MEGATRON_LM_DIR $SRC_ARG holds no pretrain_gpt.py (give a Megatron-LM checkout)" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x "$REPO/.venv/bin/python" ] && PY="$REPO/.venv/bin/python"
# OUT_DIR: new or empty (lagom_megatron.preflight.files.output_folder_problem): an earlier run's files are kept
problem=$(PYTHONPATH="$REPO" "$PY" -m lagom_megatron.preflight.files "$OUT_ARG" 2>&1)
case $? in
  0) ;;
  1) echo "$0: OUT_DIR $problem" >&2; exit 2 ;;
  *) echo "$0: cannot check OUT_DIR $OUT_ARG with $PY: $problem" >&2; exit 2 ;;
esac
OUT=$(mkdir -p "$OUT_ARG" && cd "$OUT_ARG" && pwd) || { echo "$0: cannot create OUT_DIR $OUT_ARG" >&2; exit 2; }
LIMIT_S=${LIMIT_S:-300}
DOCTOR_S=90       # each doctor run; the copy of the checkout has COPY_S: 90 + 60 + LIMIT_S stays under 540 s
COPY_S=60
ITERS=6
SUMMARY="$OUT/summary.md"
# Megatron-LM stops without --eval-interval (training.py:3307 in core_v0.16.1); without APEX the
# local layers need --no-persist-layer-norm (torch_norm.py:30) and, with --bf16, --no-masked-softmax-fusion
# (fused_softmax.py:357): lagom doctor --megatron-lm checks all three in step 1.
FLAGS=(--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
  --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" --lr 1e-4 --log-interval 1
  --eval-interval 1000 --eval-iters 1
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --transformer-impl local
  --no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion
  --use-distributed-optimizer --overlap-grad-reduce --bf16
  --lagom --lagom-warmup-iters 1 --lagom-verify-iters 1 --lagom-plan "$OUT/plan.json")
export CUDA_DEVICE_MAX_CONNECTIONS=1
STATUS=()
record() { STATUS+=("- $1: $2"); echo "== $1: $2"; }

# 1. the doctor, for the checkout's release (its megatron-core first on the path) or for each supported one
SRC=""
[ -n "$SRC_ARG" ] && SRC=$(cd "$SRC_ARG" && pwd)
if [ -n "$SRC" ]; then RELEASES=(""); else RELEASES=(core_v0.16.1 core_v0.17.1 core_v0.18.2); fi
: > "$OUT/doctor.log"
doctor_ok=1
for rel in "${RELEASES[@]}"; do
  opt=()
  [ -n "$rel" ] && opt=(--megatron-lm-release "$rel")
  PYTHONPATH="${SRC:+$SRC:}$REPO${PYTHONPATH:+:$PYTHONPATH}" WORLD_SIZE=1 \
    timeout "$DOCTOR_S" "$PY" -m lagom_megatron.cli doctor --megatron-lm "${opt[@]}" -- "${FLAGS[@]}" >> "$OUT/doctor.log" 2>&1 \
    || doctor_ok=0
done
record "lagom doctor --megatron-lm (${RELEASES[*]:-release of the checkout})" "$([ $doctor_ok = 1 ] && echo ok || echo FAILED: see doctor.log)"

ok=$doctor_ok
RC=""
PATCH=""
if [ -z "$SRC" ]; then
  record "patch and train" "skipped (no Megatron-LM checkout: give MEGATRON_LM_DIR)"
else
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  timeout "$COPY_S" cp -r "$SRC" "$WORK/mlm" || { echo "$0: copying $SRC failed or took over $COPY_S s" >&2; exit 1; }
  cd "$WORK/mlm" || exit 1
  test -d .git || git init -q
  for p in "$REPO"/patches/megatron-lm-core_v0.18+.patch "$REPO"/patches/megatron-lm-core_v0.16-0.17.patch; do
    if git apply --check "$p" 2>/dev/null; then
      PATCH=$p
      break
    fi
  done
  if [ -z "$PATCH" ] && grep -q LagomHooks pretrain_gpt.py; then
    PATCH="(already patched)"
  elif [ -n "$PATCH" ]; then
    git apply "$PATCH"
  fi
  if [ -z "$PATCH" ]; then
    record "patch" "FAILED: no patch applies to $SRC (an unknown release)"
    ok=0
  else
    record "patch" "$(basename "$PATCH")"
    export PYTHONPATH="$WORK/mlm:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    LAUNCH=(pretrain_gpt.py)
    EXTRA=()
    if [ $REHEARSE = 1 ]; then  # the GPU-only parts: CUDA -> Megatron-LM's CPU mode, NCCL -> gloo
      LAUNCH=(-m lagom_megatron.launch.megatron_lm_cpu pretrain_gpt.py)
      EXTRA=(--distributed-backend gloo)
    fi
    timeout --kill-after=10 "$LIMIT_S" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
      "${LAUNCH[@]}" "${FLAGS[@]}" "${EXTRA[@]}" > "$OUT/megatron_lm.log" 2>&1
    RC=$?
    grep -q "lagom: hooks around Megatron-LM's train_step" "$OUT/megatron_lm.log" || ok=0
    grep -Eq "iteration +$ITERS/ +$ITERS" "$OUT/megatron_lm.log" || ok=0
    test -s "$OUT/plan.json" || ok=0
    [ "$RC" -eq 0 ] || ok=0
    record "train (exit status $RC; 124: the $LIMIT_S s limit)" "$([ $ok = 1 ] && echo ok || echo FAILED)"
  fi
fi
{
  echo "# Megatron-LM patch check$([ $REHEARSE = 1 ] && echo ' (rehearsal: on CPU with gloo, not a GPU run)')"
  echo
  tag=""
  [ -n "$SRC" ] && tag=$(git -C "$SRC" describe --tags --always 2>/dev/null || echo "no git")
  echo "- checkout: ${SRC:-none} ${tag}"
  printf '%s\n' "${STATUS[@]}"
  if [ -n "$RC" ]; then
    echo "- hooks installed: $(grep -c "lagom: hooks around" "$OUT/megatron_lm.log")"
    echo "- last iteration reached: $(grep -Eq "iteration +$ITERS/ +$ITERS" "$OUT/megatron_lm.log" && echo yes || echo no)"
    echo "- plan written: $(test -s "$OUT/plan.json" && echo yes || echo no)"
  fi
  echo "- result: $([ $ok = 1 ] && echo PASS || echo FAIL)"
  echo
  echo '```'
  tail -n 20 "$OUT/megatron_lm.log" 2>/dev/null || tail -n 20 "$OUT/doctor.log"
  echo '```'
} > "$SUMMARY.tmp" && mv -f "$SUMMARY.tmp" "$SUMMARY"
cat "$SUMMARY"
[ $ok = 1 ]
