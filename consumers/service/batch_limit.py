"""How many records one poll may take: max_poll_records, lowered when the measured cost per event says a
batch that size would not finish well inside max_poll_interval_ms.

A member that does not poll again within max_poll_interval_ms is dropped from the group and its batch's
transaction is fenced: the batch is redone elsewhere, and if every batch is too slow, forever. The service
measures seconds per event over its batches (an exponential moving average; a batch's fixed costs count
in, which only errs on the safe side) and asks for at most `budget_fraction` of the interval's worth.
"""

import logging
import math

log = logging.getLogger(__name__)


class BatchLimit:
    def __init__(
        self,
        max_poll_records: int,
        max_poll_interval_ms: int,
        budget_fraction: float = 0.25,
        smoothing: float = 0.2,
    ):
        if not 0.0 < budget_fraction <= 1.0:
            raise ValueError(f"budget_fraction = {budget_fraction!r}, expected a fraction in (0, 1]")
        self.max_poll_records = max_poll_records
        self.budget_s = max_poll_interval_ms / 1000.0 * budget_fraction
        self.smoothing = smoothing
        self.seconds_per_event: float | None = None  # unknown until the first batch
        self.records = max_poll_records

    def observe(self, events: int, seconds: float) -> int:
        """Record a processed batch; returns the records the next poll may take."""
        if events <= 0:
            return self.records
        cost = seconds / events
        if self.seconds_per_event is None:
            self.seconds_per_event = cost
        else:
            self.seconds_per_event += self.smoothing * (cost - self.seconds_per_event)
        fits = max(1, math.floor(self.budget_s / self.seconds_per_event)) if self.seconds_per_event else None
        records = self.max_poll_records if fits is None else min(self.max_poll_records, fits)
        if records != self.records:
            log.warning(
                "batch size limit records=%d (max_poll_records=%d): %.2f ms an event would otherwise take "
                "more than %.1f s of max_poll_interval_ms per batch",
                records, self.max_poll_records, 1000 * self.seconds_per_event, self.budget_s,
            )  # fmt: skip
            self.records = records
        return records
