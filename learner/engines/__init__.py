"""Training engines behind one interface: `torch` (one process) and `verl` (verl workers on Ray)."""
