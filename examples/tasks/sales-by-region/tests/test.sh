#!/bin/bash
# The verifier. It runs after the agent has gone, from /tests, with the system's PATH only: nothing the agent
# left in /app or its home runs in place of python3, and test_outputs.py reads only what it checks. The reward
# (1 when every check passes, else 0) is written here, last, replacing any reward file written before it
# (by the agent, or by code under test while the checks ran).
export PATH=/usr/bin:/bin
cd /tests || exit 1
if python3 -I /tests/test_outputs.py; then reward=1; else reward=0; fi
rm -f /logs/verifier/reward.txt /logs/verifier/reward.json
echo "$reward" > /logs/verifier/reward.txt
