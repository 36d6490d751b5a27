"""The Celery worker: claims jobs from the store and fine-tunes encoders on one device."""

from shared.logs import drop_known_noise

drop_known_noise()  # before torch, transformers and torchao are imported (shared.logs.KNOWN_NOISE)
