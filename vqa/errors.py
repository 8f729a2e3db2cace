"""The one exception the data layer raises for bad data or bad data requests.

Every message names where the problem is (dataset, split, row index and id) so a
user can find the offending row without reading a traceback from deep inside
``datasets`` or PIL; the library error, when there is one, is chained as the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RowProblem:
    row_index: int
    row_id: str
    problem: str

    def __str__(self) -> str:
        return f"row {self.row_index} (id {self.row_id!r}): {self.problem}"


# Enough rows to show a pattern, few enough to keep the message readable.
_ROWS_SHOWN = 5


class VQADataError(ValueError):
    """A dataset, split, source or row that cannot be turned into VQA samples."""

    def __init__(
        self,
        problem: str,
        *,
        dataset: str,
        split: str | None = None,
        rows: Sequence[RowProblem] = (),
    ) -> None:
        self.problem = problem
        self.dataset = dataset
        self.split = split
        self.rows = tuple(rows)
        super().__init__(self._compose())

    @classmethod
    def for_rows(cls, dataset: str, split: str, rows: Sequence[RowProblem]) -> VQADataError:
        first = rows[0]
        return cls(first.problem, dataset=dataset, split=split, rows=rows)

    def _compose(self) -> str:
        where = self.dataset if self.split is None else f"{self.dataset}/{self.split}"
        if not self.rows:
            return f"[{where}] {self.problem}"
        shown = "; ".join(str(row) for row in self.rows[:_ROWS_SHOWN])
        hidden = len(self.rows) - _ROWS_SHOWN
        more = f"; and {hidden} more bad rows" if hidden > 0 else ""
        return f"[{where}] {shown}{more}"
