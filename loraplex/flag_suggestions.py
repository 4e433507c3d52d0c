"""argparse's "unrecognized arguments" with the closest known flag of each unknown one, as vLLM's
command line does (``--max-lora 4``: did you mean ``--max-loras``?)."""

from __future__ import annotations

import difflib
from collections.abc import Collection


def unrecognized_message(unknown: list[str], option_strings: Collection[str]) -> str:
    """argparse's message for ``unknown`` arguments, each unknown flag followed by the
    known flag in ``option_strings`` spelled most like it (difflib), if one is close."""
    known = sorted(option for option in option_strings if option.startswith("-"))
    hints = []
    for arg in unknown:
        if not arg.startswith("-") or arg == "-":
            continue
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hints.append(f"{name}: did you mean {close[0]}?" if close else f"{name}: no such flag")
    message = f"unrecognized arguments: {' '.join(unknown)}"
    return message + ("\n  " + "\n  ".join(hints) if hints else "")
