#!/usr/bin/env bash
# One step of `make test`: run CMD..., record its exit status in RESULTS/NAME.rc and NAME in
# RESULTS/steps (scripts/test_summary.py prints the whole run's line from them). Always exits
# 0, so that every step runs; the summary's exit status is the verdict.
# Usage: scripts/test_step.sh RESULTS NAME CMD...
set -uo pipefail
results="$1" name="$2"
shift 2
mkdir -p "$results"
echo "$name" >>"$results/steps"
"$@"
echo $? >"$results/$name.rc"
exit 0
