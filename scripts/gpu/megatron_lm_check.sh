#!/usr/bin/env bash
# One-GPU check of the Megatron-LM patch path: patch a copy of a Megatron-LM checkout, then train a
# tiny GPT for a few iterations with --lagom (local layers, mock data, NullTokenizer, TP 1).
#
#   scripts/gpu/megatron_lm_check.sh MEGATRON_LM_DIR OUT_DIR        (hard cap: LIMIT_S, default 300 s)
#   PYTHON=/path/to/python scripts/gpu/megatron_lm_check.sh ...       (a Python with CUDA torch)
#
# MEGATRON_LM_DIR is a Megatron-LM checkout (core_v0.16 to core_v0.18; later releases are outside
# the tested megatron-core range and need LAGOM_ALLOW_UNTESTED_VERSIONS=1). It is copied, never
# modified; the patch that applies (`git apply --check`) is chosen. Its Python needs
# Megatron-LM's own dependencies (six, regex, einops, tqdm, triton) besides torch.
# Writes OUT_DIR/megatron_lm.log, OUT_DIR/plan.json and OUT_DIR/summary.md. Exit status: 0 when the
# run reached its last iteration with lagom's hooks installed and wrote a plan, 1 otherwise, 2 on bad
# usage.
set -u -o pipefail

if [ $# -lt 2 ] || [ ! -f "$1/pretrain_gpt.py" ]; then
  echo "usage: $0 MEGATRON_LM_DIR OUT_DIR  (MEGATRON_LM_DIR holds pretrain_gpt.py)" >&2
  exit 2
fi
SRC=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
LIMIT_S=${LIMIT_S:-300}
ITERS=6
SUMMARY="$OUT/summary.md"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -r "$SRC" "$WORK/mlm"
cd "$WORK/mlm" || exit 1
test -d .git || git init -q
PATCH=""
for p in "$REPO"/patches/megatron-lm-core_v0.18+.patch "$REPO"/patches/megatron-lm-core_v0.16-0.17.patch; do
  if git apply --check "$p" 2>/dev/null; then
    PATCH=$p
    break
  fi
done
if [ -z "$PATCH" ]; then
  printf '# Megatron-LM patch check\n\nno patch applies to %s (already patched, or an unknown release)\n' "$SRC" > "$SUMMARY"
  cat "$SUMMARY"
  exit 1
fi
git apply "$PATCH"

export PYTHONPATH="$WORK/mlm:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
timeout --kill-after=10 "$LIMIT_S" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py \
  --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 \
  --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" --lr 1e-4 --log-interval 1 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --transformer-impl local \
  --no-gradient-accumulation-fusion --use-distributed-optimizer --overlap-grad-reduce --bf16 \
  --lagom --lagom-warmup-iters 1 --lagom-verify-iters 1 --lagom-plan "$OUT/plan.json" \
  > "$OUT/megatron_lm.log" 2>&1
RC=$?

ok=1
grep -q "lagom: hooks around Megatron-LM's train_step" "$OUT/megatron_lm.log" || ok=0
grep -Eq "iteration +$ITERS/ +$ITERS" "$OUT/megatron_lm.log" || ok=0
test -s "$OUT/plan.json" || ok=0
[ "$RC" -eq 0 ] || ok=0
{
  echo "# Megatron-LM patch check"
  echo
  echo "- checkout: $SRC ($(git -C "$SRC" describe --tags --always 2>/dev/null || echo 'no git'))"
  echo "- patch: $(basename "$PATCH")"
  echo "- exit status: $RC (124: the $LIMIT_S s limit)"
  echo "- hooks installed: $(grep -c "lagom: hooks around" "$OUT/megatron_lm.log")"
  echo "- last iteration reached: $(grep -Eq "iteration +$ITERS/ +$ITERS" "$OUT/megatron_lm.log" && echo yes || echo no)"
  echo "- plan written: $(test -s "$OUT/plan.json" && echo yes || echo no)"
  echo "- result: $([ $ok = 1 ] && echo PASS || echo FAIL)"
  echo
  echo '```'
  tail -n 20 "$OUT/megatron_lm.log"
  echo '```'
} > "$SUMMARY"
cat "$SUMMARY"
[ $ok = 1 ]
