#!/usr/bin/env bash
# Rebuilds app/site.bundle (not part of the image or the agent's copy): fixed authors and dates, so the
# commit and tree hashes tests/test_outputs.py holds never change. Usage: bash environment/make_bundle.sh
set -euo pipefail
out=$(cd "$(dirname "$0")" && pwd)/app/site.bundle
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export GIT_CONFIG_NOSYSTEM=1 HOME=/nonexistent
n=0
commit() {
  n=$((n + 1))
  local d="2024-02-$(printf %02d $n)T09:30:00+00:00"
  GIT_AUTHOR_NAME="Alan Turing" GIT_AUTHOR_EMAIL=alan@example.com GIT_AUTHOR_DATE=$d \
  GIT_COMMITTER_NAME="Alan Turing" GIT_COMMITTER_EMAIL=alan@example.com GIT_COMMITTER_DATE=$d \
    git commit -q -a -m "$1"
}
git init -q -b main .
printf '<!doctype html>\n<link rel="stylesheet" href="style.css">\n<h1>Welcome</h1>\n' > index.html
printf 'body { font-family: serif; color: #222; }\n' > style.css
printf 'About us.\n' > about.txt
git add .; commit "First version of the site"
printf 'body { font-family: sans-serif; color: #222; }\nh1 { color: navy; }\n' > style.css; commit "Headings in navy"
printf 'About us: we make calculators.\n' > about.txt; commit "Say what we make"
printf 'body { font-family: "Comic Neue"; color: #f0f; background: #0f0; }\nh1 { color: navy; }\n.banner { display: none; }\n' > style.css
printf '<!doctype html>\n<link rel="stylesheet" href="style.css">\n<div class="banner">New!</div>\n<h1>Welcome</h1>\n' > index.html
commit "Switch to the new theme"
printf 'Contact: hello@example.com\n' > contact.txt; git add contact.txt; commit "Add contact details"
printf 'About us: we make calculators and sell them.\n' > about.txt; commit "Mention sales"
git bundle create -q "$out" --all
