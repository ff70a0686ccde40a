"""Bundles: one self-describing directory holding the compiled graphs, tokenizer and manifest.

Layout::

    manifest.json      format, versions, recipe, per-graph I/O signature and ranges, sha256 of every file
    target/            the target's engine files
    draft/             the draft's engine files (absent for draft-free methods)
    tokenizer/         the tokenizer files

Loading checks the format version, the versions the backend needs, and every file's size
and sha256, and says exactly what does not match.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .version import __version__
from .digest import sha256_of
from .errors import BundleError

FORMAT = "specc-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def hash_tree(root: Path) -> dict[str, dict]:
    """{relative path: {sha256, bytes}} for every file under root except the manifest."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            out[path.relative_to(root).as_posix()] = {"sha256": sha256_of(path), "bytes": path.stat().st_size}
    return out


class BundleWriter:
    """Builds a bundle in a hidden sibling directory and moves it into place only when complete,
    so a failed compile never leaves a half bundle or destroys the previous one."""

    def __init__(self, output: Path):
        self.output = output.resolve()
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix=f".{self.output.name}.partial-", dir=self.output.parent))

    def graph_dir(self, role: str) -> Path:
        path = self.root / role
        path.mkdir(exist_ok=True)
        return path

    def finish(self, manifest: dict) -> Path:
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "specc_version": __version__, **manifest}
        manifest["files"] = hash_tree(self.root)
        (self.root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        if self.output.exists():
            old = self.output.with_name(f".{self.output.name}.old-{os.getpid()}")
            self.output.rename(old)
            self.root.rename(self.output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.root.rename(self.output)
        return self.output

    def abort(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Bundle:
    path: Path
    manifest: dict

    def graph(self, role: str) -> dict | None:
        return self.manifest["graphs"].get(role)

    @property
    def recipe(self) -> dict:
        return self.manifest["recipe"]


def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise BundleError(f"bundle {path} does not exist; build one with `specc compile RECIPE`")
    if not (path / MANIFEST).is_file():
        raise BundleError(f"{path} is not a specc bundle: it has no {MANIFEST}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path / MANIFEST} is not valid JSON ({exc}); the bundle is corrupt, compile it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{path / MANIFEST} is not a specc manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"bundle format version {version} is not supported by specc {__version__} (it reads version {FORMAT_VERSION}); "
            "compile the recipe again with this specc"
        )
    for key in ("graphs", "files", "recipe", "backend"):
        if key not in manifest:
            raise BundleError(f"{path / MANIFEST} lacks the {key!r} section; the bundle is corrupt, compile it again")
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    """Every file the manifest lists exists with the recorded size and sha256."""
    problems = []
    for rel, meta in manifest["files"].items():
        file = path / rel
        if not file.is_file():
            problems.append(f"{rel}: missing")
        elif file.stat().st_size != meta["bytes"]:
            problems.append(f"{rel}: {file.stat().st_size} bytes, manifest says {meta['bytes']} (truncated or replaced)")
        elif sha256_of(file) != meta["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (file was modified)")
    if problems:
        raise BundleError(f"bundle {path} failed verification:\n  " + "\n  ".join(problems))


def open_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Read a bundle's manifest and (by default) verify every file against its hash."""
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest)
    return Bundle(path, manifest)
