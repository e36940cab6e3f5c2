#!/usr/bin/env bash
# `make test-stress`: the test suite on a busy machine. Two CPU-burning processes run beside
# pytest for its whole run (started here, stopped by pid on any exit), as on a shared CI
# runner or a laptop doing something else. Deadlines stretch by TEACHERQ_TEST_TIMEOUT_SCALE
# (default 3 here: two burners on two cores leave the suite about a third of the CPU).
# Usage: scripts/test_stress.sh PYTHON [pytest args...]
set -euo pipefail
py=$1
shift
pids=()
stop_burners() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_burners EXIT
for _ in 1 2; do
  "$py" -c "while True: pass" &
  pids+=("$!")
done
echo "test-stress: CPU burners running as pids ${pids[*]}" >&2
TEACHERQ_TEST_TIMEOUT_SCALE=${TEACHERQ_TEST_TIMEOUT_SCALE:-3} "$py" -m pytest "$@"
