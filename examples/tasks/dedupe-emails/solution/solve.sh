#!/bin/bash
set -euo pipefail
sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' /app/subscribers.txt | tr 'A-Z' 'a-z' \
  | grep -v -e '^$' -e '^#' | awk '!seen[$0]++' > /app/unique.txt
