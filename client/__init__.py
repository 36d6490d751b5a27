"""The tunejob client: a typed, synchronous Python client for the REST API (``client.api``) and
the ``tunejob datasets|models|jobs|health`` commands built on it (``client.cli``).

It imports neither torch, the worker, pandas nor the server stack, so the commands start fast::

    from client import Client
    with Client() as tunejob:  # TUNEJOB_URL, TUNEJOB_API_KEY or <data dir>/api_key
        job = tunejob.get_job("job_...")
"""

from client.api import Client, StreamMessage, TunejobError

__all__ = ["Client", "StreamMessage", "TunejobError"]
