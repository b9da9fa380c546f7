#!/bin/bash
set -euo pipefail
cd /app
grep -rlw --include='*.py' get_user . | xargs sed -i -E 's/\bget_user\b/fetch_user/g'
python3 main.py
