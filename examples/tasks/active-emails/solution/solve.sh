#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import json

with open("/app/users.json") as f:
    users = json.load(f)
emails = sorted({u["email"].lower() for u in users if u.get("active") is True})
with open("/app/active_emails.txt", "w") as f:
    f.writelines(e + "\n" for e in emails)
PY
