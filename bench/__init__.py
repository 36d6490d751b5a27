"""Runs on real corpora: the demo (``python -m bench.demo``) and the training benchmark
(``python -m bench.train``: whole epochs, each configuration in a fresh process, beside the
Hugging Face Trainer; see docs/benchmarks.md)."""
