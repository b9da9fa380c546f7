#!/bin/bash
set -euo pipefail
git clone -q /app/calc.bundle /app/calc
cd /app/calc
git bisect start main v1.0 >/dev/null
git bisect run python3 test_calc.py >/dev/null 2>&1
git rev-parse refs/bisect/bad > /app/bad_commit.txt
git bisect reset >/dev/null 2>&1
