"""Texts cut before the tokenizer reads them."""


def head_words(texts: list[str], max_length: int) -> list[str]:
    """Each of ``texts`` cut before its ``2 * max_length + 1``-th whitespace-separated word (Python's
    ``str.split``), so that a tokenizer truncating to ``max_length`` tokens reads only what it keeps.
    A fast tokenizer normalizes and splits the whole of a text before it truncates: BBC News
    articles of about 400 words at ``max_length`` 128 were tokenized in about twice the time of
    their first 256 words.

    The tokens kept are the same, and a long text is still counted as truncated: every tokenizer
    tunejob loads (WordPiece, byte-level BPE, SentencePiece) splits on whitespace before anything
    else, so the words before a cut give the tokens they gave before, and each word gives at least
    one token. The factor 2 leaves room for "words" that give none (a lone control or zero-width
    character, which BERT's normalizer removes). Not for pairs: truncating a pair
    (``longest_first``) depends on the lengths of both texts.

    Args:
        texts: the texts, any length.
        max_length: the tokens a text is truncated to (special tokens included), >= 1.

    Returns:
        The texts in order; each a prefix of its text (the text itself when it has at most
        ``2 * max_length`` words).
    """
    words = 2 * max_length
    # ``words + 1`` words take at least ``2 * words + 1`` characters: shorter texts need no split
    return [t if len(t) <= 2 * words else _head(t, words) for t in texts]


def _head(text: str, words: int) -> str:
    parts = text.split(None, words)  # the words, and the rest of the text unsplit
    return text if len(parts) <= words else text[: len(text) - len(parts[-1])]
