"""CLI dispatcher and ``grpo-ascend doctor``."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import fake_device
import pytest
import torch

from grpo_ascend import cli
from grpo_ascend import device as dev
from grpo_ascend.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^  (\S.*?)\s{2,}(\S.*)$")


@pytest.fixture()
def cpu_only(monkeypatch):
    fake_device.cpu_only(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_doctor_prints_versions_device_and_env(cpu_only, capsys, monkeypatch):
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "900")
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    matches = [ROW.match(line) for line in out.splitlines() if line.startswith("  ")]
    assert all(matches)
    rows = {m.group(1): m.group(2) for m in matches}
    for label in ("python", "torch", "torch_npu", "CANN", "transformers", "peft", "accelerate", "datasets",
                  "device", "device count", "bf16 supported", "dist backend", "free memory"):
        assert label in rows, label
    assert rows["torch"].startswith(torch.__version__)
    assert rows["torch_npu"] == "not installed" and rows["CANN"] == "n/a"
    assert rows["device"] == "cpu" and rows["dist backend"] == "gloo" and rows["bf16 supported"] == "yes"
    assert rows["HCCL_CONNECT_TIMEOUT"] == "900"
    assert rows["HCCL_EXEC_TIMEOUT"] == "unset -> 1740 when the run is on Ascend"  # ddp_timeout 1800 - 60
    assert rows["ddp_timeout"] == "1800 s (process-group timeout)"
    assert "GiB free of" in rows["free memory"] and "host RAM" in rows["free memory"]
    assert len({m.start(2) for m in matches}) == 1  # values line up in one column


def test_doctor_json(cpu_only, capsys):
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device_type"] == "cpu" and report["dist_backend"] == "gloo"
    assert set(report["packages"]) == {"transformers", "peft", "accelerate", "datasets"}


def test_doctor_unusable_device_exits_2_with_one_line(cpu_only, capsys):
    assert cli.main(["doctor", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-ascend: error: device 'cuda' requested")
    assert cli.main(["doctor", "--device", "npu:0"]) == 2
    assert "torch_npu is not installed" in capsys.readouterr().err
    assert cli.main(["doctor", "--device", "gpu"]) == 2
    assert "unknown device 'gpu'" in capsys.readouterr().err
    assert cli.main(["doctor", "--device", "cpu"]) == 0


def test_registry_dispatch_and_error_handling(monkeypatch, capsys):
    seen = {}

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("config")

    def run(args: argparse.Namespace) -> int:
        seen["config"] = args.config
        if args.config == "bad":
            raise ConfigError("learning_rate must be > 0, got -1;\nfix the recipe")
        if args.config == "missing.yaml":
            Path(args.config).read_text()  # raises FileNotFoundError
        return 0

    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command("a test command", add_arguments, run))
    assert cli.main(["--log-level", "warning", "fake", "ok.yaml"]) == 0
    assert seen["config"] == "ok.yaml"
    assert cli.main(["fake", "bad"]) == 2
    err = capsys.readouterr().err
    assert err == "grpo-ascend: error: learning_rate must be > 0, got -1; fix the recipe\n"
    monkeypatch.chdir(REPO / "tests")
    assert cli.main(["fake", "missing.yaml"]) == 2
    assert capsys.readouterr().err == "grpo-ascend: error: file not found: missing.yaml\n"
    assert cli.main([]) == 2 and "COMMAND" in capsys.readouterr().err
    assert cli.main(["nonsense"]) == 2
    assert cli.main(["--help"]) == 0 and "doctor" in capsys.readouterr().out


def test_lazy_imports_only_when_called(monkeypatch):
    monkeypatch.delitem(sys.modules, "json.tool", raising=False)
    target = cli.lazy("json.tool:main")
    assert "json.tool" not in sys.modules
    assert callable(target)
    assert cli.lazy("os.path:basename")("/a/b.txt") == "b.txt"
    with pytest.raises(ValueError, match="package.module:function"):
        cli.lazy("os.path.basename")


def test_python_dash_m_doctor_subprocess():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    result = subprocess.run(
        [sys.executable, "-m", "grpo_ascend.cli", "doctor"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "transformers" in result.stdout and "dist backend" in result.stdout


def test_doctor_reports_broken_torch_npu(monkeypatch, capsys):
    fake_device.broken_torch_npu(monkeypatch, "libhccl.so: cannot open shared object file")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "import failed: OSError: libhccl.so" in out and "\nwarning: torch_npu is installed but unusable" in out
    assert cli.main(["doctor", "--device", "npu"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "set_env.sh" in err[0] and "libhccl.so" in err[0]


def test_doctor_on_a_fake_npu_shows_chip_and_effective_timeouts(monkeypatch, capsys):
    fake_device.install(monkeypatch, soc="Ascend910ProB")
    for name in (*dev.NPU_RUNTIME_DEFAULTS, "HCCL_EXEC_TIMEOUT", "LOCAL_RANK"):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    assert cli.main(["doctor", "--ddp_timeout", "3600"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): m.group(2) for m in map(ROW.match, out.splitlines()) if m}
    assert rows["device"] == "npu:0" and rows["device name"] == "Ascend910ProB"
    assert rows["chip family"] == "Atlas training series" and rows["dist backend"] == "hccl"
    assert rows["ddp_timeout"] == "3600 s (process-group timeout)"
    assert rows["HCCL exec timeout"] == "3540 s (derived from ddp_timeout, 3536 s on this chip)"  # 52 x 68 s
    assert rows["HCCL watchdog"] == "3600 s (torch_npu 2.12.0)"


def _doctor_subprocess(tmp_path: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]), **env_extra}
    env.pop("LOCAL_RANK", None)
    if "TORCH_DEVICE_BACKEND_AUTOLOAD" not in env_extra:
        env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    return subprocess.run([sys.executable, "-m", "grpo_ascend.cli", "doctor", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_doctor_explains_import_torch_failing_on_an_autoloaded_backend(tmp_path):
    fake_device.autoloaded_broken_torch_npu(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode != 0 and "Failed to load the backend extension: torch_npu" in probe.stderr  # the fake works

    result = _doctor_subprocess(tmp_path)
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert "Traceback" not in out + result.stderr
    assert "error: `import torch` failed: RuntimeError: Failed to load the backend extension: torch_npu" in out
    assert "cause: OSError: libascendcl.so: cannot open shared object file" in out
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in out
    assert "export TORCH_DEVICE_BACKEND_AUTOLOAD=0" in out
    base = torch.__version__.split("+")[0]
    assert f'pip install "torch-npu=={base}.*"' in out and "(installed: 2.5.1)" in out
    rows = {m.group(1): m.group(2) for m in map(ROW.match, out.splitlines()) if m}
    assert rows["torch_npu"] == "torch-npu 2.5.1 (torch_npu:_autoload)"

    report = json.loads(_doctor_subprocess(tmp_path, "--json").stdout)
    assert report["torch_import_cause"].startswith("OSError: libascendcl.so")
    assert report["backend_extensions"] == [
        {"name": "torch_npu", "target": "torch_npu:_autoload", "package": "torch-npu", "version": "2.5.1"}
    ]

    # without autoload torch imports; doctor then reports the extension as installed but unusable
    off = _doctor_subprocess(tmp_path, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert off.returncode == 0, off.stderr
    assert "import failed: OSError: libascendcl.so" in off.stdout and "warning: torch_npu is installed but unusable" in off.stdout


def test_doctor_ddp_timeout_default_is_the_config_default():
    from grpo_ascend.config.configs import GRPOConfig
    from grpo_ascend.device import doctor

    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    assert parser.parse_args([]).ddp_timeout == GRPOConfig().ddp_timeout
