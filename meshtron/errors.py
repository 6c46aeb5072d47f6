"""The one exception type for user-facing errors.

Anything a user can cause (a bad config, a missing file, a corrupt checkpoint, a layout that
cannot work) raises :class:`MeshtronError` with a single readable sentence. The CLI prints it as
one line on stderr and exits non-zero; every other exception is a bug in meshtron.
"""


class MeshtronError(Exception):
    """An error caused by the user's input, reported as one line without a traceback."""
