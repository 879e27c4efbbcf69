"""Smoke check: one weight-transfer bucket round trip between two processes on this node, bytes/s.

The check hosts a transfer group (:mod:`grpo_ascend.weight_transfer`), starts a second process that joins it,
broadcasts one bucket of random bytes to it and has it broadcast the bucket back; the bytes must come back bit for
bit. The group's backend is the accelerator's own collective backend (the receiver on the second device: two
processes cannot share one accelerator in such a group), or gloo over the host with one device or on the CPU.

With ``--vllm-server`` URLs, :func:`check_server_transfer` does the same round trip with each server's workers over
the group a run's weight syncs use (the server must run our entry point, ``python -m grpo_ascend.rollout.vllm.serve``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from grpo_ascend import device as dev
from grpo_ascend.rollout.vllm.collective_sync import CollectiveSync, resolve_transfer
from grpo_ascend.rollout.vllm.server_http import request_json
from grpo_ascend.smoke.context import SmokeContext
from grpo_ascend.smoke.report import CheckResult
from grpo_ascend.weight_transfer.group import GroupAddress, TransferGroup

#: The bucket sent: the smallest default bucket (weight_transfer/settings.py), small enough for any node.
BUCKET_BYTES = 64 * 2**20
#: Seconds the group may take to form and one bucket to cross.
TIMEOUT_S = 120.0


def _receiver(address: dict[str, Any], device: str, nbytes: int) -> None:
    """The second process: join as rank 1, receive the bucket, send it back (rank 1's broadcast)."""
    group = TransferGroup.join(GroupAddress.from_json(address), 1, device, TIMEOUT_S)
    bucket = torch.empty(nbytes, dtype=torch.uint8, device=device)
    group.broadcast(bucket).wait()
    dev.broadcast(group.group, bucket, 1).wait()
    dev.synchronize(torch.device(device))
    group.close()


def loopback_devices(device: torch.device) -> tuple[str, str, str]:
    """(sender device, receiver device, why) for this node's round trip."""
    if dev.is_accelerator(device) and dev.device_count(device.type) >= 2:
        return f"{device.type}:0", f"{device.type}:1", "two devices of this node"
    if dev.is_accelerator(device):
        return "cpu", "cpu", "one device here: the host's loopback over gloo (a device group needs two devices)"
    return "cpu", "cpu", "the host's loopback"


def round_trip(sender_device: str, receiver_device: str, nbytes: int = BUCKET_BYTES) -> dict[str, Any]:
    """One bucket there and back between this process and a second one; its numbers (raises when it failed)."""
    context = torch.multiprocessing.get_context("spawn")
    store, address = TransferGroup.listen(2, TIMEOUT_S)
    child = context.Process(target=_receiver, args=(address.to_json(), receiver_device, nbytes), daemon=True,
                            name="grpo-ascend-transfer-check")
    child.start()
    try:
        group = TransferGroup.build(store, address, 0, sender_device, TIMEOUT_S)
        sent = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        sent = sent.to(sender_device)
        back = torch.empty_like(sent)
        started = time.perf_counter()
        group.broadcast(sent).wait()
        dev.broadcast(group.group, back, 1).wait()
        dev.synchronize(torch.device(sender_device))
        seconds = time.perf_counter() - started
        group.close()
    finally:
        child.join(timeout=TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join()
    return {"bytes": nbytes, "round_trip_s": seconds, "bytes_per_s": 2 * nbytes / seconds,
            "bit_for_bit": bool(torch.equal(sent.cpu(), back.cpu())), "backend": dev.transfer_backend(sender_device),
            "sender": sender_device, "receiver": receiver_device, "receiver_exit_code": child.exitcode}


def check_server_transfer(ctx: SmokeContext) -> CheckResult:
    """One bucket round trip to each ``--vllm-server``'s workers over a transfer group (see the module docstring)."""
    if not ctx.servers:
        return CheckResult("transfer_server", "skipped", "no --vllm-server given",
                           reason="pass --vllm-server URL to check the weight transfer to a server")
    ends = resolve_transfer("collective", request_json, ctx.servers, ctx.device)  # a server that cannot join: raises
    sync = CollectiveSync(request_json, ends, ctx.device, timeout_s=2 * TIMEOUT_S)  # type: ignore[arg-type]
    try:
        numbers = {url: sync.round_trip(url, BUCKET_BYTES) for url in ctx.servers}
    finally:
        sync.close()
    summary = "; ".join(f"{url}: {n['bytes'] / 2**20:.0f} MiB to {n['workers']} worker(s) and back over {n['backend']} "
                        f"in {n['round_trip_s']:.3f} s, {n['bytes_per_s'] / 1e9:.2f} GB/s" for url, n in numbers.items())
    changed = [url for url, n in numbers.items() if not n["bit_for_bit"]]
    if changed:
        return CheckResult("transfer_server", "failed", summary, numbers,
                           f"the bucket came back changed from {', '.join(changed)}")
    return CheckResult("transfer_server", "ok", summary, numbers)


def check_transfer(ctx: SmokeContext) -> CheckResult:
    """One bucket round trip over a transfer group between two processes on this node (see the module docstring)."""
    sender, receiver, why = loopback_devices(ctx.device)
    numbers = round_trip(sender, receiver)
    summary = (f"{numbers['bytes'] / 2**20:.0f} MiB bucket {sender} -> {receiver} and back over "
               f"{numbers['backend']} in {numbers['round_trip_s']:.3f} s: {numbers['bytes_per_s'] / 1e9:.2f} GB/s ({why})")
    if not numbers["bit_for_bit"] or numbers["receiver_exit_code"] != 0:
        return CheckResult("transfer", "failed", summary, numbers,
                           f"the bucket came back changed or the receiver exited with {numbers['receiver_exit_code']}")
    return CheckResult("transfer", "ok", summary, numbers)
