#!/bin/bash
# Usage: backup.sh SOURCE_DIR DEST_DIR
# Copies every file whose name ends in .txt directly in SOURCE_DIR into DEST_DIR (created when missing), each
# under its own name with ".bak" added: "notes.txt" becomes "notes.txt.bak". Other files are left alone.
set -e
src=$1
dest=$2
mkdir -p $dest
for f in $(ls $src/*.txt); do
  cp $f $dest/$(basename $f).bak
done
