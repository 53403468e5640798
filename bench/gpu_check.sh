#!/usr/bin/env bash
# The GPU check, in one device call: bench/gpu_check.py runs bench/bench_gpu.py's phases (env;
# warm runs that compile side by side; then each phase timed alone) within TOTAL_S seconds, and
# writes $OUT/{log.txt,results.jsonl,compare.txt,schedule.json}. Its docstring lists the settings.
#
#   OUT=/tmp/gpu NANOCHAT_ROOT=$PWD/.gpu/nanochat bash bench/gpu_check.sh
#
# A CPU rehearsal of the whole script at toy sizes (a few minutes on 2 cores; it prints what it
# skips there and why):
#   D=2 R=2 STEPS=3 D20=3 R20=2 STEPS20=3 VOCAB=4096 NEW_TOKENS=16 REPS=1 DECODE_SEQ=256 CHECK_TOKENS=16 \
#     SHARD_ROWS=2 OUT=/tmp/gpu-rehearsal bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PY:-}" ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
export PY
exec "$PY" bench/gpu_check.py
