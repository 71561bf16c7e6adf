"""Whether an output can be written where the operator asked, found out before the work rather than after it."""

import tempfile
from pathlib import Path


def unwritable(directory: Path) -> str | None:
    """Why nothing can be written into `directory` (made with its parents when missing), or None. The nearest
    directory that exists is asked by making an entry in it and removing it: permission bits do not tell (root
    passes os.access where a read-only mount or /proc refuses)."""
    existing = next(path for path in (directory, *directory.parents) if path.exists())
    if not existing.is_dir():
        return f"{existing} is a file"
    try:
        Path(tempfile.mkdtemp(prefix=".txsentinel-probe-", dir=existing)).rmdir()
    except OSError as error:
        made = "" if existing == directory else f", so {directory} cannot be made"
        return f"nothing can be created in {existing} ({error.strerror}){made}"
    return None
