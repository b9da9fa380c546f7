#!/bin/sh
echo "running $(readlink -f "$(dirname "$0")/../current")"
