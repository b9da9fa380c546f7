#!/bin/bash
set -euo pipefail
python3 - <<'PY'
settings: dict[str, str] = {}
for name in ("base.env", "local.env"):
    with open(f"/app/config/{name}") as f:
        for line in f.read().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            key, value = line.removeprefix("export ").split("=", 1)
            settings[key] = value
with open("/app/.env", "w") as f:
    f.writelines(f"{key}={settings[key]}\n" for key in sorted(settings))
PY
