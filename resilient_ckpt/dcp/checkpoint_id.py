"""The iteration a DCP ``checkpoint_id`` names.

The store keys checkpoints by training iteration (an int that only grows), while DCP hands a
storage layer an opaque ``checkpoint_id`` — usually a directory such as torchtitan's
``<folder>/step-100``. The rule, the same for saving and loading:

- an ``int`` (not a ``bool``) >= 0 is the iteration itself;
- a ``str`` or ``os.PathLike``: the digits at the end of its last path component, so
  ``"step-100"``, ``"/ckpt/step-100/"``, ``"iter_0000100"`` and ``"100"`` all name 100;
- anything else (``"latest"``, ``"step-100.tmp"``, ``-1``, ``""``) is a ValueError that says so.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import ValidationError

__all__ = ["iteration_from_checkpoint_id", "is_iteration_id"]

_TRAILING_DIGITS = re.compile(r"(\d+)$")
#: The store's iteration range (a signed 64-bit value, as the manager checks).
_MAX_ITERATION = (1 << 63) - 1


def iteration_from_checkpoint_id(checkpoint_id: Any) -> int:
    """The iteration ``checkpoint_id`` names (see the module docstring for the rule).

    Raises ValidationError (a ValueError) naming the id and the accepted forms.
    """
    if isinstance(checkpoint_id, bool):
        raise ValidationError(
            f"checkpoint_id {checkpoint_id!r} is a bool; pass the training step as an int "
            "or a name ending in it, e.g. '.../step-100'"
        )
    if isinstance(checkpoint_id, int):
        iteration = checkpoint_id
    elif isinstance(checkpoint_id, (str, os.PathLike)):
        iteration = _from_name(os.fspath(checkpoint_id))
    else:
        raise ValidationError(
            f"checkpoint_id must be an int, a str or a path, got {type(checkpoint_id).__name__}; "
            "pass the training step, e.g. 100 or '.../step-100'"
        )
    if not 0 <= iteration <= _MAX_ITERATION:
        raise ValidationError(
            f"checkpoint_id {checkpoint_id!r} names iteration {iteration}, outside [0, 2**63-1]; "
            "pass the training step (0 or more)"
        )
    return iteration


def is_iteration_id(checkpoint_id: Any) -> bool:
    """Whether :func:`iteration_from_checkpoint_id` accepts ``checkpoint_id``."""
    try:
        iteration_from_checkpoint_id(checkpoint_id)
    except ValidationError:
        return False
    return True


def _from_name(name: Any) -> int:
    if isinstance(name, bytes):  # os.fspath of a bytes path
        name = name.decode(errors="replace")
    last = name.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    match = _TRAILING_DIGITS.search(last)
    if match is None:
        raise ValidationError(
            f"checkpoint_id {name!r} does not end in digits: the in-memory store keys checkpoints "
            "by training iteration, taken from the digits at the end of the id's last path "
            "component. Pass an int or a name ending in the step, e.g. '.../step-100'"
        )
    return int(match.group(1))
