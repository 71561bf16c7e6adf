"""Whether an output can be written where the operator asked, found out before the work rather than after it."""

import errno
import os
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


def unwritable_file(file: Path) -> str | None:
    """Why the existing `file` cannot be opened for writing, or None. Asked by opening it without truncating
    (nothing is lost by asking), not by its directory: /dev/stdout, or a file made in advance in a directory this
    user cannot write, takes output written in place."""
    try:
        os.close(os.open(file, os.O_WRONLY | os.O_NONBLOCK))  # O_NONBLOCK: a FIFO's open waits for a reader
    except OSError as error:
        if error.errno == errno.ENXIO:  # a FIFO no one reads yet: the writer waits for its reader
            return None
        return f"{file} cannot be opened for writing ({error.strerror})"
    return None
