#!/bin/bash
set -euo pipefail
git clone -q /app/site.bundle /app/site
cd /app/site
bad=$(git log --format=%H --grep='^Switch to the new theme$' main)
git -c user.name=Solver -c user.email=solver@example.com revert --no-edit "$bad" >/dev/null
