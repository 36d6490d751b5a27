"""Prediction with a model a tunejob training job saved: load it once (``load_for_inference``),
then predict lists of texts fast (``predict_texts``).

The loop is the training engine's smart batching without the training (McCormick, "Smart Batching
Tutorial"; Benesty, "Divide Hugging Face Transformers training time by 2 or more", in the seed
notebooks): texts are tokenized once with the fast tokenizer, without padding; their indices are
sorted by length and cut into batches by a token budget (``shared.data.batching.token_budget_batches``:
no gradients and no optimizer state, so batches can be far larger than in training); each batch is
padded only to its longest member (the CPU) or to the next width of the bucket ladder (CUDA: few
shapes), run under ``torch.inference_mode`` (with bf16 weights where the precision is bf16, the
default on CUDA and on CPUs with AMX), and the results are scattered back to input order. Texts
longer than ``max_length`` are truncated and counted, never refused.

Per-task output is a small function of the logits (``TASK_ROWS``): classification's softmax,
regression's value, multi-label's sigmoid scores against the decision threshold saved with the model,
and token classification's entities, grouped by ``transformers``' own
``TokenClassificationPipeline.postprocess`` (aggregation ``"simple"``, character offsets from the
fast tokenizer's ``offset_mapping``), so they equal ``pipeline("token-classification",
aggregation_strategy="simple")`` on the same model and text.

torch is imported here: the API imports this module only on its first prediction.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from threading import Lock
from typing import cast

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    BatchEncoding,
    DataCollatorWithPadding,
    PreTrainedTokenizerBase,
    TokenClassificationPipeline,
)
from transformers.pipelines.token_classification import AggregationStrategy

from shared.data.batching import bucket_width, job_ladder, token_budget_batches
from shared.data.texts import head_words
from shared.errors import UserError, without_paths
from shared.inference.heads import task_of
from shared.inference.int8 import Int8Model, eager_int8
from shared.inference.precision import PRECISION_NAMES, compute_dtype

PRECISIONS = ("auto", "fp32", "bf16", "int8")
# Default token budget per batch (rows x padded width). CPU: the largest budget not slower than the
# smaller ones (docs/benchmarks.md, "Measurements behind the defaults"); larger batches pad more.
# CUDA: sized for a BERT-base forward in bf16.
DEFAULT_MAX_TOKENS = {"cpu": 4096, "cuda": 65536}
DEFAULT_DECISION_THRESHOLD = 0.5  # multi_label: a model saved without ``decision_threshold`` in its config
MODEL_CLASSES = {"token_classification": AutoModelForTokenClassification}  # else AutoModelForSequenceClassification


@dataclass
class LoadedModel:
    """A model ready to predict: ``model`` in eval mode on ``device``; ``task`` is one of
    ``"classification"``, ``"regression"``, ``"multi_label"``, ``"token_classification"``
    (``task_of``); ``label_names`` the classes (tags) in logit order (None for regression);
    ``model_max_length`` the longest input in tokens (the job's ``max_length``, within the model's
    position embeddings); ``precision`` as resolved: ``"fp32"`` or ``"bf16"`` (``"fp16"`` on a GPU
    without bf16); ``decision_threshold`` (multi_label only) the sigmoid score at or above which a
    label is predicted; ``entities`` (token_classification only) the pipeline whose post-processing
    groups tokens into entities."""

    model: torch.nn.Module  # an ``Int8Model`` for int8 but token classification
    tokenizer: PreTrainedTokenizerBase  # a transformers fast tokenizer
    task: str
    label_names: list[str] | None
    model_max_length: int
    device: torch.device
    precision: str
    decision_threshold: float | None = None
    entities: TokenClassificationPipeline | None = None


@dataclass
class Predictions:
    """``rows`` in input order: classification ``{"label", "score", "probabilities": {name: p}}``,
    regression ``{"value"}``, multi_label ``{"labels": [names], "probabilities": {name: sigmoid
    score}}``, token_classification ``{"entities": [{"entity_group", "score", "word", "start",
    "end"}]}`` (``start``/``end``: character offsets into the text, end exclusive); ``truncated``
    texts cut at max_length; ``tokens`` real (non-pad) tokens; ``padded_tokens`` tokens computed,
    padding included."""

    rows: list[dict]
    truncated: int
    tokens: int
    padded_tokens: int


def load_for_inference(model_dir: Path, device: torch.device, precision: str = "auto") -> LoadedModel:
    """Load a tunejob model folder (``config.json`` with ``id2label``/``problem_type``,
    ``model.safetensors``, tokenizer files): safetensors only, no remote code. A multi_label
    model's threshold is its config's ``decision_threshold`` (``DEFAULT_DECISION_THRESHOLD`` if absent).

    ``precision``: ``auto`` (``shared.inference.precision.auto_precision``: bf16 on CUDA and on CPUs
    with AMX, fp32 on other CPUs), ``fp32``, ``bf16`` (the model's weights in bf16) or
    ``int8`` (CPU only: every ``nn.Linear`` in int8, weights quantized once and activations per
    batch: ``shared.inference.int8``, compiled on CPUs with AMX, eager elsewhere and for token
    classification). bf16 may change a few labels; on a CPU without AMX it is slower than fp32 (the
    speed and agreement of each precision: docs/benchmarks.md).

    Returns:
        the model in eval mode on ``device``, with its task, label names and length limit.

    Raises:
        UserError: (422) ``precision`` is not one of ``PRECISIONS``, or the folder is not a model of
            one of ``TASK_ROWS``' tasks with a fast tokenizer (``model_not_predictable``).
    """
    if precision not in PRECISIONS:
        raise UserError(
            "invalid_precision", f"precision {precision!r} is not one of {', '.join(PRECISIONS)}", "precision"
        )
    if precision == "int8" and device.type != "cpu":
        raise UserError(
            "unsupported_precision",
            "precision int8 (dynamic quantization) runs on CPU workers only; use auto, fp32 or bf16 on a GPU",
            "precision",
        )
    dtype = compute_dtype("fp32" if precision == "int8" else precision, device, param="precision")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        task = task_of(config)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        model = (
            MODEL_CLASSES.get(task, AutoModelForSequenceClassification)
            .from_pretrained(model_dir, config=config, use_safetensors=True, trust_remote_code=False, device_map=device)
            .eval()
        )
    except (OSError, ValueError, KeyError) as e:
        raise UserError(
            "model_not_predictable", f"not a model tunejob can predict with: {without_paths(str(e))}", "model"
        ) from e
    if not tokenizer.is_fast:
        raise UserError("model_not_predictable", "the model's tokenizer has no fast version", "model")
    labels = [config.id2label[i] for i in range(config.num_labels)] if task != "regression" else None
    max_length = min(tokenizer.model_max_length, config.max_position_embeddings)
    if precision == "int8" and task == "token_classification":
        model = eager_int8(model)
    elif precision == "int8":
        example = tokenizer(["an example", "a longer example text"], padding=True, return_tensors="pt")
        model = Int8Model(model, {k: example[k] for k in tokenizer.model_input_names if k in example}, max_length)
    elif dtype == torch.bfloat16:  # bf16 weights, as training's bf16 copy: no cast of every weight per batch
        model = model.to(torch.bfloat16)
    return LoadedModel(
        model,
        tokenizer,
        task,
        labels,
        max_length,
        device,
        "int8" if precision == "int8" else PRECISION_NAMES[dtype],
        decision_threshold=getattr(config, "decision_threshold", DEFAULT_DECISION_THRESHOLD)
        if task == "multi_label"
        else None,
        entities=TokenClassificationPipeline(model=model, tokenizer=tokenizer, device=model.device)
        if task == "token_classification"
        else None,
    )


def predict_texts(
    loaded: LoadedModel,
    texts: list[str],
    pairs: list[str] | None = None,
    max_length: int | None = None,
    max_tokens: int | None = None,
) -> Predictions:
    """Predict ``texts`` (with ``pairs`` as the tokenizer's second segment) in input order.

    ``max_length`` (default: ``loaded.model_max_length``): tokens per text; longer texts are
    truncated and counted in ``truncated``. ``max_tokens`` (default ``DEFAULT_MAX_TOKENS`` of the
    device type): the most tokens one batch computes (rows x padded width); one text longer than it
    still runs, alone.

    Raises:
        UserError: (422) ``pairs`` not as long as ``texts``, or given to a token_classification
            model; ``max_length`` below 2 or above the model's limit; ``max_tokens`` below 1.
    """
    max_length = checked_max_length(loaded, max_length)
    if pairs is not None and len(pairs) != len(texts):
        raise UserError("invalid_pairs", f"{len(pairs)} pairs for {len(texts)} texts: give one pair per text", "pairs")
    if pairs is not None and loaded.task == "token_classification":
        raise UserError("invalid_pairs", "a token_classification model tags one text per input, not pairs", "pairs")
    if max_tokens is not None and max_tokens < 1:
        raise UserError("invalid_max_tokens", f"max_tokens {max_tokens} must be at least 1", "max_tokens")
    if not texts:
        return Predictions([], 0, 0, 0)
    per_token = loaded.task == "token_classification"  # offsets and special tokens, for the entities
    encoded = loaded.tokenizer(
        head_words(texts, max_length),  # the tokens kept, read faster (a huge query: no huge cost)
        head_words(pairs, max_length) if pairs is not None else None,
        truncation=True,
        max_length=max_length,
        padding=False,
        return_offsets_mapping=per_token,
        return_special_tokens_mask=per_token,
    )
    truncated = sum(bool(e.overflowing) for e in encoded.encodings)
    features = [
        {k: encoded[k][i] for k in loaded.tokenizer.model_input_names if k in encoded} for i in range(len(texts))
    ]
    lengths = np.array([len(ids) for ids in encoded["input_ids"]])
    ladder = job_ladder(max_length, None, False, loaded.device.type == "cuda")
    budget = max_tokens or DEFAULT_MAX_TOKENS.get(loaded.device.type, DEFAULT_MAX_TOKENS["cpu"])
    logits, padded = run_batches(loaded, features, token_budget_batches(lengths, budget, ladder), ladder)
    rows = TASK_ROWS[loaded.task](loaded, logits, texts, encoded)
    return Predictions(rows, truncated, int(lengths.sum()), padded)


def checked_max_length(loaded: LoadedModel, max_length: int | None) -> int:
    """``max_length``, or the model's limit when None.

    Raises:
        UserError: below 2 (a [CLS] and a [SEP]) or above ``loaded.model_max_length``.
    """
    if max_length is None:
        return loaded.model_max_length
    if not 2 <= max_length <= loaded.model_max_length:
        raise UserError(
            "invalid_max_length",
            f"max_length {max_length} must be between 2 and the model's limit, {loaded.model_max_length}",
            "max_length",
        )
    return max_length


def run_batches(
    loaded: LoadedModel, features: list[dict], batches: list[np.ndarray], ladder: list[int]
) -> tuple[list[torch.Tensor], int]:
    """Each text's fp32 logits on the CPU, in input order: ``[num_labels]`` from a sequence head,
    ``[tokens, num_labels]`` from a token head (the text's own tokens, padding cut); and the tokens
    computed (rows x padded width, summed over batches). Each batch is padded to its ladder width
    with the tokenizer's own pad id and inputs (``DataCollatorWithPadding``); outputs stay on the
    device until the last batch has run (no synchronisation between batches)."""
    autocast = torch.float16 if loaded.precision == "fp16" else None  # bf16 models hold bf16 weights
    outputs, padded = [], 0
    with torch.inference_mode(), torch.autocast(loaded.device.type, dtype=autocast, enabled=autocast is not None):
        for indices in batches:
            width = bucket_width(ladder, max(len(features[i]["input_ids"]) for i in indices))
            pad = DataCollatorWithPadding(loaded.tokenizer, padding="max_length", max_length=width)
            batch = pad([features[i] for i in indices]).to(loaded.device)  # type: ignore[attr-defined]  # a BatchEncoding
            outputs.append((indices, loaded.model(**batch).logits.float(), batch["attention_mask"]))
            padded += len(indices) * width
    logits: list[torch.Tensor | None] = [None] * len(features)
    for indices, out, mask in outputs:
        out, mask = out.cpu(), mask.cpu().bool()
        for j, i in enumerate(indices.tolist()):
            logits[i] = out[j, mask[j]] if out.dim() == 3 else out[j]
    return cast(list[torch.Tensor], logits), padded  # every text's row filled


def classification_rows(
    loaded: LoadedModel, logits: list[torch.Tensor], texts: list[str], encoded: BatchEncoding
) -> list[dict]:
    """Softmax over each text's ``[classes]`` logits: the top label, its probability, and every class's."""
    names = loaded.label_names or []
    probabilities = torch.softmax(torch.stack(logits), dim=-1)
    top = probabilities.argmax(dim=-1).tolist()
    return [
        {"label": names[best], "score": row[best], "probabilities": dict(zip(names, row))}
        for best, row in zip(top, probabilities.tolist())
    ]


def regression_rows(
    loaded: LoadedModel, logits: list[torch.Tensor], texts: list[str], encoded: BatchEncoding
) -> list[dict]:
    """Each text's single output (``[1]`` logits) as the predicted value."""
    return [{"value": value} for value in torch.stack(logits)[:, 0].tolist()]


def multi_label_rows(
    loaded: LoadedModel, logits: list[torch.Tensor], texts: list[str], encoded: BatchEncoding
) -> list[dict]:
    """The sigmoid of each text's ``[labels]`` logits: every label's score, and the labels (in
    label order) whose score is at least ``loaded.decision_threshold``."""
    names, threshold = loaded.label_names or [], loaded.decision_threshold
    return [
        {"labels": [n for n, p in zip(names, row) if p >= threshold], "probabilities": dict(zip(names, row))}
        for row in torch.sigmoid(torch.stack(logits)).tolist()
    ]


def entity_rows(
    loaded: LoadedModel, logits: list[torch.Tensor], texts: list[str], encoded: BatchEncoding
) -> list[dict]:
    """Each text's entities from its ``[tokens, tags]`` logits, grouped by
    ``TokenClassificationPipeline.postprocess`` with aggregation ``"simple"`` (tags ``O`` left
    out): ``entity_group`` (the tag without its ``B-``/``I-``), ``score`` (the mean of its tokens'
    top softmax probability), ``word`` (its tokens decoded), ``start`` and ``end`` (character
    offsets into the text, end exclusive). ``encoded``: with ``offset_mapping`` and
    ``special_tokens_mask``."""
    assert loaded.entities is not None, "a token_classification model has its entities pipeline"
    rows = []
    for i, (text, scores) in enumerate(zip(texts, logits)):
        outputs = {
            "logits": scores[None],
            "sentence": text,
            **{k: torch.tensor([encoded[k][i]]) for k in ("input_ids", "offset_mapping", "special_tokens_mask")},
        }
        entities = loaded.entities.postprocess([outputs], aggregation_strategy=AggregationStrategy.SIMPLE)
        rows.append(
            {
                "entities": [
                    {
                        "entity_group": e["entity_group"],
                        "score": float(e["score"]),
                        "word": e["word"],
                        "start": int(e["start"]),
                        "end": int(e["end"]),
                    }
                    for e in entities
                ]
            }
        )
    return rows


RowsOf = Callable[[LoadedModel, list[torch.Tensor], list[str], BatchEncoding], list[dict]]
TASK_ROWS: dict[str, RowsOf] = {
    "classification": classification_rows,
    "regression": regression_rows,
    "multi_label": multi_label_rows,
    "token_classification": entity_rows,
}


@dataclass
class CachedModel:
    """A loaded model and the lock its predictions take: a fast tokenizer refuses calls from two
    threads at once ("Already borrowed")."""

    loaded: LoadedModel
    lock: Lock


class ModelCache:
    """Up to ``size`` loaded models by key (a job id), the least recently used evicted first;
    thread-safe. A model loads outside the cache's lock (seconds), so two first requests for one
    key may both load it; the first stored is kept. ``load``: ``load_for_inference``, or
    ``shared.inference.embed.load_embedder`` for embedding models."""

    def __init__(self, size: int, device: torch.device, precision: str = "auto", load: Callable = load_for_inference):
        self.size, self.device, self.precision, self.load = size, device, precision, load
        self._models: OrderedDict[str, CachedModel] = OrderedDict()
        self._lock = Lock()

    def get(self, key: str, model_dir: Path, precision: str | None = None) -> CachedModel:
        """The model cached under ``key``, loaded from ``model_dir`` if it is not, in ``precision``
        (default: the cache's; a key must name one precision).

        Raises:
            UserError: see ``load_for_inference``.
        """
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
        loaded = CachedModel(self.load(model_dir, self.device, precision or self.precision), Lock())
        with self._lock:
            cached = self._models.setdefault(key, loaded)
            self._models.move_to_end(key)
            while len(self._models) > self.size:
                self._models.popitem(last=False)
            return cached

    def keys(self) -> list[str]:
        """The cached keys, least recently used first."""
        with self._lock:
            return list(self._models)

    def clear(self) -> None:
        """Drop every cached model."""
        with self._lock:
            self._models.clear()
