"""One progress display over layers (convert, validate), silent when disabled (--json, --quiet, tests).

Progress goes to stderr, for every command (stdout carries results: tables, --json), so
`quantkit ... --json > out.json` and a log of `2>` each get what they expect.

In a terminal (or Jupyter) it is a rich bar. When stderr is not a terminal (`nohup`, CI, a pipe)
a bar draws nothing until the end, so a job nobody watches would log nothing for hours; there it
prints one flushed line per step instead (or per `per_line` steps: one per validate pass):
`layers 3/61  elapsed 0:41:07  ETA 12:03:10  peak host 211.4 GB  peak device 97.3 GB`.
"""

from __future__ import annotations

import sys
import time


class LayerProgress:
    """`with LayerProgress(enabled, total, "layers") as bar:` then `bar.update(done, note)` or `bar.advance()`.

    Rich renders it in terminals and in Jupyter alike; with `enabled=False` every call is a no-op.
    `lines` forces the line mode (default: when stderr is not a terminal); `per_line`: steps per line,
    `unit`: what a line counts (a line reads `<unit> i/N`, i in steps // per_line).
    """

    def __init__(self, enabled: bool, total: int, description: str, *, per_line: int = 1, unit: str | None = None,
                 lines: bool | None = None):
        self.enabled = enabled
        self.description = description
        self.total, self.done, self.per_line, self.unit = total, 0, max(per_line, 1), unit or description
        self.lines = enabled and (lines if lines is not None else not _is_terminal())
        self.t0 = time.time()
        self._printed = -1  # the last line's step count (a resume's first update prints where it starts)
        if enabled and not self.lines:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self.task = self.p.add_task(description, total=total)

    def __enter__(self) -> "LayerProgress":
        if self.enabled and not self.lines:
            self.p.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and not self.lines:
            self.p.__exit__(*exc)

    def update(self, completed: int | None = None, note: str | None = None) -> None:
        """Set the count of finished steps and/or a note shown instead of the description."""
        if not self.enabled:
            return
        if self.lines:
            if completed is not None:
                self._step(max(completed, 0))
            return
        kw = {} if completed is None else {"completed": max(completed, 0)}
        self.p.update(self.task, description=note or self.description, **kw)

    def advance(self) -> None:
        if not self.enabled:
            return
        if self.lines:
            self._step(self.done + 1)
        else:
            self.p.advance(self.task)

    def _step(self, done: int) -> None:
        if self._printed < 0:  # the first count (0, or where a resumed run starts): the clock starts here
            self.t0, self.start = time.time(), done
        self.done = done
        if done == self._printed or (done % self.per_line and done != self.total):
            return
        self._printed = done
        sys.stderr.write(self.line() + "\n")
        sys.stderr.flush()

    def line(self) -> str:
        """`<unit> i/N  elapsed  ETA  peak host  peak device` for the steps done so far."""
        elapsed = time.time() - self.t0
        ran = self.done - self.start
        eta = elapsed / ran * (self.total - self.done) if ran > 0 else None
        n, i = -(-self.total // self.per_line), -(-self.done // self.per_line)
        host, device = _peaks()
        return (f"{self.unit} {i}/{n}  elapsed {_hms(elapsed)}  ETA {_hms(eta) if eta is not None else '?'}  "
                f"peak host {host / 1e9:.2f} GB" + (f"  peak device {device / 1e9:.2f} GB" if device is not None else ""))


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty() or _in_notebook()  # Jupyter renders the bar itself
    except (AttributeError, ValueError):
        return False


def _in_notebook() -> bool:
    """Whether this process is a Jupyter kernel running user code: an IPython shell with a kernel. Not merely
    ipykernel imported (a test suite that starts a notebook imports it, and its logs still want lines)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return getattr(shell, "kernel", None) is not None


def _peaks() -> tuple[int, int | None]:
    """Peak host RSS of this process, and the CUDA device's peak allocation when one is in use."""
    from quantkit.runtime.machine import peak_rss

    torch = sys.modules.get("torch")  # never imported here just for this
    device = None
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.max_memory_allocated()
    return peak_rss(), device


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def rich_html(renderable, width: int = 110) -> str:
    """A rich renderable as an HTML fragment for Jupyter's `_repr_html_` (recorded off-screen, so
    the notebook shows it once)."""
    import io

    from rich.console import Console

    console = Console(record=True, width=width, file=io.StringIO(), force_jupyter=False)
    console.print(renderable)
    return console.export_html(inline_styles=True, code_format="<pre style=\"font-family:monospace\">{code}</pre>")
