"""``steptap serve``'s process: flags -> ``ProxyConfig`` -> the app (``serve.py``), N of them on one port
(``workers.py``), the allocator tuned for it (``malloc.py``). With ``app.py``, the composition root: it may
import every room."""
