"""A ``vllm serve`` command line's spelling, read as vLLM's argument parser reads it: a flag's
name may use ``_`` for ``-`` (``--max_loras 4``, ``--gpu_memory_utilization=0.9``, as the vLLM
production-stack Helm chart writes some of its flags). Values are left as they are."""

from __future__ import annotations


def dashed_flag_names(argv: list[str]) -> list[str]:
    """``argv`` with ``_`` in each ``--flag`` name (before any ``=value``) turned into ``-``."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out
