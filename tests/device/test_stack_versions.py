"""The supported Ascend stacks (grpo_ascend/device/stack_versions.py): the check doctor runs, and the docs,
README and pyproject's ``npu`` extra agreeing with the one table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fake_device
import pytest
import torch

from grpo_ascend import cli
from grpo_ascend.config.generated_docs import update_block
from grpo_ascend.device import ascend, doctor_facts
from grpo_ascend.device import stack_versions as sv

ROOT = Path(__file__).resolve().parents[2]
ASCEND_DOC = ROOT / "docs" / "ascend.md"
START, END = "<!-- stack-versions:start -->", "<!-- stack-versions:end -->"
ROW = re.compile(r"^  (\S.*?)\s{2,}(\S.*)$")


def stack(**kw) -> sv.InstalledStack:
    base = {"python": "3.11.7", "torch": "2.12.0+cpu", "torch_npu": "2.12.0", "cann": "9.1.0"}
    return sv.InstalledStack(**{**base, **kw})


def test_a_row_of_the_table_is_supported():
    assert sv.check_npu_stack(stack()).status == "supported"
    assert sv.check_npu_stack(stack(torch="2.10.0", torch_npu="2.10.0.post6", cann="9.1.1")).status == "supported"
    assert sv.check_npu_stack(stack(torch="2.8.0", torch_npu="2.8.0", cann="8.3.RC1.alpha002")).status == "supported"
    assert sv.check_npu_stack(stack(torch_npu=None)).line() == "n/a (torch_npu is not installed)"


def test_torch_mismatch_names_the_torch_npu_for_the_installed_torch():
    verdict = sv.check_npu_stack(stack(torch="2.10.0", torch_npu="2.12.0"))
    assert verdict.status == "unsupported"
    assert "torch_npu 2.12.0 is built for torch 2.12.0, but torch 2.10.0 is installed" in verdict.problems[0]
    # the installed torch and CANN are kept: the 26.1.0 build of 2.10 on CANN 9.1.0
    assert verdict.fix.startswith("install torch==2.10.0 and torch-npu==2.10.0.post4 on CANN 9.1.0 with Python 3.10-3.13")
    line = verdict.line()
    assert "\n" not in line and line.startswith("unsupported: ") and "Fix: install" in line


def test_cann_and_python_mismatches():
    verdict = sv.check_npu_stack(stack(cann="8.5.0"))
    assert verdict.problems == ["torch_npu 2.12.0 needs CANN 9.1.0, CANN 8.5.0 is installed"]
    assert "torch==2.12.0 and torch-npu==2.12.0 on CANN 9.1.0" in verdict.fix  # no 2.12 build for CANN 8.5
    verdict = sv.check_npu_stack(stack(torch="2.9.0", torch_npu="2.9.0.post6", cann="8.5.0"))
    assert "torch-npu==2.9.0 on CANN 8.5.0" in verdict.fix  # the build of the installed torch for the installed CANN
    verdict = sv.check_npu_stack(stack(python="3.14.1"))
    assert verdict.status == "unsupported" and "supports Python 3.10-3.13, this is Python 3.14.1" in verdict.problems[0]


def test_versions_outside_the_table():
    verdict = sv.check_npu_stack(stack(torch="2.14.0", torch_npu="2.14.0"))
    assert verdict.status == "unlisted"
    assert verdict.problems == [f"torch_npu 2.14.0 is not in Ascend's table (as of {sv.LOOKED_UP})"]
    assert "torch==2.12.0 and torch-npu==2.12.0" in verdict.fix
    unknown = sv.check_npu_stack(stack(cann=None))
    assert unknown.status == "unlisted" and "the CANN version is unknown" in unknown.problems[0]


def test_vllm_ascend_stack():
    ok = stack(torch="2.10.0", torch_npu="2.10.0.post4", vllm="0.23.0", vllm_ascend="0.23.0.post1")
    assert sv.check_vllm_stack(ok).status == "supported"
    bad = sv.check_vllm_stack(stack(torch="2.10.0", torch_npu="2.10.0.post6", vllm="0.24.1", vllm_ascend="0.23.0"))
    assert bad.status == "unsupported"
    assert bad.problems == ["vllm-ascend 0.23.0 needs vllm 0.23.0, found 0.24.1",
                            "vllm-ascend 0.23.0 needs torch_npu 2.10.0.post4, found 2.10.0.post6"]
    assert bad.fix.startswith("install vllm==0.23.0 and vllm-ascend==0.23.0 with torch==2.10.0, torch-npu==2.10.0.post4")
    alone = sv.check_vllm_stack(stack(vllm="0.23.0"))
    assert alone.status == "unsupported" and "without vllm-ascend" in alone.problems[0]
    assert "vllm-ascend==0.23.0.post1" in alone.fix
    assert sv.check_vllm_stack(stack()).status == "n/a"
    assert sv.check_vllm_stack(stack(torch_npu=None, vllm="0.32.0")).status == "n/a"  # vLLM off Ascend


def test_pyproject_npu_extra_is_the_table():
    (npu,) = re.findall(r"^npu = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)  # no tomllib on 3.10
    assert npu == f'"{sv.npu_extra()}"'
    assert sv.npu_extra() == "torch-npu>=2.6.0,<2.13"


def test_docs_tables_are_generated_from_the_table(tmp_path):
    page = tmp_path / "ascend.md"
    page.write_text(ASCEND_DOC.read_text())
    if not update_block(page, START, END, sv.markdown_tables(), check=True):
        pytest.fail("docs/ascend.md's version tables are stale; put the output of "
                    "`python -m grpo_ascend.device.stack_versions` between its stack-versions markers")


def test_readme_and_ascend_doc_name_the_recommended_sets():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| Ascend NPU |"))
    best, vllm = sv.RECOMMENDED, sv.RECOMMENDED_VLLM
    for text in (f"torch {best.torch}", f"torch_npu {best.torch_npu}", f"CANN {best.cann}",
                 f"Python {sv.python_range(best.python)}", "docs/ascend.md#versions"):
        assert text in row, text
    doc = ASCEND_DOC.read_text()
    for text in (f"vllm-ascend {vllm.vllm_ascend}", f"vLLM {vllm.vllm}", f"torch_npu {vllm.torch_npu}"):
        assert text in doc, text


def test_device_layer_uses_no_deprecated_torch_npu_name():
    used = set()
    for path in (ROOT / "grpo_ascend" / "device").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
    found = {name: new for name, new in fake_device.DEPRECATED_NPU_APIS.items() if name in used}
    assert not found, f"deprecated torch_npu names in grpo_ascend/device (use the replacements): {found}"
    runtime = fake_device.FakeRuntime()
    assert not any(hasattr(runtime, name) for name in fake_device.DEPRECATED_NPU_APIS)


def test_watchdog_switches_read_the_current_names_first():
    assert ascend.watchdog_enabled({})
    assert ascend.watchdog_switch({"HCCL_ASYNC_ERROR_HANDLING": "0"}) == "HCCL_ASYNC_ERROR_HANDLING=0"
    assert ascend.watchdog_enabled({"TORCH_HCCL_ASYNC_ERROR_HANDLING": "1", "HCCL_ASYNC_ERROR_HANDLING": "0"})
    assert ascend.watchdog_switch({"TORCH_HCCL_BLOCKING_WAIT": "1"}) == "TORCH_HCCL_BLOCKING_WAIT=1"


def test_doctor_checks_the_fake_npu_stack(monkeypatch, capsys):
    fake_device.install(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch, "__version__", "2.12.0+cpu")
    assert doctor_facts.installed_stack().cann == "9.1.0"  # torch.version.cann is "not known": the runtime answers
    assert cli.main(["doctor"]) == 0
    rows = {m.group(1): m.group(2) for m in map(ROW.match, capsys.readouterr().out.splitlines()) if m}
    assert rows["torch_npu stack"] == "supported" and rows["CANN"] == "9.1.0"
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    assert cli.main(["doctor"]) == 0
    rows = {m.group(1): m.group(2) for m in map(ROW.match, capsys.readouterr().out.splitlines()) if m}
    assert rows["torch_npu stack"].startswith("unsupported: torch_npu 2.12.0 is built for torch 2.12.0, but torch "
                                              "2.14.0+cpu is installed. Fix: install torch==2.12.0 and torch-npu==2.12.0")
