"""Kernel tests run the Triton kernels under the interpreter, on CPU tensors.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated, i.e. when
``loraplex.kernels.triton_*`` is first imported; set it here, before any test module imports them.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
