#!/bin/bash
# Usage: sum.sh FILE
# Prints the sum of the integers in FILE (one per line, possibly negative; blank lines are skipped) as one line.
total=0
while read -r n; do
  [ -z "$n" ] && continue
  total=$((total + n))
done < "$1"
echo "$total"
