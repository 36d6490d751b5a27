"""``POST /v1/embeddings`` in OpenAI's shapes (``client.embeddings.create`` of the ``openai`` SDK),
over the same model lookup and encoder as ``POST /models/{job_id}/embed``."""

import base64
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Text = Annotated[str, Field(min_length=1)]  # OpenAI refuses an empty text ("'$.input' is invalid")


class EmbeddingCreate(BaseModel):
    """OpenAI's request. ``model``: an embedding job's id or fine-tuned model name, or a base model's
    name. ``input``: a text or a list of texts (token arrays are refused). ``dimensions``, when
    given, must be the model's own (no truncation)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: Text | Annotated[list[Text], Field(min_length=1)] = Field(
        description="a non-empty text or a list of them; at most max_sync_inputs (default 64)"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32 (encoding_format)")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def embedding_list(model: str, vectors: np.ndarray, tokens: int, encoding_format: str) -> EmbeddingList:
    """The response for ``vectors`` ``[texts, dimensions]`` (float32): each as floats, or as base64
    of its little-endian float32 bytes, which the SDK decodes (its default format)."""

    def encode(vector: np.ndarray) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()

    return EmbeddingList(
        data=[Embedding(index=i, embedding=encode(v)) for i, v in enumerate(vectors)],
        model=model,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
