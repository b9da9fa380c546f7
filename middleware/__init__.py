"""steptap.middleware: the capture proxy, the record schema, the trajectory log, the stream and its client.

Needs only aiohttp, msgspec and fsspec: never import torch, transformers, ray or verl here."""
