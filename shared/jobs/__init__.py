"""The job lifecycle, above the store and the data: admission, state changes and recovery
(``lifecycle``), the checks and dry-run plans of training jobs (``planning``), prediction jobs
(``predictions``), dataset uploads (``uploads``), the base models on disk (``base_models``) and the
training curves (``curves``)."""
