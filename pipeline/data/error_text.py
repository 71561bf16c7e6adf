"""A library's error quoted inside a message of ours. Imports nothing: the command line's error handling, which
must not wait for MLflow or Kafka to load, shares it with the tracking store's checks."""


def first_line(text: str) -> str:
    """The first line of `text` that holds anything, stripped, without the period that closes it: the message
    quoting it goes on after it, and ends in exactly one period of its own. "" when `text` holds nothing."""
    return next((line.strip().rstrip(".") for line in str(text).splitlines() if line.strip()), "")
