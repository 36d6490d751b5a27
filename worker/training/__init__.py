"""The training recipe (``worker.training.recipe``) and its parts, one module each."""
