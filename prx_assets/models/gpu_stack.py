"""The GPU stack, resolved from registry metadata and installed with uv's overrides.

    python -m prx_assets.models.gpu_stack check     # CI: does the GPU stack still resolve?
    python -m prx_assets.models.gpu_stack install   # a CUDA Linux x86-64 machine

What the stack is, is not written down here: it is `ray[llm]` at the installed Ray's version
(whose extra names the vLLM that Ray's LLM stage is tested with), and the torch, torchvision
and transformers that this vLLM resolves to for Linux x86-64 (PyPI's CUDA wheels), read from
the registry at run time. The project then installs beside them with those three overridden
(OVERRIDES says why each), because `pip install '.[gpu]'` cannot resolve:

- the CPU install pins torch==2.14.1 (the release on the build machines' disk); every vLLM
  pins its own torch;
- vLLM >= 0.24 needs transformers 5, and every mosaicml-streaming release declares
  transformers<5 (the project's own <5 follows it, so pip installs one consistent set on
  the CPU); pip has no way to override a declared bound, uv has `--override`.

An override replaces every requirement on that package, so the resolution cannot see a
third package's bound on it: `make test-transformers5` is what shows the code runs there.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from packaging.requirements import Requirement

PLATFORM = "x86_64-manylinux_2_28"  # Linux x86-64: PyPI's torch wheels there are CUDA builds
PYTHON_VERSION = "3.11"  # requires-python's floor, and the CPU install's
REPO = Path(__file__).resolve().parents[2]
# The packages the GPU stack's own resolution decides for the project, and why each must be
# overridden rather than resolved with the project's bounds.
OVERRIDES = {
    "torch": "vLLM pins its own torch (a CUDA build); the CPU install pins 2.14.1, the "
             "release on the build machines' disk",
    "torchvision": "built against exactly one torch: the one vLLM pins",
    "transformers": "vLLM >= 0.24 needs transformers 5; mosaicml-streaming declares <5 in "
                    "every release but only imports BatchFeature/BatchEncoding, which 5.x "
                    "keeps (make test-transformers5 runs the code there)",
}
CUDA_RUNTIME = "nvidia-cuda-runtime"  # its version is the CUDA the torch wheel was built for


class StackError(RuntimeError):
    """The GPU stack does not resolve; the message names the conflicting pins."""


def ray_llm() -> str:
    """`ray[llm]` at the installed Ray's version."""
    return f"ray[llm]=={importlib.metadata.version('ray')}"


def named_vllm() -> str:
    """The vLLM requirement that the installed Ray's `llm` extra names."""
    for line in importlib.metadata.requires("ray") or []:
        requirement = Requirement(line)
        if requirement.name == "vllm" and requirement.marker is not None \
                and requirement.marker.evaluate({"extra": "llm"}):
            return str(requirement).split(";")[0].strip()
    raise StackError(f"ray {importlib.metadata.version('ray')} names no vllm in its llm extra")


def uv_binary() -> str:
    """uv beside this interpreter (the test extra installs it), else on the PATH."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.exists() else shutil.which("uv")
    if found is None:
        raise StackError("uv is missing: pip install uv (it is in the test extra)")
    return found


def compile_command(inputs: Sequence[str], overrides: Path | None,
                    python_version: str = PYTHON_VERSION) -> list[str]:
    """A resolver dry run for Linux x86-64 from metadata alone (nothing is installed)."""
    command = [uv_binary(), "pip", "compile", "--quiet", "--no-header", "--no-annotate",
               "--python-platform", PLATFORM, "--python-version", python_version, *inputs]
    return command + (["--override", str(overrides)] if overrides else [])


def resolve(requirements: Iterable[str], overrides: Path | None = None,
            extras: Sequence[str] = ("gpu",), with_project: bool = True) -> dict[str, str]:
    """Name -> version of everything `requirements` (and the project with `extras`) resolve
    to; StackError with the resolver's explanation when they do not."""
    with tempfile.TemporaryDirectory() as folder:
        listed = Path(folder) / "requirements.in"
        listed.write_text("".join(f"{r}\n" for r in requirements))
        inputs = [str(listed)]
        if with_project:
            inputs = [str(REPO / "pyproject.toml"), *inputs,
                      *(arg for extra in extras for arg in ("--extra", extra))]
        run = subprocess.run(compile_command(inputs, overrides), capture_output=True,
                             text=True, check=False, cwd=REPO)
    if run.returncode != 0:
        raise StackError(run.stderr.strip() or run.stdout.strip())
    return parse_pins(run.stdout)


def parse_pins(text: str) -> dict[str, str]:
    """`name==version` lines of a compiled requirements file."""
    pins = {}
    for line in text.splitlines():
        found = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;]+)", line)
        if found:
            pins[canonical(found.group(1))] = found.group(2)
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stack_pins() -> dict[str, str]:
    """What `ray[llm]` resolves to on its own for Linux x86-64."""
    return resolve([ray_llm()], with_project=False)


def overrides_text(pins: dict[str, str], only: Iterable[str] = OVERRIDES) -> str:
    """uv's override file: each package at the GPU stack's version, its reason beside it."""
    return "".join(f"{name}=={pins[name]}  # {OVERRIDES[name]}\n" for name in only)


def check(extra_requirements: Sequence[str] = ()) -> str:
    """The project's gpu extra beside `ray[llm]`, with the overrides, resolved from metadata:
    a summary of the stack; StackError naming the conflict otherwise."""
    pins = stack_pins()
    with tempfile.TemporaryDirectory() as folder:
        overrides = Path(folder) / "overrides.txt"
        overrides.write_text(overrides_text(pins))
        resolved = resolve([ray_llm(), *extra_requirements], overrides)
    lines = [f"GPU stack resolves for {PLATFORM}, Python {PYTHON_VERSION} "
             f"({len(resolved)} packages, from metadata; nothing installed):",
             f"  {named_vllm()} (named by {ray_llm()}) -> vllm {resolved['vllm']}"]
    lines += [f"  {name} {resolved[name]}  (overrides the project's bound: {OVERRIDES[name]})"
              for name in OVERRIDES]
    lines += [f"  {name} {resolved[name]}" for name in ("mosaicml-streaming", CUDA_RUNTIME)
              if name in resolved]
    return "\n".join(lines)


def pip_index_args(python: str = sys.executable) -> list[str]:
    """The indexes, wheel folders and constraints pip is configured with, as uv arguments
    (uv does not read pip's configuration; a build machine keeps torch on its disk)."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, check=False).stdout
    flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
             "find-links": "--find-links", "constraint": "--constraint"}
    pairs: list[tuple[str, str]] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        flag = flags.get(key.rsplit(".", 1)[-1], "")
        for item in value.strip().strip("'\"").split() if flag else []:
            if (flag, item) not in pairs:  # global and environment settings repeat
                pairs.append((flag, item))
    args = [part for pair in pairs for part in pair]
    if any(flag in args for flag in ("--extra-index-url", "--find-links")):
        args += ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best version wins
    return args


def install(target: str, extras: Sequence[str], only: Sequence[str], with_ray_llm: bool,
            dry_run: bool = False) -> None:
    """Install the project (editable, with `extras`) into `target`'s environment with the GPU
    stack's versions of `only` overridden (and `ray[llm]` itself when `with_ray_llm`)."""
    text = overrides_text(stack_pins(), only)
    print(f"gpu_stack: installing {ray_llm() if with_ray_llm else 'the project'} with these "
          f"overrides:\n{text}", end="", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        overrides = Path(folder) / "overrides.txt"
        overrides.write_text(text)
        project = f"{REPO}[{','.join(extras)}]" if extras else str(REPO)
        # The CPU torch comes from wherever pip is set to find it (a build machine's disk);
        # the GPU torch only from the registry's CUDA builds (uv's own settings still apply).
        indexes = [] if "torch" in only else pip_index_args()
        command = [uv_binary(), "pip", "install", "--python", target, "-e", project,
                   *([ray_llm()] if with_ray_llm else []), "--override", str(overrides),
                   *indexes, *(["--dry-run"] if dry_run else [])]
        if subprocess.run(command, check=False).returncode != 0:
            raise StackError(f"uv pip install failed (its output above): {' '.join(command)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prx_assets.models.gpu_stack",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    checking = commands.add_parser("check", help="resolve the GPU stack from metadata")
    checking.add_argument("--with", dest="extra", action="append", default=[],
                          help="one more requirement (shows what a conflicting pin does)")
    installing = commands.add_parser("install", help="install the GPU stack here")
    installing.add_argument("--python", default=sys.executable,
                            help="the environment's interpreter (default: this one)")
    installing.add_argument("--extra", action="append", default=None,
                            help="project extras (default: gpu)")
    installing.add_argument("--only", action="append", choices=sorted(OVERRIDES),
                            help="override only these (default: all; transformers alone "
                                 "is the CPU install on transformers 5)")
    installing.add_argument("--no-ray-llm", action="store_true",
                            help="leave ray[llm] (and vLLM) out")
    installing.add_argument("--dry-run", action="store_true",
                            help="resolve and list the changes; install nothing")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            print(check(args.extra))
        else:
            install(args.python, args.extra or ["gpu"], args.only or list(OVERRIDES),
                    not args.no_ray_llm, args.dry_run)
    except StackError as error:
        print(f"gpu_stack: the GPU stack does not resolve for {PLATFORM}, Python "
              f"{PYTHON_VERSION}:\n{error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
