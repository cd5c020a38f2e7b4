"""The release wheel (``make wheel``) installs into a fresh virtual environment and its command
line runs from there: ``disagg-rs plan`` with the library alone, ``disagg-rs demo`` with the
``demo`` extra, and without it one line naming the extra.

Nothing is downloaded: each fresh environment sees, through a ``.pth`` file, a directory of
links to exactly the distributions its requirements need (resolved from the wheel's own
metadata, transitively, in the development environment), and ``pip install --no-index``
resolves the wheel's requirements against them. So a package the CLI imports but the extra
does not declare is missing there, and the test fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "dist"

pytestmark = pytest.mark.slow


def _wheel() -> Path:
    wheels = sorted(DIST.glob("disagg_rs-*.whl"))
    if not wheels:
        pytest.fail("no wheel in dist/: run `make wheel` first (`make test` does)")
    return wheels[-1]


def _wheel_requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist: "):
            req = Requirement(line.removeprefix("Requires-Dist: "))
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
                out.append(req)
    return out


def _closure(reqs: Iterable[Requirement]) -> set[str]:
    """Distribution names needed by ``reqs`` (with their extras), transitively, here."""
    seen: set[tuple[str, str]] = set()
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == "disagg-rs":  # a self-referencing extra ("disagg_rs[demo]")
            todo.extend(_wheel_requirements(_wheel(), set(req.extras)))
            continue
        for extra in {"", *req.extras}:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for line in metadata.distribution(name).requires or []:
                sub = Requirement(line)
                if sub.marker is None or sub.marker.evaluate({"extra": extra}):
                    if extra and sub.marker is None:
                        continue  # the base requirements come with extra ""
                    todo.append(sub)
    return {name for name, _ in seen}


def _link_dir(dists: set[str], where: Path) -> Path:
    """A directory of links to the files of ``dists`` in this environment's site-packages."""
    where.mkdir()
    for name in dists:
        dist = metadata.distribution(name)
        site = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            if top in {"..", "__pycache__"} or top.endswith(".pth"):
                continue
            src, dst = site / top, where / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    return where


def _fresh_env(tmp: Path, extras: set[str]) -> Path:
    wheel = _wheel()
    deps = _closure(_wheel_requirements(wheel, extras))
    links = _link_dir(deps, tmp / "links")
    env_dir = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "dev-packages.pth").write_text(f"{links}\n")
    target = f"disagg_rs[{','.join(sorted(extras))}]" if extras else "disagg_rs"
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    proc = subprocess.run(
        [*pip, "install", "--no-index", "--find-links", str(wheel.parent), target],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Downloading" not in proc.stdout
    return env_dir


def _run(env_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env["PATH"] = f"{env_dir / 'bin'}:{env.get('PATH', '')}"
    return subprocess.run(
        [str(env_dir / "bin" / "disagg-rs"), *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=env_dir,  # not the repository: `import disagg_rs` must find the installed wheel
        timeout=900,  # a hang guard for the multi-process demo, not a measurement
    )


def _elf_section_names(data: bytes) -> list[str]:
    """Section names of a 64-bit little-endian ELF file."""
    assert data[:6] == b"\x7fELF\x02\x01"
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize, shnum, shstrndx = (
        int.from_bytes(data[o : o + 2], "little") for o in (0x3A, 0x3C, 0x3E)
    )

    def header(i: int) -> tuple[int, int]:  # (name offset, section file offset)
        h = data[shoff + i * shentsize : shoff + (i + 1) * shentsize]
        return int.from_bytes(h[0:4], "little"), int.from_bytes(h[0x18:0x20], "little")

    strtab = header(shstrndx)[1]
    names = []
    for i in range(shnum):
        start = strtab + header(i)[0]
        names.append(data[start : data.index(b"\0", start)].decode())
    return names


def test_the_wheel_is_abi3_manylinux_2_28_stripped_and_carries_the_license() -> None:
    wheel = _wheel()
    assert re.search(r"-cp310-abi3-manylinux_2_28_x86_64\.whl$", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        so = next(n for n in names if n.endswith(".so"))
        info = z.getinfo(so)
        meta = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert any(n.endswith("licenses/LICENSE") for n in names), names
    # Stripped: no .debug_* or .symtab section (the development build's .so is 11 MB).
    sections = _elf_section_names(zipfile.ZipFile(wheel).read(so))
    assert ".text" in sections
    assert not [n for n in sections if n.startswith(".debug") or n == ".symtab"], sections
    assert info.file_size < 4 << 20
    assert "License-Expression: Apache-2.0" in meta
    assert "Project-URL: Source" in meta
    assert "Provides-Extra: demo" in meta


def test_plan_runs_from_the_wheel_and_demo_without_its_extra_names_the_extra(
    tmp_path: Path,
) -> None:
    env_dir = _fresh_env(tmp_path, set())
    plan = _run(env_dir, "plan", "--src", "tp=2", "--dst", "tp=1", "--layers", "4")
    assert plan.returncode == 0, plan.stderr
    assert "2 transfers, 2 source ranks -> 1 destination ranks" in plan.stdout
    version = _run(env_dir, "--version")
    assert version.stdout.startswith("disagg-rs ")
    demo = _run(env_dir, "demo")
    assert demo.returncode == 2
    assert demo.stderr.strip().count("\n") == 0, demo.stderr
    assert 'pip install "disagg_rs[demo]"' in demo.stderr


def test_a_short_demo_runs_from_the_wheel_with_the_demo_extra(tmp_path: Path) -> None:
    env_dir = _fresh_env(tmp_path, {"demo"})
    demo = _run(env_dir, "demo", "--backend", "nccl", "--requests", "2", "--max-new-tokens", "2")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "OK: every answer equals the colocated run; nothing leaked." in demo.stdout
