"""Padding efficiency of ``token_budget`` against ``smart`` batching at the same mean batch size.

For each corpus (BBC News @512, Rotten Tomatoes @128, WNUT-16 tweets @128; all-MiniLM-L6-v2
tokenizer), on all its texts and on a held-out 20% (seed 42), and for batch sizes 16 and 32:
``token_budget`` with ``max_tokens_per_batch = batch_size x mean real length`` (as the plan section
of ``bench.train`` sets it), its mean examples per micro-batch ``m``, and ``smart`` at batch size
``round(m)``; real / padded tokens (each micro-batch padded to its longest member), mean over 5
epochs. Token lengths only: no training.

    python -m bench.padding            # prints a Markdown table
"""

import argparse

import numpy as np
from transformers import AutoTokenizer

from bench import corpora
from shared.data.batching import BatchPlan
from shared.jobs.base_models import resolve_model

SETS = {
    "bbc": (corpora.bbc_news, "text", 512),
    "rotten_tomatoes": (corpora.rotten_tomatoes, "text", 128),
    "wnut16": (corpora.wnut16, "tokens", 128),
}


def lengths_of(name: str, tokenizer) -> np.ndarray:
    """Real tokens per text of corpus ``name`` (WNUT-16: its words, split into subwords)."""
    read, column, max_length = SETS[name]
    values = read()[column].tolist()
    encoded = tokenizer(values, truncation=True, max_length=max_length, is_split_into_words=column == "tokens")
    return np.array([len(ids) for ids in encoded["input_ids"]])


def efficiency(
    lengths: np.ndarray, batch_size: int, strategy: str, max_tokens: int | None = None, epochs: int = 5
) -> tuple[float, float]:
    """(real / padded tokens, mean examples per micro-batch) over ``epochs`` epochs of the plan."""
    plan = BatchPlan(lengths, batch_size, strategy, seed=42, max_tokens=max_tokens)
    rows = [(plan.padding_efficiency(e), len(lengths) / len(plan.epoch_batches(e))) for e in range(epochs)]
    return float(np.mean([r[0] for r in rows])), float(np.mean([r[1] for r in rows]))


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("all-MiniLM-L6-v2"))
    print("| set | texts | batch | token_budget | examples/micro-batch | smart at that batch size | smart at batch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in SETS:
        everything = lengths_of(name, tokenizer)
        held_out = everything[np.random.default_rng(42).permutation(len(everything))[: len(everything) // 5]]
        for part, lengths in (("all", everything), ("held-out 20%", held_out)):
            for batch_size in (16, 32):
                budget, mean_rows = efficiency(lengths, batch_size, "token_budget", int(batch_size * lengths.mean()))
                same, _ = efficiency(lengths, max(1, round(mean_rows)), "smart")
                smart, _ = efficiency(lengths, batch_size, "smart")
                print(
                    f"| {name} {part} | {len(lengths)} | {batch_size} | {budget:.4f} | {mean_rows:.1f} | {same:.4f} "
                    f"| {smart:.4f} |"
                )


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options: --help, then nothing
    main()
