"""Starting and supervising processes: the vLLM server in its own venv, process groups and health waits,
`steptap up` and its live view. May import rich and psutil (the `up` extra), lazily, and only here."""
