#!/bin/bash
set -euo pipefail
sed -i 's/^while read -r n; do$/while read -r n || [ -n "$n" ]; do/' /app/sum.sh
[ "$(printf '1\n2\n3' > /tmp/n.txt && /app/sum.sh /tmp/n.txt)" = 6 ]
