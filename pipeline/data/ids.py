"""What an id (event, account, terminal) may hold: one rule for the files `txsentinel ingest` reads and the
messages the service decodes (consumers/scoring/message_limits.py), so that no row trains a model on an id
the live service would refuse.

An id is a non-empty string of at most `max_id_chars` characters, each printable (str.isprintable: no
control, format, surrogate, private-use, unassigned or separator character but the space) and visible, and
its first character after any spaces is no combining mark (one has nothing to combine with: an id of
marks alone prints as no character). Ids are compared code point by code point, as Kafka compares keys:
"Zoë" written precomposed (NFC) and decomposed (NFD) are two ids, two accounts, as they would be two keys.
"""

import re
import unicodedata

MAX_ID_CHARS = 256  # the service's default max_id_chars

# Characters Python calls printable that render as nothing: Unicode's Default_Ignorable_Code_Point set
# (DerivedCoreProperties.txt) less what isprintable() already refuses (the format controls, U+200B..U+200F,
# U+202A..U+202E, U+2060.., U+FEFF: Cf), plus the Braille blank. Each makes an id look like another, or like
# no id at all, in an alert, a log line or a dead letter.
INVISIBLE = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180d\u180f\u2800\u3164\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef]"
)


def unseen_character(value: str) -> str | None:
    """What makes `value` unfit to read as an id, character-wise: "U+XXXX, <why>" for its first character
    that is not printable or prints as nothing; None when every one is fine."""
    if value.isprintable():  # C speed; an ASCII id pays nothing more, a refused one the searches below
        if value.isascii():  # no ASCII character is invisible or a combining mark
            return None
        invisible = INVISIBLE.search(value)
        if invisible is not None:
            return f"U+{ord(invisible.group()):04X}, which prints as nothing"
        first = value.lstrip(" ")[:1]
        if first and not first.isascii() and unicodedata.category(first).startswith("M"):
            return f"U+{ord(first):04X} first, a combining mark with no character before it to combine with"
        return None
    bad = next(c for c in value if not c.isprintable())
    kind = "a lone surrogate, which UTF-8 cannot encode" if 0xD800 <= ord(bad) <= 0xDFFF else "not printable"
    return f"U+{ord(bad):04X}, {kind}"


def id_problem(value: str, max_chars: int = MAX_ID_CHARS) -> str | None:
    """Why `value` is not an id, in words (None: it is one); emptiness is the caller's to say."""
    if len(value) > max_chars:
        return f"has {len(value)} characters, over the limit of {max_chars}"
    unseen = unseen_character(value)
    return None if unseen is None else f"holds {unseen}"
