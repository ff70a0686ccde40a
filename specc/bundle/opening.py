"""Opening a bundle: its manifest read and its id checked, then every file checked against the manifest's file
table before any loader opens one; and the refusal of backends that run code from a bundle unless trusted."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..digest import sha256_of
from ..errors import BundleError
from ..recipe import Recipe

from .manifest import MANIFEST, GraphEntry, Manifest, normalize_id, read_manifest


@dataclass
class Bundle:
    path: Path
    manifest: Manifest
    trust_code: bool = False  # the caller accepts backends that execute code from the bundle

    @property
    def id(self) -> str:
        return self.manifest.id

    def graph(self, role: str) -> GraphEntry | None:
        return self.manifest.graph(role)

    @property
    def recipe(self) -> Recipe:
        return self.manifest.recipe


def check_files(path: Path, manifest: Manifest, verify: bool = True, prefixes: tuple[str, ...] | None = None) -> None:
    """The bundle on disk is exactly the manifest's file table: every listed file (under prefixes, if
    given) is a regular file inside the bundle with the recorded size and (verify) sha256, and every
    file present is listed. Nothing is opened by a loader before this passes."""
    root = Path(path).resolve()
    problems = []
    present = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for name in dirnames + filenames:
            full = base / name
            rel = full.relative_to(root).as_posix()
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                problems.append(f"{rel}: a symlink (bundles hold regular files only)")
            elif stat.S_ISDIR(mode):
                continue
            elif not stat.S_ISREG(mode):
                problems.append(f"{rel}: not a regular file")
            elif rel != MANIFEST:
                present.add(rel)
        dirnames[:] = [d for d in dirnames if not os.path.islink(base / d)]
    wanted = {rel: meta for rel, meta in manifest.files.items() if prefixes is None or rel.startswith(prefixes)}
    for rel in sorted(present - set(manifest.files)):
        problems.append(f"{rel}: present but not listed in the manifest (unlisted files are refused)")
    for rel, meta in sorted(wanted.items()):
        if rel not in present:
            if not any(p.startswith(f"{rel}: ") for p in problems):
                problems.append(f"{rel}: missing")
            continue
        size = os.lstat(root / rel).st_size
        if size != meta.bytes:
            problems.append(f"{rel}: {size} bytes, manifest says {meta.bytes} (truncated or replaced)")
        elif verify and sha256_of(root / rel) != meta.sha256:
            problems.append(f"{rel}: sha256 differs from the manifest (file was modified)")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise BundleError(f"bundle {path} failed verification:", details=shown)


def open_bundle(path: str | Path, verify: bool = True, expect_id: str | None = None, trust_code: bool = False,
                prefixes: tuple[str, ...] | None = None) -> Bundle:
    """Read a bundle's manifest, check its id against expect_id, and check its files (sizes and
    listing always; sha256 unless verify=False). prefixes: a partial bundle holding only the
    listed files under these paths (Triton's split layout)."""
    path = Path(path)
    manifest = read_manifest(path)
    if expect_id is not None and manifest.id != normalize_id(expect_id):
        raise BundleError(f"bundle {path} has id {manifest.id}, not the expected {normalize_id(expect_id)}; "
                          "it was rebuilt or tampered with")
    try:
        check_files(path, manifest, verify=verify, prefixes=prefixes)
    except OSError as exc:
        raise BundleError(f"cannot read bundle {path}: {exc.strerror or exc}") from None
    return Bundle(path, manifest, trust_code)


def check_code_trust(bundle: Bundle, reason: str | None) -> None:
    """Refuse to open a graph whose backend runs code from the bundle (reason says how) unless trusted."""
    if reason and not bundle.trust_code:
        raise BundleError(f"bundle {bundle.path} uses backend {bundle.manifest.backend!r}: {reason}. Loading it runs "
                          "that code with your privileges; pass trust_code=True (CLI: --trust-code) only for bundles "
                          "you built or whose id you pinned (--expect-id)")
