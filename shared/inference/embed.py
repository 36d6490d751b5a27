"""Embeddings from a sentence-transformers model directory: an embedding job's artifact
(``worker.embedding``) or a base model (a plain encoder gets mean pooling).

Texts are batched as tunejob batches them, by token count (``SentenceTransformer.encode`` sorts by
character length, which pads short texts poorly), and each batch is encoded by ``encode`` itself in
one forward pass (the model's own pooling and normalization), so that ``/models/{id}/embed``,
``/v1/embeddings`` and a user's ``SentenceTransformer(path).encode`` give the same vectors. torch is
imported here: the API imports this module only on its first embedding request.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from shared.errors import UserError, without_paths

ENCODE_BATCH = 64  # texts per forward pass


@dataclass
class LoadedEmbedder:
    """A model ready to embed: ``model`` in eval mode on ``device``; ``max_length`` its
    ``max_seq_length`` in tokens (the job's ``max_length``); ``dimensions`` the vector size."""

    model: SentenceTransformer
    max_length: int
    dimensions: int
    device: torch.device


@dataclass
class Embeddings:
    """``vectors`` float32 ``[texts, dimensions]`` in input order; ``tokens`` the texts' tokens
    (special tokens included, before truncation: what the caller sent, a request's usage);
    ``truncated`` texts longer than ``max_length``; ``real_tokens`` the tokens computed, after
    truncation, without padding; ``padded_tokens`` tokens computed, padding included: each batch's
    texts times its longest member's tokens after truncation (``embed_texts`` batches the texts by
    that count)."""

    vectors: np.ndarray
    tokens: int
    truncated: int
    real_tokens: int
    padded_tokens: int


def load_embedder(model_dir: Path, device: torch.device, precision: str = "auto") -> LoadedEmbedder:
    """Load a model directory as a ``SentenceTransformer``: safetensors only, no remote code,
    offline. ``precision`` is accepted for ``shared.inference.loop.ModelCache`` and must be ``auto``
    or ``fp32`` (embeddings are computed in fp32).

    Raises:
        UserError: (422) ``model_not_embeddable`` when the directory does not load.
    """
    if precision not in ("auto", "fp32"):
        raise UserError("invalid_precision", f"embeddings are computed in fp32, not {precision}", "precision")
    try:
        model = SentenceTransformer(
            str(model_dir),
            device=str(device),
            local_files_only=True,
            trust_remote_code=False,
            model_kwargs={"use_safetensors": True},
        ).eval()
    except (OSError, ValueError, KeyError) as e:
        raise UserError(
            "model_not_embeddable", f"not a model tunejob can embed with: {without_paths(str(e))}", "model"
        ) from e
    max_length, dimensions = model.max_seq_length, model.get_embedding_dimension()
    if max_length is None or dimensions is None:
        raise UserError(
            "model_not_embeddable",
            "not a model tunejob can embed with: its length limit or vector size is unknown",
            "model",
        )
    return LoadedEmbedder(model, max_length, dimensions, device)


def embed_texts(
    loaded: LoadedEmbedder,
    texts: list[str],
    normalize: bool = True,
    max_length: int | None = None,
    batch_size: int = ENCODE_BATCH,
) -> Embeddings:
    """Embed ``texts`` in input order, ``batch_size`` texts per forward pass, each cut at
    ``max_length`` tokens (default and upper bound: ``loaded.max_length``); ``normalize``: unit
    length (the model's own ``Normalize`` module does it already for tunejob's models).

    Raises:
        UserError: (422) ``max_length`` below 2 or above ``loaded.max_length``.
    """
    limit = max_length or loaded.max_length
    if not 2 <= limit <= loaded.max_length:
        raise UserError(
            "invalid_max_length",
            f"max_length {limit} must be between 2 and the model's limit, {loaded.max_length}",
            "max_length",
        )
    model = loaded.model
    ids = model.tokenizer(texts, truncation=False, add_special_tokens=True, return_attention_mask=False)["input_ids"]
    counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(texts))
    clipped = np.minimum(counts, limit)  # the tokens ``encode`` computes for each text
    order = np.argsort(-clipped, kind="stable")  # longest first
    batches = [order[a : a + batch_size] for a in range(0, len(texts), batch_size)]
    vectors = np.empty((len(texts), loaded.dimensions), dtype=np.float32)
    model.max_seq_length = limit  # the cached model is used under its lock (one call at a time)
    try:
        with torch.inference_mode():
            for batch in batches:  # one forward pass each: encode's own batching is not used
                vectors[batch] = model.encode(
                    [texts[i] for i in batch],
                    batch_size=len(batch),
                    convert_to_numpy=True,
                    normalize_embeddings=normalize,
                    show_progress_bar=False,
                )
    finally:
        model.max_seq_length = loaded.max_length
    padded = sum(len(batch) * int(clipped[batch[0]]) for batch in batches)
    return Embeddings(vectors, int(counts.sum()), int((counts > limit).sum()), int(clipped.sum()), padded)
