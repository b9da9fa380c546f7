#!/bin/bash
set -euo pipefail
cd /app/project
export GIT_AUTHOR_NAME="Ada Lovelace" GIT_AUTHOR_EMAIL=ada@example.com
export GIT_COMMITTER_NAME="Ada Lovelace" GIT_COMMITTER_EMAIL=ada@example.com
git init -q -b main
printf 'out/\n' > .gitignore
git add .gitignore README.md src/main.py
git commit -q -m "Initial commit"
git tag -a v0.1.0 -m "First release"
