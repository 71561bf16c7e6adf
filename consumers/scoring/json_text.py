"""Hostile JSON text, read within bounds: how deep it nests, measured before the parser recurses into it,
and a parser that refuses what Python's json would take silently (a field named twice, a byte order mark).
"""

import json

import numpy as np


def json_depth(value: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings aside); 0 for a scalar.

    Vectorised over the bytes, so a hostile 64 KiB costs about a millisecond: a quote is escaped when an
    odd run of backslashes precedes it, real quotes toggle "inside a string", and the depth is the running
    sum of the brackets outside strings.
    """
    b = np.frombuffer(value, dtype=np.uint8)
    if len(b) == 0:
        return 0
    index = np.arange(len(b))
    backslash = b == 0x5C
    run = index - np.maximum.accumulate(np.where(backslash, -1, index))  # backslashes ending at each byte
    escaped = np.zeros(len(b), dtype=bool)
    escaped[1:] = run[:-1] % 2 == 1
    inside = np.cumsum((b == 0x22) & ~escaped) % 2 == 1  # an opening quote counts as inside: not a bracket
    opens = ((b == 0x5B) | (b == 0x7B)) & ~inside
    closes = ((b == 0x5D) | (b == 0x7D)) & ~inside
    return int(np.cumsum(opens.astype(np.int64) - closes).max())


def _unique_names(pairs: list[tuple[str, object]]) -> dict:
    # Python's json keeps the last of two equal names, other readers the first: a transaction naming
    # account_id twice would be one account's event to the service and another's to the next reader.
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        twice = next(name for name, _ in pairs if name in seen or seen.add(name))
        shown = twice if twice.isprintable() and len(twice) <= 80 else repr(twice[:80])
        raise ValueError(
            f"field {shown!r} appears more than once; JSON readers disagree on which value counts"
        )
    return data


# Built once: json.loads with a hook builds a JSONDecoder per call (~10 us of a ~20 us decode).
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_names)


def parse_json(text: str):
    """json.loads(text), but ValueError for a field named twice in any object, or a leading byte order mark.
    NaN and Infinity still parse (Python's json allows them): the caller refuses them where it wants a number."""
    if text.startswith("\ufeff"):  # json.loads says so; the decoder under it would say 'Expecting value'
        raise ValueError("it starts with a byte order mark (U+FEFF), which JSON text may not carry")
    return _DECODER.decode(text)
