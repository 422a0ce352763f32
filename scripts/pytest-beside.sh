#!/usr/bin/env bash
# pytest on tests/e2e and, beside it in a second process, on tests/unit, with the same
# arguments (`make test-all`): the e2e tests leave about a quarter of the two cores idle while
# they wait on servers, engines and streams, and the unit tests (4-5 minutes beside them) fit
# in it, so the tier takes about the e2e tests' time (docs/benchmarks.md, "Test suite").
#
# Not pytest-xdist: the e2e tests check what a deployment leaves on the host (/dev/shm,
# processes), so they run one at a time in one process; the unit tests touch only what they
# create. The e2e tests that compare /dev/shm as a whole come late in their order (test_real_model,
# test_server, test_stop), long after the unit tests end.
#
# The unit tests' output follows the e2e tests'; the exit status is non-zero if either failed.
# Usage: PYTHON=.venv/bin/python scripts/pytest-beside.sh [pytest arguments]
set -u
python=${PYTHON:-.venv/bin/python}
log=$(mktemp)
unit=
cleanup() {
    if [ -n "$unit" ]; then kill "$unit" 2>/dev/null; wait "$unit" 2>/dev/null; fi
    rm -f "$log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$python" -m pytest "$@" tests/unit >"$log" 2>&1 &
unit=$!
"$python" -m pytest "$@" tests/e2e
e2e=$?
wait "$unit"
units=$?
unit=
echo
echo "---- tests/unit (ran beside tests/e2e) ----"
cat "$log"
echo "---- tests/e2e exit ${e2e}, tests/unit exit ${units}"
[ "$e2e" -eq 0 ] && [ "$units" -eq 0 ]
