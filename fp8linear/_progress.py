"""Progress bars for the steps that take long on big models (tqdm, on stderr)."""
from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(progress: bool | None, **options) -> tqdm:
    """A tqdm bar; ``progress=None`` shows it only when stderr is a terminal, so logs,
    pipes and test runs stay clean, while True/False force it on/off."""
    return tqdm(disable=None if progress is None else not progress, **options)
