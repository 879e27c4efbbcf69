"""Weights moved from the trainer to samplers on other devices over a process group, not through files.

The sender packs the policy's tensors, in the order of a :class:`~.manifest.Manifest`, into buckets of at most
``bucket_bytes`` (one flat buffer each, the receiver's dtype) and broadcasts each bucket over one
:class:`~.group.TransferGroup` per sampler: HCCL on Ascend, NCCL on CUDA, gloo on the CPU (the device layer
picks). A receiver (a vLLM server's workers, the rollout process) unpacks each bucket into views and hands them to
its loader. Groups are built once per run and reused for every version; a sampler that dies is dropped from the
transfer while the others finish.

Modules: ``settings`` (``weight_transfer`` modes, bucket size), ``manifest`` (what is sent, bucket layout),
``group`` (one sender-receivers group), ``sender`` / ``receiver`` (the two ends).
"""
