"""Runs on real corpora: the demo (``python -m bench.demo``) and the training benchmark (``python -m bench.train``)."""
