"""Counts the words of standard input."""

import sys

print(len(sys.stdin.read().split()))
