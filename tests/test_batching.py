"""Batch planning (``shared.data.batching.BatchPlan``), tokenization and per-batch padding
(``worker.data``): pure unit tests, no service stack."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from shared.data.batching import (
    MAX_PADDING_SHARE,
    BatchPlan,
    bucket_ladder,
    bucket_width,
)
from tests.conftest import TINY_MODEL
from worker.data import BatchStats, make_collator, tokenize

STRATEGIES = ["smart", "dynamic", "fixed", "token_budget"]
SIZED = ["smart", "dynamic", "fixed"]  # strategies that cut by batch_size


def ragged_lengths(n: int = 403, seed: int = 0) -> np.ndarray:
    """Token counts with a long tail, like real text: log-normal, clipped to [3, 512]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=3.5, sigma=0.8, size=n).astype(int), 3, 512)


def efficiency(batches: list[list[int]], lengths: np.ndarray) -> float:
    """Real tokens / tokens after padding each batch to its longest member."""
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    return real / padded


def compositions(batches: list[list[int]]) -> set[frozenset[int]]:
    return {frozenset(b) for b in batches}


# ----------------------------------------------------------------------------- BatchPlan


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n, batch_size", [(403, 16), (64, 8), (5, 8), (1, 4), (17, 1)])
def test_every_example_exactly_once_per_epoch(strategy, n, batch_size):
    lengths = ragged_lengths(n)
    plan = BatchPlan(lengths, batch_size, strategy, seed=7)
    for epoch in range(4):
        plan.set_epoch(epoch)
        batches = list(plan)
        assert batches == plan.epoch_batches(epoch)
        assert all(batches), "no empty micro-batch"
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(n))
        assert all(isinstance(i, int) for i in flat)
        if strategy in SIZED:
            assert max(len(b) for b in batches) <= batch_size
            assert sum(len(b) < batch_size for b in batches) <= (2 if strategy == "smart" else 1)
        if strategy in ("dynamic", "fixed"):
            assert len(batches) == math.ceil(n / batch_size)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_composition_changes_between_epochs(strategy):
    plan = BatchPlan(ragged_lengths(), 16, strategy, seed=1)
    epochs = [compositions(plan.epoch_batches(e)) for e in range(5)]
    for a in range(5):
        for b in range(a + 1, 5):
            assert epochs[a] != epochs[b], (a, b)
    # The order of batches changes too, not only their membership.
    firsts = [tuple(plan.epoch_batches(e)[1]) for e in range(5)]
    assert len(set(firsts)) > 1


def test_smart_batches_change_even_when_all_lengths_tie():
    """Ties are broken at random: equal lengths must not freeze the batches."""
    plan = BatchPlan(np.full(96, 20), 8, "smart", seed=3)
    a, b = compositions(plan.epoch_batches(0)), compositions(plan.epoch_batches(1))
    assert a != b
    assert len(a & b) < len(a) // 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_seed_same_plan_other_seed_other_plan(strategy):
    lengths = ragged_lengths()
    one, two = BatchPlan(lengths, 16, strategy, seed=42), BatchPlan(lengths.copy(), 16, strategy, seed=42)
    other = BatchPlan(lengths, 16, strategy, seed=43)
    for epoch in range(3):
        assert one.epoch_batches(epoch) == two.epoch_batches(epoch)
        assert one.epoch_batches(epoch) != other.epoch_batches(epoch)
        assert compositions(one.epoch_batches(epoch)) != compositions(other.epoch_batches(epoch))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_two_seeds_share_an_epoch_plan(strategy):
    """Runs over several seeds are independent: seed 43's first epoch is not seed 42's second."""
    lengths = ragged_lengths()
    plans = {seed: BatchPlan(lengths, 16, strategy, seed=seed) for seed in (42, 43)}
    epochs = {(seed, e): plans[seed].epoch_batches(e) for seed in plans for e in range(3)}
    for (seed, e), batches in epochs.items():
        for (other_seed, other_e), other in epochs.items():
            if seed != other_seed:
                assert batches != other, f"seed {seed} epoch {e} is seed {other_seed} epoch {other_e}"


def test_smart_batching_pads_far_less_than_random_batching():
    lengths = ragged_lengths(n=2000, seed=5)
    smart = BatchPlan(lengths, 32, "smart", seed=0)
    dynamic = BatchPlan(lengths, 32, "dynamic", seed=0)
    for epoch in range(3):
        smart_eff = efficiency(smart.epoch_batches(epoch), lengths)
        dynamic_eff = efficiency(dynamic.epoch_batches(epoch), lengths)
        assert smart_eff > 0.9, smart_eff
        assert dynamic_eff < 0.6, dynamic_eff
        assert smart_eff > 1.5 * dynamic_eff
        # The plan's own estimate agrees with the one computed here.
        assert smart.padding_efficiency(epoch) == pytest.approx(smart_eff)
        assert dynamic.padding_efficiency(epoch) == pytest.approx(dynamic_eff)
    # Each smart batch spans a narrow band of lengths: its members are neighbours in sorted order.
    ranks = np.empty(len(lengths), dtype=int)
    ranks[np.argsort(lengths, kind="stable")] = np.arange(len(lengths))
    sorted_lengths = np.sort(lengths)
    for batch in smart.epoch_batches(0):
        lo, hi = int(lengths[batch].min()), int(lengths[batch].max())
        # no example outside the batch lies strictly between its shortest and longest
        between = np.count_nonzero((sorted_lengths > lo) & (sorted_lengths < hi))
        inside = np.count_nonzero((lengths[batch] > lo) & (lengths[batch] < hi))
        assert between == inside


@pytest.mark.parametrize("batch_size", [16, 32])
def test_token_budget_pads_no_more_than_smart_at_the_same_mean_batch_size(batch_size):
    """Texts truncated at max_length pile up there (no padding among them); below, lengths spread
    out, as on BBC News (a held-out set of 450). A budget of batch_size x mean length gives the pile
    fewer rows than batch_size, so before the padding cap the spread-out batches took more rows and
    padded across length gaps: 0.968 against smart batching's 0.976 at batch 32."""
    lengths = np.minimum(np.random.default_rng(0).integers(150, 900, 450), 512)
    plan = BatchPlan(lengths, batch_size, "token_budget", seed=0, max_tokens=int(batch_size * lengths.mean()))
    budget_eff, smart_eff = [], []
    for epoch in range(5):
        batches = plan.epoch_batches(epoch)
        budget_eff.append(efficiency(batches, lengths))
        assert all(len(b) * lengths[b].max() <= plan.max_tokens for b in batches if len(b) > 1)
        padding = [len(b) * int(lengths[b].max()) - int(lengths[b].sum()) for b in batches]
        assert max(padding) <= 1.5 * MAX_PADDING_SHARE * plan.max_tokens
        smart = BatchPlan(lengths, round(len(lengths) / len(batches)), "smart", seed=0)  # same mean batch size
        smart_eff.append(efficiency(smart.epoch_batches(epoch), lengths))
    assert np.mean(budget_eff) >= 0.98 and np.mean(budget_eff) >= np.mean(smart_eff), (budget_eff, smart_eff)


def test_fixed_padding_efficiency_is_against_max_length():
    lengths = ragged_lengths()
    plan = BatchPlan(lengths, 16, "fixed", seed=0)
    assert plan.padding_efficiency(0, max_length=512) == pytest.approx(lengths.sum() / (len(lengths) * 512))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_with_most_tokens_comes_first(strategy):
    lengths = ragged_lengths()
    plan = BatchPlan(lengths, 16, strategy, seed=11)
    for epoch in range(5):
        batches = plan.epoch_batches(epoch)
        tokens = [len(b) * int(lengths[b].max()) for b in batches]
        assert tokens[0] == max(tokens), epoch


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("epochs", [1, 3, 2.5, 0.3])
def test_count_steps_agrees_with_iterating_the_epochs(strategy, accumulation, epochs):
    """Replays the training loop: epochs of micro-batches, one optimizer step per ``accumulation``
    micro-batches (a short group at an epoch's end), stopping part-way into a fractional epoch."""
    plan = BatchPlan(ragged_lengths(203), 16, strategy, seed=9)
    total = plan.count_steps(epochs, accumulation)
    steps_per_epoch = []
    for epoch in range(math.ceil(epochs)):
        plan.set_epoch(epoch)
        steps_per_epoch.append(math.ceil(len(list(plan)) / accumulation))
    full = int(epochs)
    expected = sum(steps_per_epoch[:full])
    if epochs > full:
        expected += math.ceil((epochs - full) * steps_per_epoch[full])
    assert total == max(1, expected)
    assert total >= 1


def test_smart_epochs_can_differ_in_batch_count_and_count_steps_follows():
    """The random first cut makes some epochs one batch longer; count_steps must count each epoch."""
    lengths = ragged_lengths(203)
    plan = BatchPlan(lengths, 16, "smart", seed=0)
    counts = [len(plan.epoch_batches(e)) for e in range(20)]
    assert set(counts) <= {math.ceil(203 / 16), math.ceil(203 / 16) + 1}
    assert plan.count_steps(20, 1) == sum(counts)


def test_set_epoch_skip_resumes_mid_epoch():
    plan = BatchPlan(ragged_lengths(), 16, "smart", seed=2)
    full = plan.epoch_batches(3)
    resumed = BatchPlan(ragged_lengths(), 16, "smart", seed=2)  # a fresh process after a restart
    resumed.set_epoch(3, skip=5)
    assert len(resumed) == len(full) - 5
    assert list(resumed) == full[5:]


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="batching"):
        BatchPlan(ragged_lengths(), 16, "sorted", seed=0)


# ----------------------------------------------------------------------------- bucket ladder


@pytest.mark.parametrize("max_length", [8, 48, 64, 128, 300, 512, 1000, 4096])
def test_bucket_ladder_is_short_ascending_and_pads_at_most_a_fifth_beyond_64(max_length):
    ladder = bucket_ladder(max_length)
    assert ladder == sorted(set(ladder)) and ladder[-1] == max_length and ladder[0] >= 1
    assert all(w % 16 == 0 for w in ladder[:-1])  # tensor-core friendly, except max_length itself
    assert len(ladder) <= 8 + 4 * max(0, math.ceil(math.log2(max_length / 128)))
    for longest in range(1, max_length + 1):
        width = bucket_width(ladder, longest)
        assert width in ladder and width >= longest
        assert ladder.index(width) == 0 or ladder[ladder.index(width) - 1] < longest  # the first that fits
        if longest > 64:
            assert width <= 1.25 * longest  # at most a fifth of the width is padding


def test_bucket_ladder_for_max_length_512_and_multiples():
    assert bucket_ladder(512) == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert bucket_ladder(20, 8) == [8, 16, 20]
    assert bucket_ladder(5, 1) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        bucket_ladder(0)


def test_bucket_efficiency_and_the_widths_a_plan_uses():
    lengths = ragged_lengths(n=2000, seed=5)
    ladder = bucket_ladder(512)
    plan = BatchPlan(lengths, 32, "smart", seed=0)
    for epoch in range(3):
        batches = plan.epoch_batches(epoch)
        real = sum(int(lengths[b].sum()) for b in batches)
        bucketed = sum(len(b) * bucket_width(ladder, int(lengths[b].max())) for b in batches)
        assert plan.padding_efficiency(epoch, ladder=ladder) == pytest.approx(real / bucketed)
        assert plan.padding_efficiency(epoch, ladder=ladder) < plan.padding_efficiency(epoch) <= 1
        assert plan.padding_efficiency(epoch, ladder=bucket_ladder(512, 1)) == pytest.approx(
            plan.padding_efficiency(epoch)
        )
    counts = plan.width_counts(ladder, epochs=2.5)
    assert set(counts) <= set(ladder) and list(counts) == sorted(counts)
    assert sum(counts.values()) == sum(len(plan.epoch_batches(e)) for e in range(3))
    # The bucket widths add at most a quarter beyond 64 tokens and at most 15 tokens a row below.
    batches = plan.epoch_batches(0)
    unrounded = sum(len(b) * int(lengths[b].max()) for b in batches)
    real = int(lengths.sum())
    assert real / plan.padding_efficiency(0, ladder=ladder) <= 1.25 * unrounded + 15 * len(lengths)


def test_training_batches_have_ladder_widths_and_every_example_once_per_epoch(engine_env):
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job
    from tests.conftest import RecordingReporter
    from worker.data import JobData
    from worker.training import batches
    from worker.training.recipe import Recipe

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "market", "goal"]
    df = pd.DataFrame(
        {
            "text": [" ".join(rng.choice(words, size=rng.integers(1, 60))) for _ in range(90)],
            "label": ["a", "b", "c"] * 30,
        }
    )
    spec = JobCreate(
        base_model=TINY_MODEL,
        training_dataset="ds",
        validation_split=0.0,
        hyperparameters={"batch_size": 8, "max_length": 64, "pad_to_multiple_of": None},
    )
    job = Job(
        id="buckets",
        task="classification",
        base_model=TINY_MODEL,
        label_names=["a", "b", "c"],
        spec=spec.model_dump(mode="json"),
    )
    run = Recipe(job, torch.device("cpu")).setup(JobData(df, None), RecordingReporter())
    ladder = bucket_ladder(64)
    run.job_setup.collator.ladder = ladder  # as on a CUDA worker
    for epoch in range(3):
        run.job_setup.plan.set_epoch(epoch)
        seen, widths = [], set()
        js = run.job_setup
        for planned, batch in zip(js.plan.epoch_batches(epoch), batches.make_loader(js, js.train_set, js.plan, epoch)):
            width = batch["input_ids"].shape[1]
            assert width == bucket_width(ladder, int(run.job_setup.train_set.lengths[planned].max()))
            widths.add(width)
            seen += planned
        assert sorted(seen) == list(range(len(df)))
        assert widths <= set(ladder) and len(widths) > 1


# ----------------------------------------------------------------------------- tokenize and collate


@pytest.fixture
def tokenizer(models_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models_dir / TINY_MODEL)


TEXTS = [
    "goal",
    "the coach praised the team after a long league match",
    "shares rose",
    "bank profit and market sales were up again this quarter, said the bank",
    "a",
    "team team team team team team team team team team team team team team team team team team",
]


def frame(n: int = len(TEXTS)) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "text": TEXTS[:n],
            "other": [t[::-1] for t in TEXTS[:n]],
            "label": ["sports", "sports", "business", "business", "sports", "sports"][:n],
        }
    )


def encode(tokenizer, max_length: int = 64, **kw):
    return tokenize(tokenizer, frame(), "text", kw.get("pair"), "label", ["business", "sports"], max_length)


def check_padding(batch: dict, dataset, indices: list[int], pad_id: int) -> None:
    """Each row holds its example's tokens, then ``pad_id`` with attention 0 exactly on the pads."""
    mask, ids = batch["attention_mask"], batch["input_ids"]
    assert mask.dtype == torch.int64 and ids.dtype == torch.int64
    for row, i in enumerate(indices):
        n = int(dataset.lengths[i])
        assert mask[row].tolist() == [1] * n + [0] * (mask.shape[1] - n)
        assert ids[row, :n].tolist() == dataset[i]["input_ids"]
        assert (ids[row, n:] == pad_id).all()
        if "token_type_ids" in batch:
            assert batch["token_type_ids"][row, :n].tolist() == dataset[i]["token_type_ids"]
            assert (batch["token_type_ids"][row, n:] == 0).all()


def test_tokenized_examples_are_the_tokenizer_s_lists_held_in_flat_arrays(tokenizer, monkeypatch):
    """Each example reads back as exactly what the tokenizer returned, across its batches of
    ``TOKENIZE_BATCH`` texts, while the dataset holds about 4 bytes a token per input: lists of
    Python ints took ten times that (5.3 GB of worker memory for 1.35 million short rows)."""
    import pandas as pd

    from worker import data

    monkeypatch.setattr(data, "TOKENIZE_BATCH", 7)  # several tokenizer calls, joined
    texts = [" ".join(TEXTS[: 1 + i % len(TEXTS)]) for i in range(50)]
    frame = pd.DataFrame({"text": texts, "label": ["sports"] * 50})
    ds = data.tokenize(tokenizer, frame, "text", None, "label", ["sports"], 64)
    expected = tokenizer(texts, truncation=True, max_length=64)
    for k in ("input_ids", "token_type_ids", "attention_mask"):
        assert [ds[i][k] for i in range(50)] == expected[k], k
    tokens = int(ds.lengths.sum())
    held = sum(r.values.nbytes + r.offsets.nbytes for r in ds.encodings.values())
    assert held <= 3 * (4 * tokens + 8 * 51)


def test_tokenize_once_without_padding_and_map_labels(tokenizer):
    ds = encode(tokenizer, max_length=12)
    assert len(ds) == len(TEXTS)
    assert set(ds.encodings) == {"input_ids", "token_type_ids", "attention_mask"}
    assert ds.lengths.tolist() == [len(ids) for ids in ds.encodings["input_ids"]]
    assert ds.lengths.max() == 12 and ds.lengths.min() == 3  # [CLS] a [SEP]
    assert all(
        ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id for ids in ds.encodings["input_ids"]
    )
    assert ds.labels == [1, 1, 0, 0, 1, 1]
    assert ds[3]["labels"] == 0 and len(ds[3]["input_ids"]) == 12  # truncated to max_length


@pytest.mark.parametrize("batching", ["smart", "dynamic"])
@pytest.mark.parametrize("pad_token", [None, "[unused0]"])
def test_collator_pads_to_longest_rounded_up_with_the_tokenizers_pad_id(tokenizer, batching, pad_token):
    if pad_token:
        tokenizer.pad_token = pad_token
        assert tokenizer.pad_token_id == 1
    pad_id = tokenizer.pad_token_id
    assert pad_id == (1 if pad_token else 0)
    ds = encode(tokenizer)
    assert not any(pad_id in ids for ids in ds.encodings["input_ids"])  # pads are recognisable
    collate = make_collator(tokenizer, batching, 64, bucket_ladder(64, 8))
    for indices in [[0, 1, 2], [4, 0], [5, 3, 1, 0], [4]]:
        batch = collate([ds[i] for i in indices])
        longest = int(ds.lengths[indices].max())
        assert batch["input_ids"].shape == (len(indices), 8 * math.ceil(longest / 8))
        assert batch["input_ids"].shape[1] % 8 == 0
        check_padding(batch, ds, indices, pad_id)
        assert batch["labels"].tolist() == [ds.labels[i] for i in indices]
        assert batch["labels"].dtype == torch.int64


def test_collator_without_rounding_pads_to_exactly_the_longest(tokenizer):
    ds = encode(tokenizer)
    for ladder in (None, bucket_ladder(64, 1)):
        batch = make_collator(tokenizer, "smart", 64, ladder)([ds[i] for i in [0, 2, 4]])
        assert batch["input_ids"].shape[1] == int(ds.lengths[[0, 2, 4]].max())
        check_padding(batch, ds, [0, 2, 4], 0)


@pytest.mark.parametrize("max_length", [64, 30])
def test_fixed_collator_pads_to_exactly_max_length(tokenizer, max_length):
    tokenizer.pad_token = "[unused0]"
    ds = encode(tokenizer, max_length=max_length)
    collate = make_collator(tokenizer, "fixed", max_length, bucket_ladder(max_length, 8))
    for indices in [[0, 4], [1, 3, 5]]:
        batch = collate([ds[i] for i in indices])
        assert batch["input_ids"].shape == (len(indices), max_length)
        check_padding(batch, ds, indices, 1)


def test_text_pairs_keep_their_segment_ids(tokenizer):
    ds = encode(tokenizer, pair="other")
    assert all(1 in t for t in ds.encodings["token_type_ids"])
    batch = make_collator(tokenizer, "smart", 64, bucket_ladder(64, 8))([ds[i] for i in range(len(ds))])
    check_padding(batch, ds, list(range(len(ds))), 0)


def test_tokenizer_without_token_type_ids_gives_batches_without_them(tokenizer):
    """MPNet/RoBERTa-style tokenizers have no segment ids; neither must the batches."""
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    ds = encode(tokenizer)
    assert set(ds.encodings) == {"input_ids", "attention_mask"}
    assert set(ds[0]) == {"input_ids", "attention_mask", "labels"}
    for batching in ["smart", "fixed"]:
        batch = make_collator(tokenizer, batching, 64, bucket_ladder(64, 8))([ds[i] for i in [0, 1, 3]])
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        check_padding(batch, ds, [0, 1, 3], 0)


def test_regression_labels_are_float(tokenizer):
    df = frame().assign(score=[0.5, 1, -2, 3.25, 0, 1e-3])
    ds = tokenize(tokenizer, df, "text", None, "score", None, 64)
    batch = make_collator(tokenizer, "smart", 64, bucket_ladder(64, 8))([ds[i] for i in range(6)])
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"].tolist() == pytest.approx([0.5, 1, -2, 3.25, 0, 1e-3])


# ----------------------------------------------------------------------------- BatchStats


def test_batch_stats_count_real_unrounded_and_padded_tokens(tokenizer):
    ds = encode(tokenizer)
    indices = [0, 2, 1]
    lengths = ds.lengths[indices]
    batch = make_collator(tokenizer, "smart", 64, bucket_ladder(64, 8))([ds[i] for i in indices])
    width = batch["input_ids"].shape[1]
    assert width == 8 * math.ceil(lengths.max() / 8) and width > lengths.max()  # rounding did add pads
    stats = BatchStats.of(batch)
    assert stats == BatchStats(real=int(lengths.sum()), unrounded=3 * int(lengths.max()), padded=3 * width)
    assert stats.real <= stats.unrounded <= stats.padded

    fixed = make_collator(tokenizer, "fixed", 64, bucket_ladder(64, 8))([ds[i] for i in indices])
    stats = BatchStats.of(fixed, padded_to_longest=False)
    assert stats == BatchStats(real=int(lengths.sum()), unrounded=3 * 64, padded=3 * 64)


def test_batch_stats_by_hand():
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]])
    assert BatchStats.of({"attention_mask": mask}) == BatchStats(real=9, unrounded=15, padded=24)
    assert BatchStats.of({"attention_mask": mask}, padded_to_longest=False) == BatchStats(9, 24, 24)
    # two columns of width 6 side by side (an embedding job's anchor and positive): each computed at
    # its own longest, 5 and 4 tokens
    left = [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]
    right = [[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    pairs = torch.tensor([a + b for a, b in zip(left, right)])
    assert BatchStats.of({"attention_mask": pairs}, columns=2) == BatchStats(real=18, unrounded=27, padded=27)


def test_padding_ladder_defaults():
    from shared.schemas.hyperparameters import Hyperparameters
    from worker.device import padding_ladder

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert padding_ladder(Hyperparameters(max_length=128), cpu) == list(range(1, 129))  # the longest member
    assert padding_ladder(Hyperparameters(max_length=128), cuda) == [16, 32, 48, 64, 80, 96, 112, 128]
    assert padding_ladder(Hyperparameters(max_length=200, torch_compile=True), cpu) == [64, 128, 192, 200]
    assert padding_ladder(Hyperparameters(max_length=40, pad_to_multiple_of=16, torch_compile=True), cuda) == [
        16,
        32,
        40,
    ]


def test_dry_run_plan_shows_smart_and_bucket_efficiency_and_the_buckets(models_dir, monkeypatch, tmp_path):
    from shared.jobs import planning
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Dataset
    from shared.store.tenancy import Caller

    monkeypatch.setattr(planning, "estimate_seconds", lambda model, tokens, caller: {"estimated_seconds": None})
    rng = np.random.default_rng(1)
    texts = [" ".join(["market"] * int(n)) for n in rng.integers(1, 200, size=300)]
    train = pd.DataFrame({"text": texts, "label": ["a", "b"] * 150})
    spec = JobCreate(
        base_model=TINY_MODEL, training_dataset="ds", hyperparameters={"batch_size": 16, "max_length": 128, "epochs": 2}
    )
    train.to_csv(tmp_path / "train.csv", index=False)
    dataset = Dataset(id="ds", filename="train.csv", format="csv", path=str(tmp_path / "train.csv"), rows=len(train))
    plan = planning.plan_job(
        planning.CheckedSpec(spec, models_dir / TINY_MODEL, dataset, None, ["a", "b"], Caller("tenant-a"))
    )
    ladder = bucket_ladder(128)
    assert plan["buckets"]["ladder"] == ladder
    widths = plan["buckets"]["widths"]
    used = [w["width"] for w in widths]
    assert used == sorted(used) and set(used) <= set(ladder)
    assert sum(w["micro_batches"] for w in widths) == plan["total_steps"]  # every micro-batch of the 2 epochs
    smart = plan["padding_efficiency"]["smart"]
    assert plan["buckets"]["padding_efficiency"] == smart["bucketed"] < smart["unrounded"] <= 1
    assert plan["padding_efficiency"]["fixed"]["bucketed"] == plan["padding_efficiency"]["fixed"]["unrounded"]


def test_a_large_file_is_planned_from_a_sample_close_to_the_whole(models_dir, monkeypatch, tmp_path):
    """A dry run tokenizes about ``TUNEJOB_DRY_RUN_ROWS`` rows (it runs in the API: 1.5 million
    rows took it past the client's 60 s, a CPU of the API's busy meanwhile); a larger file is
    planned from a random sample of its rows, its counts scaled to the whole, and says so."""
    from shared.jobs import planning
    from shared.schemas.jobs import JobCreate
    from shared.settings import get_settings
    from shared.store.rows import Dataset
    from shared.store.tenancy import Caller

    monkeypatch.setattr(planning, "estimate_seconds", lambda model, tokens, caller: {"estimated_seconds": None})
    rng = np.random.default_rng(2)
    # laid out in a pattern, as a reranking file is (a query's positive, then its negatives): every
    # 6th row long; a sample of every 6th row (what this was first) took only those
    texts = [" ".join(["market"] * (150 if i % 6 == 0 else int(n))) for i, n in enumerate(rng.integers(1, 40, 3000))]
    train = pd.DataFrame({"text": texts, "label": ["a", "b", "c"] * 1000})
    train.to_csv(tmp_path / "train.csv", index=False)
    dataset = Dataset(id="ds", filename="train.csv", format="csv", path=str(tmp_path / "train.csv"), rows=len(train))
    spec = JobCreate(
        base_model=TINY_MODEL, training_dataset="ds", hyperparameters={"batch_size": 16, "max_length": 128, "epochs": 2}
    )
    checked = planning.CheckedSpec(spec, models_dir / TINY_MODEL, dataset, None, ["a", "b", "c"], Caller("tenant-a"))
    whole = planning.plan_job(checked)
    assert "sampled_rows" not in whole and whole["notes"] == []
    monkeypatch.setattr(get_settings(), "dry_run_rows", 500)
    tokenized = []
    real_counts = planning.token_counts
    monkeypatch.setattr(
        planning, "token_counts", lambda tok, t, *a: tokenized.append(len(t)) or real_counts(tok, t, *a)
    )
    sampled = planning.plan_job(checked)
    assert 400 <= sum(tokenized) <= 600  # each row of 3,000 with probability 1/6 (seeded)
    assert sampled["examples"] == whole["examples"] == 2700 and 350 <= sampled["sampled_rows"] <= 550
    assert sampled["notes"] == [
        f"planned from {sampled['sampled_rows']} of the 2,700 training examples, a random sample "
        "(TUNEJOB_DRY_RUN_ROWS): the counts and the estimate are scaled to the whole"
    ]
    assert planning.plan_job(checked) == sampled  # the same file, the same sample
    for key, within in (("total_steps", 0.1), ("micro_batches_per_epoch", 0.1), ("truncated_examples", 0.35)):
        assert abs(sampled[key] - whole[key]) <= within * whole[key], (key, sampled[key], whole[key])
    assert abs(sampled["token_lengths"]["mean"] - whole["token_lengths"]["mean"]) < 0.1 * whole["token_lengths"]["mean"]
    assert abs(sum(sampled["token_lengths"]["counts"]) - 2700) <= 10
    for strategy, figures in whole["padding_efficiency"].items():
        assert abs(sampled["padding_efficiency"][strategy]["unrounded"] - figures["unrounded"]) < 0.03, strategy


@pytest.mark.parametrize(
    "lengths",
    [[128] * 50, [5, 5, 6], list(range(24, 129)) * 3, [1, 512], [7]],
    ids=["all-equal", "narrow", "spread", "far-apart", "one"],
)
def test_the_plans_length_bins_are_whole_tokens_and_hold_every_example(lengths):
    """Every example equally long (all cut at max_length) drew 16 fractional bins around that length."""
    from shared.jobs.planning import length_bins

    counts, edges = length_bins(np.array(lengths))
    widths = np.diff(edges)
    assert 1 <= len(counts) <= 16 and len(edges) == len(counts) + 1
    assert all(float(e).is_integer() for e in edges) and len(set(widths)) == 1, edges
    assert counts.sum() == len(lengths) and edges[0] == min(lengths) and edges[-2] <= max(lengths) < edges[-1]
    for i, count in enumerate(counts):
        assert count == sum(edges[i] <= x < edges[i + 1] for x in lengths)
    if len(set(lengths)) == 1:
        assert counts.tolist() == [len(lengths)] and edges.tolist() == [lengths[0], lengths[0] + 1]
