#!/bin/bash
set -euo pipefail
mkdir -p /app/out
printf 'Hello, Harbor!\n' > /app/out/hello.txt
