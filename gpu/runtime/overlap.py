"""Overlapped steps: a step's sampled tokens left on the device until the next step is
launched (``Engine.step``; docs/worker.md, "Overlapped steps").

A row flies when nothing the host does before the next step needs its token's value; it
then holds a placeholder as its last token (``Sequence.future``: the token's index in the
step's sampled tokens), which the next step's input reads on the device
(``StepInput.future``), and which ``land`` replaces once the host reads the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpu.kernels.host import HostInts
from gpu.runtime.sampling import sample_plain
from gpu.runtime.scheduler import Sequence
from wire.worker_options import OVERLAP_MODES

__all__ = ["InFlight", "flies", "fly", "land", "overlap_on"]

PLACEHOLDER = 0  # a valid id, never read: the device fills the row from the step's tokens


def overlap_on(mode: str, device: torch.device) -> bool:
    """Whether steps overlap: ``--overlap`` on, or auto on a CUDA device (on the CPU
    nothing runs ahead of the host, so overlap only costs there)."""
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def flies(seq: Sequence) -> bool:
    """Whether a row's token may stay unread until the next step is launched: no grammar
    matcher to advance, no penalty, bias or EOG mask over its output, no forks to make,
    no logprobs or hidden states to gather, no end of its reasoning to force in its place
    (the next step would read the sampled token on the device)."""
    o = seq.options
    return (
        seq.plain
        and seq.matcher is None
        and not seq.forks
        and not o.return_logprob
        and not o.return_hidden_states
        and (seq.budget is None or not seq.budget.forcing)
    )


@dataclass(slots=True)
class InFlight:
    """A step's samplers and their tokens, which the host has not read."""

    samplers: list[Sequence]
    tokens: HostInts  # for the host: ``NON_FINITE`` where a row's logits were not
    on_device: Tensor  # for the next step's input: valid ids on every row


def fly(samplers: list[Sequence], logits: Tensor) -> InFlight:
    """Sample ``samplers`` (every one ``flies``) on the device; each holds a placeholder."""
    tokens, marked = sample_plain(logits, samplers)
    for k, seq in enumerate(samplers):
        seq.tokens.append(PLACEHOLDER)
        seq.future = k
    return InFlight(samplers, HostInts(marked), tokens)


def land(flight: InFlight) -> list[int]:
    """Read the tokens (waiting for their copy alone); the placeholders go, and the
    caller appends each token as a synchronous step's would be."""
    for seq in flight.samplers:
        seq.future = None
        seq.tokens.pop()
    return flight.tokens.tolist()
