"""Where a command's outputs go: a stream (standard output, a pipe, a device) appended to, or a file of its own
written beside itself and renamed over it when whole; and the check that refuses an output before a run that could
not write it, rather than after it (``laps simulate``, ``laps loadgen`` and the bench scripts' ``--out``).
"""

from __future__ import annotations

import errno
import itertools
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from stat import S_IMODE, S_ISCHR, S_ISSOCK
from typing import BinaryIO


MAX_LINK_HOPS = 40  # as Linux's own limit on links followed in one lookup (ELOOP)


def is_stream(path: Path) -> bool:
    """Whether ``path`` names a stream rather than a file of its own: an existing path that is no regular file (a
    device, a FIFO, a pipe; a socket or a folder too, which :func:`check_output_path` refuses), or a path
    that is, or whose links lead through, a link that names a file descriptor (``/dev/stdout``, ``/dev/stderr``,
    ``/dev/fd/N``, ``/proc/PID/fd/N``), whatever the shell redirected it to (or nothing, where it is closed). A file of
    its own under ``/dev/shm``, or a link there to one, is none. Outputs are appended to a stream as they are: no plot
    beside it, no file renamed over it.

    Raises:
        OSError: the path cannot be looked up (a folder on the way that cannot be searched).
    """
    path = Path(path).absolute()
    if path.exists() and not path.is_file():
        return True
    return _names_descriptor(path) or any(_names_descriptor(link) for link, _ in link_chain(path))


def link_chain(path: Path) -> Iterator[tuple[Path, str]]:
    """The links on the way from ``path`` to what it names, each as (its absolute path, the text it holds); at most
    :data:`MAX_LINK_HOPS` (a longer chain, or a loop, ends there).

    Raises:
        OSError: a link cannot be looked up.
    """
    path = Path(path).absolute()
    for _ in range(MAX_LINK_HOPS):
        if not path.is_symlink():
            return
        text = os.readlink(path)
        yield path, text
        path = path.parent / text  # a relative link from its own folder


def _names_descriptor(path: Path) -> bool:
    """Whether absolute ``path`` is one of the links that name an open file descriptor (:func:`is_stream`)."""
    parts = path.parts
    if parts[1:2] == ("dev",):
        return parts[2:] in (("stdin",), ("stdout",), ("stderr",)) or parts[2:3] == ("fd",)
    return parts[1:2] == ("proc",) and parts[3:4] == ("fd",)


def is_stdout(path: Path) -> bool:
    """Whether ``path`` is a stream (:func:`is_stream`) that goes where this process's standard output goes, a pipe or
    a file (the tables a command prints then go to standard error, so the output stays one JSON document); a device
    (a terminal, /dev/null) is none: what is printed there goes there anyway."""
    try:
        if not is_stream(path):
            return False
        out = os.stat(path)
        return not S_ISCHR(out.st_mode) and os.path.samestat(out, os.fstat(1))
    except OSError:  # no standard output, or a path that cannot be looked up
        return False


def partial_path(target: Path) -> Path:
    """Where :func:`open_output` writes a file before renaming it over ``target`` (``NAME.partial`` beside it)."""
    return target.with_name(target.name + ".partial")


def beside(out: Path, name: str) -> Path:
    """The file called ``name`` in the folder ``out`` is in (a link named ``out`` has its plot beside the link, not
    where it leads)."""
    return Path(out).parent / name


def written_in_place(target: Path, earlier: os.stat_result | None) -> bool:
    """Whether :func:`open_output` writes ``target`` in place rather than beside itself: an existing file with other
    names (hard links: it stays one file), or in a folder that cannot take the file beside it (``earlier``:
    ``target``'s stat, None where it does not exist)."""
    return earlier is not None and (earlier.st_nlink > 1 or not os.access(target.parent, os.W_OK | os.X_OK))


def make_folders(folder: Path) -> tuple[Path, ...]:
    """Make ``folder`` and those missing above it; the ones made, innermost first (for :func:`remove_empty`).

    Raises:
        OSError: a folder cannot be made.
    """
    missing = tuple(itertools.takewhile(lambda f: not f.exists(), (folder, *folder.parents)))
    for i in reversed(range(len(missing))):  # outermost first; where one cannot be made, those made are removed
        try:
            missing[i].mkdir(exist_ok=True)
        except OSError:
            remove_empty(missing[i + 1:])
            raise
    return missing


def remove_empty(folders: Iterable[Path]) -> None:
    """Remove each of ``folders`` (innermost first) while it is empty; one with something in it, and those above it,
    stay."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


@contextmanager
def open_output(path: Path) -> Iterator[BinaryIO]:
    """Open an output for writing, as a ``with`` block: a stream (:func:`is_stream`) appended to, as a shell's ``>>``
    would; a file of its own written beside itself (:func:`partial_path`, at a link's target; a file or link left
    there from before removed first, never written through) and renamed over it, with the earlier file's permission
    bits, when the block ends, so a write that fails (a full disk) or is interrupted leaves the earlier file whole and
    no partial file nor folder this call made. An existing file :func:`written_in_place` is written in place.

    Raises:
        OSError: the file, the one beside it or a folder cannot be written (an existing file without write
            permission included; a folder in the way of the file beside it).
    """
    if is_stream(path):
        with open(path, "ab") as f:
            yield f
        return
    target = Path(path).resolve()
    made = make_folders(target.parent)
    earlier = target.stat() if target.exists() else None
    if earlier is not None and not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    if written_in_place(target, earlier):
        with open(target, "wb") as f:
            yield f
        return
    partial = partial_path(target)
    try:
        if os.path.lexists(partial) and not partial.is_dir():
            partial.unlink()
        f = open(partial, "xb")
    except OSError:
        remove_empty(made)
        raise
    try:
        with f:
            if earlier is not None:
                os.fchmod(f.fileno(), S_IMODE(earlier.st_mode) & 0o777)
            yield f
        partial.replace(target)
    except BaseException:
        partial.unlink(missing_ok=True)
        remove_empty(made)
        raise


def check_output_path(flag: str, path: Path) -> object:
    """Refuse ``path`` (``flag``'s) before a run unless it names a file of its own that :func:`open_output` can write:
    an existing one (or what a link names: a FIFO, a device, /dev/stdout; no socket) writable, without being opened;
    a new one creatable; and, as a file is written beside itself and renamed over (unless :func:`written_in_place`),
    its ``NAME.partial`` too (each created and removed again here; a folder of that name refused); in folders still
    to be made (made when the outputs are written, at a link's target), names the file system takes, under a nearest
    existing folder in which a folder can be made (one is made and removed again). The link it names may not name a
    folder (``dir/``, ``dir/.``) nor a file descriptor that is not open, and the way to it (links followed where they
    are met) may not go up (``..``) from a folder that is not there (``missing/../x.json``, which the system cannot
    open). What tells it apart from other outputs: None for a device, which takes any number; a pipe's or an existing
    file's device and inode (a hard link, or /dev/stdout redirected to it, is the same file); else the path it would
    be written at (a link's target).

    Raises:
        ValueError: why, naming the flag and the path.
    """
    try:
        return _check_output_path(flag, path)
    except OSError as err:  # a folder on the way that cannot be searched, a name too long to look up
        raise ValueError(f"{flag} {path}: cannot be written ({err.strerror or err})") from None


def _check_output_path(flag: str, path: Path) -> object:
    """:func:`check_output_path`, which turns this one's OSError into its ValueError.

    Raises:
        ValueError: as :func:`check_output_path`.
        OSError: the path cannot be looked up.
    """
    for _, link in link_chain(path):
        if link in (".", "..") or link.endswith(("/", "/.", "/..")):
            raise ValueError(f"{flag} {path}: a link to a folder ({link}), not to a file")
    missing = _up_from_missing(path)
    if missing is not None:
        raise ValueError(f"{flag} {path}: cannot be written (the way to it goes up (..) from {missing}, which is no folder)")
    if path.is_dir():
        raise ValueError(f"{flag} {path}: a directory, not a file name")
    if not path.exists() and is_stream(path):
        raise ValueError(f"{flag} {path}: names a file descriptor that is not open")
    try:
        target = path.resolve()  # where it is written: a link's target, a dangling link's too
    except RuntimeError as err:  # a loop of links
        raise ValueError(f"{flag} {path}: cannot be written ({err})") from None
    identity: object = target
    if path.exists():  # not opened here
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: cannot be written (no write permission)")
        stat = path.stat()  # what a stream goes to: a file redirected to is one file with its own name
        if S_ISSOCK(stat.st_mode):
            raise ValueError(f"{flag} {path}: a socket, not a file")
        if is_stream(path):
            return None if S_ISCHR(stat.st_mode) else (stat.st_dev, stat.st_ino)
        identity = stat.st_dev, stat.st_ino
        if written_in_place(target, stat):
            return identity
    partial = partial_path(target)
    if not target.parent.is_dir():
        _check_folders_can_be_made(flag, path, partial)
        return identity
    longest = os.pathconf(target.parent, "PC_NAME_MAX")
    if len(os.fsencode(partial.name)) > longest:
        raise ValueError(f"{flag} {path}: cannot be written ({_ends(partial.name)}, which it is written as first, "
                         f"is longer than {longest} bytes)")
    if partial.is_dir():
        raise ValueError(f"{flag} {path}: cannot be written ({partial.name}, which it is written as first, is a folder)")
    for name in (target, partial):
        if os.path.lexists(name):
            continue  # the file itself (checked above), or a file or link left from before: replaced when written
        try:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except OSError as err:
            raise ValueError(f"{flag} {path}: cannot be written ({err.strerror or err}: {name.name})") from None
        name.unlink()
    return identity


def _up_from_missing(path: Path) -> Path | None:
    """Where looking ``path`` up as the system does, part by part with every link followed where it is met, would go
    up (``..``) from something that is no folder (``missing/../x.json``, or a link to ``gone/../dir`` on the way),
    which the system refuses though :meth:`pathlib.Path.resolve` takes it; None where it goes up from none.

    Raises:
        OSError: a link cannot be read.
    """
    here, ahead, links = Path("/"), list(reversed(Path(path).absolute().parts[1:])), 0
    while ahead:
        part = ahead.pop()
        if part == "..":
            if not here.is_dir():
                return here
            here = here.parent
        elif (here / part).is_symlink() and links < MAX_LINK_HOPS:
            links += 1
            text = Path(os.readlink(here / part))
            here = Path("/") if text.is_absolute() else here
            ahead.extend(reversed(text.parts[1:] if text.is_absolute() else text.parts))
        else:
            here = here / part
    return None


def _ends(name: str) -> str:
    """A long file name shortened to its two ends (where a suffix such as ``.partial`` shows)."""
    return name if len(name) <= 50 else f"{name[:24]}...{name[-24:]}"


def _check_folders_can_be_made(flag: str, path: Path, first: Path) -> None:
    """Refuse ``path`` (``flag``'s, whose file is written first at ``first``, its NAME.partial) where the folders it
    needs could not be made: its nearest existing ancestor is not a folder, or no folder can be made in it (one is
    made and removed again), or a name on the way is longer than that file system takes.

    Raises:
        ValueError: naming the ancestor or the name, and why.
    """
    ancestor = next(a for a in first.parents if a.exists())  # the root always exists
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {path}: cannot make its folder ({ancestor} is not a folder)")
    longest = os.pathconf(ancestor, "PC_NAME_MAX")
    for name in first.relative_to(ancestor).parts:
        if len(os.fsencode(name)) > longest:
            raise ValueError(f"{flag} {path}: cannot be written (a name longer than {longest} bytes: {_ends(name)})")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".laps-check-", dir=ancestor))
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot make its folder in {ancestor} ({err.strerror or err})") from None
