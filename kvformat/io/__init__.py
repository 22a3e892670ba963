"""Where a `.kv` file's bytes come from and go to: local files, HTTP range requests and fsspec
object stores for reading; the one rule for every file a writer or a command publishes.

- `outputs`: an existing output is refused unless forced, never one of the command's own inputs,
  written under a temporary name and renamed once complete (`check_output`, `publish`,
  `output_path`, `files_into` for a folder of outputs); its extension names a format the command
  writes (`output_format`).
- `source`: a byte source over a local file (memory-mapped), an ``http(s)://`` URL or an fsspec
  path (`open_source`); `remote` batches and caches the range reads (`is_url`, `expand`).
- `http_range` (the standard library's HTTP client), `filesystems` (fsspec, optional), `durability`
  (fsync of a folder).

Standard library, numpy and, for object stores, fsspec only.
"""

from kvformat.io.outputs import (
    MissingFolderError,
    OutputExistsError,
    OutputFormatError,
    SameAsInputError,
    check_output,
    check_output_folder,
    files_into,
    in_use,
    lock_for_writing,
    output_format,
    output_path,
    publish,
    same_file,
)
from kvformat.io.remote import expand, is_url

__all__ = [
    "MissingFolderError",
    "OutputExistsError",
    "OutputFormatError",
    "SameAsInputError",
    "check_output",
    "check_output_folder",
    "expand",
    "files_into",
    "in_use",
    "is_url",
    "lock_for_writing",
    "output_format",
    "output_path",
    "publish",
    "same_file",
]
