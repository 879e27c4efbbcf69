"""Where a rollout process samples on the CPU: the split of the process's threads, and the trainer's share
given back when a later run in the same process has no rollout process."""

from __future__ import annotations

import torch

from grpo_ascend import device as dev


def test_split_is_taken_from_the_process_threads_every_run_and_given_back():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        first = dev.rollout_placement(torch.device("cpu"), None, None)
        assert (first.device, first.threads, first.trainer_threads) == ("cpu", 2, 2)
        dev.use_trainer_threads(first)
        assert torch.get_num_threads() == 2 and dev.host_threads() == 4
        second = dev.rollout_placement(torch.device("cpu"), None, 3)  # a second run: still 4 threads to split
        assert (second.threads, second.trainer_threads) == (3, 1)
        dev.use_trainer_threads(second)
        assert torch.get_num_threads() == 1
        dev.use_trainer_threads(None)  # a sync run afterwards trains on all of them
        assert torch.get_num_threads() == 4 and dev.host_threads() == 4
        on_npu = dev.rollout_placement(torch.device("cpu"), "npu:1", None)
        assert (on_npu.device, on_npu.trainer_threads) == ("npu:1", None)
    finally:
        dev.use_trainer_threads(None)
        torch.set_num_threads(before)
