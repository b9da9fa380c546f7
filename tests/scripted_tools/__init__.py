"""Test infrastructure loaded into vLLM by tests (a scripted tool-call logits processor): see
tool_script.py."""
