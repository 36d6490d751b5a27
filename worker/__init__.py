"""The Celery worker: claims jobs from the store and fine-tunes encoders on one device."""
