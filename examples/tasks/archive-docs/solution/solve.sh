#!/bin/bash
set -euo pipefail
tar -C /app -czf /app/docs.tar.gz docs
