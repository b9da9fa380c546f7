#!/bin/bash
set -euo pipefail
cd /app/release
chmod 755 bin/run.sh
chmod 600 config/secret.env
ln -sfn releases/v2 current
