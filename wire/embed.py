"""The embed request (``specs/wire.cddl`` ``embed-options``): one definition both sides read.

A SUBMIT entry whose options carry ``"embed"`` asks for the prompt's final hidden state
(after the model's final norm), pooled over the prompt, instead of generated tokens: the
worker runs its prefill only, samples nothing, keeps no KV for it afterwards, and ends it
with one STEP entry whose finish is ``["embed", dimensions]`` and whose extra carries
``"embedding"`` (f32s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["POOLINGS", "EmbedOptions"]

POOLINGS = ("last", "mean")  # the last prompt position, or the mean over every position


@dataclass(frozen=True, slots=True)
class EmbedOptions:
    pooling: str = "last"
    normalize: bool = True  # L2: the vector has norm 1 (cosine similarity is a dot product)

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {self.pooling!r}.")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}.")

    def to_wire(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "normalize": self.normalize}

    @classmethod
    def from_wire(cls, v: Any) -> EmbedOptions:
        """Read the ``embed`` option; ``ValueError`` carries a message for REQ-ERROR.
        Absent keys take their defaults; unknown keys are ignored (as in every map)."""
        if not isinstance(v, dict):
            raise ValueError("embed must be a map")
        pooling = v.get("pooling", "last")
        normalize = v.get("normalize", True)
        return cls("last" if pooling is None else pooling, True if normalize is None else normalize)
