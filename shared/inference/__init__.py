"""The scoring loop (torch): tokenized once, sorted by length, cut by a token budget (``loop``), at
the precision a prediction asks for (``precision``). Used by prediction jobs and the sync endpoint."""
