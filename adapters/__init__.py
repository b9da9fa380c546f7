"""steptap.adapters: plug existing agents (any OpenAI-compatible client, agent frameworks, any program) into
steptap sessions. Depends on the middleware's client only; each framework is imported lazily."""
