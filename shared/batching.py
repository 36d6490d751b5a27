"""Batch planning: which examples share a micro-batch, in which order. NumPy only (no torch), so
the API can plan a job (``POST /jobs?dry_run=true``) and the worker can train with the same code.

Smart batching (dynamic padding + uniform-length batching) follows the seed notebooks
(McCormick, "Smart Batching Tutorial"; Benesty, "Divide Hugging Face Transformers training time
by 2 or more"): sequences of similar length share a micro-batch, each is padded only to its
longest member, and the batch order is shuffled every epoch.
"""

import math

import numpy as np

STRATEGIES = ("fixed", "dynamic", "smart", "token_budget")


class BatchPlan:
    """The micro-batches (lists of example indices) of each epoch; iterating yields the current one's.

    Strategies:
        smart: sort by length (ties broken at random), cut into ``batch_size`` chunks starting at a
            random offset, shuffle the chunk order.
        token_budget: sorted the same way, but cut so that each micro-batch holds about
            ``max_tokens`` padded tokens (examples x longest length): short sequences ride in large
            batches and long ones in small batches. The first cut falls at a random fraction of the
            budget.
        dynamic, fixed: a random permutation cut into ``batch_size`` chunks (``fixed`` is padded to
            ``max_length`` by the collator).

    Each epoch's randomness comes from ``seed + epoch``: batch composition changes between epochs,
    and a given seed always gives the same plan, so a run resumes from (epoch, position) alone.
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
        rng = np.random.default_rng(self.seed + epoch)
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
        cuts, start = [0], 0
        budget = rng.uniform(0, self.max_tokens)  # a random first cut changes composition per epoch
        for i, length in enumerate(self.lengths[order]):
            if i > start and (i - start + 1) * int(length) > budget:
                cuts.append(i)
                start, budget = i, self.max_tokens
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

    def padding_efficiency(self, epoch: int = 0, max_length: int | None = None, multiple: int = 1) -> float:
        """Real tokens / padded tokens of an epoch's plan: batches padded to their longest member
        rounded up to ``multiple``, or to ``max_length`` when given (``fixed`` padding)."""
        real = padded = 0
        for batch in self.epoch_batches(epoch):
            lengths = self.lengths[batch]
            width = max_length or multiple * math.ceil(int(lengths.max()) / multiple)
            real += int(lengths.sum())
            padded += len(batch) * width
        return real / padded
