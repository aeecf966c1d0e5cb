"""The wheel folder `benchmarks/gpu_check.sh` installs on a GPU machine without a package index.

    python benchmarks/gpu_wheels.py check .whl       # is the set complete and closed?
    python benchmarks/gpu_wheels.py installed .whl   # (on the GPU machine, after installing)
    python benchmarks/gpu_wheels.py missing .whl     # what gpu_check.sh's parts must do without

``check`` reads every ``*.whl`` in the folder (its ``METADATA``), and fails, naming them, when
- a pin of ``benchmarks/gpu_wheels.txt`` has no wheel of that version, or a wheel is no pin's;
- a wheel cannot run on the machine (CPython 3.12, Linux x86_64, glibc 2.28 or older tags);
- a requirement of a wheel (markers evaluated for that machine, the extras the project asks for)
  is neither a wheel in the folder nor a package of the image (``gpu_image_packages.txt``).
The image's versions are not known here, so a requirement it satisfies is checked by name only.
`benchmarks/gpu_wheels.sh` fills the folder, then runs this check.

``installed`` checks versions where they are known: in the Python that runs it, every requirement
of every wheel in the folder (markers evaluated there) is installed at a version it accepts.
`benchmarks/gpu_check.sh` runs it after installing the wheels, and says what conflicts.

``missing`` names, one ``package<TAB>why`` a line, each package `gpu_check.sh`'s parts use
(`IMPORTS`) that this Python cannot import, or that the folder (when there is one) cannot install:
no wheel of its own, or none of a dependency the image lacks. A wheel left out of the folder then
skips only the parts that need its package (docs/gpu.md); the exit status is 0 either way.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
PINS = HERE / "gpu_wheels.txt"
IMAGE = HERE / "gpu_image_packages.txt"
# What the project asks for (pyproject.toml), by the extras it names.
ROOTS = {"jsonargparse": {"signatures"}, "wandb": set(), "compressed-tensors": set()}
# What gpu_check.sh's parts import, by distribution: the roots above and the image's test tools.
IMPORTS = {
    "jsonargparse": ("jsonargparse", "docstring_parser", "typeshed_client"),  # [signatures]
    "wandb": ("wandb",),
    "compressed-tensors": ("compressed_tensors",),
    "pytest": ("pytest",),
    "hypothesis": ("hypothesis",),
}
# The GPU machine: python3 3.12 (CPython) on Linux x86_64.
MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
PLATFORMS = ("any", "linux_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64") + tuple(
    f"manylinux_2_{minor}_x86_64" for minor in range(5, 29)
)


def names(path: Path) -> list[str]:
    """The non-comment lines of a list file."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _runs_there(tag: Tag) -> bool:
    python_ok = tag.interpreter in ("py3", "cp312") or tag.interpreter.startswith("py3")
    abi_ok = tag.abi in ("none", "abi3", "cp312")
    return python_ok and abi_ok and tag.platform in PLATFORMS


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    return Parser().parsestr(text).get_all("Requires-Dist") or []


def problems(folder: Path, pins: list[str], image: list[str]) -> list[str]:
    """What is wrong with the wheel folder (empty: complete and closed)."""
    found: dict[str, tuple[str, Path]] = {}
    errors = []
    for wheel in sorted(folder.glob("*.whl")):
        project, built, _, tags = parse_wheel_filename(wheel.name)
        found[str(project)] = (str(built), wheel)
        if not any(_runs_there(tag) for tag in tags):
            errors.append(f"{wheel.name}: no tag runs on CPython 3.12, Linux x86_64")
    pinned: dict[str, str] = {}
    for pin in pins:
        requirement = Requirement(pin)
        (spec,) = requirement.specifier
        pinned[canonicalize_name(requirement.name)] = spec.version
    for name, version in pinned.items():
        if name not in found:
            errors.append(f"{name}=={version}: no wheel (run bash benchmarks/gpu_wheels.sh)")
        elif found[name][0] != version:
            errors.append(f"{name}: wheel {found[name][0]}, pinned {version}")
    errors += [f"{name}: a wheel no pin asks for" for name in found if name not in pinned]
    present = set(found) | {canonicalize_name(n) for n in image}
    for owner, (_, wheel) in found.items():
        extras = ROOTS.get(owner, set())
        for line in _requires(wheel):
            requirement = Requirement(line)
            wanted = _wanted(requirement, extras, markers=None)
            dependency = canonicalize_name(requirement.name)
            if wanted and dependency != owner and dependency not in present:
                errors.append(f"{owner} needs {line.split(';')[0].strip()}: not a wheel here")
    return errors


def _wanted(requirement: Requirement, extras: set[str], markers: dict[str, str] | None) -> bool:
    """Whether ``requirement`` applies with ``extras`` asked for: on the GPU machine (``markers``
    None: `MARKERS`), or on this Python (``{}``: packaging's default, the running interpreter)."""
    if requirement.marker is None:
        return True
    base = MARKERS if markers is None else markers
    return any(requirement.marker.evaluate({**base, "extra": e}) for e in (extras or {""}))


def installed_problems(folder: Path) -> list[str]:
    """Requirements of the folder's wheels that this Python's installed packages do not meet
    (markers evaluated for this Python)."""
    errors = []
    for wheel in sorted(folder.glob("*.whl")):
        owner = str(parse_wheel_filename(wheel.name)[0])
        for line in _requires(wheel):
            requirement = Requirement(line)
            if not _wanted(requirement, ROOTS.get(owner, set()), markers={}):
                continue
            try:
                version = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                errors.append(f"{owner} needs {requirement.name}: not installed")
                continue
            if not requirement.specifier.contains(version, prereleases=True):
                spec = f"{requirement.name}{requirement.specifier}"
                errors.append(f"{owner} needs {spec}: {version} is installed")
    return errors


def _first_gap(name: str, extras: set[str], wheels: dict[str, Path], image: set[str]) -> str | None:
    """The first package of ``name``'s dependency closure (``name`` included, markers of the GPU
    machine) that is neither a wheel in the folder nor a package of the image; None: none."""
    seen: set[str] = set()
    todo = [(canonicalize_name(name), extras)]
    while todo:
        project, wanted_extras = todo.pop()
        if project in seen:
            continue
        seen.add(project)
        if project not in wheels:
            if project in image:
                continue
            return project
        for line in _requires(wheels[project]):
            requirement = Requirement(line)
            if _wanted(requirement, wanted_extras, markers=None):
                todo.append((canonicalize_name(requirement.name), set(requirement.extras)))
    return None


def missing(folder: Path | None, image: list[str]) -> dict[str, str]:
    """``{package: why}`` for each package of `IMPORTS` that the wheel ``folder`` (None or absent:
    not consulted) cannot install, or that this Python cannot import."""
    wheels: dict[str, Path] | None = None
    if folder is not None and folder.is_dir():
        wheels = {str(parse_wheel_filename(w.name)[0]): w for w in sorted(folder.glob("*.whl"))}
    in_image = {canonicalize_name(n) for n in image}
    why = {}
    for name, modules in IMPORTS.items():
        if wheels is not None and name in ROOTS:
            gap = _first_gap(name, ROOTS[name], wheels, in_image)
            if gap is not None:
                needs = "" if gap == name else f", which {name} needs"
                why[name] = f"no wheel for {gap} in {folder}{needs}"
                continue
        absent = [m for m in modules if importlib.util.find_spec(m) is None]
        if absent:
            why[name] = f"not installed ({', '.join(absent)} cannot be imported)"
    return why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["check", "installed", "missing"])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "missing":  # the folder may be absent: then this Python alone decides
        for name, why in missing(args.folder, names(IMAGE)).items():
            print(f"{name}\t{why}")
        return 0
    if not args.folder.is_dir():
        print(f"{args.folder}: no such folder (fill it with bash benchmarks/gpu_wheels.sh)")
        return 1
    if args.command == "installed":
        errors = installed_problems(args.folder)
        for error in errors:
            print(f"gpu_wheels: {error}")
        print(f"gpu_wheels: installed: {len(errors)} unmet requirement(s) of the wheels")
        return 1 if errors else 0
    errors = problems(args.folder, names(PINS), names(IMAGE))
    for error in errors:
        print(f"gpu_wheels: {error}")
    count = len(list(args.folder.glob("*.whl")))
    print(f"gpu_wheels: {args.folder}: {count} wheels, " + ("NOT ready" if errors else "ready"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
