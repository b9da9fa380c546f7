#!/bin/bash
set -euo pipefail
cd /app/logs
for f in *.log; do
  printf '%s %s\n' "$f" "$(awk '$2 == "ERROR"' "$f" | wc -l)"
done | sort > /app/error_counts.txt
