"""What a generate call asks of the process around it: ``CallHost``, which
``lifecycle.core.frontend.Frontend`` implements and ``lifecycle.core.call`` uses (its
admission, codec and tokenizer, a ready worker link, and the registry's open / close
notices)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from lifecycle.core.buffers import AdmissionQueue
from lifecycle.core.detok import TextCodec, TokenizerLike
from lifecycle.core.fsm import RequestRecord
from lifecycle.core.ports import WorkerLink
from lifecycle.core.reasoning import ReasoningFormat

if TYPE_CHECKING:
    from lifecycle.core.call import GenerateCall

__all__ = ["CallHost"]


class CallHost(Protocol):
    """What a call asks of the process around it (``lifecycle.core.frontend.Frontend``)."""

    @property
    def admission(self) -> AdmissionQueue: ...

    @property
    def codec(self) -> TextCodec: ...

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def model_config(self) -> Any: ...

    @property
    def output_margin(self) -> int: ...

    @property
    def weight_version(self) -> str: ...

    @property
    def reasoning(self) -> ReasoningFormat | None: ...

    def dp_rank(self, client: WorkerLink) -> int | None: ...

    def ready_client(self, prompt: Sequence[int] | None = None) -> WorkerLink: ...

    def opened(self, rec: RequestRecord, call: GenerateCall) -> None: ...

    def worker_released(self, rec_id: int) -> None: ...

    def closed(self, call: GenerateCall) -> None: ...
