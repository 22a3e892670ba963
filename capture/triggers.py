"""When a snapshot is taken during generation: every N tokens, at given counts, on a condition,
and at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvformat.errors import InvalidArgumentError


@dataclass(frozen=True)
class Triggers:
    """``every``: after every N generated tokens; ``at``: at these generated-token counts;
    ``when``: whenever it returns True for a response; ``final``: after the last token."""

    every: int | None = None
    at: frozenset[int] = field(default_factory=frozenset)
    when: Callable[[Any], bool] | None = None
    final: bool = True

    @classmethod
    def of(
        cls,
        every: int | None = None,
        at: Iterable[int] = (),
        when: Callable[[Any], bool] | None = None,
        final: bool = True,
    ) -> Triggers:
        if every is not None and (not isinstance(every, int) or every < 1):
            raise InvalidArgumentError(f"every must be a positive number of tokens, got {every!r}")
        counts = frozenset(int(n) for n in at)
        if any(n < 1 for n in counts):
            raise InvalidArgumentError(f"'at' counts must be positive, got {sorted(counts)}")
        return cls(every, counts, when, final)

    def due(self, generated: int, response: Any, is_final: bool) -> bool:
        """Whether a snapshot is taken after ``generated`` tokens."""
        return bool(
            (self.every and generated % self.every == 0)
            or generated in self.at
            or (self.when is not None and self.when(response))
            or (self.final and is_final)
        )
