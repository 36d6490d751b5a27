"""BBC News as title -> article retrieval (issue 36): each article's first line is its title, the rest
its body. The articles are split at random (by article) into training and validation pairs; an
``embedding`` job fine-tunes a base model on the training pairs through the worker's own recipe
(``worker.training.recipe.fine_tune``, a transient ``Job``) and reports the validation ``ndcg@10`` of the
base model (zero-shot, before the first step) and after each epoch.

    python -m bench.retrieval --train 400 --validation 200 --epochs 1 --max-length 128

``--side peer`` trains the same examples with ``SentenceTransformerTrainer`` instead (the same loss,
MultipleNegativesRankingLoss; the same batch size, learning rate, warm-up ratio, weight decay,
epochs, max_length and seed; ``BatchSamplers.NO_DUPLICATES``, as tunejob's duplicate-free batches);
``--side rerank --embedder DIR`` trains a ``reranking`` job (tunejob's recipe) on the training
titles, their articles (label 1) and the ``--negatives`` articles the embedding model ``DIR``
ranks first among the other training articles (hard negatives, label 0; default 1), then reranks
that embedding model's top ``--top-k`` articles of each validation title; ``--reranker peer``
trains the reranker with ``CrossEncoderTrainer`` (``BinaryCrossEntropyLoss``; ``peer-listnet``:
``ListNetLoss``; ``peer-lce``: its ``MultipleNegativesRankingLoss``) on the same rows and
settings instead, and ``--pos-weight`` sets the positives' weight on either side (tunejob's
default: the labels' negatives per positive; the peer's: none). ``--side compare`` runs the
three, each cold in its own process (tunejob, the peer, then the reranker on tunejob's model),
and prints them together.
``--precision bf16`` trains in bf16: tunejob's jobs with ``precision: bf16`` (a bf16 copy of the
model, fp32 master weights), the peer with ``bf16=True`` (autocast); it pays on a CPU with AMX.
Both embedding sides are scored by the same function (``worker.embedding.retrieval_metrics``:
sentence-transformers' ``InformationRetrievalEvaluator``); the epoch time is the training loop's own
(tunejob's ``train_seconds``, the Trainer's ``train_runtime``), evaluation excluded.

Prints one JSON object: the sizes, the retrieval metrics and the seconds.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from types import SimpleNamespace

import pandas as pd
import torch

from bench.corpora import bbc_news

NAMES = ("ndcg@10", "mrr@10", "recall@1", "recall@10", "map@100")


def title_pairs() -> pd.DataFrame:
    """Columns ``anchor`` (the title) and ``positive`` (the body) of every BBC News article."""
    parts = bbc_news()["text"].str.strip().str.split("\n", n=1, expand=True)
    return (
        pd.DataFrame({"anchor": parts[0].str.strip(), "positive": parts[1].fillna("").str.strip()})
        .query("anchor != '' and positive != ''")
        .reset_index(drop=True)
    )


def splits(args) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The training and validation pairs: the articles shuffled with ``--seed``, then cut."""
    pairs = title_pairs().sample(frac=1.0, random_state=args.seed).reset_index(drop=True)
    return (
        pairs.iloc[: args.train].reset_index(drop=True),
        pairs.iloc[args.train : args.train + args.validation].reset_index(drop=True),
    )


def scores(model, frame: pd.DataFrame) -> dict[str, float]:
    """``worker.embedding.retrieval_metrics`` of a ``SentenceTransformer`` on a split's pairs."""
    from worker.embedding import retrieval_metrics

    split = SimpleNamespace(texts=[frame["anchor"].tolist(), frame["positive"].tolist()], labels=[0.0] * len(frame))
    return {name: round(value, 4) for name, value in retrieval_metrics(model, split).items()}


def fine_tune_job(args, task: str, train: pd.DataFrame, validation: pd.DataFrame, **hyperparameters):
    """Run a transient job of ``task`` through the worker's recipe; (its reporter, its model directory)."""
    from shared.schemas.jobs import JobCreate
    from shared.store import artifacts
    from shared.store.rows import Job
    from worker.data import JobData
    from worker.reporter import MemoryReporter
    from worker.training.recipe import fine_tune

    spec = JobCreate(
        base_model=args.model,
        task=task,
        training_dataset="ds_bench",
        hyperparameters={
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "max_length": args.max_length,
            "learning_rate": args.learning_rate,
            "seed": args.seed,
            "precision": args.precision,
            **hyperparameters,
        },
    )
    job = Job(id=f"bench-{uuid.uuid4().hex[:12]}", task=task, base_model=args.model, spec=spec.model_dump(mode="json"))
    reporter = MemoryReporter()
    outcome = fine_tune(job, JobData(train, validation), torch.device("cpu"), reporter)
    assert outcome == "succeeded", outcome
    return reporter, artifacts.model_dir(job.id)


def tunejob_side(args) -> dict:
    """An ``embedding`` job on the training pairs; its own zero-shot and fine-tuned metrics."""
    from sentence_transformers import SentenceTransformer

    train, validation = splits(args)
    start = time.perf_counter()
    reporter, model_dir = fine_tune_job(args, "embedding", train, validation)
    series = {name: reporter.series(f"eval_{name}") for name in NAMES}
    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    return {
        "side": "tunejob",
        "train_pairs": len(train),
        "validation_pairs": len(validation),
        "zero_shot": {n: round(s[0], 4) for n, s in series.items()},
        "fine_tuned": {n: round(s[max(s)], 4) for n, s in series.items()},
        "scored": scores(model, validation),
        "train_seconds": round(reporter.fields["train_metrics"]["train_seconds"], 1),
        "seconds": round(time.perf_counter() - start, 1),
        "model": str(model_dir),
        "torch_threads": torch.get_num_threads(),
    }


def peer_arguments(args, arguments_class, epochs: float, batch_size: int | None = None, **extra):
    """sentence-transformers' training arguments (``arguments_class``) with tunejob's settings for
    the same job: ``epochs``, ``batch_size`` (rows a step; default ``args``'), the learning rate,
    seed and precision of ``args``, the default warm-up ratio and weight decay; no saving,
    evaluation or logging along the way."""
    from shared.schemas.hyperparameters import Hyperparameters

    defaults = Hyperparameters()
    return arguments_class(
        output_dir=tempfile.mkdtemp(prefix="bench-peer-"),
        num_train_epochs=epochs,
        per_device_train_batch_size=batch_size or args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=defaults.warmup_ratio,
        weight_decay=defaults.weight_decay,
        seed=args.seed,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=args.precision == "bf16",
        logging_steps=1_000_000,
        disable_tqdm=True,
        **extra,
    )


def peer_side(args) -> dict:
    """``SentenceTransformerTrainer`` with MultipleNegativesRankingLoss on the same pairs and settings."""
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers

    from shared.jobs.base_models import resolve_model

    train, validation = splits(args)
    start = time.perf_counter()
    model = SentenceTransformer(str(resolve_model(args.model)), device="cpu", local_files_only=True)
    model.max_seq_length = args.max_length
    trainer = SentenceTransformerTrainer(
        model=model,
        args=peer_arguments(
            args, SentenceTransformerTrainingArguments, args.epochs, batch_sampler=BatchSamplers.NO_DUPLICATES
        ),
        loss=MultipleNegativesRankingLoss(model),
        train_dataset=Dataset.from_pandas(train[["anchor", "positive"]]),
    )
    runtime = trainer.train().metrics["train_runtime"]
    return {
        "side": "SentenceTransformerTrainer",
        "scored": scores(model, validation),
        "train_seconds": round(runtime, 1),
        "seconds": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
    }


def top_k(model, queries: list[str], corpus: list[str], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine scores, indices) of each query's ``k`` nearest ``corpus`` texts, best first."""
    from sentence_transformers import util

    q = model.encode(queries, convert_to_tensor=True, normalize_embeddings=True, batch_size=64)
    c = model.encode(corpus, convert_to_tensor=True, normalize_embeddings=True, batch_size=64)
    return torch.topk(util.cos_sim(q, c), min(k, len(corpus)), dim=1)


def reranker_pairs(embedder, frame: pd.DataFrame, negatives: int) -> pd.DataFrame:
    """Columns ``query``, ``passage``, ``label``: each title with its article (1.0) and the
    ``negatives`` other articles of ``frame`` that ``embedder`` ranks highest for it (0.0)."""
    _, found = top_k(embedder, frame["anchor"].tolist(), frame["positive"].tolist(), negatives + 1)
    hard = [[d for d in row if d != i][:negatives] for i, row in enumerate(found.tolist())]
    return pd.concat(
        [
            pd.DataFrame({"query": frame["anchor"], "passage": frame["positive"], "label": 1.0}),
            *(
                pd.DataFrame(
                    {
                        "query": frame["anchor"],
                        "passage": frame["positive"].iloc[[row[n] for row in hard]].values,
                        "label": 0.0,
                    }
                )
                for n in range(negatives)
            ),
        ],
        ignore_index=True,
    )


def peer_reranker(args, train: pd.DataFrame) -> tuple[str, float]:
    """``CrossEncoderTrainer`` on the same pairs and settings as tunejob's ``reranking`` job, with
    ``BinaryCrossEntropyLoss`` (``pos_weight`` when ``--pos-weight`` is given), or with
    ``--reranker peer-listnet`` ``ListNetLoss`` over each title's passages (Cao et al. 2007: the
    cross-entropy of the softmax of the scores against the softmax of the labels, a soft target:
    0.41 for the positive among 4 negatives, not the one-hot target of Gao et al. 2021's
    localized contrastive estimation), or with ``--reranker peer-lce`` its
    ``MultipleNegativesRankingLoss`` over each title's article and hard negatives (Gao et al. 2021's
    localized contrastive estimation: the cross-entropy of the softmax over the group, the
    article the target) and ``--in-batch-negatives`` other titles' passages (0: none);
    ``--batch-size`` pairs a step as nearly as whole titles allow; (its model directory, its
    ``train_runtime``)."""
    from datasets import Dataset
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import (
        BinaryCrossEntropyLoss,
        ListNetLoss,
        MultipleNegativesRankingLoss,
    )

    from shared.jobs.base_models import resolve_model

    model = CrossEncoder(  # a new one-logit head over any head the checkpoint has, as tunejob's loader
        str(resolve_model(args.model)),
        num_labels=1,
        max_length=args.max_length,
        device="cpu",
        local_files_only=True,
        model_kwargs={"ignore_mismatched_sizes": True},
    )
    if args.reranker == "peer-lce":  # reranker_pairs' rows: the articles, then each rank of negatives
        n = len(train) // (args.negatives + 1)
        columns = {"query": train["query"][:n].tolist()}
        for k in range(args.negatives + 1):
            columns[f"passage_{k}"] = train["passage"][k * n : (k + 1) * n].tolist()
        dataset = Dataset.from_dict(columns)
        titles = max(1, args.batch_size // (args.negatives + 1))
        training = peer_arguments(args, CrossEncoderTrainingArguments, args.rerank_epochs, titles)
        loss = MultipleNegativesRankingLoss(model, num_negatives=args.in_batch_negatives or None)
        if not args.in_batch_negatives:  # the hard negatives only (sentence-transformers samples at least one)
            loss.get_in_batch_negatives = lambda anchors, candidates: iter(())
    elif args.reranker == "peer-listnet":
        groups = train.groupby("query", sort=False)
        dataset = Dataset.from_dict(
            {
                "query": list(groups.groups),
                "docs": groups["passage"].agg(list).tolist(),
                "labels": groups["label"].agg(list).tolist(),
            }
        )
        titles = max(1, round(args.batch_size * len(dataset) / len(train)))
        training = peer_arguments(args, CrossEncoderTrainingArguments, args.rerank_epochs, titles)
        loss = ListNetLoss(model)
    else:
        dataset = Dataset.from_pandas(train)
        training = peer_arguments(args, CrossEncoderTrainingArguments, args.rerank_epochs)
        pos_weight = None if args.pos_weight is None else torch.tensor(args.pos_weight)
        loss = BinaryCrossEntropyLoss(model, pos_weight=pos_weight)
    trainer = CrossEncoderTrainer(model=model, args=training, loss=loss, train_dataset=dataset)
    runtime = trainer.train().metrics["train_runtime"]
    model.save_pretrained(training.output_dir)
    return training.output_dir, runtime


def rerank_side(args) -> dict:
    """A reranker trained on the training titles with their articles and ``--negatives`` hard
    negatives each (the other articles the embedding model ranks highest): a ``reranking`` job, or
    with ``--reranker peer`` ``CrossEncoderTrainer``; then the validation titles' top ``--top-k``
    from the embedding model, reranked by it."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    from worker.reranking import ranking_metrics

    train, validation = splits(args)
    embedder = SentenceTransformer(args.embedder, device="cpu", local_files_only=True)
    start, pairs = time.perf_counter(), reranker_pairs(embedder, train, args.negatives)
    job_validation = None
    if args.reranker.startswith("peer"):
        model_dir, train_seconds = peer_reranker(args, pairs)
    else:
        extra = {} if args.pos_weight is None else {"pos_weight": args.pos_weight}
        reporter, model_dir = fine_tune_job(
            args,
            "reranking",
            pairs,
            reranker_pairs(embedder, validation, args.negatives),
            epochs=args.rerank_epochs,
            **extra,
        )
        train_seconds = reporter.fields["train_metrics"]["train_seconds"]
        job_validation = {
            name: {step: round(v, 4) for step, v in reporter.series(f"eval_{name}").items()}
            for name in ("loss", "ndcg@10", "mrr@10")
        }
    anchors, bodies = validation["anchor"].tolist(), validation["positive"].tolist()
    cosine, found = top_k(embedder, anchors, bodies, args.top_k)
    queries = [anchors[q] for q, row in enumerate(found.tolist()) for _ in row]
    passages = [bodies[d] for row in found.tolist() for d in row]
    labels = torch.tensor([float(bodies[d] == bodies[q]) for q, row in enumerate(found.tolist()) for d in row])
    reranker = CrossEncoder(str(model_dir), device="cpu", local_files_only=True)
    reranked = reranker.predict(list(zip(queries, passages)), batch_size=64, show_progress_bar=False)
    before = ranking_metrics(queries, cosine.reshape(-1).numpy(), labels.numpy())
    after = ranking_metrics(queries, torch.as_tensor(reranked).reshape(-1).numpy(), labels.numpy())
    return {
        "side": "rerank",
        "reranker": args.reranker,
        "top_k": args.top_k,
        "reranker_train_rows": len(pairs),
        "embedding_top_k": {k: round(v, 4) for k, v in before.items()},
        "reranked": {k: round(v, 4) for k, v in after.items()},
        "job_validation": job_validation,
        "train_seconds": round(train_seconds, 1),
        "seconds": round(time.perf_counter() - start, 1),
    }


def cold(side: str, argv: list[str], *extra: str) -> dict:
    """One side in a fresh process (its own data directory): the JSON it prints."""
    env = {**os.environ, "TUNEJOB_DATA_DIR": tempfile.mkdtemp(prefix=f"bench-retrieval-{side}-")}
    out = subprocess.run(
        [sys.executable, "-m", "bench.retrieval", *argv, "--side", side, *extra],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    out = "\n" + out  # the JSON may be all it printed
    return json.loads(out[out.rindex("\n{\n") + 1 :])  # the last thing printed (the Trainer prints dicts too)


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line's settings (``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["tunejob", "peer", "rerank", "compare"], default="tunejob")
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--validation", type=int, default=200)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--embedder", help="--side rerank: the embedding model directory whose top-k is reranked")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--negatives", type=int, default=1, help="--side rerank: hard negatives per training title")
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="tunejob's precision; the peer trains with bf16=True when bf16",
    )
    p.add_argument("--rerank-epochs", type=float, default=1)
    p.add_argument(
        "--reranker",
        choices=["tunejob", "peer", "peer-listnet", "peer-lce"],
        default="tunejob",
        help="--side rerank: who trains the reranker, with which loss",
    )
    p.add_argument(
        "--in-batch-negatives", type=int, default=4, help="--reranker peer-lce: other titles' passages per title"
    )
    p.add_argument("--pos-weight", type=float, help="--side rerank: the positives' weight in binary cross-entropy")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    os.environ.setdefault("TUNEJOB_DATA_DIR", tempfile.mkdtemp(prefix="bench-retrieval-"))
    if args.side == "compare":
        common = [a for i, a in enumerate(argv) if a != "--side" and (i == 0 or argv[i - 1] != "--side")]
        ours = cold("tunejob", common)
        result = {
            "tunejob": ours,
            "peer": cold("peer", common),
            "rerank": cold("rerank", common, "--embedder", ours["model"]),
        }
        result["epoch_time_ratio"] = round(result["peer"]["train_seconds"] / ours["train_seconds"], 2)
    else:
        from worker.device import reuse_freed_cpu_memory

        reuse_freed_cpu_memory()  # the CPU worker's allocator setting, for every side alike (as bench.train)
        result = {"tunejob": tunejob_side, "peer": peer_side, "rerank": rerank_side}[args.side](args)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
