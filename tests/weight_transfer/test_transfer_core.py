"""The transfer core over gloo: buckets laid out alike on both ends, values bit for bit, bad buckets refused,
a receiver that stops answering fails the transfer to it alone within the timeout."""

from __future__ import annotations

import threading

import pytest
import torch

from grpo_ascend.errors import ConfigError
from grpo_ascend.weight_transfer.group import TransferGroup
from grpo_ascend.weight_transfer.manifest import ALIGN, Manifest
from grpo_ascend.weight_transfer.receiver import WeightReceiver
from grpo_ascend.weight_transfer.sender import WeightSender
from grpo_ascend.weight_transfer.settings import check_weight_transfer, default_bucket_bytes


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 16, generator=g),
        "layer.0.q.weight": torch.randn(16, 16, generator=g),
        "layer.0.norm": torch.randn(16, generator=g),
        "layer.0.idx": torch.arange(5, dtype=torch.int64),
        "head.weight": torch.randn(37, 16, generator=g).to(torch.bfloat16),
    }


def _manifest(tensors: dict[str, torch.Tensor], bucket: int, dtype: torch.dtype | None = None) -> Manifest:
    return Manifest.plan([(n, dtype if dtype and t.is_floating_point() else t.dtype, t.shape)
                          for n, t in tensors.items()], bucket)


def _groups(receivers: int, timeout: float = 20.0) -> tuple[TransferGroup, list[TransferGroup]]:
    """A sender and ``receivers`` receivers, each pair in a group of its own, built in threads."""
    senders: list[TransferGroup | None] = [None] * receivers
    joined: list[TransferGroup | None] = [None] * receivers

    def build(i: int, store, address) -> None:
        senders[i] = TransferGroup.build(store, address, 0, "cpu", timeout)

    def join(i: int, address) -> None:
        joined[i] = TransferGroup.join(address, 1, "cpu", timeout)

    threads = []
    for i in range(receivers):
        store, address = TransferGroup.listen(2, timeout)
        threads += [threading.Thread(target=build, args=(i, store, address)),
                    threading.Thread(target=join, args=(i, address))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return senders, joined  # type: ignore[return-value]


def test_manifest_layout_round_trips_and_is_aligned():
    tensors = _tensors()
    manifest = _manifest(tensors, 3072)
    assert [t.name for t in manifest.tensors] == list(tensors)
    assert all(b.nbytes <= 3072 for b in manifest.buckets) and len(manifest.buckets) > 1
    assert all(t.offset % ALIGN == 0 for t in manifest.tensors)
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_bucket_smaller_than_largest_tensor_is_refused_with_the_size_that_fits():
    with pytest.raises(ConfigError, match=r"weight_transfer_bucket_bytes=1000 is smaller than the tensor "
                                          r"'embed.weight' \(2368 bytes.*at least 2368"):
        _manifest(_tensors(), 1000)


def test_bad_settings_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match="weight_transfer must be one of .*'colective'.*did you mean 'collective'"):
        check_weight_transfer("colective", None)
    with pytest.raises(ConfigError, match="weight_transfer_bucket_bytes must be null .* got 0"):
        check_weight_transfer("auto", 0)
    assert default_bucket_bytes("cpu", largest_tensor=3 * 2**30) == 3 * 2**30


def test_values_received_equal_values_sent_bit_for_bit_to_two_receivers():
    tensors = _tensors()
    manifest = _manifest(tensors, 3072)
    senders, receivers = _groups(2)
    got: list[dict[str, torch.Tensor]] = [{}, {}]

    def receive(i: int) -> None:
        for bucket in WeightReceiver(receivers[i]).buckets(manifest):
            got[i].update({n: t.clone() for n, t in bucket})

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    report = WeightSender("cpu").send(manifest, iter(tensors.items()), senders)
    for t in threads:
        t.join()
    assert report.failed == {} and report.buckets == len(manifest.buckets)
    for received in got:
        assert list(received) == list(tensors)
        for name, sent in tensors.items():
            assert received[name].dtype == sent.dtype
            assert torch.equal(received[name].view(torch.uint8), sent.contiguous().view(torch.uint8)), name


def test_wire_dtype_casts_on_the_sender():
    tensors = {k: v for k, v in _tensors().items() if v.dtype == torch.float32}
    manifest = _manifest(tensors, 4096, dtype=torch.bfloat16)
    senders, receivers = _groups(1)
    got: dict[str, torch.Tensor] = {}
    thread = threading.Thread(target=lambda: [got.update({n: t.clone() for n, t in b})
                                              for b in WeightReceiver(receivers[0]).buckets(manifest)])
    thread.start()
    WeightSender("cpu").send(manifest, iter(tensors.items()), senders)
    thread.join()
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in tensors.items())


def test_a_receiver_that_stops_answering_fails_alone_within_the_timeout():
    """Receiver 1 takes the first bucket and then hangs; the transfer to receiver 0 completes and receiver 1 is
    reported failed once the group's timeout passes (the sender does not hang)."""
    tensors = {f"w{i}": torch.full((64, 64), float(i)) for i in range(6)}
    manifest = _manifest(tensors, 64 * 64 * 4)
    senders, receivers = _groups(2, timeout=3.0)
    got: dict[str, torch.Tensor] = {}

    def receive_all() -> None:
        for bucket in WeightReceiver(receivers[0]).buckets(manifest):
            got.update({n: t.clone() for n, t in bucket})

    def receive_one_then_hang() -> None:
        stream = WeightReceiver(receivers[1]).buckets(manifest)
        next(stream)
        stop.wait(15)

    stop = threading.Event()
    threads = [threading.Thread(target=receive_all), threading.Thread(target=receive_one_then_hang, daemon=True)]
    for t in threads:
        t.start()
    import time

    started = time.perf_counter()
    report = WeightSender("cpu").send(manifest, iter(tensors.items()), senders)
    elapsed = time.perf_counter() - started
    stop.set()
    threads[0].join()
    assert list(report.failed) == [1], report
    assert elapsed < 12, elapsed
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
