#!/bin/bash
set -euo pipefail
tr -cs 'A-Za-z' '\n' < /app/book.txt | tr 'A-Z' 'a-z' | sed '/^$/d' | LC_ALL=C sort | uniq -c \
  | LC_ALL=C sort -k1,1nr -k2,2 | head -n 10 | awk '{print $2, $1}' > /app/top_words.txt
