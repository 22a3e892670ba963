"""Errors raised for files that are not valid `.kv` snapshots and for requests that cannot be done
as asked, and the root of every error kvsnap raises on purpose.

Every malformed, truncated or hostile file raises a subclass of `KVFormatError` (itself a
`ValueError`), never a bare numpy, struct, zstd or JSON exception. Every request kvsnap refuses
(an argument outside its domain, an unknown name, arrays that do not fit a layer) raises a
subclass of `UsageError` (also a `ValueError`; those that Python would raise as a ``TypeError``
are one too). A bare built-in exception from kvsnap is a bug, and the command line shows its
traceback. `KVSnapError` is the base of
every error class of kvformat, the capture stage and the analysis stage (``kvsnap.Error``): one
``except`` catches whatever kvsnap refused, while each class still is the built-in exception its
meaning is (``ValueError``, ``IndexError``, ``OSError``, ...).
"""

from __future__ import annotations


class KVSnapError(Exception):
    """The base of every error kvsnap raises on purpose (``kvsnap.Error``)."""


class KVFormatError(KVSnapError, ValueError):
    """A file is not a valid `.kv` snapshot, or asks for something this reader cannot do."""


class TruncatedFileError(KVFormatError):
    """The file ends before a structure it declares (often: the writer never finished)."""


class IncompleteRecoveryError(TruncatedFileError):
    """`kvformat.recover` found no snapshot whose every head was written: nothing complete to keep."""


class IncompleteSnapshotError(KVFormatError):
    """A snapshot rebuilt from a cut file holds some heads only in part (``Snapshot.incomplete``):
    their rows are refused rather than returned short."""


class CorruptFileError(KVFormatError):
    """A structure is malformed or breaks a rule of the spec."""


class ForeignFormatError(CorruptFileError):
    """The file is another format kvsnap can import (e.g. go-mlx MLXKV001): the message names
    the command that converts it."""


class ChecksumError(CorruptFileError):
    """A stored CRC-32C does not match the bytes it covers."""


class UnsupportedVersionError(KVFormatError):
    """The file's major format version is not one this reader implements."""


class UnsupportedFeatureError(KVFormatError):
    """The file requires a feature, dtype or codec this reader does not implement."""


class LimitExceededError(KVFormatError):
    """A size or count field exceeds a hard limit of the spec."""


class MissingKeysError(KVFormatError):
    """Attention was asked for queries that saw keys no snapshot of the file holds (a windowed
    cache snapshotted after those keys left the window): they cannot be recomputed exactly."""


class RemoteError(KVFormatError):
    """A remote file could not be read: network failure, timeout, refused range request, or the
    file changed on the server while it was open."""


class RemoteNotFoundError(RemoteError):
    """A remote file does not exist (or vanished after it was opened)."""


class OutOfRangeError(KVSnapError, IndexError):
    """A snapshot, layer, head or sequence index outside what the file holds (a usage error, not
    a file problem: the message names the valid range)."""


class FileInUseError(KVSnapError, OSError):
    """A ``.partial`` file that a live writer still holds (its advisory lock) was given to a command
    that would read it as abandoned (`kvformat.recover`)."""


class UsageError(KVSnapError, ValueError):
    """A call or a command asked for something that cannot be done as asked: the file is fine,
    the request is not. The message names the argument and what it may be."""


class InvalidArgumentError(UsageError):
    """An argument, option or setting outside its domain (a count below 1, a range that runs
    backwards, an environment variable that is not one of its values)."""


class UnknownNameError(UsageError):
    """A name (codec, backend, statistic, group, method, executor, format) that is none of the
    choices; the message lists them."""


class ConflictingArgumentsError(UsageError, TypeError):
    """Arguments that cannot be given together (a keyword and the option object that holds it,
    an old name and its new one), or an argument the call does not take."""


class InvalidArrayError(UsageError, TypeError):
    """Arrays or positions handed to a writer that do not fit the layer they are written to:
    their shape, dtype, count or order (positions strictly increasing, after those written)."""


class InvalidLayoutError(UsageError):
    """A layer, query or quantization description, or metadata, that the format cannot hold
    (SPEC 7): a count out of its range, settings that exclude each other, metadata that is not
    plain JSON."""


class WriterClosedError(UsageError):
    """A `kvformat.Writer` used after it was closed."""


class PooledKeysError(UsageError):
    """A computation over a layer's own keys asked of a layer whose queries also read pooled
    keys (format 1.8, DeepSeek-V4.1): it would leave those keys out. `kvformat.Snapshot`'s
    ``attention`` and ``attention_output`` compute such a layer's attention."""


class NoQueriesError(UsageError):
    """Attention was asked of a layer or file that holds no queries: capture with ``--queries``
    (``queries=...``)."""


class InvalidTypeError(UsageError, TypeError):
    """An argument of a kind the call does not take (a file object that cannot seek, a
    filesystem that is neither fsspec's nor pyarrow's)."""


class WriterProcessError(KVSnapError, RuntimeError):
    """A writer process (`kvformat.writer_process`) stopped answering: it exited, or its pipe
    broke."""
