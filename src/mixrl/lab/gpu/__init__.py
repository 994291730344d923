"""GPU checks (``scripts/gpu_check.sh``): what a run on an accelerator must show."""


class Skip(Exception):
    """This check cannot run on this machine (the message says why)."""
