"""Batch planning: which examples share a micro-batch, in which order. NumPy only (no torch), so
the API can plan a job (``POST /jobs?dry_run=true``) and the worker can train with the same code.

Smart batching (dynamic padding + uniform-length batching) follows the seed notebooks
(McCormick, "Smart Batching Tutorial"; Benesty, "Divide Hugging Face Transformers training time
by 2 or more"): sequences of similar length share a micro-batch, each is padded only to its
longest member, and the batch order is shuffled every epoch.

Bucketed widths: each micro-batch is padded up to the next width of a small, fixed ladder
(``bucket_ladder``), so that a job has few tensor shapes and a CUDA graph captured for one shape can
be replayed for every micro-batch of that width, in this job and in later jobs of the same model.
"""

import bisect
import math

import numpy as np

STRATEGIES = ("fixed", "dynamic", "smart", "token_budget")
WIDTHS_PER_OCTAVE = 4  # bucket ladder: at most this many widths between a width and its double
MIN_BUCKET_STEP = 16  # and none closer together than this (tensor-core tiles; short widths cost little on a GPU)
# token_budget: a micro-batch's padding (padded - real tokens) stays within a share of max_tokens
# drawn per micro-batch between 0.5 and 1.5 times this (random, so cuts move between epochs)
MAX_PADDING_SHARE = 0.02


def bucket_ladder(max_length: int, multiple: int | None = None) -> list[int]:
    """The widths (tokens) a micro-batch may be padded to, ascending, ending at ``max_length``.

    ``multiple`` given: every multiple of it (``1``: every width, i.e. pad to the longest member).
    ``None``: a geometric ladder, the same for every job with this ``max_length``: steps of 16 up
    to 128, then ``WIDTHS_PER_OCTAVE`` widths per doubling (32 apart up to 256, 64 up to 512, ...).
    16, 32, ..., 128, 160, 192, 224, 256, 320, 384, 448, 512 for ``max_length`` 512 (16 widths).
    A micro-batch whose longest member has ``n`` tokens is padded to the first width >= ``n``:
    at most 1/5 of its tokens are padding beyond 64 tokens. Measured on the engine's smart batches
    (batch 32, all-MiniLM-L6-v2 tokenizer): BBC News at 512 keeps 0.95 of the computed tokens
    real (7 widths used; multiples of 8: 0.99 with 43 widths), Rotten Tomatoes at 128 0.78 (5
    widths; multiples of 8: 0.88 with 9), where texts are short and a GPU step costs about the
    same at any width up to 64.

    Raises:
        ValueError: ``max_length`` or ``multiple`` below 1.
    """
    if max_length < 1 or (multiple is not None and multiple < 1):
        raise ValueError(f"max_length {max_length} and multiple {multiple} must be at least 1")
    if multiple is not None:
        return [*range(multiple, max_length, multiple), max_length]
    widths, width = [], 0
    while width < max_length:
        octave_start = 1 << max(0, width.bit_length() - 1)  # the largest power of two <= width
        width = min(max_length, width + max(MIN_BUCKET_STEP, octave_start // WIDTHS_PER_OCTAVE))
        widths.append(width)
    return widths


def job_ladder(max_length: int, pad_to_multiple_of: int | None, torch_compile: bool, cuda: bool) -> list[int]:
    """The widths a job's micro-batches are padded to on a CUDA or a CPU worker.

    ``pad_to_multiple_of`` if set: its multiples. ``torch_compile``: multiples of 64 (a few shapes,
    few recompiles). CUDA: the geometric ``bucket_ladder``, so that a job has a few shapes, each
    captured once as a CUDA graph (``worker.training.capture``). The CPU: every width (pad to the longest
    member): the CPU runs eagerly, has no per-shape cost to save, and pays for every pad token;
    rounding to multiples of 8 cost 8-9% of the tokens/s on short texts (Rotten Tomatoes, 3
    repeats: smart ran 1,613 real tokens/s unrounded vs 1,468 rounded at batch 16, 1,785 vs 1,652
    at batch 32; docs/benchmarks.md), and the bucket ladder pads more than that.
    """
    if pad_to_multiple_of:
        return bucket_ladder(max_length, pad_to_multiple_of)
    if torch_compile:
        return bucket_ladder(max_length, 64)
    return bucket_ladder(max_length, None if cuda else 1)


def bucket_width(ladder: list[int], longest: int) -> int:
    """The first width of ``ladder`` that holds ``longest`` tokens (the last one if none does)."""
    return ladder[min(bisect.bisect_left(ladder, longest), len(ladder) - 1)]


class BatchPlan:
    """The micro-batches (lists of example indices) of each epoch; iterating yields the current one's.

    Strategies:
        smart: sort by length (ties broken at random), cut into ``batch_size`` chunks starting at a
            random offset, shuffle the chunk order.
        token_budget: sorted the same way, but cut so that each micro-batch holds at most
            ``max_tokens`` padded tokens (examples x longest length) and at most
            ``MAX_PADDING_SHARE`` of ``max_tokens`` of padding: short sequences ride in large
            batches and long ones in small batches, and a batch ends where lengths spread out
            rather than pad across a gap. The first cut falls at a random fraction of the budget.
        dynamic, fixed: a random permutation cut into ``batch_size`` chunks (``fixed`` is padded to
            ``max_length`` by the collator).

    Each epoch's randomness comes from the pair ``(seed, epoch)``: batch composition changes between
    epochs, a given seed always gives the same plan (a run resumes from (epoch, position) alone),
    and no two seeds share an epoch's plan (``seed + epoch`` would give seed 2's first epoch to
    seed 1's second, so runs over several seeds would not be independent).
    Every example appears exactly once per epoch. The micro-batch with the most padded tokens is
    moved to the front, so an out-of-memory error shows at the first step rather than an hour in.
    ``set_epoch(epoch, skip)`` selects the epoch and skips its first ``skip`` micro-batches.

    Args:
        lengths: ``[n]`` real tokens per example.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, strategy: str, seed: int, max_tokens: int | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown batching strategy {strategy!r}")
        self.lengths, self.batch_size, self.strategy, self.seed = np.asarray(lengths), batch_size, strategy, seed
        self.max_tokens = max_tokens or batch_size * int(self.lengths.max(initial=1))
        self.set_epoch(0)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip
        self.batches = self.epoch_batches(epoch)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng((self.seed, epoch))
        order = rng.permutation(len(self.lengths))
        if self.strategy in ("smart", "token_budget"):
            order = order[np.argsort(self.lengths[order], kind="stable")]
            cuts = self._budget_cuts(order, rng) if self.strategy == "token_budget" else self._size_cuts(order, rng)
            batches = [order[a:b].tolist() for a, b in zip(cuts, cuts[1:]) if b > a]
            batches = [batches[i] for i in rng.permutation(len(batches))]
        else:
            batches = [order[i : i + self.batch_size].tolist() for i in range(0, len(order), self.batch_size)]
        tokens = [len(b) * int(self.lengths[b].max()) for b in batches]
        batches.insert(0, batches.pop(int(np.argmax(tokens))))
        return batches

    def _size_cuts(self, order: np.ndarray, rng: np.random.Generator) -> list[int]:
        bs = self.batch_size
        offset = int(rng.integers(0, bs)) if len(order) > bs else 0
        return [0, *range(offset or bs, len(order), bs), len(order)]

    def _budget_cuts(self, order: np.ndarray, rng: np.random.Generator) -> list[int]:
        """Cut points of ``order`` (sorted by length): a micro-batch ends before the example that
        would take its padded tokens over the budget or its padding over about ``MAX_PADDING_SHARE``
        of ``max_tokens`` (0.5-1.5 times that, drawn per micro-batch: cuts driven by length gaps
        alone would give every epoch the same batches). Without the padding cap, batches of the longest examples (often a pile
        truncated at max_length, which pads nothing) hold fewer rows than ``batch_size`` and the
        batches of sparse, spread-out lengths make up for it with more rows and padding across
        length gaps: held-out WNUT-16 tweets (478) at a budget of 16 x their mean length padded to
        0.971 of real tokens against smart batching's 0.973 at the same mean batch size, BBC News
        held out (445) at 32 x mean to 0.970 against 0.975; with the cap 0.990 and 0.983
        (``python -m bench.padding``, docs/benchmarks.md)."""
        cuts, start, real = [0], 0, 0
        budget = rng.uniform(0, self.max_tokens)  # a random first cut changes composition per epoch
        share = MAX_PADDING_SHARE * self.max_tokens
        padding_cap = rng.uniform(0.5, 1.5) * share
        for i, length in enumerate(self.lengths[order].tolist()):
            padded = (i - start + 1) * length
            if i > start and (padded > budget or padded - real - length > padding_cap):
                cuts.append(i)
                start, budget, real = i, self.max_tokens, 0
                padding_cap = rng.uniform(0.5, 1.5) * share
            real += length
        return [*cuts, len(order)]

    def __iter__(self):
        yield from self.batches[self.skip :]

    def __len__(self) -> int:
        return len(self.batches) - self.skip

    def count_steps(self, epochs: float, gradient_accumulation_steps: int) -> int:
        """Optimizer steps in ``epochs`` epochs (a fractional last epoch is cut short)."""
        full, fraction = int(epochs), epochs - int(epochs)
        per_epoch = [math.ceil(len(self.epoch_batches(e)) / gradient_accumulation_steps) for e in range(full + 1)]
        return max(1, sum(per_epoch[:full]) + math.ceil(fraction * per_epoch[full]))

    def padding_efficiency(
        self,
        epoch: int = 0,
        max_length: int | None = None,
        multiple: int = 1,
        ladder: list[int] | None = None,
        columns: np.ndarray | None = None,
    ) -> float:
        """Real tokens / padded tokens of an epoch's plan: batches padded to their longest member
        rounded up to ``multiple`` or to the next width of ``ladder``, or to ``max_length`` when given
        (``fixed`` padding). ``columns``: ``[n, texts]`` real tokens of each text of an example
        (an embedding pair's anchor, positive, negatives), each text encoded alone and padded to
        its own column's longest in the micro-batch, as the job computes them."""
        real = padded = 0
        for batch in self.epoch_batches(epoch):
            for lengths in [self.lengths[batch]] if columns is None else columns[batch].T:
                longest = int(lengths.max())
                if max_length:
                    width = max_length
                else:
                    width = bucket_width(ladder, longest) if ladder else multiple * math.ceil(longest / multiple)
                real += int(lengths.sum())
                padded += len(batch) * width
        return real / padded

    def width_counts(self, ladder: list[int], epochs: float) -> dict[int, int]:
        """How many micro-batches of the first ``ceil(epochs)`` epochs are padded to each width of
        ``ladder``: the shapes a job will train with."""
        counts: dict[int, int] = {}
        for epoch in range(max(1, math.ceil(epochs))):
            for batch in self.epoch_batches(epoch):
                width = bucket_width(ladder, int(self.lengths[batch].max()))
                counts[width] = counts.get(width, 0) + 1
        return dict(sorted(counts.items()))


class DistinctBatchPlan(BatchPlan):
    """``BatchPlan`` whose micro-batches never hold the same text twice among their anchors and
    positives: a repeated anchor (a query with several positives) or positive would be another
    row's in-batch negative while being its positive (a false negative). As
    sentence-transformers' ``NoDuplicatesBatchSampler``, but after the plan's own batching, so
    smart batching keeps its length-sorted micro-batches: a row that collides is moved to the next
    micro-batch where it does not (a new one at the end if none), which keeps every row exactly
    once per epoch and every micro-batch at most ``batch_size`` rows.

    Args:
        keys: ``[n, 2]`` int ids of each row's anchor and positive text, from one id space (a
            text that is one row's anchor and another's positive has one id).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        keys: np.ndarray,
        batch_size: int,
        strategy: str,
        seed: int,
        max_tokens: int | None = None,
    ):
        self.keys = keys
        super().__init__(lengths, batch_size, strategy, seed, max_tokens)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        batches: list[list[int]] = []
        pending: list[int] = []
        for planned in super().epoch_batches(epoch):
            batch, pending = self._fill(pending + planned, len(planned))
            batches.append(batch)
        while pending:  # rows no later micro-batch could take: as few more micro-batches as it needs
            batch, pending = self._fill(pending, self.batch_size)
            batches.append(batch)
        return batches

    def _fill(self, rows: list[int], size: int) -> tuple[list[int], list[int]]:
        """A micro-batch of at most ``size`` of ``rows``, in order, none sharing a text (``keys``)
        with another; and the rows left for later."""
        batch: list[int] = []
        deferred: list[int] = []
        seen: set[int] = set()
        for row in rows:
            keys = set(self.keys[row].tolist())
            if len(batch) < size and not keys & seen:
                batch.append(row)
                seen |= keys
            else:
                deferred.append(row)
        return batch, deferred


def token_budget_batches(lengths: np.ndarray, max_tokens: int, ladder: list[int]) -> list[np.ndarray]:
    """Prediction batches: example indices sorted by length (ties in input order), cut so that each
    batch's computed tokens (rows x its longest member's width on ``ladder``) stay within
    ``max_tokens``; a batch holds at least one example, however long. Deterministic, unlike
    ``BatchPlan``'s ``token_budget`` (no random first cut, no shuffle): prediction has no epochs.

    Args:
        lengths: ``[n]`` real tokens per example.

    Returns:
        index arrays, shortest examples first; together they hold every index once.
    """
    order = np.argsort(np.asarray(lengths), kind="stable")
    batches, start = [], 0
    for i, index in enumerate(order):
        width = bucket_width(ladder, int(lengths[index]))
        if i > start and (i - start + 1) * width > max_tokens:
            batches.append(order[start:i])
            start = i
    return [*batches, order[start:]] if len(order) else []
