"""The error of the checkpoint tools (merge, convert, the Megatron-LM reader)."""


class CheckpointError(ValueError):
    """Bad input or a failed self-check; the message is one line naming the problem and the fix."""
