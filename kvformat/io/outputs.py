"""One rule for every file or folder a command writes.

- An existing output is refused (`OutputExistsError`) unless ``force``/``overwrite`` is given.
- An output that is one of the command's own inputs is refused even then (`SameAsInputError`).
- The output's folder must exist (`MissingFolderError`): nothing is created silently above it.
- The data goes to a temporary name in the output's folder and is renamed to the output path only
  once it is complete, so an interrupted or failed run leaves nothing (or the old file) there.
  Without ``force`` the rename does not replace a file that appeared meanwhile (a hard link, then
  the temporary name removed: no window where another writer's file is lost).

The errors are `OSError`/`ValueError` subclasses, so the command line reports them in one line with
exit status 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

from kvformat.errors import InvalidArgumentError, KVSnapError

__all__ = [
    "MissingFolderError",
    "OutputError",
    "OutputExistsError",
    "OutputFormatError",
    "OutputIsFileError",
    "OutputIsFolderError",
    "SameAsInputError",
    "check_output",
    "check_output_folder",
    "files_into",
    "in_use",
    "inside",
    "lock_for_writing",
    "output_format",
    "output_path",
    "publish",
    "refuse_inside",
    "same_file",
]


class OutputError(KVSnapError, OSError):
    """An output path a command refuses; its message reads as written (no ``[Errno 17]``)."""

    def __str__(self) -> str:
        return self.strerror if self.strerror else super().__str__()


class OutputExistsError(OutputError, FileExistsError):
    """The output path exists and ``force`` was not given."""


class SameAsInputError(KVSnapError, ValueError):
    """The output path names one of the command's own inputs, or lies inside a folder it reads
    (a model folder)."""


class MissingFolderError(OutputError, FileNotFoundError):
    """The output's folder does not exist."""


class OutputIsFolderError(OutputError, IsADirectoryError):
    """A file was to be written where a folder is."""


class OutputIsFileError(OutputError, NotADirectoryError):
    """A folder was to be written where a file is."""


class OutputFormatError(KVSnapError, ValueError):
    """An output name whose extension is a format the command does not write."""


REPLACE = "replace it with --force (overwrite=True from Python)"


def output_format(path: str | os.PathLike[str], formats: Iterable[str], option: str = "-o") -> str:
    """The format an output is written in: its extension, lower case, without the dot, when it is
    one of ``formats`` (``("parquet", "csv")``); `OutputFormatError` naming the ones there are
    otherwise (a name without one included), before any work."""
    allowed = tuple(formats)
    name = os.path.basename(os.fspath(path))
    extension = os.path.splitext(name)[1].lower().lstrip(".")
    if extension in allowed:
        return extension
    found = f".{extension}" if extension else "no extension"
    listed = ", ".join(f".{f}" for f in allowed)
    raise OutputFormatError(f"{option} {os.fspath(path)}: {found}; this command writes {listed}")


def _is_url(path: str) -> bool:
    return "://" in path


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name the same file (same resolved path, or the same inode through
    a hard link or another mount). URLs compare as text."""
    a, b = os.fspath(a), os.fspath(b)
    if _is_url(a) or _is_url(b):
        return a == b
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is ``folder`` or lies anywhere under it (links resolved; URLs never)."""
    a, b = os.fspath(path), os.fspath(folder)
    if _is_url(a) or _is_url(b):
        return False
    target, root = os.path.realpath(a), os.path.realpath(b)
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)


def refuse_inside(path: str | os.PathLike[str], folders: Iterable[str | os.PathLike[str]]) -> None:
    """`SameAsInputError` where ``path`` lies in one of ``folders`` (folders a command reads)."""
    for folder in folders:
        if inside(path, folder):
            raise SameAsInputError(
                f"{os.fspath(path)} is inside {os.fspath(folder)}, a folder this command reads; "
                "write the output elsewhere"
            )


def check_output(
    path: str | os.PathLike[str],
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    force: bool = False,
    folder: bool = False,
    input_folders: Iterable[str | os.PathLike[str]] = (),
) -> str:
    """Refuse ``path`` as an output before any work: one of ``inputs`` (even with ``force``), a
    path inside one of ``input_folders`` (folders the command reads, such as a model's: every
    file in them is an input, even with ``force``), an existing file or folder without
    ``force``, a folder where a file is wanted (and the reverse), or a missing parent folder.
    Returns the path as a string."""
    out = os.fspath(path)
    for source in inputs:
        if same_file(out, source):
            raise SameAsInputError(f"{out} is an input of this command; write the output elsewhere")
    refuse_inside(out, input_folders)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise MissingFolderError(errno.ENOENT, f"{out}: folder {parent} does not exist")
    if os.path.isdir(out) and not folder:
        raise OutputIsFolderError(errno.EISDIR, f"{out} is a folder; give a file name")
    if os.path.lexists(out):
        if folder and not os.path.isdir(out):
            raise OutputIsFileError(errno.ENOTDIR, f"{out} is a file; give a folder name")
        if not force:
            raise OutputExistsError(errno.EEXIST, f"{out} exists; {REPLACE}")
    return out


def publish(temporary: str, path: str, *, force: bool = False) -> None:
    """Rename the finished ``temporary`` (a file or folder in ``path``'s folder) to ``path``.
    Without ``force`` an existing ``path`` is never replaced (`OutputExistsError`, ``temporary``
    left in place for the caller to remove)."""
    if os.path.isdir(temporary):
        _publish_folder(temporary, path, force)
        return
    if force:
        os.replace(temporary, path)
        return
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise OutputExistsError(errno.EEXIST, f"{path} exists; {REPLACE}") from None
    except OSError:  # no hard links here (some network and FAT file systems): check, then rename
        if os.path.lexists(path):
            raise OutputExistsError(errno.EEXIST, f"{path} exists; {REPLACE}") from None
        os.replace(temporary, path)
        return
    os.unlink(temporary)


def _publish_folder(temporary: str, path: str, force: bool) -> None:
    """`publish` for a folder: an existing ``path`` (with ``force``) is moved aside first, then
    removed once ``temporary`` has taken its name. Only a folder holding nothing but names the new
    one holds too is replaced: anything else in it (a file of the user's, the command's input)
    is refused, so that no file the command did not write is lost."""
    if not os.path.lexists(path):
        os.rename(temporary, path)
        return
    if not force:
        raise OutputExistsError(errno.EEXIST, f"{path} exists; {REPLACE}")
    foreign = sorted(set(os.listdir(path)) - set(os.listdir(temporary)))
    if foreign:
        raise OutputExistsError(
            errno.EEXIST,
            f"{path} holds {foreign[0]!r}, which this command does not write: "
            "choose another folder (--force replaces only a folder of this command's own files)",
        )
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path) or ".")
    os.rmdir(old)
    os.rename(path, old)
    os.rename(temporary, path)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.unlink(old)


def lock_for_writing(fd: int) -> None:
    """Take an exclusive advisory lock (``flock``) on a file being written, held until it is
    closed: `in_use` in another process (or another open of the file) then sees it. A no-op
    where ``flock`` does not exist (Windows) or the file system refuses it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def in_use(path: str | os.PathLike[str]) -> bool:
    """Whether a live writer holds ``path`` (`lock_for_writing`); False where locks do not
    exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return False
    with open(path, "rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return False


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def output_path(
    path: str | os.PathLike[str],
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    force: bool = False,
    folder: bool = False,
) -> Iterator[str]:
    """Check ``path`` (`check_output`), yield a temporary name in its folder to write to (a
    created empty folder with ``folder``), and on success `publish` it to ``path``; on any error
    the temporary is removed and ``path`` is untouched.

    The temporary name keeps the output's extension (``.tmp-XXXXXXXX.out.parquet``), so libraries
    that pick a format by extension write the same bytes."""
    out = check_output(path, inputs=inputs, force=force, folder=folder)
    parent = os.path.dirname(os.path.abspath(out))
    name = os.path.basename(out)
    # Not created here (but for a folder): the writer creates it, with the usual permissions.
    temporary = os.path.join(parent, f".tmp-{os.urandom(4).hex()}.{name}")
    if folder:
        os.mkdir(temporary)
    try:
        yield temporary
        publish(temporary, out, force=force)
    except BaseException:
        _remove(temporary)
        raise


def check_output_folder(path: str | os.PathLike[str]) -> str:
    """Refuse ``path`` as a folder to write files into, before any work: a file, a URL, or a
    missing parent folder. An existing folder is fine (`files_into` writes only its own names
    there). Returns the path as a string."""
    out = os.fspath(path)
    if _is_url(out):
        raise InvalidArgumentError(f"{out}: write the output to a local folder")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutputIsFileError(errno.ENOTDIR, f"{out} is a file; give a folder name")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out) and not os.path.isdir(parent):
        raise MissingFolderError(errno.ENOENT, f"{out}: folder {parent} does not exist")
    return out


def check_names(
    folder: str | os.PathLike[str],
    names: Iterable[str],
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    force: bool = False,
) -> None:
    """Refuse writing files ``names`` into ``folder``: a name that is one of ``inputs`` (even with
    ``force``), names a folder, or exists without ``force``."""
    sources = list(inputs)
    for name in names:
        target = os.path.join(os.fspath(folder), name)
        for source in sources:
            if same_file(target, source):
                raise SameAsInputError(f"{target} is an input of this command; write the output elsewhere")
        if os.path.isdir(target):
            raise OutputIsFolderError(errno.EISDIR, f"{target} is a folder; this command writes a file there")
        if os.path.lexists(target) and not force:
            raise OutputExistsError(
                errno.EEXIST,
                f"{target} exists; --force (overwrite=True from Python) replaces the files this "
                "command writes (nothing else in the folder is touched)",
            )


@contextlib.contextmanager
def files_into(
    folder: str | os.PathLike[str],
    names: list[str],
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    force: bool = False,
) -> Iterator[str]:
    """Write the files ``names`` into ``folder`` (created if missing): yields a temporary folder to
    write them to; on success each is moved to ``folder/name``. Nothing else in ``folder`` is
    read, replaced or removed; ``force`` replaces only files named in ``names``, never one of
    ``inputs``. On any error (or a name the caller did not write) the temporary folder is removed
    and ``folder`` is as it was, but for files already moved when a rename failed."""
    out = check_output_folder(folder)
    sources = list(inputs)
    if not os.path.isdir(out):  # a new folder: written beside it, renamed in one step
        with output_path(out, inputs=sources, folder=True) as temporary:
            yield temporary
            missing = sorted(set(names) - set(os.listdir(temporary)))
            if missing:
                raise FileNotFoundError(errno.ENOENT, f"{missing[0]} was not written")
        return
    check_names(out, names, inputs=sources, force=force)
    temporary = tempfile.mkdtemp(prefix=".tmp-", suffix=".kvsnap", dir=out)
    try:
        yield temporary
        check_names(out, names, inputs=sources, force=force)  # nothing appeared meanwhile
        for name in names:
            publish(os.path.join(temporary, name), os.path.join(out, name), force=force)
    finally:
        _remove(temporary)
