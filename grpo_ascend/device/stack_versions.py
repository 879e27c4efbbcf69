"""The Ascend software stacks we support, as data: torch / torch_npu / CANN / Python, and the vLLM backend's
vllm-ascend / vLLM / torch_npu / CANN sets; the check doctor runs against them, with a one-line fix.

One place: ``grpo-ascend doctor``, docs/ascend.md's tables (:func:`markdown_tables`) and pyproject's ``npu``
extra (:func:`npu_extra`) are all checked against these rows by tests/device/test_stack_versions.py. No torch import.

Sources, looked up on :data:`LOOKED_UP`:

- Ascend/pytorch ``COMPATIBILITY.md`` (the TorchNPU version table, and PyTorch <-> Python) and
  ``docs/zh/release_notes.md`` (26.1.0: package version, CANN, Python per branch);
  the 26.1.1 rows (CANN 9.1.x) from the same table on gitcode's master; torch_npu 2.10.0 <-> CANN 9.0.0
  from the v2.12.0 README (dropped from the table by mistake: Ascend/pytorch issue 4688).
- vllm-ascend's release compatibility matrix (``docs/source/community/versioning_policy.md``, v0.23.0 docs)
  and its v0.23.0 installation page; PyPI for what is published (torch-npu up to 2.14.0, vllm-ascend up to
  0.23.0.post1, a post-release of v0.23.0 with no matrix row of its own, so it carries v0.23.0's).

Only rows with torch >= 2.6 are listed: transformers 5 and accelerate need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

LOOKED_UP = "2026-12-04"
TORCH_NPU_TABLE_URL = "https://gitcode.com/Ascend/pytorch/blob/master/COMPATIBILITY.md"
VLLM_ASCEND_MATRIX_URL = "https://docs.vllm.ai/projects/ascend/en/latest/community/versioning_policy.html"


@dataclass(frozen=True)
class NpuStack:
    """One row of Ascend's table: a torch_npu package version, the torch it is built for, its CANN, Pythons."""

    torch_npu: str
    torch: str
    cann: str  # 'X.Y.Z', 'X.Y.RCn', or 'X.Y.X' for any X.Y.z
    python: tuple[str, ...]
    release: str  # the TorchNPU product version (the branch suffix)


@dataclass(frozen=True)
class VllmAscendStack:
    """One row of vllm-ascend's compatibility matrix (vllm-ascend pins torch-npu exactly)."""

    vllm_ascend: str
    vllm: str
    torch: str
    torch_npu: str
    cann: str
    python: tuple[str, ...]


_PY_310_313 = ("3.10", "3.11", "3.12", "3.13")
_PY_39_313 = ("3.9", *_PY_310_313)
_PY_39_311 = ("3.9", "3.10", "3.11")

#: Ascend's TorchNPU table, newest first (torch >= 2.6 only). The first row is Ascend's recommended set.
TORCH_NPU_STACKS: tuple[NpuStack, ...] = (
    NpuStack("2.12.0", "2.12.0", "9.1.0", _PY_310_313, "26.1.0"),
    NpuStack("2.12.0.post2", "2.12.0", "9.1.X", _PY_310_313, "26.1.1"),
    NpuStack("2.11.0", "2.11.0", "9.1.0", _PY_310_313, "26.1.0"),
    NpuStack("2.11.0.post2", "2.11.0", "9.1.X", _PY_310_313, "26.1.1"),
    NpuStack("2.10.0.post4", "2.10.0", "9.1.0", _PY_310_313, "26.1.0"),
    NpuStack("2.10.0.post6", "2.10.0", "9.1.X", _PY_310_313, "26.1.1"),
    NpuStack("2.10.0", "2.10.0", "9.0.0", _PY_310_313, "26.0.0"),
    NpuStack("2.9.0.post6", "2.9.0", "9.1.0", _PY_310_313, "26.1.0"),
    NpuStack("2.9.0.post8", "2.9.0", "9.1.X", _PY_310_313, "26.1.1"),
    NpuStack("2.9.0.post2", "2.9.0", "9.0.0", _PY_310_313, "26.0.0"),
    NpuStack("2.9.0", "2.9.0", "8.5.0", _PY_310_313, "7.3.0"),
    NpuStack("2.8.0.post4", "2.8.0", "9.0.0", _PY_39_313, "26.0.0"),
    NpuStack("2.8.0.post2", "2.8.0", "8.5.0", _PY_39_313, "7.3.0"),
    NpuStack("2.8.0", "2.8.0", "8.3.RC1", _PY_39_313, "7.2.0"),
    NpuStack("2.7.1.post8", "2.7.1", "9.1.0", _PY_39_313, "26.1.0"),
    NpuStack("2.7.1.post10", "2.7.1", "9.1.X", _PY_39_313, "26.1.1"),
    NpuStack("2.7.1.post4", "2.7.1", "9.0.0", _PY_39_313, "26.0.0"),
    NpuStack("2.7.1.post2", "2.7.1", "8.5.0", _PY_39_313, "7.3.0"),
    NpuStack("2.7.1", "2.7.1", "8.3.RC1", _PY_39_313, "7.2.0"),
    NpuStack("2.6.0.post5", "2.6.0", "8.5.0", _PY_39_311, "7.3.0"),
    NpuStack("2.6.0.post3", "2.6.0", "8.3.RC1", _PY_39_311, "7.2.0"),
    NpuStack("2.6.0", "2.6.0", "8.2.RC1", _PY_39_311, "7.1.0"),
)

#: vllm-ascend final releases on PyPI with torch >= 2.6, newest first; the first row is what we recommend.
VLLM_ASCEND_STACKS: tuple[VllmAscendStack, ...] = (
    VllmAscendStack("0.23.0.post1", "0.23.0", "2.10.0", "2.10.0.post4", "9.1.0", ("3.10", "3.11", "3.12")),
    VllmAscendStack("0.23.0", "0.23.0", "2.10.0", "2.10.0.post4", "9.1.0", ("3.10", "3.11", "3.12")),
    VllmAscendStack("0.18.0", "0.18.0", "2.9.0", "2.9.0.post1+git4c901a4", "8.5.1", ("3.10", "3.11")),
)

RECOMMENDED = TORCH_NPU_STACKS[0]
RECOMMENDED_VLLM = VLLM_ASCEND_STACKS[0]


def base_version(version: str) -> str:
    """'2.10.0' of '2.10.0.post4', '2.10.0+cpu', '2.10.0rc2' or 'v2.10.0'."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    return ".".join(match.group(1).split(".")[:3]) if match else version.strip()


def _release_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in base_version(version).split("."))


def npu_extra() -> str:
    """pyproject's ``npu`` extra: every torch-npu line of the table, and no newer line."""
    lines = sorted({_release_tuple(row.torch_npu)[:2] for row in TORCH_NPU_STACKS})
    low, high = lines[0], lines[-1]
    oldest = min((row.torch_npu for row in TORCH_NPU_STACKS if _release_tuple(row.torch_npu)[:2] == low),
                 key=_release_tuple)
    return f"torch-npu>={base_version(oldest)},<{high[0]}.{high[1] + 1}"


def cann_matches(installed: str, listed: str) -> bool:
    """Whether an installed CANN version ('9.1.0', '8.3.RC1.alpha002', ...) is the table's ('9.1.0', '9.1.X')."""
    have, want = installed.strip().upper(), listed.strip().upper()
    if want.endswith(".X"):
        return have.startswith(want[:-1])
    return have == want or have.startswith(want + ".")


def python_range(pythons: tuple[str, ...]) -> str:
    """'3.10-3.13' for ('3.10', ..., '3.13')."""
    return pythons[0] if len(pythons) == 1 else f"{pythons[0]}-{pythons[-1]}"


def install_line(row: NpuStack) -> str:
    """What to install for a table row, in one phrase."""
    cann = row.cann.replace(".X", ".x")
    return (f"torch=={row.torch} and torch-npu=={row.torch_npu} on CANN {cann} with Python "
            f"{python_range(row.python)}")


def vllm_install_line(row: VllmAscendStack) -> str:
    """What to install for a vllm-ascend matrix row, in one phrase."""
    return (f"vllm=={row.vllm} and vllm-ascend=={row.vllm_ascend} with torch=={row.torch}, "
            f"torch-npu=={row.torch_npu} on CANN {row.cann}, Python {python_range(row.python)}")


@dataclass(frozen=True)
class InstalledStack:
    """Versions found on this machine (None: not installed, or for CANN: unknown)."""

    python: str
    torch: str | None
    torch_npu: str | None
    cann: str | None
    vllm: str | None = None
    vllm_ascend: str | None = None


@dataclass
class StackVerdict:
    """``status``: 'supported', 'unlisted' (not in the tables: may work), 'unsupported' or 'n/a' (no torch_npu);
    ``problems``: one sentence each; ``fix``: one line naming the versions to install ('' when supported)."""

    status: str
    problems: list[str] = field(default_factory=list)
    fix: str = ""

    def line(self) -> str:
        """The doctor's one-line summary."""
        if self.status in ("supported", "n/a"):
            return self.status + (f" ({self.problems[0]})" if self.problems else "")
        return f"{self.status}: {'; '.join(self.problems)}. Fix: {self.fix}"


def _row_for(torch_npu: str) -> NpuStack | None:
    return next((row for row in TORCH_NPU_STACKS if row.torch_npu == torch_npu.strip()), None)


def _rows_for_torch(torch: str) -> list[NpuStack]:
    return [row for row in TORCH_NPU_STACKS if row.torch == base_version(torch)]


def _suggest(stack: InstalledStack) -> NpuStack:
    """The row to move to: keep the installed torch (and CANN, then Python) when the table allows it."""
    candidates = _rows_for_torch(stack.torch or "") or list(TORCH_NPU_STACKS)
    python = ".".join(stack.python.split(".")[:2])
    for keep in (lambda r: stack.cann is not None and cann_matches(stack.cann, r.cann) and python in r.python,
                 lambda r: python in r.python, lambda r: True):
        found = [row for row in candidates if keep(row)]
        if found:
            return found[0]
    return RECOMMENDED


def check_npu_stack(stack: InstalledStack) -> StackVerdict:
    """Whether torch, torch_npu, CANN and Python form one row of Ascend's table."""
    if stack.torch_npu is None:
        return StackVerdict("n/a", ["torch_npu is not installed"])
    problems: list[str] = []
    if stack.torch is None or base_version(stack.torch) != base_version(stack.torch_npu):
        problems.append(f"torch_npu {stack.torch_npu} is built for torch {base_version(stack.torch_npu)}, "
                        f"but torch {stack.torch or 'is not installed'}" + (" is installed" if stack.torch else ""))
    row = _row_for(stack.torch_npu)
    unlisted = row is None
    if row is None:
        problems.append(f"torch_npu {stack.torch_npu} is not in Ascend's table (as of {LOOKED_UP})")
    else:
        if stack.cann is None:
            problems.append(f"the CANN version is unknown (torch_npu {row.torch_npu} needs CANN "
                            f"{row.cann.replace('.X', '.x')})")
        elif not cann_matches(stack.cann, row.cann):
            problems.append(f"torch_npu {row.torch_npu} needs CANN {row.cann.replace('.X', '.x')}, "
                            f"CANN {stack.cann} is installed")
        python = ".".join(stack.python.split(".")[:2])
        if python not in row.python:
            problems.append(f"torch_npu {row.torch_npu} supports Python {python_range(row.python)}, "
                            f"this is Python {stack.python}")
    if not problems:
        return StackVerdict("supported")
    only_unknown_cann = len(problems) == 1 and stack.cann is None and row is not None
    status = "unlisted" if (unlisted and len(problems) == 1) or only_unknown_cann else "unsupported"
    return StackVerdict(status, problems, f"install {install_line(_suggest(stack))} ({TORCH_NPU_TABLE_URL})")


def check_vllm_stack(stack: InstalledStack) -> StackVerdict:
    """Whether vllm, vllm-ascend, torch, torch_npu and CANN form one row of vllm-ascend's matrix."""
    if stack.vllm_ascend is None and (stack.vllm is None or stack.torch_npu is None):
        return StackVerdict("n/a", ["vllm-ascend is not installed"])
    fix = f"install {vllm_install_line(RECOMMENDED_VLLM)} ({VLLM_ASCEND_MATRIX_URL})"
    if stack.vllm_ascend is None:
        return StackVerdict("unsupported", [f"vllm {stack.vllm} is installed without vllm-ascend, so vLLM rollouts "
                                            "cannot use the NPUs"], fix)
    row = next((r for r in VLLM_ASCEND_STACKS if r.vllm_ascend == stack.vllm_ascend.strip()), None)
    if row is None:
        return StackVerdict("unlisted", [f"vllm-ascend {stack.vllm_ascend} is not in our copy of vllm-ascend's "
                                         f"matrix (as of {LOOKED_UP})"], fix)
    fix = f"install {vllm_install_line(row)} ({VLLM_ASCEND_MATRIX_URL})"
    wanted = {"vllm": (stack.vllm, row.vllm), "torch": (stack.torch, row.torch), "torch_npu": (stack.torch_npu, row.torch_npu)}
    problems = []
    for name, (have, want) in wanted.items():
        same = have is not None and (have.strip() == want if name == "torch_npu" else base_version(have) == want)
        if not same:
            problems.append(f"vllm-ascend {row.vllm_ascend} needs {name} {want}, found {have or 'none'}")
    if stack.cann is not None and not cann_matches(stack.cann, row.cann):
        problems.append(f"vllm-ascend {row.vllm_ascend} needs CANN {row.cann}, found {stack.cann}")
    python = ".".join(stack.python.split(".")[:2])
    if python not in row.python:
        problems.append(f"vllm-ascend {row.vllm_ascend} supports Python {python_range(row.python)}, "
                        f"this is Python {stack.python}")
    return StackVerdict("unsupported", problems, fix) if problems else StackVerdict("supported")


def markdown_tables() -> str:
    """docs/ascend.md's version tables, generated from the rows above (tests keep the page in step)."""
    lines = [f"Ascend's TorchNPU table ([source]({TORCH_NPU_TABLE_URL}), looked up {LOOKED_UP}; torch >= 2.6 rows):",
             "", "| torch_npu | torch | CANN | Python | TorchNPU release |", "|---|---|---|---|---|"]
    lines += [f"| {r.torch_npu} | {r.torch} | {r.cann.replace('.X', '.x')} | {python_range(r.python)} | {r.release} |"
              for r in TORCH_NPU_STACKS]
    lines += ["", f"vllm-ascend's compatibility matrix ([source]({VLLM_ASCEND_MATRIX_URL}), looked up {LOOKED_UP}):",
              "", "| vllm-ascend | vLLM | torch | torch_npu | CANN | Python |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.vllm_ascend} | {r.vllm} | {r.torch} | {r.torch_npu} | {r.cann} | {python_range(r.python)} |"
              for r in VLLM_ASCEND_STACKS]
    lines += ["", f"pyproject's `npu` extra: `{npu_extra()}`."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_tables())
