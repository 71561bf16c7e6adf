"""What ingest says of its input: the report of rows read, written and set aside, each problem with its
first rows, and the error that carries a report when nothing could be written."""

from dataclasses import dataclass
from pathlib import Path

from pipeline.data.dataset import QUARANTINE_FILE


@dataclass(frozen=True)
class Problem:
    title: str  # e.g. "negative amount"
    column: str  # e.g. "TX_AMOUNT -> amount"
    rows: int
    examples: tuple[str, ...]  # the first rows, each naming file, row, column, value and what was expected


@dataclass(frozen=True)
class IngestReport:
    input: str
    input_format: str
    rows_read: int = 0
    rows_written: int = 0
    rows_quarantined: int = 0
    rows_invalid: int = 0  # rows with at least one problem
    problems: tuple[Problem, ...] = ()
    out: str | None = None

    def format(self) -> str:
        head = f"{self.input} ({self.input_format}): {self.rows_read} rows read, {self.rows_written} written"
        if self.rows_quarantined:
            head += f", {self.rows_quarantined} quarantined in {Path(self.out or '.') / QUARANTINE_FILE}"
        return "\n".join([head, *self.problem_lines()])

    def problem_lines(self) -> list[str]:
        lines = []
        for p in self.problems:
            lines.append(f"  {p.title} ({p.column}): {p.rows} row{'s' if p.rows != 1 else ''}")
            lines += [f"    {example}" for example in p.examples]
            if p.rows > len(p.examples) > 0:
                lines.append(f"    ... and {p.rows - len(p.examples)} more")
        return lines


class IngestError(Exception):
    """Input that cannot be ingested as asked; str() is the summary for a person, `report` the details."""

    def __init__(self, message: str, report: IngestReport):
        super().__init__(message)
        self.report = report


__all__ = ["IngestError", "IngestReport", "Problem"]
