"""shared.inference: a tunejob model folder loads for prediction, and the sorted, token-budgeted
batches give the same outputs, in input order, as running the model on each text alone; a
multi-label model's rows are its sigmoid scores against its saved threshold, and a token
classifier's entities are those of ``pipeline("token-classification", aggregation_strategy="simple")``.
Embeddings (``shared.inference.embed``) are ``SentenceTransformer.encode``'s, in input order, from
batches of texts sorted by token count, and ``padded_tokens`` is what those batches compute."""

import shutil

import numpy as np
import pytest
import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    pipeline,
)

from shared.data.batching import token_budget_batches
from shared.errors import UserError
from shared.inference.embed import embed_texts, load_embedder
from shared.inference.loop import ModelCache, load_for_inference, predict_texts
from shared.jobs.base_models import BUILTIN, available_models
from tests.conftest import TINY_MODEL

LABELS = ["business", "sport", "tech"]
TEXTS = [
    "Shares fell sharply after the bank's results were published on Monday morning.",
    "A goal.",
    "",
    "The new phone has a faster chip, a larger screen and a battery that lasts two days " * 3,
    "Injury time winner",
    "Markets rallied.",
    "Rain stopped play for an hour at Lord's.",
]
MIXED = [  # character and token order disagree: digits and punctuation are a token each, long words one
    "Markets rallied on Monday as investors welcomed the results.",  # 60 characters, 12 tokens
    "Government announces international cooperation agreement",  # 56, 7
    "understanding responsibilities",  # 30, 4
    "1,2,3,4,5,6,7,8,9,10,11,12",  # 26, 25
    "C3PO: #42 @x9 (v2.0)!",  # 21, 18
    "2:1 (3-0), 4/5; 6.7%",  # 20, 19
    "Ministers resign",  # 16, 4
    "a",  # 1, 3
]
TAGS = ["B-LOC", "B-PER", "I-LOC", "O"]
CPU = torch.device("cpu")


def save_tiny_model(
    path,
    num_labels: int,
    max_length: int = 32,
    problem_type: str | None = "single_label_classification",
    names: list[str] = LABELS,
    head=BertForSequenceClassification,
):
    """A 2-layer BERT saved as a tunejob job saves its model: safetensors, config with id2label
    and problem_type, the all-MiniLM-L6-v2 tokenizer with ``model_max_length`` = the job's max_length.
    ``num_labels`` 1: a regression model; ``head``: ``BertForTokenClassification`` for a tagger."""
    tokenizer = AutoTokenizer.from_pretrained(available_models()[next(iter(BUILTIN))][0])
    labels = (
        {
            "id2label": dict(enumerate(names)),
            "label2id": {n: i for i, n in enumerate(names)},
            "problem_type": problem_type,
        }
        if num_labels > 1
        else {"problem_type": "regression"}
    )
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=num_labels,
        **labels,
    )
    torch.manual_seed(0)
    head(config).save_pretrained(path, safe_serialization=True)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("classifier"), len(LABELS))


@pytest.fixture(scope="module")
def classifier(classifier_dir):
    return load_for_inference(classifier_dir, CPU)


def logits_one_by_one(loaded, texts: list[str], max_length: int) -> torch.Tensor:
    """The model run on each text alone, unpadded: the reference."""
    with torch.no_grad():
        return torch.cat(
            [
                loaded.model(**loaded.tokenizer(t, truncation=True, max_length=max_length, return_tensors="pt")).logits
                for t in texts
            ]
        )


def test_loads_a_tunejob_model(classifier):
    assert classifier.task == "classification" and classifier.label_names == LABELS
    assert classifier.model_max_length == 32 and classifier.precision == "fp32" and not classifier.model.training


@pytest.mark.parametrize("max_tokens", [1, 40, None])  # one text per batch, a few per batch, all in one
def test_predictions_match_the_model_run_text_by_text_in_input_order(classifier, max_tokens):
    got = predict_texts(classifier, TEXTS, max_tokens=max_tokens)
    expected = torch.softmax(logits_one_by_one(classifier, TEXTS, 32), dim=-1)
    assert [r["label"] for r in got.rows] == [LABELS[i] for i in expected.argmax(-1).tolist()]
    for row, probabilities in zip(got.rows, expected.tolist()):
        assert list(row["probabilities"].values()) == pytest.approx(probabilities, abs=1e-5)
        assert row["score"] == max(row["probabilities"].values())


def test_long_texts_are_truncated_and_counted(classifier):
    got = predict_texts(classifier, TEXTS, max_length=16)
    lengths = [len(classifier.tokenizer(t, truncation=True, max_length=16)["input_ids"]) for t in TEXTS]
    untruncated = [len(classifier.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert got.truncated == sum(n > 16 for n in untruncated) == 2
    assert got.tokens == sum(lengths) and got.padded_tokens >= got.tokens
    expected = logits_one_by_one(classifier, TEXTS, 16).argmax(-1).tolist()
    assert [r["label"] for r in got.rows] == [LABELS[i] for i in expected]


def test_pairs_are_the_second_segment(classifier):
    pairs = ["first"] * len(TEXTS)
    got = predict_texts(classifier, TEXTS, pairs)
    with torch.no_grad():
        expected = [
            classifier.model(**classifier.tokenizer(t, p, truncation=True, max_length=32, return_tensors="pt"))
            .logits.argmax(-1)
            .item()
            for t, p in zip(TEXTS, pairs)
        ]
    assert [r["label"] for r in got.rows] == [LABELS[i] for i in expected]


def test_regression_gives_the_single_output(tmp_path):
    loaded = load_for_inference(save_tiny_model(tmp_path, 1), CPU)
    got = predict_texts(loaded, TEXTS)
    assert loaded.task == "regression" and loaded.label_names is None
    assert [r["value"] for r in got.rows] == pytest.approx(
        logits_one_by_one(loaded, TEXTS, 32)[:, 0].tolist(), abs=1e-5
    )


def test_multi_label_rows_are_sigmoid_scores_against_the_saved_threshold(tmp_path):
    from worker.training.export import write_decision_threshold

    model_dir = save_tiny_model(tmp_path, len(LABELS), problem_type="multi_label_classification")
    default = load_for_inference(model_dir, CPU)
    assert default.task == "multi_label" and default.label_names == LABELS and default.decision_threshold == 0.5
    scores = torch.sigmoid(logits_one_by_one(default, TEXTS, 32))
    threshold = scores.median().item()  # some labels in, some out
    write_decision_threshold(model_dir, threshold)
    loaded = load_for_inference(model_dir, CPU)
    assert loaded.decision_threshold == threshold
    rows = predict_texts(loaded, TEXTS, max_tokens=40).rows
    for row, expected in zip(rows, scores.tolist()):
        assert list(row["probabilities"]) == LABELS
        assert list(row["probabilities"].values()) == pytest.approx(expected, abs=1e-5)
        assert row["labels"] == [name for name, p in zip(LABELS, row["probabilities"].values()) if p >= threshold]
    assert 0 < sum(len(row["labels"]) for row in rows) < len(TEXTS) * len(LABELS)


@pytest.fixture(scope="module")
def tagger_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("tagger"), len(TAGS), problem_type=None, names=TAGS, head=BertForTokenClassification
    )


@pytest.mark.parametrize("max_tokens", [1, None])
def test_entities_are_the_token_classification_pipeline_s(tagger_dir, max_tokens):
    loaded = load_for_inference(tagger_dir, CPU)
    assert loaded.task == "token_classification" and loaded.label_names == TAGS
    texts = TEXTS + ["Carol flew to New York, said Schwarzenegger.", "  bob   went  to paris "]
    got = predict_texts(loaded, texts, max_tokens=max_tokens)
    assert got.truncated == 1  # the long text: cut at 32 tokens, as the pipeline cuts it (model_max_length)
    ner = pipeline("token-classification", model=str(tagger_dir), aggregation_strategy="simple", device="cpu")
    expected = [
        [{**e, "score": pytest.approx(float(e["score"]), abs=1e-5)} for e in entities] for entities in ner(texts)
    ]
    assert [row["entities"] for row in got.rows] == expected
    assert sum(len(e) for e in expected) > len(texts)  # random weights tag plenty of tokens
    for text, row in zip(texts, got.rows):  # offsets into the text (the uncased tokenizer lowercases words)
        assert all(
            text[e["start"] : e["end"]].lower().replace(" ", "") == e["word"].replace(" ", "")
            for e in row["entities"]
            if "#" not in e["word"]
        )
    with pytest.raises(UserError) as e:
        predict_texts(loaded, ["carol"], ["pair"])
    assert e.value.status == 422 and e.value.param == "pairs"


def test_bf16_predicts_with_bf16_weights_what_fp32_predicts(classifier, classifier_dir, tagger_dir):
    """bf16 holds the model's weights in bf16 (no autocast casting every weight per batch) and
    answers fp32's probabilities up to bf16's rounding; a tagger's entities come through too."""
    loaded = load_for_inference(classifier_dir, CPU, precision="bf16")
    assert loaded.precision == "bf16" and {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    got, expected = predict_texts(loaded, TEXTS), predict_texts(classifier, TEXTS)
    for row, reference in zip(got.rows, expected.rows):
        assert list(row["probabilities"].values()) == pytest.approx(list(reference["probabilities"].values()), abs=0.02)
    tagger = load_for_inference(tagger_dir, CPU, precision="bf16")
    rows = predict_texts(tagger, ["Carol flew to New York."]).rows
    assert rows and all(isinstance(e["score"], float) for e in rows[0]["entities"])


def test_bad_arguments_are_user_errors_naming_the_field(classifier):
    for kwargs, param in [
        ({"max_length": 33}, "max_length"),
        ({"max_length": 1}, "max_length"),
        ({"pairs": ["one"]}, "pairs"),
        ({"max_tokens": 0}, "max_tokens"),
    ]:
        with pytest.raises(UserError) as e:
            predict_texts(classifier, TEXTS, **kwargs)
        assert e.value.status == 422 and e.value.param == param
    assert predict_texts(classifier, []).rows == []


def test_a_folder_that_is_not_a_predictable_model_is_a_422(tmp_path, classifier_dir):
    (tmp_path / "empty").mkdir()
    pickled = tmp_path / "pickled"  # the same model with its weights pickled: safetensors are required
    shutil.copytree(classifier_dir, pickled)
    model = BertForSequenceClassification.from_pretrained(classifier_dir)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    for folder in (tmp_path / "empty", pickled):
        with pytest.raises(UserError) as e:
            load_for_inference(folder, CPU)
        assert e.value.status == 422 and e.value.code == "model_not_predictable"
        assert str(tmp_path) not in e.value.message
    with pytest.raises(UserError) as e:
        load_for_inference(classifier_dir, CPU, precision="fp8")
    assert e.value.param == "precision"


def test_token_budget_batches_sort_and_respect_the_budget():
    lengths = np.array([5, 1, 9, 3, 3, 7])
    batches = token_budget_batches(lengths, 10, list(range(1, 11)))
    assert sorted(np.concatenate(batches).tolist()) == list(range(6))
    assert [b.tolist() for b in batches] == [[1, 3, 4], [0], [5], [2]]  # 3x3, 1x5 (2x7 > 10), 1x7, 1x9
    assert token_budget_batches(np.array([], dtype=int), 10, [10]) == []


def test_model_cache_keeps_the_most_recently_used(classifier_dir):
    cache = ModelCache(2, CPU)
    first = cache.get("a", classifier_dir)
    cache.get("b", classifier_dir)
    assert cache.get("a", classifier_dir) is first  # a hit: the same object, now most recent
    cache.get("c", classifier_dir)
    assert cache.keys() == ["a", "c"]  # b was least recently used


@pytest.fixture(scope="module")
def embedder(models_dir):
    """The tiny BERT as a plain encoder: ``SentenceTransformer`` gives it mean pooling."""
    return load_embedder(models_dir / TINY_MODEL, CPU)


def padding(lengths: list[int], batch_size: int) -> int:
    """Tokens computed for ``lengths`` in that order, cut into ``batch_size`` batches, each padded to its longest."""
    return sum(len(b) * max(b) for b in (lengths[a : a + batch_size] for a in range(0, len(lengths), batch_size)))


@pytest.mark.parametrize("max_length", [None, 8])
def test_embeddings_are_sentence_transformers_own_in_input_order(embedder, models_dir, max_length):
    from sentence_transformers import SentenceTransformer

    texts = TEXTS + MIXED  # 1 to 250 characters, 2 to 60 tokens, in no order
    got = embed_texts(embedder, texts, max_length=max_length, batch_size=3)
    reference = SentenceTransformer(str(models_dir / TINY_MODEL), device="cpu", local_files_only=True)
    reference.max_seq_length = max_length or embedder.max_length
    expected = reference.encode(texts, normalize_embeddings=True)
    assert got.vectors.dtype == np.float32 and got.vectors.shape == expected.shape == (len(texts), embedder.dimensions)
    assert (got.vectors * expected).sum(1).min() >= 0.9999  # both unit length
    assert ((got.vectors @ expected.T).argmax(1) == np.arange(len(texts))).all()  # each row its own text's
    assert embedder.model.max_seq_length == embedder.max_length  # restored


@pytest.mark.parametrize(("max_length", "batch_size"), [(None, 2), (None, 3), (8, 2), (None, 64)])
def test_padded_tokens_are_those_of_the_token_sorted_batches_encode_computes(embedder, max_length, batch_size):
    computed = []  # input_ids.numel() of each forward pass
    hook = embedder.model.register_forward_pre_hook(lambda _, args: computed.append(args[0]["input_ids"].numel()))
    try:
        got = embed_texts(embedder, MIXED, max_length=max_length, batch_size=batch_size)
    finally:
        hook.remove()
    full = [len(ids) for ids in embedder.model.tokenizer(MIXED)["input_ids"]]
    clipped = [min(n, max_length or embedder.max_length) for n in full]
    assert (got.tokens, got.truncated) == (sum(full), sum(n > c for n, c in zip(full, clipped)))
    assert got.real_tokens == sum(clipped)  # what is computed, without padding
    assert got.padded_tokens == padding(sorted(clipped, reverse=True), batch_size) == sum(computed)
    assert len(computed) == -(-len(MIXED) // batch_size)  # one forward pass per batch
    by_characters = padding([clipped[i] for i in sorted(range(len(MIXED)), key=lambda i: -len(MIXED[i]))], batch_size)
    if (max_length, batch_size) == (None, 2):
        assert got.padded_tokens < by_characters == 120  # 108: by characters is how encode batches
