"""Progress bars that read well both on a terminal and in the rendered book.

On a terminal a tqdm bar redraws itself in place. In a notebook that is noise: a
widget (tqdm.auto) that a static page cannot show, or a bar redrawn with carriage
returns on stderr, which the book prints as a red warning box. So inside a Jupyter
kernel the bar stays silent while it runs and prints one plain line on stdout when it
closes, with the same numbers tqdm would show (count, time, rate, postfix).
"""

from __future__ import annotations

import sys
import time

from tqdm.std import tqdm


def in_notebook() -> bool:
    """Running inside a Jupyter kernel (the book's notebooks, executed or live)."""
    return "ipykernel" in sys.modules and type(sys.stdout).__module__.startswith("ipykernel")


class Progress:
    """`tqdm`'s `update`, `set_postfix` and `close`, as a terminal bar or, in a notebook,
    one summary line at `close`. Also iterable over `iterable`, like tqdm."""

    def __init__(self, iterable=None, *, total: int | None = None, desc: str = "",
                 enabled: bool = True, leave: bool = True, **tqdm_kw):
        self.iterable = iterable
        self.total = total if total is not None else (
            len(iterable) if hasattr(iterable, "__len__") else None)
        self.desc, self.enabled = desc, enabled
        self.text = enabled and in_notebook()
        self.bar = tqdm(total=self.total, desc=desc, leave=leave,
                        disable=not enabled or self.text, **tqdm_kw)
        self.n, self.postfix, self.t0, self.closed = 0, {}, time.perf_counter(), False

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)

    def set_postfix(self, refresh: bool = False, **kw) -> None:
        self.postfix = kw
        self.bar.set_postfix(refresh=refresh, **kw)

    def summary(self) -> str:
        """The line a notebook gets: "desc: n/total steps in 1.2 s (66.1 it/s), k=v"."""
        elapsed = time.perf_counter() - self.t0
        of = f"/{self.total}" if self.total is not None else ""
        rate = f" ({self.n / elapsed:.1f} it/s)" if elapsed > 0 and self.n else ""
        post = "".join(f", {k}={v}" for k, v in self.postfix.items())
        return f"{self.desc}: {self.n}{of} in {elapsed:.1f} s{rate}{post}"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.bar.close()
        if self.text:
            print(self.summary(), flush=True)
