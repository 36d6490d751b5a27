"""Packed (padding-free) micro-batches: the examples of a micro-batch laid end to end as one row.

A padded micro-batch ``[rows, width]`` computes ``rows x width`` tokens and passes a padding mask to
attention, which rules out the flash kernel. Packed, the same examples are ``[1, tokens]`` with
position ids restarting at each example, and attention runs per example on a variable-length
kernel over ``cu_seqlens`` (the cumulative example lengths, as FlashAttention's
``flash_attn_varlen_func`` takes them): no token attends across examples, none is padding, and
no mask is built. The classifier reads each example's first token (``cls_index``); token
classification reads every token. Equal, up to float rounding, to the padded step in loss and
gradients (``tests/test_packing.py``).

Sources: Krell et al., "Efficient Sequence Packing without Cross-contamination" (arXiv
2107.02027); transformers' ``DataCollatorWithFlattening`` (PR #31629), whose two traps are
avoided here: its bidirectional mask ignores packed position ids (here no mask is built; attention
is split by ``cu_seqlens`` alone), and RoBERTa's positions start at ``padding_idx + 1`` (added
here, ``position_offset``).

Attention (``packed_attention``, registered with transformers' ``AttentionInterface`` as
``PACKED_ATTENTION``): on CUDA in fp16/bf16, PyTorch's flash kernel over ``cu_seqlens``
(``aten._flash_attention_forward``, differentiable, with attention dropout); elsewhere SDPA over a
nested (jagged) tensor, one sequence per example, which keeps dropout too.
"""

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

PACKED_ATTENTION = "tunejob_packed"
# Model families whose encoder takes position_ids and dispatches attention through transformers'
# AttentionInterface, with the classification head they put on the first token. RoBERTa-style
# positions start at padding_idx + 1.
HEADS = {"bert": "pooler", "roberta": "features", "xlm-roberta": "features", "camembert": "features"}
POSITION_OFFSET_FAMILIES = {"roberta", "xlm-roberta", "camembert"}


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention within each packed example, for transformers' ``AttentionInterface``.

    Args:
        module: the attention module (unused: transformers passes it to every attention function).
        query: ``[1, heads, tokens, head_dim]`` (the packed row).
        key: as ``query``.
        value: as ``query``.
        attention_mask: must be None (packed rows have no padding mask).
        dropout: attention dropout probability (transformers passes 0.0 in eval mode).
        scaling: softmax scale (None: ``1/sqrt(head_dim)``).
        cu_seq_lens_q: ``[examples + 1]`` int32 cumulative lengths, 0 first and ``tokens`` last.
        max_length_q: the longest example, in tokens (an upper bound will do).

    Returns:
        (``[1, tokens, heads, head_dim]``, None): the layout transformers' attention functions return.

    Raises:
        ValueError: no ``cu_seq_lens_q``, or a mask was passed (the model was not given a packed batch).
    """
    if cu_seq_lens_q is None or attention_mask is not None:
        raise ValueError("packed attention needs cu_seq_lens_q and no attention mask")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, dropout, False, False, scale=scaling
        )[0]
    else:
        nested = [torch.nested.nested_tensor_from_jagged(t, cu_seq_lens_q.long()).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*nested, dropout_p=dropout, scale=scaling).transpose(1, 2).values()
    return out[None], None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
# SDPA on jagged nested tensors on the CPU warns about the prototype strided layout it builds inside
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")


def padded_reason(model: torch.nn.Module, torch_compile: bool, gradient_checkpointing: bool) -> str | None:
    """Why a job that asked for ``packing`` trains on padded micro-batches all the same, or None
    when it can be packed.

    Args:
        model: the job's model (its family decides, ``unsupported_reason``).
        torch_compile: the job's setting of that name.
        gradient_checkpointing: the job's setting of that name.
    """
    if torch_compile:
        return "torch_compile traces the padded model"
    if gradient_checkpointing:
        return "gradient_checkpointing recomputes the padded layers"
    return unsupported_reason(model)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot train on packed micro-batches, or None when it can: its family must
    take position ids and dispatch attention through ``AttentionInterface`` (``HEADS``); a model
    that is not a transformers one (an embedding job's ``worker.embedding.Objective``) cannot."""
    if getattr(model, "config", None) is None:
        return f"{type(model).__name__} is not a transformers classifier: it has no packed path"
    family = model.config.model_type
    if family not in HEADS:
        return f"{type(model).__name__} ({family}) has no packed attention path"
    return None


@contextlib.contextmanager
def packed_mode(model: torch.nn.Module) -> Iterator[None]:
    """Within: ``model``'s attention runs ``packed_attention`` (its config's attention
    implementation switched, then restored: evaluation and the saved config keep SDPA)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def pack(batch: dict[str, torch.Tensor], position_offset: int = 0, token_labels: bool = False) -> dict:
    """A padded micro-batch as one packed row (on the host, in NumPy: no device work, and about ten
    times cheaper than torch's boolean indexing of small CPU tensors).

    Args:
        batch: ``input_ids``, ``attention_mask`` (1 = real token, real tokens first in each row)
            and optionally ``token_type_ids``, each ``[n, width]`` on the CPU, and ``labels``:
            ``[n]``, ``[n, labels]`` (multi_label) or, with ``token_labels``, ``[n, width]`` (-100 on padding).
        position_offset: added to every position id (``padding_idx + 1`` for RoBERTa families).
        token_labels: the labels are per token (token_classification).

    Returns:
        ``input_ids``, ``position_ids`` and (if given) ``token_type_ids`` ``[1, tokens]`` int64;
        ``cu_seq_lens_q`` ``[n + 1]`` int32; ``cls_index`` ``[n]`` (each example's first token);
        ``labels`` as given, or ``[1, tokens]`` with ``token_labels``; ``max_length_q``, the
        longest example in tokens (an int: the kernel sizes its grid by it, with no device read).
    """
    mask = batch["attention_mask"].numpy().astype(bool)
    lengths = mask.sum(1)
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    starts = cu[:-1].astype(np.int64)
    positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(starts, lengths) + position_offset
    out = {
        "input_ids": batch["input_ids"].numpy()[mask][None],
        "position_ids": positions[None],
        "cu_seq_lens_q": cu,
        "cls_index": starts,
    }
    if "token_type_ids" in batch:
        out["token_type_ids"] = batch["token_type_ids"].numpy()[mask][None]
    if token_labels:
        out["labels"] = batch["labels"].numpy()[mask][None]
    out = {k: torch.from_numpy(v) for k, v in out.items()}
    out.setdefault("labels", batch["labels"])
    out["max_length_q"] = int(lengths.max()) if len(lengths) else 0
    return out


PACKED = "packed"  # the key of a collated micro-batch's packed layout (``PackingCollator``)


class PackingCollator:
    """The job's collator (``worker.data.BucketCollator``), each padded micro-batch with its packed
    layout (``pack``) under ``PACKED``: built where the padded one is, in the DataLoader's workers
    (``dataloader_num_workers``) and pinned by its pin-memory thread on CUDA, so that the training
    thread only copies it to the device while the GPU runs the previous micro-batch.

    The padded tensors stay beside it: token counts, out-of-memory splits and the captured steps'
    shapes read them on the host, and are never copied to the device.

    Args:
        collator: the padded collator (a callable over a list of features).
        position_offset: as ``pack``'s.
        token_labels: as ``pack``'s (token_classification).
    """

    def __init__(self, collator: Callable[[list[dict]], dict], position_offset: int, token_labels: bool):
        self.collator, self.position_offset, self.token_labels = collator, position_offset, token_labels

    def __call__(self, features: list[dict]) -> dict:
        batch = self.collator(features)
        batch[PACKED] = pack(batch, self.position_offset, self.token_labels)
        return batch


def packed_of(batch: dict, position_offset: int, token_labels: bool) -> dict:
    """The packed layout of a padded micro-batch: the one its collator built (``PackingCollator``),
    else ``pack``'s now (a piece of an out-of-memory split, a sample read from the plan ahead of
    training)."""
    return batch[PACKED] if PACKED in batch else pack(batch, position_offset, token_labels)


def token_bucket(real: int, examples: int, rows: int, max_length: int) -> int:
    """The tokens of a captured packed micro-batch (``pack_fixed``) that holds ``examples`` of
    ``real`` tokens in all, for graphs of ``rows`` rows: a multiple of the bucket size (at least
    ``max_length``; about a sixteenth of ``rows x max_length``), with room for a one-token filler
    sequence per missing row and for the tail of filler tokens in pieces of at most ``max_length``.
    Few buckets per job, so few captures; the same for every job of that shape."""
    size = max(max_length, 2 ** math.ceil(math.log2(max(1, rows * max_length / 16))))
    need = real + rows - examples
    tokens = max(size, math.ceil(need / size) * size)
    while tokens < need + math.ceil(tokens / max_length):
        tokens += size
    return tokens


def pack_fixed(
    packed: dict, rows: int, tokens: int, max_length: int, position_offset: int, pad_id: int, token_labels: bool = False
) -> dict:
    """A packed micro-batch (``pack``'s layout) in the fixed layout a captured graph reads: exactly
    ``tokens`` tokens, ``rows`` sequences read by the classifier and ``ceil(tokens / max_length)``
    filler sequences after them.

    The ``n`` examples come first; then ``rows - n`` filler rows of one pad token each (loss weight
    0, as ``capture.with_filler_rows``); then the remaining tokens as filler sequences of at most
    ``max_length`` tokens, so that every sequence fits the kernel's ``max_length_q`` and no token
    is left outside one (the flash kernel leaves such tokens' outputs unwritten).

    Returns:
        ``pack``'s tensors at these fixed shapes (``input_ids``, ``position_ids``,
        ``token_type_ids`` if given, ``labels`` ``[1, tokens]``: ``[1, tokens]``; ``cu_seq_lens_q``
        ``[rows + ceil(tokens / max_length) + 1]``; ``cls_index``, ``weights`` (1.0 real, 0.0
        filler) and per-row ``labels``: ``[rows]``), and ``max_length_q`` = ``max_length``.

    Raises:
        ValueError: the batch does not fit ``rows`` and ``tokens`` (``token_bucket``).
    """
    n, real = len(packed["cls_index"]), packed["input_ids"].shape[1]
    pieces = math.ceil(tokens / max_length)
    tail = tokens - real - (rows - n)
    if n > rows or tail < pieces:
        raise ValueError(f"{n} examples of {real} tokens do not fit {rows} rows and {tokens} tokens")
    tail_lengths = [len(part) for part in np.array_split(np.arange(tail), pieces)]
    lengths = np.concatenate([np.diff(packed["cu_seq_lens_q"].numpy()), np.ones(rows - n, np.int64), tail_lengths])
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    starts = cu[:-1].astype(np.int64)
    positions = np.arange(tokens, dtype=np.int64) - np.repeat(starts, lengths) + position_offset
    filler = tokens - real
    out = {
        "input_ids": torch.cat([packed["input_ids"], torch.full((1, filler), pad_id)], 1),
        "position_ids": torch.from_numpy(positions[None]),
        "cu_seq_lens_q": torch.from_numpy(cu),
        "cls_index": torch.from_numpy(starts[:rows]),
        "weights": torch.cat([torch.ones(n), torch.zeros(rows - n)]),
    }
    if "token_type_ids" in packed:
        out["token_type_ids"] = torch.cat([packed["token_type_ids"], torch.zeros(1, filler, dtype=torch.long)], 1)
    labels = packed["labels"]
    if token_labels:
        out["labels"] = torch.cat([labels, torch.full((1, filler), -100)], 1)
    else:
        out["labels"] = torch.cat([labels, torch.zeros(rows - n, *labels.shape[1:], dtype=labels.dtype)])
    out["max_length_q"] = max_length
    return out


def bucket_counts(plan, rows: int, max_length: int, epochs: float) -> dict[int, int]:
    """How many micro-batches of the first ``ceil(epochs)`` epochs of ``plan``
    (``shared.data.batching.BatchPlan``) fall in each ``token_bucket``: the shapes a packed job's
    graphs are captured for."""
    counts: dict[int, int] = {}
    for epoch in range(max(1, math.ceil(epochs))):
        for batch in plan.epoch_batches(epoch):
            bucket = batch_bucket(plan.lengths, batch, rows, max_length)
            counts[bucket] = counts.get(bucket, 0) + 1
    return dict(sorted(counts.items()))


def batch_bucket(lengths: np.ndarray, batch: np.ndarray, rows: int, max_length: int) -> int:
    """The ``token_bucket`` of a planned micro-batch: ``batch`` indexes the examples' real token
    counts ``lengths``."""
    return token_bucket(int(lengths[batch].sum()), len(batch), rows, max_length)


def position_offset(model: torch.nn.Module) -> int:
    """The first position id of an example: ``padding_idx + 1`` in RoBERTa families, else 0."""
    if model.config.model_type in POSITION_OFFSET_FAMILIES:
        return model.config.pad_token_id + 1
    return 0


def packed_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    """The model's logits on a packed micro-batch (``pack``, on the model's device).

    Returns:
        ``[n, classes]`` (one row per example, read at ``cls_index``), or for token_classification
        ``[1, tokens, tags]``.
    """
    encoder = model.base_model
    kwargs = {k: inputs[k] for k in ("input_ids", "position_ids", "token_type_ids") if k in inputs}
    with packed_mode(model):
        hidden = encoder(
            **kwargs, cu_seq_lens_q=inputs["cu_seq_lens_q"], max_length_q=inputs["max_length_q"], return_dict=True
        ).last_hidden_state  # [1, tokens, hidden]
    if task == "token_classification":
        return model.classifier(model.dropout(hidden))
    first = hidden[0, inputs["cls_index"]][:, None]  # [n, 1, hidden]: a one-token sequence per example
    if HEADS[model.config.model_type] == "pooler":  # BERT: pooler, dropout, classifier
        return model.classifier(model.dropout(encoder.pooler(first)))
    return model.classifier(first)  # RoBERTa: its head reads features[:, 0]
