"""The exceptions pagedkv raises.

Every error derives from :class:`PagedKVError` and also from the builtin that vLLM-style code
already catches, so ``except KeyError`` or ``except ValueError`` keeps working:

====================== ==========================================
class                  also a
====================== ==========================================
InvalidArgumentError   ValueError
UnknownSequenceError   KeyError
DoubleFreeError        ValueError
OutOfBlocksError       ValueError (what vLLM raises) and MemoryError
ArgumentTypeError      InvalidArgumentError and TypeError
InUseError             RuntimeError
UnsupportedVLLMError   ImportError
====================== ==========================================

An operation that raises one of these has changed nothing.
"""

from __future__ import annotations

__all__ = [
    "PagedKVError",
    "InvalidArgumentError",
    "UnknownSequenceError",
    "DoubleFreeError",
    "OutOfBlocksError",
    "ArgumentTypeError",
    "InUseError",
    "UnsupportedVLLMError",
]


class PagedKVError(Exception):
    """Base class of every pagedkv error."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument breaks a precondition (bad id, wrong length, wrong type or state)."""


class UnknownSequenceError(PagedKVError, KeyError):
    """The manager has no block table for this sequence id."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class DoubleFreeError(PagedKVError, ValueError):
    """A block was freed while its reference count was already zero."""


class OutOfBlocksError(PagedKVError, ValueError, MemoryError):
    """Not enough free blocks on a device for the requested operation."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (also a TypeError)."""


class InUseError(PagedKVError, RuntimeError):
    """A native object (a manager, a pool, a token store) is in the middle of another call: a
    second thread called it concurrently, or a Python callback it made (a foreign sequence's
    ``get_token_ids``, say) called back into it. Nothing was changed; each object serves one
    call at a time and never blocks waiting for another."""


class UnsupportedVLLMError(PagedKVError, ImportError):
    """``pagedkv.vllm_v1`` was used with a vLLM release it does not support (or without vLLM)."""
