#!/bin/bash
set -euo pipefail
sed -i 's/            number = ch$/            number += ch/' /app/duration.py
python3 -c 'import sys; sys.path.insert(0, "/app"); from duration import parse_duration as p; assert p("1h30m") == 5400'
