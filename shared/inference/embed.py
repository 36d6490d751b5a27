"""Embeddings from a sentence-transformers model directory: an embedding job's artifact
(``worker.embedding``) or a base model (a plain encoder gets mean pooling).

Texts are encoded by ``SentenceTransformer.encode`` itself (length-sorted batches, the model's own
pooling and normalization), so that ``/models/{id}/embed``, ``/v1/embeddings`` and a user's
``SentenceTransformer(path).encode`` give the same vectors. torch is imported here: the API imports
this module only on its first embedding request.
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
    (special tokens included, before truncation); ``truncated`` texts longer than ``max_length``."""

    vectors: np.ndarray
    tokens: int
    truncated: int


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
        model = SentenceTransformer(str(model_dir), device=str(device), local_files_only=True,
                                    trust_remote_code=False, model_kwargs={"use_safetensors": True}).eval()
    except (OSError, ValueError, KeyError) as e:
        raise UserError("model_not_embeddable", f"not a model tunejob can embed with: {without_paths(str(e))}",
                        "model") from e
    max_length, dimensions = model.max_seq_length, model.get_embedding_dimension()
    if max_length is None or dimensions is None:
        raise UserError("model_not_embeddable", "not a model tunejob can embed with: its length limit or vector size "
                        "is unknown", "model")
    return LoadedEmbedder(model, max_length, dimensions, device)


def embed_texts(loaded: LoadedEmbedder, texts: list[str], normalize: bool = True) -> Embeddings:
    """Embed ``texts`` (cut at ``loaded.max_length`` tokens) in input order; ``normalize``: unit
    length (the model's own ``Normalize`` module does it already for tunejob's models)."""
    model = loaded.model
    counts = [len(ids) for ids in model.tokenizer(texts, truncation=False, add_special_tokens=True)["input_ids"]]
    with torch.inference_mode():
        vectors = model.encode(texts, batch_size=ENCODE_BATCH, convert_to_numpy=True,
                               normalize_embeddings=normalize, show_progress_bar=False)
    return Embeddings(vectors.astype(np.float32, copy=False), sum(counts),
                      sum(n > loaded.max_length for n in counts))
