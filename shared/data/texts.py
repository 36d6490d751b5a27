"""Texts cut before the tokenizer reads them."""

CHARS_PER_WORD = 100  # WordPiece's longest word (``max_input_chars_per_word``): any real word is shorter


def head_words(texts: list[str], max_length: int) -> list[str]:
    """Each of ``texts`` cut before its ``2 * max_length + 1``-th whitespace-separated word (Python's
    ``str.split``), and at ``CHARS_PER_WORD`` characters a word, so that a tokenizer truncating to
    ``max_length`` tokens reads little more than what it keeps. A fast tokenizer normalizes and
    splits the whole of a text before it truncates, so its time grew with the whole text (long
    articles, and a huge query to ``/rerank``, tokenized with each of its documents: figures in
    docs/benchmarks.md, "Measurements behind the defaults").

    A single text keeps its tokens, and a long one is still counted as truncated: every tokenizer
    tunejob loads (WordPiece, byte-level BPE, SentencePiece) splits on whitespace before anything
    else, so the words before a cut give the tokens they gave before, and each word gives at least
    one token. The factor 2 leaves room for "words" that give none (a lone control or zero-width
    character, which BERT's normalizer removes). A pair (``longest_first`` truncation) keeps its
    tokens too, except where both texts are longer than half of ``max_length``: the tokenizer then
    gives the longer text one token more than the other, and the cut may change which is longer.
    Only a text of more than ``CHARS_PER_WORD`` characters a word (no whitespace: base64, a
    dump) may lose tokens within ``max_length`` at the character cut.

    Args:
        texts: the texts, any length.
        max_length: the tokens a text (or a pair) is truncated to, special tokens included, >= 1.

    Returns:
        The texts in order; each a prefix of its text (the text itself when it has at most
        ``2 * max_length`` words and characters within the cap).
    """
    words = 2 * max_length
    # ``words + 1`` words take at least ``2 * words + 1`` characters: shorter texts need no split
    return [t if len(t) <= 2 * words else _head(t[: CHARS_PER_WORD * words], words) for t in texts]


def _head(text: str, words: int) -> str:
    parts = text.split(None, words)  # the words, and the rest of the text unsplit
    return text if len(parts) <= words else text[: len(text) - len(parts[-1])]
