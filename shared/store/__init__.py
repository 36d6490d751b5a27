"""The job store, at the bottom of ``shared/``: the database engine and sessions (``engine``), the
rows (``rows``), tenants and API keys, idempotency records, quotas, and the bookkeeping of files on
disk (``artifacts``, ``manifest``). Imports nothing else of ``shared/`` but settings and errors."""
