"""Weight hot swap: the checks before a swap, the swapper (hold, drain, pause, load, resume) and its route."""
