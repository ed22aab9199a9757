#!/usr/bin/env bash
# The lock: requirements/lock.txt holds the exact version of every dependency the test suite passed
# with, and scripts/install.sh installs those (FT_UNLOCKED=1 resolves the newest releases instead).
# This script is the other way round: the newest releases, in a fresh virtual environment.
#   bash scripts/lock.sh          a fresh venv (build/lock-venv) with the newest release of every
#                                 dependency; prints what changed against the lock; writes nothing
#   bash scripts/lock.sh --test   the same, then the README's test command in that venv; only if it
#                                 passes is requirements/lock.txt rewritten with those versions (commit it)
# So a dependency's release that breaks us shows up here, as a failure we read, before a user's
# install finds it. Takes an install (5-9 minutes on 2 cores) plus, with --test, the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    *) echo "scripts/lock.sh: unknown argument '$arg'; valid: --test" >&2; exit 2 ;;
  esac
done
VENV=build/lock-venv
rm -rf "$VENV"
"$PY" -m venv "$VENV"
FT_UNLOCKED=1 PYTHON="$VENV/bin/python" bash scripts/install.sh --test
NEW=build/lock.new.txt
"$VENV/bin/python" scripts/write_lock.py "$NEW"
"$VENV/bin/python" scripts/write_lock.py --diff requirements/lock.txt "$NEW"
if [ "$TEST" = 1 ]; then
  (source "$VENV/bin/activate" && python3 -m pytest -q -n 2 --dist loadgroup)
  mv "$NEW" requirements/lock.txt
  echo "scripts/lock.sh: the suite passed with the newest releases: requirements/lock.txt rewritten (commit it)"
fi
