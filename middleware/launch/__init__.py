"""Starting and supervising processes: the vLLM server in its own venv (virtualenvs built once: ``venvs.py``),
children that die with their launcher (``lifetime.py``), process groups and health waits, `steptap up` and its
live view. May import rich and psutil (the `up` extra), lazily, and only here."""
