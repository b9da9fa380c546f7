#!/bin/bash
set -euo pipefail
sed -i 's/return (ordered\[mid\] + ordered\[mid + 1\]) \/ 2/return (ordered[mid - 1] + ordered[mid]) \/ 2/' \
  /app/stats.py
python3 /app/test_stats.py
