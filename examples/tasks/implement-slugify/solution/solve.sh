#!/bin/bash
set -euo pipefail
python3 - <<'PY'
path = "/app/textutils.py"
with open(path) as f:
    source = f.read()
body = '''    slug = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return slug[:max_length].rstrip("-")
'''
source = source.replace("    raise NotImplementedError\n", body)
source = source.replace("from __future__ import annotations\n", "from __future__ import annotations\n\nimport re\n")
with open(path, "w") as f:
    f.write(source)
PY
python3 -c 'import sys; sys.path.insert(0, "/app"); from textutils import slugify; assert slugify("Hello, World!") == "hello-world"'
