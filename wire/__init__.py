"""The frontend <-> worker wire protocol (``specs/wire.cddl``): frames, framing, and the
sampling contract both sides build and read (``SamplingParams``).

Imported by both ``lifecycle`` and ``gpu``; depends on neither.
"""

from wire import (
    auth,
    embed,
    frames,
    framing,
    grammar,
    options,
    reasoning_budget,
    sampling,
    stats,
)
from wire.auth import *  # noqa: F403
from wire.embed import *  # noqa: F403
from wire.frames import *  # noqa: F403  (each module's __all__ is the package's)
from wire.framing import *  # noqa: F403
from wire.grammar import *  # noqa: F403
from wire.options import *  # noqa: F403
from wire.reasoning_budget import *  # noqa: F403
from wire.sampling import *  # noqa: F403
from wire.stats import *  # noqa: F403

__all__ = [
    *auth.__all__,
    *embed.__all__,
    *frames.__all__,
    *framing.__all__,
    *grammar.__all__,
    *options.__all__,
    *reasoning_budget.__all__,
    *sampling.__all__,
    *stats.__all__,
]
