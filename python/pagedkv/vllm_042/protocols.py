"""What :class:`~pagedkv.BlockSpaceManager` reads from the sequences and groups it is given.

The manager is typed against these protocols, not against :class:`pagedkv.Sequence`, because it
takes any object with the same surface: pagedkv's own ``Sequence``/``SequenceGroup`` (the fast
path: it reads their native token store, ``seq.data._store``, directly) and vLLM's (it keeps a
native copy of their tokens, synced through the methods below). Both satisfy these protocols
without inheriting from them.
"""

from __future__ import annotations

from typing import List, Protocol
from typing import Sequence as Seq

__all__ = ["SequenceGroupLike", "SequenceLike", "StatusLike"]


class StatusLike(Protocol):
    """A ``SequenceStatus`` member: the manager goes by its name (``WAITING``, ``RUNNING``,
    ``SWAPPED``, ``FINISHED_*``), so pagedkv's and vLLM's enums both work."""

    @property
    def name(self) -> str:
        """The member's name."""
        ...


class SequenceLike(Protocol):
    """A sequence as the manager reads it.

    Besides these members, the manager reads when present: ``seq.data._store`` (pagedkv's native
    token store; without it, the tokens come from the methods below), ``lora_int_id`` and
    ``cache_salt`` (both enter the block hash).
    """

    @property
    def seq_id(self) -> int:
        """The sequence's id, unique among the sequences the manager holds tables for."""
        ...

    @property
    def status(self) -> StatusLike:
        """Which calls act on it: WAITING (``allocate``), RUNNING (``append_slots``,
        ``swap_out``), SWAPPED (``swap_in``), FINISHED_* (left out)."""
        ...

    def get_len(self) -> int:
        """Prompt plus output tokens."""
        ...

    def get_prompt_len(self) -> int:
        """Prompt tokens."""
        ...

    def get_token_ids(self) -> List[int]:
        """Prompt then output token ids."""
        ...

    def get_output_token_ids(self) -> Seq[int]:
        """Output token ids (read to sync tokens appended since the last call)."""
        ...


class SequenceGroupLike(Protocol):
    """A sequence group as the manager reads it: its sequences, in order (a ``seqs_dict``
    attribute, when present, is read instead of calling ``get_seqs``)."""

    def get_seqs(self) -> Seq[SequenceLike]:
        """The group's sequences, in order."""
        ...
