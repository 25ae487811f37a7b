"""The exceptions callers may want to catch.

Bad arguments raise the built-in ``ValueError`` / ``TypeError``; everything here
is about the checkpoint, the quantization scheme or the memory budget, and every
message names what failed, the values seen and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable


class LowMemError(Exception):
    """Base class of every error raised by lightning_lowmem."""


class CheckpointError(LowMemError):
    """A checkpoint could not be read: missing, truncated, unknown format or unsafe."""


class CheckpointFormatError(CheckpointError):
    """The file is not a checkpoint we can read, or it is truncated or incomplete."""


class NoStateDictError(CheckpointFormatError):
    """A torch file holds no state dict of tensors (a bare tensor, a list, a dict of other things): it is not a set
    of weights. Beside other weight sets in a directory it is left out, with a warning."""


class CheckpointChangedError(CheckpointFormatError):
    """A checkpoint file that a running model reads its layers from (``disk_offload``) changed, was cut short or
    could not be read: the forward stops there, and every later one too, rather than run on other weights."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path, or a file it refers to, does not exist."""


class CheckpointReadError(CheckpointError, OSError):
    """A checkpoint file could not be opened or read: no permission, an I/O error from the disk or the network
    filesystem. ``errno`` is the system's error number (None when it came from another rank)."""


class AmbiguousCheckpointError(CheckpointError):
    """A path stands for two different sets of weights (a directory holding ``lit_model.pth`` and a
    ``model.safetensors`` that differ); nothing is read until one is picked."""


class CheckpointDiffersError(CheckpointError):
    """The ranks of a sharded load read different checkpoints: a file on one rank holds other bytes than the same
    file on rank 0 (another size, other headers, other data where sampled); raised on every rank before any reads."""


class UnverifiedWeightsWarning(UserWarning):
    """A directory holds several weight sets whose names, shapes and dtypes agree, and one was read by the documented
    order without its bytes being compared with the others' (``verify_weight_sets=True`` compares them; ``prefer=``
    picks one): they may hold other values."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle-based checkpoint asks to import or run code; it is never executed."""


class CheckpointMismatchError(LowMemError):
    """The checkpoint does not fit the module: missing or unexpected keys, wrong shapes."""


class UnsupportedQuantizationError(LowMemError, ValueError):
    """A quantization scheme is unknown or has no kernel on the target device."""


class DeviceUnavailableError(LowMemError, RuntimeError):
    """The device a load targets does not exist on this machine or in this PyTorch build."""


class RankLostError(LowMemError, RuntimeError):
    """A collective between the ranks of a sharded load failed: another rank's process ended (killed for memory,
    its node lost), the connection to it broke, or the backend timed out. It is a ``RuntimeError`` too, as the
    backend's own error was; the model is put back as it was and the process group cannot be used again."""


class UnsupportedPlatformError(LowMemError, ImportError):
    """The operating system lacks what the library needs (Windows: positioned reads, ``fcntl``); raised when
    ``lightning_lowmem`` is imported. It runs on Linux and macOS (on Windows, under WSL2)."""


class MemoryBudgetError(LowMemError):
    """A memory budget cannot hold what was asked for."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class MetaTensorError(CheckpointMismatchError):
    """Parameters or buffers were left on the meta device after a load."""


class SaveError(LowMemError, OSError):
    """A save could not be made: no space, no permission, a directory that cannot be switched whole. The target
    holds what it held before (the old checkpoint whole, or nothing).

    It is an ``OSError`` too; ``errno`` is the system's error when one caused it (``errno.ENOSPC``), else None.

    Attributes:
        path: the file or directory the save was writing, or could not write.
        needed: bytes the save needed on that file system (None when not known).
        available: bytes free there when it failed (None when not known).
    """

    def __init__(self, message: str, *, path: str | None = None, needed: int | None = None,
                 available: int | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.needed = needed
        self.available = available
        self.errno = errno  # strerror stays None, so str() is the message


class ForeignWeightsError(SaveError):
    """A save's directory holds weight files lightning_lowmem did not write (``lit_model.pth``, ``pytorch_model.bin``,
    another ``*.safetensors``, a ``.gguf``): refused before anything is written, so that the directory never holds
    two weight sets; ``overwrite=True`` removes them once the new save is in place.

    Attributes:
        files: the names of those files.
    """

    def __init__(self, message: str, *, path: str | None = None, files: list[str] | None = None) -> None:
        super().__init__(message, path=path)
        self.files = list(files or [])


def format_names(names: Iterable[str], limit: int = 10, *, quote: bool = True, sep: str = ", ") -> str:
    """``'a', 'b' ... and N more``: at most ``limit`` names, in the given order.

    Args:
        names: the names (or already formatted items, with ``quote=False``).
        limit: how many to show.
        quote: show each name as its ``repr``.
        sep: what goes between two items.

    Example::

        >>> format_names(["a", "b", "c"], limit=2)
        "'a', 'b' ... and 1 more"
        >>> format_names(["x (why)", "y (why)"], quote=False, sep="; ")
        'x (why); y (why)'
    """
    names = list(names)
    shown = sep.join(repr(n) if quote else str(n) for n in names[:limit])
    if len(names) > limit:
        shown += f" ... and {len(names) - limit} more"
    return shown


class KVCacheTooShortError(LowMemError, ValueError):
    """A generation request needs more KV-cache positions (or a larger batch) than a fixed cache holds.

    What is raised is one of its three subclasses, each also the type litgpt raises in the same place, so that code
    written for litgpt (``except IndexError``) catches it as before."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class KVCachePositionError(KVCacheTooShortError, IndexError):
    """A forward writes positions past the KV cache (litgpt: an ``IndexError`` from its mask lookup)."""


class KVCacheBatchError(KVCacheTooShortError, RuntimeError, AssertionError):
    """A forward has more sequences than the KV cache holds. litgpt raises torch's ``RuntimeError`` from
    ``index_copy_`` there (positions of shape ``(T,)``), or a bare ``AssertionError`` (positions ``(B, T)``): this is
    both."""


class KVCacheLengthError(KVCacheTooShortError, NotImplementedError):
    """A generation request is longer than the model's ``max_seq_length`` (litgpt's ``generate``:
    ``NotImplementedError``, whose words its message starts with)."""
