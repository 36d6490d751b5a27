"""Throughput and padding of ``shared.inference.embed.embed_texts`` on BBC News (every title, the
article's first line: short texts, or every whole article) or on one prediction part of
``bench.predict``'s short texts (4,096 texts of 3-12 words, as in its embedding prediction job), in
this process (start one per run, so that each starts cold). ``--embed FILE`` times another version
of the module, e.g. the previous commit's (``git show HEAD~:shared/inference/embed.py >
/tmp/old_embed.py``), on the same texts.

    python -m bench.embed_throughput --texts titles
    python -m bench.embed_throughput --texts articles --max-length 128 --embed /tmp/old_embed.py

Prints one JSON object: texts/s and process CPU seconds (the figure that other work on the machine
inflates least) of the ``embed_texts`` call (after an untimed warm-up on 8 texts),
real tokens after truncation, the tokens the model's forward passes received (padding included,
counted by a hook) and ``padded_tokens`` as reported, and their ratio (padding efficiency).
"""

import argparse
import importlib.util
import json
import time

import torch

from bench.corpora import bbc_news
from bench.predict import short_texts
from bench.retrieval import title_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", choices=["titles", "articles", "short"], default="titles")
    parser.add_argument("--max-length", type=int, default=None, help="tokens (default: the model's limit)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--embed", default="shared/inference/embed.py", help="the embed module's file to time")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    spec = importlib.util.spec_from_file_location("embed_under_test", args.embed)
    assert spec is not None and spec.loader is not None
    embed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(embed)
    from shared.jobs.base_models import available_models

    if args.texts == "short":
        texts = short_texts(4096)  # the worker embeds a prediction's rows one part (4,096 rows) at a time
    else:
        texts = title_pairs()["anchor"].tolist() if args.texts == "titles" else bbc_news()["text"].tolist()
    loaded = embed.load_embedder(available_models()[args.model][0], torch.device("cpu"))
    limit = args.max_length or loaded.max_length
    real = sum(min(len(ids), limit) for ids in loaded.model.tokenizer(texts)["input_ids"])
    embed.embed_texts(loaded, texts[:8], max_length=args.max_length, batch_size=args.batch_size)  # warm-up
    computed = []
    hook = loaded.model.register_forward_pre_hook(lambda _, a: computed.append(a[0]["input_ids"].numel()))
    began, cpu = time.perf_counter(), time.process_time()
    got = embed.embed_texts(loaded, texts, max_length=args.max_length, batch_size=args.batch_size)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    hook.remove()
    print(
        json.dumps(
            {
                "embed": args.embed,
                "texts": len(texts),
                "kind": args.texts,
                "max_length": limit,
                "batch_size": args.batch_size,
                "threads": torch.get_num_threads(),
                "seconds": round(seconds, 2),
                "texts_per_second": round(len(texts) / seconds, 1),
                "cpu_seconds": round(cpu, 2),
                "real_tokens": real,
                "computed_tokens": sum(computed),
                "padded_tokens": got.padded_tokens,
                "padding_efficiency": round(real / sum(computed), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
