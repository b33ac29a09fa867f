"""One rich progress bar over layers (convert, validate), silent when disabled (--json, tests)."""

from __future__ import annotations


class LayerProgress:
    """`with LayerProgress(enabled, total, "layers") as bar:` then `bar.update(done, note)` or `bar.advance()`.

    Rich renders it in terminals and in Jupyter alike; with `enabled=False` every call is a no-op.
    """

    def __init__(self, enabled: bool, total: int, description: str):
        self.enabled = enabled
        self.description = description
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.p.add_task(description, total=total)

    def __enter__(self) -> "LayerProgress":
        if self.enabled:
            self.p.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.p.__exit__(*exc)

    def update(self, completed: int | None = None, note: str | None = None) -> None:
        """Set the count of finished steps and/or a note shown instead of the description."""
        if self.enabled:
            kw = {} if completed is None else {"completed": max(completed, 0)}
            self.p.update(self.task, description=note or self.description, **kw)

    def advance(self) -> None:
        if self.enabled:
            self.p.advance(self.task)


def rich_html(renderable, width: int = 110) -> str:
    """A rich renderable as an HTML fragment for Jupyter's `_repr_html_` (recorded off-screen, so
    the notebook shows it once)."""
    import io

    from rich.console import Console

    console = Console(record=True, width=width, file=io.StringIO(), force_jupyter=False)
    console.print(renderable)
    return console.export_html(inline_styles=True, code_format="<pre style=\"font-family:monospace\">{code}</pre>")
