#!/bin/bash
set -euo pipefail
find /app/site -type f -name '*.html' -exec sed -i -E "s#http://example\.com([/\"'])#https://example.com\1#g" {} +
