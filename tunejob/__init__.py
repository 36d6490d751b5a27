"""The ``tunejob`` command (``tunejob.cli``): it starts the API (``api``), workers (``worker``) and
the HTTP client (``client``), so it stands above all of them; ``python -m tunejob`` runs it too."""
