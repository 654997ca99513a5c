"""Install otelprof from a `make gpu-bundle` folder, with no package index, into a folder.

    python3 scripts/gpu_bundle_install.py BUNDLE SITE

Run by `scripts/gpu-check` with the GPU machine's own `python3`. Of the bundle's wheels it
installs only those whose distribution this Python lacks, or has at a version that a
requirement in otelprof's dependency closure refuses; the machine's packages are left as they
are (SITE goes first on PYTHONPATH). otelprof's sdist is built here, so its C extension is
compiled for this Python; the build's own tools (setuptools, wheel) come from the bundle's
`build/` folder through pip's isolated build. Exits 1 naming what is missing or refused.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def _metadata_of(path: Path) -> str:
    """The METADATA (wheel) or PKG-INFO (sdist) text of a bundled distribution."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            (name,) = (n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            return wheel.read(name).decode()
    with tarfile.open(path) as sdist:
        member = next(m for m in sdist.getmembers() if m.name.count("/") == 1 and
                      m.name.endswith("/PKG-INFO"))  # fmt: skip
        handle = sdist.extractfile(member)
        assert handle is not None
        return handle.read().decode()


def _requirements(metadata: str) -> list[Requirement]:
    headers = HeaderParser().parsestr(metadata)
    reqs = [Requirement(line) for line in headers.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _installed(name: str, site: Path | None) -> Version | None:
    paths = ([str(site)] if site else []) + sys.path
    for dist in md.distributions(path=paths):
        if canonicalize_name(dist.metadata["Name"]) == name:
            return Version(dist.version)
    return None


def plan(bundle: Path) -> tuple[list[Path], list[str], dict[str, list[Requirement]]]:
    """(wheels to install, distributions taken from this Python, every closure requirement)."""
    manifest = json.loads((bundle / "bundle.json").read_text())
    by_name = {e["distribution"]: bundle / e["file"] for e in manifest["files"]}
    wanted: dict[str, list[Requirement]] = {}
    todo = ["otelprof"]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in by_name:
            continue  # a requirement the bundle does not carry: checked after the install
        for req in _requirements(_metadata_of(by_name[name])):
            wanted.setdefault(canonicalize_name(req.name), []).append(req)
            todo.append(canonicalize_name(req.name))
    install, kept = [], []
    for name, reqs in sorted(wanted.items()):
        have = _installed(name, None)
        if have is not None and all(have in r.specifier for r in reqs):
            kept.append(f"{name} {have}")
        elif name in by_name:
            install.append(by_name[name])
    return install, kept, wanted


def check(site: Path, wanted: dict[str, list[Requirement]]) -> list[str]:
    """Each closure requirement the installed result (SITE first) does not meet."""
    problems = []
    for name, reqs in sorted(wanted.items()):
        have = _installed(name, site)
        for req in reqs:
            if have is None or have not in req.specifier:
                problems.append(f"{req} (found {have or 'nothing'})")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    bundle, site = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    if not (bundle / "bundle.json").is_file():
        print(f"gpu-bundle-install: {bundle} is not a bundle (run `make gpu-bundle`)")
        return 1
    install, kept, wanted = plan(bundle)
    (sdist,) = bundle.glob("otelprof-*.tar.gz")
    print(f"from this Python: {', '.join(kept) or 'nothing'}")
    print(f"from the bundle: {', '.join(p.name.split('-')[0] for p in install) or 'nothing'}")
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
        "--no-cache-dir", "--no-compile", "--disable-pip-version-check",
        "--find-links", str(bundle / "build"), "--target", str(site), *map(str, install),
        str(sdist),
    ]  # fmt: skip
    if subprocess.run(cmd).returncode != 0:
        print("gpu-bundle-install: pip failed (above)")
        return 1
    problems = check(site, wanted)
    if problems:
        print("gpu-bundle-install: requirements not met: " + "; ".join(problems))
        return 1
    compiled = sorted(site.glob("otelprof/**/_speedups*.so"))
    if not compiled:
        print("gpu-bundle-install: otelprof's C extension was not built (no compiler?)")
        return 1
    print(f"otelprof installed in {site}, extension {compiled[0].relative_to(site)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
