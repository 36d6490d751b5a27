"""What a model's head predicts, read from its config alone (no torch: the API checks a prediction
job's model with it before anything is queued)."""


def task_of(config) -> str:
    """``"token_classification"`` (a ``…ForTokenClassification`` architecture), else, for a
    ``…ForSequenceClassification`` one: ``"regression"`` (problem_type regression, or a single
    output), ``"multi_label"`` (problem_type multi_label_classification) or ``"classification"``.

    Raises:
        ValueError: a problem type or architecture this module has no output for.
    """
    architectures = config.architectures or []
    if any(a.endswith("ForTokenClassification") for a in architectures):
        return "token_classification"
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"architectures {architectures} are not sequence or token classification")
    if config.problem_type == "regression" or (config.problem_type is None and config.num_labels == 1):
        return "regression"
    if config.problem_type in (None, "single_label_classification"):
        return "classification"
    if config.problem_type == "multi_label_classification":
        return "multi_label"
    raise ValueError(f"problem_type {config.problem_type!r} is not supported for prediction")
