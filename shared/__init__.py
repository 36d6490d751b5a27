"""Code shared by the API and the worker: settings, the job store, schemas and the job lifecycle."""
