"""``POST /models/{job_id}/predict``, ``/embed`` and ``/rerank``: a fine-tuned model answers a few texts right away,
on the API process's CPU (``shared.inference``). Up to ``sync_model_cache`` models of each kind stay loaded.

torch and transformers load on the first prediction, not when the API starts.
"""

import math
import os
from functools import cache

from fastapi import APIRouter

from api.auth import CallerDep
from api.errors import error_responses
from shared.errors import UserError
from shared.jobs import aliases
from shared.jobs.models import embedding_model, trained_model
from shared.schemas.predictions import EmbedIn, EmbedOut, PredictIn, PredictOut, RerankIn, RerankOut, RerankResult
from shared.settings import get_settings
from shared.store.tenancy import Caller

router = APIRouter(tags=["models"])


@router.post("/models/{job_id}/predict", responses=error_responses(404, 409, 422))
def predict(job_id: str, body: PredictIn, caller: CallerDep) -> PredictOut:
    """Predict up to ``max_sync_inputs`` (default 64) texts with the model of a succeeded training
    job, in input order, with the rows of a batch prediction (``PredictOut.predictions``); a
    token_classification model takes raw texts, not pairs. Inputs longer than ``max_length`` (default: the model's) are truncated
    and counted in ``truncated``. The first request for a model loads it (about a second for
    all-MiniLM-L6-v2); later ones reuse it while it stays among the ``sync_model_cache`` most
    recently used. For many texts, use a batch prediction job. ``job_id`` may be one of your
    model aliases (``PUT /models/aliases/{alias}``), resolved on each request: ``model`` in the
    answer is the job id it named. A job that is not a succeeded training job of the caller's
    tenant gets the errors of every model endpoint (``shared.jobs.models.trained_model``)."""
    check_count(body.inputs, "inputs")
    job, model_dir = trained_model(job_id, caller)
    job_id = job.id  # an alias's job
    if job.task == "embedding":  # its artifact has no head: "architectures ['BertModel'] are not ..." said only that
        raise UserError(
            "unsupported_task",
            f"job {job_id!r} is an embedding model: it gives vectors, not predictions: "
            f"POST /models/{job_id}/embed (tunejob predict embed)",
            "job_id",
        )
    if job.task == "reranking":  # its raw logit here, a sigmoid from /rerank: two scores for one pair
        raise UserError(
            "unsupported_task",
            f"job {job_id!r} is a reranking model: it scores a query's documents: POST /models/{job_id}/rerank",
            "job_id",
        )
    cached = model_cache().get(job_id, model_dir)
    texts, pairs = split_inputs(body.inputs)
    if pairs is not None and cached.loaded.task == "token_classification":
        raise UserError(
            "invalid_inputs",
            f"job {job_id!r} is a token_classification model: inputs are texts, not [text, text_pair] pairs",
            "inputs",
        )
    from shared.inference.loop import predict_texts

    with cached.lock:
        predictions = predict_texts(cached.loaded, texts, pairs, body.max_length)
    return PredictOut(
        model=job_id,
        predictions=predictions.rows,
        truncated=predictions.truncated,
        max_length=body.max_length or cached.loaded.model_max_length,
    )


@router.post("/models/{job_id}/embed", responses=error_responses(404, 409, 422))
def embed(job_id: str, body: EmbedIn, caller: CallerDep) -> EmbedOut:
    """Embed up to ``max_sync_inputs`` (default 64) texts with the model of a succeeded ``embedding``
    job (or a base model, by name), in input order: the vectors ``SentenceTransformer(path).encode``
    gives for the job's artifact. Texts longer than the job's ``max_length`` are truncated and counted.
    ``model`` in the answer is the job an alias named, as ``/predict``'s (the alias may move)."""
    job_id = aliases.resolve(job_id, caller)
    result, loaded = embed_texts_with(job_id, body.inputs, body.normalize, caller, "inputs")
    return EmbedOut(
        model=job_id,
        embeddings=result.vectors.tolist(),
        dimensions=loaded.dimensions,
        tokens=result.tokens,
        truncated=result.truncated,
        max_length=loaded.max_length,
    )


@router.post("/models/{job_id}/rerank", responses=error_responses(404, 409, 422))
def rerank(job_id: str, body: RerankIn, caller: CallerDep) -> RerankOut:
    """Order up to ``max_sync_inputs`` documents by a succeeded ``reranking`` job's score of each
    (query, document) pair (the sigmoid of its one logit, as ``CrossEncoder(path).predict``), best
    first; ``top_n`` keeps the best few."""
    check_count(body.documents, "documents", "send the rest in further requests: each document's score is its own")
    job, model_dir = trained_model(job_id, caller)
    job_id = job.id  # an alias's job
    if job.task != "reranking":
        raise UserError(
            "unsupported_task", f"job {job_id!r} was trained for {job.task}; reranking needs a reranking job", "job_id"
        )
    cached = model_cache().get(job_id, model_dir)
    from shared.inference.loop import predict_texts

    with cached.lock:
        rows = predict_texts(cached.loaded, [body.query] * len(body.documents), body.documents).rows
    scores = [1 / (1 + math.exp(-row["value"])) for row in rows]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    return RerankOut(model=job_id, results=[RerankResult(index=i, relevance_score=scores[i]) for i in order])


def embed_texts_with(ref: str, texts: list[str], normalize: bool, caller: Caller, param: str):
    """(``shared.inference.embed.Embeddings``, the ``LoadedEmbedder``) of ``texts`` with the model
    ``ref`` names (``shared.jobs.models.embedding_model``; an alias is resolved first), loaded once
    into ``embedder_cache``.

    Raises:
        UserError: ``too_many_inputs`` (naming ``param``), and those of ``embedding_model`` and ``load_embedder``.
    """
    check_count(texts, param)
    model_dir = embedding_model(aliases.resolve(ref, caller), caller)
    cached = embedder_cache().get(str(model_dir), model_dir)
    from shared.inference.embed import embed_texts

    with cached.lock:
        return embed_texts(cached.loaded, texts, normalize), cached.loaded


def check_count(items: list, param: str, more: str = "score more with a prediction job (POST /predictions)") -> None:
    """A request answers at most ``max_sync_inputs`` items at once (``more``: what to do instead).

    Raises:
        UserError: 422 ``too_many_inputs`` naming ``param`` and the count.
    """
    limit = get_settings().max_sync_inputs
    if len(items) > limit:
        raise UserError(
            "too_many_inputs",
            f"{param} has {len(items)} items; at most {limit} are answered at once (TUNEJOB_MAX_SYNC_INPUTS); {more}",
            param,
        )


def split_inputs(inputs: list[str] | list[tuple[str, str]]) -> tuple[list[str], list[str] | None]:
    """(texts, pairs or None) from a request's ``inputs``."""
    if isinstance(inputs[0], str):
        return list(inputs), None
    return [text for text, _ in inputs], [pair for _, pair in inputs]


@cache
def model_cache():
    """The API process's ``shared.inference.loop.ModelCache`` on the CPU, built on first use: importing
    it loads torch, and limits torch's threads to ``sync_predict_threads``."""
    import torch

    from shared.inference.loop import ModelCache

    settings = get_settings()
    torch.set_num_threads(settings.sync_predict_threads or max(1, (os.cpu_count() or 2) // 2))
    return ModelCache(settings.sync_model_cache, torch.device("cpu"))


@cache
def embedder_cache():
    """``model_cache``'s counterpart for embedding models (``shared.inference.embed.load_embedder``),
    keyed by model directory."""
    import torch

    from shared.inference.embed import load_embedder
    from shared.inference.loop import ModelCache

    model_cache()  # torch's thread count, set once
    return ModelCache(get_settings().sync_model_cache, torch.device("cpu"), load=load_embedder)
