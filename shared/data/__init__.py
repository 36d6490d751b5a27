"""Datasets: reading and validating uploads (CSV, TSV, JSONL, Parquet, CoNLL), in bounded batches.

Used by the API (to refuse bad input with a 4xx before anything is stored or queued) and by the
worker (to load the same table the API validated, through the same checks).

- **Readers**, one per format, all streaming: CSV and TSV with Python's ``csv`` module (strict
  RFC 4180 quoting; every cell read as text, as written; measured at a third of the memory of
  ``pyarrow.csv``'s streaming reader, which holds several blocks), JSONL line by line with the
  standard ``json`` module, Parquet with ``pyarrow.parquet.ParquetFile.iter_batches`` (text columns read as
  dictionaries, so that a decompression bomb is measured before it is expanded), CoNLL-style text
  (a token and its tag per line, a blank line between sentences) sentence by sentence. Each yields
  ``Batch`` es of at most about ``BATCH_BYTES`` of data, so memory grows with the batch, not the file.
- **Upload checks** (``inspect_dataset``): UTF-8, parses, unique non-nested header, no ragged row,
  JSONL rows are objects without duplicate keys or NaN/Infinity, at least one row, Parquet
  expanded size within ``TUNEJOB_MAX_DATASET_BYTES``.
- **Job checks** (``scan_job_data``, ``job_batches``): the job's text columns hold non-empty
  strings, its labels are scalars (class names: strings, integers, booleans; regression targets:
  finite numbers with |y| <= ``MAX_REGRESSION_TARGET`` unless the spec opts out), for
  ``multi_label`` lists of class names (JSONL or Parquet lists, or text split on
  ``label_separator``), for token_classification non-empty lists of words with as many tags. A rejection
  carries a validation report: up to ``MAX_PROBLEMS`` problems, each {row, column, value, message},
  in row order (``shared.data.problems``).
- **Texts cut before tokenizing** (``shared.data.texts``): a long text's words past what
  ``max_length`` tokens can keep.
"""
