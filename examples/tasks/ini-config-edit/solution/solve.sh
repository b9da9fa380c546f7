#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import configparser

config = configparser.ConfigParser(interpolation=None)
config.read("/app/app.ini")
config["server"]["port"] = "8080"
config.remove_option("server", "workers")
config["features"]["beta_search"] = "true"
config["logging"] = {"level": "debug", "file": "/var/log/app.log"}
with open("/app/app.ini", "w") as f:
    config.write(f)
PY
