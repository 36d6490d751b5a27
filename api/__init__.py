"""The REST API (FastAPI). It imports no torch: training happens in the worker."""
