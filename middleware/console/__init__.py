"""The run console: a web page served by the proxy (``/console/``), the JSON it polls, and curation that
gates training (docs/console.md)."""
