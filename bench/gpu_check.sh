#!/usr/bin/env bash
# The GPU check: lockstep on one CUDA device against itself (reference path vs fast paths) and
# against the nanochat baseline, through bench/bench_gpu.py, in about 8 minutes on an H100:
#   1. env: the device, its datasheet peak and the measured bf16 matmul rate
#   2. training, d12 at 32 rows x 2048: lockstep --kernels off, --kernels on, nanochat
#   3. decoding at d12, batch 1 and 8: lockstep reference and fast engine (bf16 weights), nanochat
#   4. training, d20 at 16 rows x 2048: the same three
#   5. optional: lockstep's stages (pretrain, midtrain, sft, rl, eval rl) on smoke data (SMOKE)
# Each phase runs under its own time limit, and none starts past TOTAL_S seconds from the start
# (it is logged as skipped), so a cut-off run still ends. After every phase $OUT/results.jsonl
# (the RESULT lines so far) and $OUT/compare.txt (bench_gpu.py compare: ratios) are rewritten.
#
#   OUT=/tmp/gpu NANOCHAT_ROOT=~/nanochat bash bench/gpu_check.sh
#
# Settings (environment): OUT (bench/out/gpu), PY (python3), NANOCHAT_ROOT (a nanochat checkout at
# commit 92d63d4; unset: the baseline phases are skipped), D R STEPS (12 32 10), D20 R20 STEPS20
# (20 16 8), SEQ (0 = 2048 on CUDA, 128 on CPU), VOCAB (65536), COMPILE (on), NEW_TOKENS (200),
# REPS (2), DECODE_SEQ (2048), SMOKE (a smoke workspace: params.yaml + data/{raw,tokenizer,cache};
# unset: no stages), STAGE_KERNELS (on), TOTAL_S (540).
# A CPU rehearsal of the script itself (a few minutes on 2 cores):
#   D=2 R=2 STEPS=3 D20=3 R20=2 STEPS20=3 COMPILE=off VOCAB=4096 NEW_TOKENS=16 REPS=1 DECODE_SEQ=256 \
#     OUT=/tmp/gpu-rehearsal bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-$ROOT/bench/out/gpu}
PY=${PY:-python3}
D=${D:-12}; R=${R:-32}; STEPS=${STEPS:-10}
D20=${D20:-20}; R20=${R20:-16}; STEPS20=${STEPS20:-8}
SEQ=${SEQ:-0}; VOCAB=${VOCAB:-65536}; COMPILE=${COMPILE:-on}
NEW_TOKENS=${NEW_TOKENS:-200}; REPS=${REPS:-2}; DECODE_SEQ=${DECODE_SEQ:-2048}
STAGE_KERNELS=${STAGE_KERNELS:-on}; TOTAL_S=${TOTAL_S:-540}
export PYTHONPATH="$ROOT/lib:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

mkdir -p "$OUT" || exit 2
LOG=$OUT/log.txt
: > "$LOG"
rm -f "$OUT/results.jsonl" "$OUT/compare.txt"
START=$(date +%s)

collect() {  # results.jsonl and compare.txt from the log so far, each replaced whole
  grep '^RESULT ' "$LOG" | sed 's/^RESULT //' > "$OUT/results.jsonl.tmp" && mv "$OUT/results.jsonl.tmp" "$OUT/results.jsonl"
  "$PY" bench/bench_gpu.py compare "$OUT/results.jsonl" > "$OUT/compare.txt.tmp" 2>&1
  mv "$OUT/compare.txt.tmp" "$OUT/compare.txt"
}

phase() {  # LIMIT_S ARGS...: bench_gpu.py ARGS under min(LIMIT_S, what TOTAL_S leaves)
  local limit=$1; shift
  local left=$((START + TOTAL_S - $(date +%s)))
  if ((left < 15)); then
    echo "== skipped, TOTAL_S=$TOTAL_S spent: $*" >> "$LOG"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $(date +%T) [limit ${limit}s] bench_gpu.py $*" >> "$LOG"
  timeout -k 10 "$limit" "$PY" bench/bench_gpu.py "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "== rc=$rc$( ((rc == 124)) && echo ' (time limit)') $(date +%T)" >> "$LOG"
  collect
}

baseline() {  # LIMIT_S ARGS...: a nanochat phase, skipped without NANOCHAT_ROOT
  if [ -z "${NANOCHAT_ROOT:-}" ]; then
    echo "== skipped, NANOCHAT_ROOT not set: bench_gpu.py ${*:2}" >> "$LOG"
    return
  fi
  phase "$@"
}

{
  echo "== lockstep $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | grep -q . && echo '(uncommitted changes)')"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "nanochat: ${NANOCHAT_ROOT:-not set} $( [ -n "${NANOCHAT_ROOT:-}" ] && git -C "$NANOCHAT_ROOT" rev-parse --short HEAD 2>/dev/null)"
} >> "$LOG" 2>&1

train=(--seq "$SEQ" --vocab "$VOCAB" --compile "$COMPILE")
decode=(--depth "$D" --vocab "$VOCAB" --new-tokens "$NEW_TOKENS" --reps "$REPS" --decode-seq "$DECODE_SEQ" --compile "$COMPILE")
phase 60 env
phase 180 ls_train --depth "$D" --rows "$R" --steps "$STEPS" --kernels off "${train[@]}"
phase 180 ls_train --depth "$D" --rows "$R" --steps "$STEPS" --kernels on "${train[@]}"
baseline 180 nc_train --depth "$D" --rows "$R" --steps "$STEPS" "${train[@]}"
phase 120 ls_decode "${decode[@]}"
baseline 60 nc_decode "${decode[@]}"
phase 150 ls_train --depth "$D20" --rows "$R20" --steps "$STEPS20" --kernels off "${train[@]}"
phase 150 ls_train --depth "$D20" --rows "$R20" --steps "$STEPS20" --kernels on "${train[@]}"
baseline 150 nc_train --depth "$D20" --rows "$R20" --steps "$STEPS20" "${train[@]}"
if [ -n "${SMOKE:-}" ]; then
  phase 420 stages --smoke "$SMOKE" --kernels "$STAGE_KERNELS" --stage-timeout-s 100
else
  echo "== skipped, SMOKE not set: stages" >> "$LOG"
fi
collect
echo "== done $(date +%T), $(($(date +%s) - START)) s" >> "$LOG"
cat "$OUT/compare.txt"
