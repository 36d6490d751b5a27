"""The model card in every artifact (issue 37): ``README.md`` written with ``huggingface_hub``'s
``ModelCard`` and ``ModelCardData`` (the Hub's model card format: YAML metadata with a
``model-index``, then Markdown), so that ``ModelCard.load`` parses it and the Hub shows it.

Its ``model-index`` holds the evaluation report's ``metrics`` (``worker.evaluation.headline``), the
same figures as ``GET /jobs/{id}/evaluation``, on the validation split.
"""

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from shared.store.rows import Job
from worker.data import JobData

CARD = "README.md"
# else text-classification
PIPELINE_TAGS = {
    "token_classification": "token-classification",
    "embedding": "sentence-similarity",
    "reranking": "text-ranking",
}
MODEL_CLASSES = {"token_classification": "AutoModelForTokenClassification"}  # else ...SequenceClassification
TEMPLATE = """---
{{ card_data }}
---

# {{ job.id }}

A fine-tuned `{{ job.base_model }}` for {{ job.task }}, trained by tunejob job `{{ job.id }}`
{%- if labels %} on the labels {{ labels }}{% endif %}.

## Data

- training dataset: `{{ job.training_dataset_id }}` (sha256 `{{ train_sha256 }}`)
- validation: {{ validation }}

## Evaluation (validation split, the kept checkpoint)

{% if metrics %}| metric | value |
| --- | --- |
{% for name, value in metrics.items() %}| {{ name }} | {{ value if value is none else "%.4f"|format(value) }} |
{% endfor %}
The full report (per-class figures, confusion matrix, mistakes) is `evaluation.json`.
{% else %}No validation rows: no evaluation.
{% endif %}
## Training

- hyperparameters: {% for name, value in hyperparameters.items() %}`{{ name }}={{ value }}`{{ ", " if not loop.last }}{% endfor %}
- training time: {{ train_seconds }} s of training, {{ total_seconds }} s from submission to the saved model
- hardware: {{ hardware }}

## How to load it

```python
from transformers import AutoTokenizer, {{ model_class }}

model = {{ model_class }}.from_pretrained("path/to/model", use_safetensors=True)
tokenizer = AutoTokenizer.from_pretrained("path/to/model")
```

or `pipeline("{{ card.pipeline_tag }}", model="path/to/model")`.

## Intended use and limitations

_For the model's owner to fill in: what it is for, what it is not for, and the data it has not seen._
"""


def write_model_card(
    directory: Path, job: Job, data: JobData | None, report: dict | None, hardware: str, timings: dict
) -> ModelCard:
    """Write ``README.md`` into the model ``directory``: ``base_model``, ``pipeline_tag``,
    ``library_name``, the training dataset's id (``datasets``) and sha256 (``dataset_sha256``),
    ``model-index`` with ``report``'s ``metrics`` (none without a report), the hyperparameters,
    ``timings`` (seconds: ``train``, ``total``), ``hardware``, how to load the model, and a section
    on intended use for its owner. Returns the card."""
    metrics = (report or {}).get("metrics", {})
    # a held-out split is of the training data; a job outside the store (the benchmark's) has neither id
    validation = job.validation_dataset_id or job.training_dataset_id or "validation"
    train_id = job.training_dataset_id
    card_data = ModelCardData(
        model_name=job.id,
        base_model=job.base_model,
        library_name="sentence-transformers" if job.task in ("embedding", "reranking") else "transformers",
        pipeline_tag=PIPELINE_TAGS.get(job.task, "text-classification"),
        datasets=[train_id] if train_id else None,
        dataset_sha256={train_id: data.train_sha256} if train_id and data else None,
        eval_results=[
            EvalResult(
                task_type=PIPELINE_TAGS.get(job.task, "text-classification"),
                dataset_type=validation,
                dataset_name=validation,
                dataset_split="validation",
                dataset_revision=data.validation_sha256 if data else None,
                metric_type=name,
                metric_value=value,
            )
            for name, value in metrics.items()
            if value is not None
        ]
        or None,
    )
    held_out = f"{job.spec.get('validation_split')} of the training rows, held out" if report else "none"
    card = ModelCard.from_template(
        card_data,
        template_str=TEMPLATE,
        job=job,
        labels=", ".join(job.label_names or []),
        metrics=metrics,
        train_sha256=data.train_sha256 if data else None,
        validation=(
            f"`{job.validation_dataset_id}` (sha256 `{data.validation_sha256 if data else None}`)"
            if job.validation_dataset_id
            else held_out
        ),
        hyperparameters=job.spec["hyperparameters"],
        train_seconds=timings.get("train"),
        total_seconds=timings.get("total"),
        hardware=hardware,
        model_class=MODEL_CLASSES.get(job.task, "AutoModelForSequenceClassification"),
        card=card_data,
    )
    card.save(directory / CARD)
    return card
