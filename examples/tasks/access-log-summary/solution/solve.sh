#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import collections
import json

with open("/app/access.log") as f:
    lines = [line for line in f.read().splitlines() if line]
status = collections.Counter(line.split('"')[2].split()[0] for line in lines)
paths = collections.Counter(line.split('"')[1].split()[1] for line in lines)
summary = {
    "requests": len(lines),
    "status": dict(sorted(status.items())),
    "top_path": min(paths, key=lambda p: (-paths[p], p)),
    "unique_ips": len({line.split()[0] for line in lines}),
}
with open("/app/summary.json", "w") as f:
    json.dump(summary, f, indent=2)
PY
