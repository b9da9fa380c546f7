#!/bin/bash
# The verifier. It runs after the agent has gone, from /tests, with the system's PATH only: nothing the agent
# left in /app or its home runs in place of python3, and test_outputs.py reads only what it checks. It writes
# the named rewards to /logs/verifier/reward.json itself, replacing whatever reward file was there before.
export PATH=/usr/bin:/bin
cd /tests || exit 1
rm -f /logs/verifier/reward.txt /logs/verifier/reward.json
python3 -I /tests/test_outputs.py /logs/verifier/reward.json
