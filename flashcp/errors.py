"""The one error type users see: its message is a plain sentence, printed without a traceback."""


class FlashcpError(Exception):
    """An expected failure caused by input or state outside flashcp (bad file, stale plan, bad option).

    The CLI prints ``str(error)`` as one line and exits 1. Messages say what was found, what is required
    and, where it helps, what to do.
    """


class PlanError(FlashcpError):
    """A sharding plan that breaks a rule: coverage, equal tokens, or stored metrics."""


class StalePlanError(FlashcpError):
    """A plan made from data files other than the ones the dataset holds now."""


class KernelCacheWarning(UserWarning):
    """The compiled-kernel cache could not be used as it is (a damaged entry, a full disk); work goes on.

    The CLI prints it as one ``warning:`` line.
    """
