"""The model-call path: the upstream (backend) client, the relay (handlers, SSE relay) and capture (pure
functions from vLLM replies to steps)."""
