"""Rich output shared by the commands: tables on stdout at their natural width, the progress
bar on stderr, and :class:`fqr.bench.report.ReportTable` data as a Rich table."""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from fqr.text import printable

from .common import err, out


def print_table(table: Table) -> None:
    """Print ``table`` to stdout; never squeezed into a pipe's default 80 columns (its cells
    are data), on a terminal no wider than the terminal lets it be."""
    if out.is_terminal:
        out.print(table)
        return
    width = Measurement.get(out, out.options.update(max_width=1000), table).maximum
    Console(file=out.file, width=max(out.width, width), soft_wrap=True).print(table)


def progress_bar() -> Progress:
    """The transient progress bar on stderr: description, bar, done/total, elapsed."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


def plain(text) -> Text:
    """Text shown as written, never read as Rich markup, control characters escaped
    (:func:`fqr.text.printable`): names, paths and messages, often read from files."""
    return Text(printable(text))


def rich_table(report, failed: tuple[str, ...] = ()) -> Table:
    """A Rich table of a :class:`fqr.bench.report.ReportTable` (its text often read from a
    saved document: shown as written); cells whose text is in ``failed`` in red."""
    table = Table(title=plain(report.title), caption=plain(report.caption))
    for name, justify in report.columns:
        table.add_column(plain(name), justify=justify)
    for row in report.rows:
        table.add_row(*(Text(c, style="red") if c in failed else plain(c) for c in row))
    return table


def add_plain_row(table: Table, *cells: str) -> None:
    """Add a row whose cells are shown as written (names, paths, messages: never Rich markup)."""
    table.add_row(*(plain(c) for c in cells))
