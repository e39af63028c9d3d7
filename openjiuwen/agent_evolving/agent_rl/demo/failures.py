"""The failure every part of the demo raises: the driver names the step it happened in and that step's log."""


class DemoFailed(Exception):
    """A step failed; the message says why (the step and its log are known to the driver)."""
