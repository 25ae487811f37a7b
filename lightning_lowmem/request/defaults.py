"""Where a load computes and in what dtype, when the caller does not say: one answer for every face, the runtime's
(``runtime/execution.py`` owns where and how a layer runs; these turn a load's options into its questions).

* :func:`execution_device`: where the layers of a load run: ``max_memory``'s execution device (offloaded and on-disk
  layers are brought there for their forward), else ``device``, else the face's default. The prepared load, the
  load's memory monitor, ``generate`` and its command-line faces, the litgpt loader and the estimate all ask it.
* :func:`default_device`: litgpt's default where nothing is asked: CUDA when there is one, else the CPU (the command
  line, and the estimate of a generation).
* :func:`generation_dtype`: the dtype of a generation: ``dtype``, else the precision flag, else bf16 (litgpt's
  ``--precision`` default).
* :func:`compute_dtype`: the dtype a load computes in on its execution device: bf16 becomes fp16 where that device
  lacks bf16, by the rule the execution plan applies to each layer (``runtime/execution.py``,
  :func:`~lightning_lowmem.dtypes.fallback_dtype`). A face that sets a precision up around the loaded model (the
  litgpt loader's Fabric) asks it, so it does not cast the fp16 model back to bf16.
"""

from __future__ import annotations

import torch

from lightning_lowmem.dtypes import load_dtype
from lightning_lowmem.request.options import LoadOptions
from lightning_lowmem.runtime import execution

GENERATION_DTYPE = torch.bfloat16
"""The dtype a generation loads in unless told otherwise (litgpt's ``--precision bf16-true``)."""


def execution_device(options: LoadOptions, default: torch.device | str | None = None) -> torch.device | None:
    """Where a load with ``options`` computes: ``max_memory``'s execution device, else ``options.device``, else
    ``default`` (None: each tensor where the module holds it).

    Example::

        >>> execution_device(LoadOptions(max_memory={"cuda:0": "6GiB", "cpu": "20GiB"}))
        device(type='cuda', index=0)
        >>> execution_device(LoadOptions(), "cpu"), execution_device(LoadOptions())
        (device(type='cpu'), None)
    """
    budget = options.budgets.execution_device if options.budgets is not None else None
    return execution.execution_device(budget, options.device, default)


def default_device() -> torch.device:
    """litgpt's default device: ``cuda`` when this machine has one, else ``cpu`` (``runtime/execution.py``)."""
    return execution.default_device()


def generation_dtype(dtype: torch.dtype | None = None, precision: str | None = None) -> torch.dtype:
    """The dtype a generation loads in: ``dtype``, else ``precision`` (``"16-true"``), else :data:`GENERATION_DTYPE`.

    Raises:
        ValueError: ``dtype`` and ``precision`` disagree, or ``precision`` keeps no one dtype.

    Example::

        >>> generation_dtype(), generation_dtype(precision="32-true")
        (torch.bfloat16, torch.float32)
    """
    return load_dtype(dtype, precision, GENERATION_DTYPE) or GENERATION_DTYPE


def compute_dtype(options: LoadOptions) -> torch.dtype | None:
    """The floating dtype a load with ``options`` computes in on its :func:`execution_device` (the CPU when it names
    none): ``options.dtype``, but fp16 for bf16 where that device lacks bf16; None without ``options.dtype``.

    Example::

        >>> from lightning_lowmem.dtypes import assume_bf16_support
        >>> with assume_bf16_support("cpu", False):
        ...     compute_dtype(LoadOptions(dtype=torch.bfloat16)), compute_dtype(LoadOptions(dtype=torch.float32))
        (torch.float16, torch.float32)
    """
    return execution.compute_dtype(options.dtype, execution_device(options, "cpu"))
