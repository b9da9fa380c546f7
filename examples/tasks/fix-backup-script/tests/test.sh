#!/bin/bash
# The verifier. It runs after the agent has gone, from /tests, with the system's PATH only: nothing the agent
# left in /app or its home runs in place of python3, and test_outputs.py reads only what it checks. The reward
# (1 when every check passes, else 0) is written here, replacing whatever reward file was there before.
export PATH=/usr/bin:/bin
cd /tests || exit 1
rm -f /logs/verifier/reward.txt /logs/verifier/reward.json
if python3 -I /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
