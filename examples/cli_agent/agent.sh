#!/usr/bin/env bash
# A command-line agent in plain bash (curl + jq): two model calls, then it writes its own reward.
#
#   steptap run --reward-file reward.txt -- bash examples/cli_agent/agent.sh 17 25
#
# `steptap run` gives it OPENAI_BASE_URL and OPENAI_API_KEY for a fresh session (and STEPTAP_REWARD_FILE);
# the agent knows nothing else about steptap. SCRIPTED=1 forces the right answer with vLLM's structured
# outputs (for a random test model).
set -euo pipefail
A=${1:-$((RANDOM % 50))}
B=${2:-$((RANDOM % 50))}
ANSWER=$((A + B))
: "${OPENAI_BASE_URL:?run me under steptap run (or set OPENAI_BASE_URL and OPENAI_API_KEY)}"
KEY=${OPENAI_API_KEY:-EMPTY}
MODEL=${OPENAI_MODEL:-$(curl -sf -H "Authorization: Bearer $KEY" "$OPENAI_BASE_URL/models" | jq -r '.data[0].id')}
EXTRA='{}'
if [ "${SCRIPTED:-0}" = 1 ]; then
  EXTRA=$(jq -n --arg r "$ANSWER" '{structured_outputs: {regex: $r}}')
fi

messages=$(jq -n --arg q "What is $A + $B? Answer with one number." \
  '[{role: "system", content: "You are a terse calculator."}, {role: "user", content: $q}]')

chat() {  # POST the conversation so far; print the assistant's text
  jq -n --arg m "$MODEL" --argjson msgs "$messages" --argjson extra "$EXTRA" \
    '{model: $m, messages: $msgs, max_tokens: 16, temperature: 1.0} + $extra' |
    curl -sf "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $KEY" \
      -H "Content-Type: application/json" -d @- |
    jq -r '.choices[0].message.content // ""'
}

first=$(chat)
echo "turn 1: $first"
messages=$(jq --arg r "$first" \
  '. + [{role: "assistant", content: $r}, {role: "user", content: "Check it and give the final number."}]' \
  <<<"$messages")
final=$(chat)
echo "turn 2: $final"

reward=0
if grep -qE "(^|[^0-9])${ANSWER}([^0-9]|$)" <<<"$final"; then reward=1; fi
echo "reward $reward (expected $ANSWER)"
if [ -n "${STEPTAP_REWARD_FILE:-}" ]; then echo "$reward" > "$STEPTAP_REWARD_FILE"; fi
