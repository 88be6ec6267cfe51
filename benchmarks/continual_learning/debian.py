"""Data files from a Debian package, installed or unpacked without root.

When the package is installed its files are read where it put them; otherwise ``apt-get download``
fetches the ``.deb`` (no root needed) and ``dpkg-deb -x`` unpacks it under a data directory, once.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path


class DebianPackageError(RuntimeError):
    """The package's files are not installed and could not be downloaded or unpacked."""


def package_dir(package: str, share_dir: str, names: tuple[str, ...], data_dir: Path, hint: str) -> Path:
    """The directory ``/<share_dir>`` holding all of ``names`` (installed package), else the same
    directory of the package unpacked under ``data_dir/<package>/root`` (downloaded when missing).

    Args:
        package: Debian package name, e.g. ``"dict-foldoc"``.
        share_dir: the files' directory inside the package, e.g. ``"usr/share/dictd"``.
        names: files that must be there.
        hint: what else the user can do (named in errors), e.g. ``"pass --foldoc-dir"``.

    Raises:
        DebianPackageError: ``apt-get``/``dpkg-deb`` missing or failing (their error quoted), or the
            unpacked package lacks one of ``names``.
    """
    installed = Path("/") / share_dir
    if all((installed / n).is_file() for n in names):
        return installed
    unpacked = Path(data_dir) / package / "root"
    files = unpacked / share_dir
    if all((files / n).is_file() for n in names):
        return files
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise DebianPackageError(f"{tool} not found: install Debian's {package} package, or {hint}")
    unpacked.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=unpacked.parent, prefix=".download-") as tmp:
        _run(["apt-get", "download", package], tmp, package, hint)
        debs = list(Path(tmp).glob("*.deb"))
        if len(debs) != 1:
            raise DebianPackageError(f"apt-get download {package} left {len(debs)} .deb files in {tmp}")
        _run(["dpkg-deb", "-x", str(debs[0]), str(Path(tmp) / "root")], tmp, package, hint)
        if unpacked.exists():
            shutil.rmtree(unpacked)
        (Path(tmp) / "root").rename(unpacked)
    missing = [n for n in names if not (files / n).is_file()]
    if missing:
        raise DebianPackageError(f"Debian's {package} has no {', '.join(missing)} under /{share_dir}; {hint}")
    return files


def _run(cmd: list[str], cwd: str, package: str, hint: str) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise DebianPackageError(f"`{' '.join(cmd)}` failed ({tail}); run `apt-get update` first, or install "
                                 f"{package}, or {hint}")
