"""`make gpu-bundle`: what a bare GPU machine lacks to run `scripts/gpu-check` with no index.

    python scripts/gpu_bundle.py [OUT_DIR]        (default: gpu-bundle/)

The GPU machines lent for a check (an H100 or H200, see docs/DEVELOPING.md) have Python 3.12
with PyTorch, nvidia-ml-py, psutil, grpcio, protobuf, httpx, rich, pytest, setuptools and a C
compiler, but none of the OpenTelemetry packages and no package index. The bundle holds:

- a wheel for CPython 3.12 on manylinux x86-64 of every distribution in otelprof's runtime
  dependency closure, at the versions this environment resolved (the matched OpenTelemetry
  set): `scripts/gpu_bundle_install.py` installs only those the machine lacks or has at a
  version otelprof's requirements refuse, so the image's own packages stay as they are;
- otelprof itself as an sdist, so its C extension is compiled there, for that Python, and in
  `build/` the sdist's build requirements (pip builds it in isolation, from that folder);
- `bundle.json`: each file with its size and sha256, and the requirement it satisfies.

Fails (exit 1) when the bundle would exceed `MAX_BYTES`, what the device tool carries with
room for the working tree.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 60 << 20
TARGET_PYTHON = "3.12"
# The machine's marker environment: requirements are resolved for it, not for this machine.
TARGET_MARKERS = {
    "python_version": TARGET_PYTHON,
    "python_full_version": f"{TARGET_PYTHON}.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def runtime_closure(root: str = "otelprof") -> dict[str, str]:
    """{canonical name: installed version} of `root`'s runtime dependencies, transitively
    (no extras), evaluated for the GPU machine's Python and platform."""
    pinned: dict[str, str] = {}
    todo = [root]
    while todo:
        dist = md.distribution(todo.pop())
        name = canonicalize_name(dist.metadata["Name"])
        if name in pinned:
            continue
        pinned[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(TARGET_MARKERS):
                todo.append(req.name)
    pinned.pop(canonicalize_name(root))
    return pinned


def download_wheels(pins: dict[str, str], into: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp",
        *platforms, "--dest", str(into), *(f"{n}=={v}" for n, v in sorted(pins.items())),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)


def download_build_tools(into: Path) -> None:
    """pyproject.toml's build requirements, for pip's isolated build of the sdist there."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    pins = [_pin_installed(r) for r in requires]
    into.mkdir()
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
        "--python-version", TARGET_PYTHON, "--implementation", "cp", "--dest", str(into), *pins,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)


def _pin_installed(requirement: str) -> str:
    """`requirement` at the version this environment has, where it has one that fits."""
    req = Requirement(requirement)
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        return requirement
    return f"{req.name}=={version}" if version in req.specifier else requirement


def build_sdist(into: Path) -> Path:
    """otelprof's sdist, built from this checkout (its extension compiles on the machine)."""
    with tempfile.TemporaryDirectory(prefix="otelprof-sdist-") as tmp:
        subprocess.run(
            [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", tmp],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (built,) = Path(tmp).glob("otelprof-*.tar.gz")
        return Path(shutil.copy2(built, into / built.name))


def _wheel_name(path: Path) -> str:
    return canonicalize_name(path.name.split("-")[0])


def write_manifest(out: Path, pins: dict[str, str]) -> dict[str, object]:
    files = sorted(p for p in out.rglob("*") if p.suffix in (".whl", ".gz"))
    entries = []
    for path in files:
        data = path.read_bytes()
        name = "otelprof" if path.name.endswith(".tar.gz") else _wheel_name(path)
        if path.parent != out:
            name = f"build: {name}"  # the sdist's build tools, not installed
        entries.append(
            {
                "file": str(path.relative_to(out)),
                "distribution": name,
                "version": pins.get(name, ""),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    manifest: dict[str, object] = {
        "python": TARGET_PYTHON,
        "platforms": list(PLATFORMS),
        "bytes": sum(int(str(e["bytes"])) for e in entries),
        "files": entries,
    }
    (out / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "gpu-bundle")
    args = parser.parse_args(argv)
    out: Path = args.out
    pins = runtime_closure()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    download_wheels(pins, out)
    missing = sorted(set(pins) - {_wheel_name(p) for p in out.glob("*.whl")})
    if missing:
        print(f"gpu-bundle: no wheel downloaded for {', '.join(missing)}", file=sys.stderr)
        return 1
    download_build_tools(out / "build")
    sdist = build_sdist(out)
    manifest = write_manifest(out, pins)
    size = int(str(manifest["bytes"]))
    print(
        f"gpu-bundle: {len(pins)} wheels + {sdist.name} in {out}, "
        f"{size / (1 << 20):.1f} MiB (limit {MAX_BYTES >> 20} MiB)"
    )
    if size > MAX_BYTES:
        print(f"gpu-bundle: larger than {MAX_BYTES >> 20} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
