"""Sessions: identity (which session a call belongs to), prefix continuity, the session domain (manager),
rewards, and the control routes."""
