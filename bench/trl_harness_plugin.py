"""The pytest plugin of ``bench/trl_tests_harness.py`` (loaded with ``-p trl_harness_plugin`` in both runs).

- Maps TRL's hub dataset ids to the local stand-in folders named in ``$TRL_HARNESS_DATASETS`` (JSON {id: folder}):
  ``datasets.load_dataset`` offline cannot read a dataset repo from the hub cache, so the id is swapped for the
  folder before the test module imports ``load_dataset``.
- Gives an installed trl that predates the test file the ``trl.import_utils.is_<package>_available`` checks that
  the test helpers import (the package is looked up with ``importlib.util.find_spec``), so the helpers import.
- In TRL's run, where torchvision is missing (it cannot be installed beside the CPU torch here), lets
  ``AutoProcessor`` load the Qwen2-VL / Qwen2.5-VL / Qwen3.5 processors without their video part (grpo-ascend's
  image-only stand-ins, from the checkout named in ``$TRL_HARNESS_IMAGE_ONLY_FROM``): TRL loads every processor
  with ``AutoProcessor``, which needs torchvision for those; with a working torchvision nothing changes.
- Stops a test that runs past ``$TRL_HARNESS_TEST_TIMEOUT`` seconds (SIGALRM; a failure, not a hung run).
- Writes one JSON line per test to ``$TRL_HARNESS_OUTCOMES`` from the process that ran it: its outcome per phase,
  the first line of a failure, and whether it needs jmespath (TRL's tool tests).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal

import pytest

OUTCOMES = os.environ.get("TRL_HARNESS_OUTCOMES")
TIMEOUT = int(os.environ.get("TRL_HARNESS_TEST_TIMEOUT", "0"))


def map_datasets() -> None:
    import datasets

    folders = json.loads(os.environ.get("TRL_HARNESS_DATASETS", "{}"))
    original = datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        return original(folders.get(path, path), *args, **kwargs)

    datasets.load_dataset = load_dataset


def add_availability_checks() -> list[str]:
    """``is_<name>_available`` for helpers written against a newer trl; returns the names added."""
    checks = importlib.import_module("trl.import_utils")
    added = []
    for name in os.environ.get("TRL_HARNESS_AVAILABILITY", "").split(","):
        attribute = f"is_{name}_available"
        if name and not hasattr(checks, attribute):
            setattr(checks, attribute, lambda module=name: importlib.util.find_spec(module) is not None)
            added.append(attribute)
    return added


def image_only_processors() -> bool:
    """``AutoProcessor.from_pretrained`` falls back to the image-only processor where torchvision is missing (see
    the module docstring); returns whether it was patched."""
    root = os.environ.get("TRL_HARNESS_IMAGE_ONLY_FROM")
    from transformers.utils import is_torchvision_available

    if not root or is_torchvision_available():
        return False
    import sys

    import transformers

    sys.path.insert(0, root)
    from grpo_ascend.models.tiny_vlm_processors import load_vlm_processor

    original = transformers.AutoProcessor.from_pretrained

    def from_pretrained(path, **kwargs):
        try:
            return original(path, **kwargs)
        except ImportError as error:
            if "torchvision" not in str(error).lower():
                raise
            return load_vlm_processor(path, **kwargs)

    transformers.AutoProcessor.from_pretrained = from_pretrained
    return True


map_datasets()
add_availability_checks()
image_only_processors()


RECORDS = pytest.StashKey[dict]()
STATE: dict[str, pytest.Config] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RECORDS] = {}
    STATE["config"] = config


def is_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("dsession")  # pytest-xdist's controller: its workers record


def timed_out(signum, frame):  # noqa: ANN001 - a signal handler
    raise TimeoutError(f"the test ran past the harness's {TIMEOUT} s limit")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if TIMEOUT:
        signal.signal(signal.SIGALRM, timed_out)
        signal.alarm(TIMEOUT)
    try:
        yield
    finally:
        if TIMEOUT:
            signal.alarm(0)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if is_controller(item.config):
        return
    jmespath = any("jmespath" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif"))
    item.config.stash[RECORDS][item.nodeid] = {"nodeid": item.nodeid, "jmespath": jmespath, "phases": {}}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = STATE["config"]
    if OUTCOMES is None or is_controller(config):
        return
    record = config.stash[RECORDS].setdefault(report.nodeid, {"nodeid": report.nodeid, "jmespath": False,
                                                              "phases": {}})
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    record["phases"][report.when] = outcome
    record["seconds"] = record.get("seconds", 0.0) + report.duration
    if report.failed or report.skipped:
        crash = getattr(report.longrepr, "reprcrash", None)
        if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
            message = str(report.longrepr[2])
        else:
            message = crash.message if crash is not None else str(report.longrepr)
        record.setdefault("message", message.strip().splitlines()[0][:400] if message.strip() else "")
    if report.when == "teardown":
        with open(OUTCOMES, "a") as out:
            out.write(json.dumps(record) + "\n")

