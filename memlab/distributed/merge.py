"""Per-rank reports merged into one table: every rank's value per line (or per statistic), the
highest and lowest rank and the skew between them, and which ranks reported at all.

Plain Python on plain data: the reports are what :func:`memlab.distributed.gather.rank_report`
builds on each rank (picklable, JSON-able), so this module never needs ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memlab._units import format_size
from memlab.line_profiler.export import records_from_data

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "FORMAT",
    "LINES",
    "STATS",
    "MergedLines",
    "MergedStats",
    "RankReport",
    "merge_reports",
]

#: ``format`` of a rank's report; ``kind`` is :data:`LINES` or :data:`STATS`.
FORMAT = "memlab.rank_report/1"
LINES = "lines"
STATS = "stats"
#: A rank's ``status``: it sent numbers, it profiled nothing (no profiled call ran), it raised.
STATUSES = ("profiled", "empty", "error")
#: The tracker statistics a :data:`STATS` report carries, in bytes.
STAT_FIELDS = ("allocated_peak", "reserved_peak", "allocated_current", "reserved_current")


@dataclass
class RankReport:
    """What one rank sent: ``status`` (one of :data:`STATUSES`), ``error`` (the exception it
    reported, as ``"Type: message"``, for ``"error"``), ``source`` (where its numbers come from)
    and ``data`` (its line records or statistics; ``None`` when it has none)."""

    rank: int
    status: str
    error: str | None = None
    source: str | None = None
    data: Any = field(default=None, repr=False)

    @classmethod
    def read(cls, rank: int, report: Any, kind: str) -> RankReport:
        """The report ``rank`` sent, checked: anything that is not a report of ``kind`` is an
        ``"error"`` report that says what came instead."""
        if not isinstance(report, dict) or report.get("format") != FORMAT:
            return cls(rank, "error", f"sent {type(report).__name__}, not a memlab rank report ({FORMAT})")
        if report.get("kind") != kind and report.get("status") == "profiled":
            return cls(rank, "error", f"sent {report.get('kind')} where the others sent {kind}")
        status = report.get("status")
        if status not in STATUSES:
            return cls(rank, "error", f"sent an unknown status {status!r}")
        return cls(rank, status, report.get("error"), report.get("source"), report.get("data"))


def _status_line(reports: Sequence[RankReport]) -> str:
    """``1 of 3 ranks reported (0); rank 1 profiled nothing; rank 2 failed: RuntimeError: boom``."""
    profiled = [r.rank for r in reports if r.status == "profiled"]
    text = f"{len(profiled)} of {len(reports)} ranks reported ({', '.join(map(str, profiled)) or 'none'})"
    empty = [r.rank for r in reports if r.status == "empty"]
    if empty:
        ranks = f"rank {empty[0]}" if len(empty) == 1 else f"ranks {', '.join(map(str, empty))}"
        text += f"; {ranks} profiled nothing"
    for report in reports:
        if report.status == "error":
            text += f"; rank {report.rank} failed: {report.error}"
    return text


def _spread(
    values: Sequence[int | None],
) -> tuple[int | None, int | None, int | None, int | None, int | None]:
    """``(max, max rank, min, min rank, skew)`` of per-rank values (``None`` where a rank has none);
    on ties the lowest rank; all ``None`` when no rank has a value."""
    ranked = [(v, r) for r, v in enumerate(values) if v is not None]
    if not ranked:
        return None, None, None, None, None
    high = max(ranked, key=lambda vr: (vr[0], -vr[1]))
    low = min(ranked, key=lambda vr: (vr[0], vr[1]))
    return high[0], high[1], low[0], low[1], high[0] - low[0]


def _frame(index: Any, data: dict[str, Any], columns: list[str]) -> pd.DataFrame:
    import pandas as pd

    frame = pd.DataFrame({c: pd.array(v, dtype="Int64") for c, v in data.items()}, index=index)
    return frame[columns]


@dataclass
class MergedLines:
    """Line records of every rank, merged by (function name, line number).

    ``reports`` holds each rank's :class:`RankReport` (index = rank); ``columns`` the statistics the
    records carry (``hits``, byte columns, ``delta``...); ``lines`` one entry per source line,
    ``(function, line, code, {column: [value per rank]})``, a value ``None`` where that rank has
    none (it did not report, or never ran the line). Values are what each rank's
    :class:`memlab.LineProfiler` recorded (bytes for ``*_bytes.*`` and ``delta``).
    """

    reports: list[RankReport]
    columns: list[str]
    lines: list[tuple[str, int, str, dict[str, list[int | None]]]]

    @property
    def world_size(self) -> int:
        """Number of ranks that took part in the gather."""
        return len(self.reports)

    @property
    def reported(self) -> list[int]:
        """The ranks that sent line records with at least one profiled call."""
        return [r.rank for r in self.reports if r.status == "profiled"]

    def status(self) -> str:
        """One line: which ranks reported, which profiled nothing and which failed (and why)."""
        return _status_line(self.reports)

    def to_dataframe(self, column: str | None = None) -> pd.DataFrame:
        """``column`` (default: the first statistic after ``hits``) per line, indexed by
        (``function``, ``line``): ``rank 0`` ... ``rank N-1``, then ``max``, ``max_rank``, ``min``,
        ``min_rank``, ``skew`` (``max - min`` over the ranks with a value), as nullable integers,
        then ``code``. ``attrs["status"]`` is :meth:`status`."""
        import pandas as pd

        column = self._column(column)
        ranks = [f"rank {r}" for r in range(self.world_size)]
        data: dict[str, list[Any]] = {
            name: [] for name in (*ranks, "max", "max_rank", "min", "min_rank", "skew")
        }
        for _, _, _, values in self.lines:
            per_rank = values[column]
            for name, value in zip(ranks, per_rank, strict=True):
                data[name].append(value)
            for name, value in zip(
                ("max", "max_rank", "min", "min_rank", "skew"), _spread(per_rank), strict=True
            ):
                data[name].append(value)
        index = pd.MultiIndex.from_arrays(
            [
                pd.Index([f for f, _, _, _ in self.lines], dtype=object),
                pd.Index([n for _, n, _, _ in self.lines], dtype="int64"),
            ],
            names=["function", "line"],
        )
        frame = _frame(index, data, list(data))
        frame["code"] = pd.array([c for _, _, c, _ in self.lines], dtype=object)
        frame.attrs["status"] = self.status()
        return frame

    def _column(self, column: str | None) -> str:
        if column is None:
            return next((c for c in self.columns if c != "hits"), "hits")
        if column not in self.columns:
            raise ValueError(f"column {column!r} was not gathered; gathered: {', '.join(self.columns)}")
        return column

    def render(self, column: str | None = None) -> str:
        """The table of ``column`` as text: the status line, each reporting rank's source line,
        then per function one row per line that ran on some rank: each rank's value, the
        max and min with their ranks, the skew, and the code."""
        column = self._column(column)
        to_text = format_size if ("bytes" in column or column == "delta") else str
        out = [f"memlab: {column} across ranks: {self.status()}"]
        out += [f"rank {r.rank}: {r.source}" for r in self.reports if r.source]
        header = ["Line", *(f"rank {r}" for r in range(self.world_size)), "max", "min", "skew", "Code"]
        function = None
        for name, number, code, values in self.lines:
            per_rank = values[column]
            if all(v is None for v in per_rank):
                continue
            if name != function:
                function = name
                out += ["", f"## {name}", "", "  ".join(f"{h:>10}" for h in header[:-1]) + "  Code"]
            high, high_rank, low, low_rank, skew = _spread(per_rank)
            cells = [str(number), *("" if v is None else to_text(v) for v in per_rank)]
            cells += [f"{to_text(high)} ({high_rank})", f"{to_text(low)} ({low_rank})", to_text(skew)]
            out.append("  ".join(f"{c:>10}" for c in cells) + "  " + code)
        return "\n".join(out) + "\n"

    def __repr__(self) -> str:
        return self.render().rstrip("\n")  # print() adds the last newline

    def to_data(self) -> dict[str, Any]:
        """Plain data (JSON-able): ``format``, ``status``, ``ranks`` (rank, status, error, source),
        ``columns`` and ``lines`` as ``[function, line, code, {column: [value per rank]}]``."""
        return {
            "format": "memlab.merged_lines/1",
            "status": self.status(),
            "ranks": [
                {"rank": r.rank, "status": r.status, "error": r.error, "source": r.source}
                for r in self.reports
            ],
            "columns": self.columns,
            "lines": [[f, n, c, v] for f, n, c, v in self.lines],
        }


@dataclass
class MergedStats:
    """Tracker statistics of every rank: per rank ``allocated_peak``, ``reserved_peak``,
    ``allocated_current``, ``reserved_current`` (bytes, as each rank's
    :class:`memlab.TensorTracker` reports them) and ``peak_time_us`` (when its allocated bytes
    first reached their peak, microseconds since the epoch by that rank's clock; ``None``
    without a history)."""

    reports: list[RankReport]

    @property
    def world_size(self) -> int:
        """Number of ranks that took part in the gather."""
        return len(self.reports)

    def status(self) -> str:
        """One line: which ranks reported, which profiled nothing and which failed (and why)."""
        return _status_line(self.reports)

    def values(self, name: str) -> list[int | None]:
        """``name`` (one of :data:`STAT_FIELDS` or ``peak_time_us``) per rank; ``None`` where a rank
        has none."""
        if name not in (*STAT_FIELDS, "peak_time_us"):
            raise ValueError(
                f"unknown statistic {name!r}; valid: {', '.join((*STAT_FIELDS, 'peak_time_us'))}"
            )
        return [r.data.get(name) if r.status == "profiled" and r.data else None for r in self.reports]

    def spread(self, name: str = "allocated_peak") -> dict[str, int | None]:
        """``max``, ``max_rank``, ``min``, ``min_rank`` and ``skew`` of statistic ``name`` over the ranks."""
        return dict(
            zip(("max", "max_rank", "min", "min_rank", "skew"), _spread(self.values(name)), strict=True)
        )

    @property
    def first_to_peak(self) -> int | None:
        """The rank whose allocated bytes reached their peak first (by ``peak_time_us``; clocks of
        different hosts are only as close as they are synchronised), ``None`` when no rank knows."""
        times = [(t, r) for r, t in enumerate(self.values("peak_time_us")) if t is not None]
        return min(times)[1] if times else None

    def to_dataframe(self) -> pd.DataFrame:
        """One row per rank (index ``rank``): the statistics as nullable integers, then ``status``."""
        import pandas as pd

        data = {name: self.values(name) for name in (*STAT_FIELDS, "peak_time_us")}
        frame = _frame(pd.Index(range(self.world_size), name="rank"), data, list(data))
        frame["status"] = pd.array([r.status for r in self.reports], dtype=object)
        frame.attrs["status"] = self.status()
        return frame

    def render(self) -> str:
        """The per-rank peaks as text, with the spread of each and the rank that peaked first."""
        out = [f"memlab: tracker statistics across ranks: {self.status()}"]
        out.append(f"{'rank':>6}  {'allocated peak':>14}  {'reserved peak':>14}")
        allocated, reserved = self.values("allocated_peak"), self.values("reserved_peak")
        for rank in range(self.world_size):
            a, r = allocated[rank], reserved[rank]
            cells = ["" if v is None else format_size(v) for v in (a, r)]
            out.append(f"{rank:>6}  {cells[0]:>14}  {cells[1]:>14}")
        for name, values in (("allocated peak", allocated), ("reserved peak", reserved)):
            high, high_rank, low, low_rank, skew = _spread(values)
            if high is not None:
                out.append(
                    f"{name}: max {format_size(high)} (rank {high_rank}), min {format_size(low)} "
                    f"(rank {low_rank}), skew {format_size(skew)}"
                )
        first = self.first_to_peak
        if first is not None:
            out.append(f"first to peak: rank {first}")
        return "\n".join(out) + "\n"

    def __repr__(self) -> str:
        return self.render().rstrip("\n")  # print() adds the last newline

    def to_data(self) -> dict[str, Any]:
        """Plain data (JSON-able): ``format``, ``status``, ``ranks`` with each rank's statistics."""
        return {
            "format": "memlab.merged_stats/1",
            "status": self.status(),
            "ranks": [
                {"rank": r.rank, "status": r.status, "error": r.error, "source": r.source, "stats": r.data}
                for r in self.reports
            ],
        }


def merge_reports(reports: Sequence[Any]) -> MergedLines | MergedStats:
    """Merge the reports gathered from every rank (index = rank; anything that is not a report
    counts as an error of that rank). The kind is that of the first rank that profiled something
    (:data:`LINES` when none is): line records become :class:`MergedLines`, statistics
    :class:`MergedStats`."""
    kind = next(
        (
            r["kind"]
            for r in reports
            if isinstance(r, dict) and r.get("format") == FORMAT and r.get("status") == "profiled"
        ),
        LINES,
    )
    read = [RankReport.read(rank, report, kind) for rank, report in enumerate(reports)]
    if kind == STATS:
        return MergedStats(read)
    return _merge_lines(read)


def _merge_lines(reports: list[RankReport]) -> MergedLines:
    columns: list[str] = []
    keys: dict[tuple[str, int], tuple[str, dict[str, list[int | None]]]] = {}
    per_rank: list[dict[tuple[str, int], dict[str, int] | None]] = []
    for report in reports:
        found: dict[tuple[str, int], dict[str, int] | None] = {}
        if report.data is not None:
            try:
                tables = records_from_data(report.data)
            except (TypeError, ValueError) as error:
                report.status, report.error, report.data = "error", f"sent unreadable records: {error}", None
                tables = []
            columns += [c for c in report.data["columns"] if c not in columns] if report.data else []
            for table in tables:
                for number, code, values in table.lines:
                    keys.setdefault((table.name, number), (code, {}))
                    found[(table.name, number)] = values
        per_rank.append(found)
    lines = []
    for (name, number), (code, _) in keys.items():
        values = {
            column: [
                None if (v := found.get((name, number))) is None else v.get(column) for found in per_rank
            ]
            for column in columns
        }
        lines.append((name, number, code, values))
    return MergedLines(reports, columns, lines)
