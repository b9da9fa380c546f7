"""steptap.learner: trains the policy on the trajectory stream (torch engine with verl's algorithms) and
hot-swaps the new weights into vLLM through the proxy."""
