"""The one client for vLLM: its URL type, one client per replica, and the replica pool (ARCHITECTURE.md)."""
