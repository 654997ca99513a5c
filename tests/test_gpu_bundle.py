"""The GPU check's path, kept from rotting between lent GPUs: `make gpu-bundle`'s folder installs
with no package index into a Python that has what the GPU machines' image has (PyTorch, psutil,
grpcio, ...) and none of the OpenTelemetry packages, and `scripts/gpu-check` gets through its
install and build steps to its first GPU step, which says it needs an NVIDIA GPU."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
# what the GPU machines' image lacks (see scripts/gpu_bundle.py)
NOT_IN_IMAGE = ("opentelemetry-", "googleapis-common-protos", "otelprof")


def _image_view(into: Path) -> None:
    """This environment's packages less those the image lacks, as links: a distribution's
    files are linked by top-level entry, or file by file where two share one (`google/`)."""
    owners: dict[str, dict[Path, bool]] = {}
    site = sysconfig.get_path("purelib")
    for dist in md.distributions(path=[site]):
        allowed = not canonicalize_name(dist.metadata["Name"]).startswith(NOT_IN_IMAGE)
        for file in dist.files or []:
            parts = Path(file).parts
            if parts and parts[0] != "..":
                owners.setdefault(parts[0], {})[Path(file)] = allowed
    for top, files in owners.items():
        if all(files.values()):
            (into / top).symlink_to(Path(site) / top)
            continue
        for file, allowed in files.items():
            if allowed and (Path(site) / file).exists():
                (into / file).parent.mkdir(parents=True, exist_ok=True)
                (into / file).symlink_to(Path(site) / file)


def _image_python(tmp: Path) -> Path:
    """A fresh virtual environment that sees the image's packages and nothing else."""
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True)
    python = tmp / "venv" / "bin" / "python"
    view = tmp / "image-site"
    view.mkdir()
    _image_view(view)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "image.pth").write_text(f"{view}\n")
    return python


def test_the_bundle_installs_without_an_index_and_gpu_check_stops_at_its_first_gpu_step(
    tmp_path: Path,
) -> None:
    bundle = tmp_path / "bundle"
    made = subprocess.run(
        [sys.executable, "scripts/gpu_bundle.py", str(bundle)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert sum(p.stat().st_size for p in bundle.rglob("*")) < 60 << 20
    python = _image_python(tmp_path)
    lacks = subprocess.run([python, "-c", "import opentelemetry.sdk"], capture_output=True)
    assert lacks.returncode != 0, "the stand-in image must lack the OpenTelemetry packages"
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(python), "GPU_BUNDLE": str(bundle)}
    env.update(GPU_CHECK_OUT=str(out), CUDA_VISIBLE_DEVICES="")
    check = subprocess.run(
        ["scripts/gpu-check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    installed = (out / "install.log").read_text()
    assert "opentelemetry_sdk" in installed.split("from the bundle:")[1], installed
    assert "extension otelprof/" in installed and "_speedups" in installed, installed
    if check.returncode == 2:  # no GPU here: the first GPU step says so, before any step
        assert "gpu-check needs an NVIDIA GPU" in check.stdout, check.stdout + check.stderr
    else:  # a machine with a GPU ran every step
        assert (out / "summary.txt").is_file(), check.stdout + check.stderr
