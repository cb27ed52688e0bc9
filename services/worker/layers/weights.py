"""Loading a model's weights: every layer names the checkpoint tensors it reads and where.

A layer that holds weights yields ``(hf_name, WeightSlot)`` pairs from ``weight_slots()``:
the slot's ``target`` (a view of one of its parameters) receives the whole checkpoint
tensor, or the range ``[start, stop)`` of it along ``dim`` (this rank's rows or columns
under tensor parallelism, or one part of a fused checkpoint tensor). A layer whose matrix
may stay quantized (``Quantizable``) also says which checkpoint tensors make it, in order.
``load_model_weights`` reads each tensor once from a ``WeightSource``
(``shared.model_files.open_weights``), only the ranges its slots need, checks that every
slot was filled, hands whole quantized matrices to their layers, and finally calls each
layer's ``after_loading`` (a transform of the loaded values, e.g. Gemma's ``1 + w``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from shared.gguf_quants import QuantizedTensor

from ..linear import dequantize


@dataclass
class WeightSlot:
    """Where one checkpoint tensor (or part of one) goes: ``target`` receives
    ``tensor.narrow(dim, start, stop - start)`` of the tensor of shape ``full_shape``
    (``dim`` None: the whole tensor)."""

    target: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0


def weight_slot(target: torch.Tensor, full_shape, dim: int | None = None, start: int = 0,
                stop: int = 0) -> WeightSlot:
    """A ``WeightSlot``; a range covering the whole tensor becomes the whole tensor."""
    if dim is not None and start == 0 and stop == full_shape[dim]:
        dim = None
    return WeightSlot(target, tuple(full_shape), dim, start, stop)


class Quantizable:
    """A layer whose weight matrix may be kept quantized: ``checkpoint_names`` are the
    tensors whose rows make it, in order, and ``keep_quantized`` takes them fused
    (``batch_invariant``: its products run one kernel at every row count,
    ``..linear.quantized_linear``)."""

    checkpoint_names: tuple[str, ...] = ()

    def keep_quantized(self, tensor, batch_invariant: bool = False) -> None:
        raise NotImplementedError


def _layers_with_weights(model: nn.Module) -> Iterator[nn.Module]:
    return (m for m in model.modules() if hasattr(m, "weight_slots"))


def weight_plan(model: nn.Module) -> dict[str, list[WeightSlot]]:
    """Every checkpoint tensor this rank reads, under its HF name, and where it goes."""
    plan: dict[str, list[WeightSlot]] = {}
    for layer in _layers_with_weights(model):
        for name, slot in layer.weight_slots():
            plan.setdefault(name, []).append(slot)
    return plan


def _put(slot: WeightSlot, tensor: torch.Tensor, name: str) -> None:
    if slot.target.shape != tensor.shape:
        raise ValueError(f"weight {name}: expected shape {tuple(slot.target.shape)}, got {tuple(tensor.shape)}")
    slot.target.copy_(tensor)


def _check_full_shape(slot: WeightSlot, shape, name: str) -> None:
    if tuple(shape) != slot.full_shape:
        raise ValueError(f"weight {name}: expected shape {slot.full_shape}, got {tuple(shape)}")


def _check_complete(plan: dict[str, list[WeightSlot]], loaded: set[str]) -> None:
    missing = sorted(set(plan) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


def load_weights(model: nn.Module, weights) -> None:
    """Copy ``(hf_name, full tensor)`` pairs into the model's layers, each slot taking its
    range; every slot must be filled. Unknown names are skipped."""
    plan = weight_plan(model)
    loaded: set[str] = set()
    for name, tensor in weights:
        for slot in plan.get(name, ()):
            if slot.dim is None:
                _put(slot, tensor, name)
            else:
                _check_full_shape(slot, tensor.shape, name)
                _put(slot, tensor.narrow(slot.dim, slot.start, slot.stop - slot.start), name)
            loaded.add(name)
    _check_complete(plan, loaded)
    _after_loading(model)


def load_model_weights(model: nn.Module, source, dtype: torch.dtype = torch.float32,
                       keep_quantized: bool = False, batch_invariant: bool = False) -> None:
    """Load from a ``WeightSource``, reading only the ranges the slots need.
    ``keep_quantized``: a matrix the source holds as int8 / int4 in every one of its
    checkpoint tensors, each read whole, stays so (``Quantizable.keep_quantized``); one
    whose parts are not all kept alike is dequantized into its parameter instead.
    ``batch_invariant``: the kept matrices' products, as ``Quantizable`` says."""
    plan = weight_plan(model)
    quantizable = {name for layer in model.modules() if isinstance(layer, Quantizable)
                   for name in layer.checkpoint_names}
    loaded: set[str] = set()
    kept: dict[str, QuantizedTensor] = {}
    for name in source.names():
        slots = plan.get(name)
        if not slots:
            continue
        if keep_quantized and name in quantizable and len(slots) == 1 and slots[0].dim is None:
            tensor = source.load_quantized(name)
            if tensor is not None:
                kept[name] = tensor
                loaded.add(name)
                continue
        for slot in slots:
            if slot.dim is None:
                _put(slot, source.load(name, dtype), name)
                continue
            _check_full_shape(slot, source.shape(name), name)
            if slot.stop > slot.start:  # else a rank holding only vocabulary padding
                _put(slot, source.load_slice(name, slot.dim, slot.start, slot.stop, dtype), name)
        loaded.add(name)
    _check_complete(plan, loaded)
    if kept:
        _hand_over_quantized(model, plan, kept, batch_invariant)
    _after_loading(model)


def _hand_over_quantized(model: nn.Module, plan: dict[str, list[WeightSlot]], kept: dict[str, QuantizedTensor],
                         batch_invariant: bool) -> None:
    for layer in model.modules():
        if not isinstance(layer, Quantizable) or not layer.checkpoint_names:
            continue
        parts = [kept.get(name) for name in layer.checkpoint_names]
        if all(parts) and len({part.bits for part in parts}) == 1:
            layer.keep_quantized(QuantizedTensor.cat(parts) if len(parts) > 1 else parts[0], batch_invariant)
            continue
        for name, part in zip(layer.checkpoint_names, parts):
            if part is not None:
                _put(plan[name][0], dequantize(part), name)


def _after_loading(model: nn.Module) -> None:
    for layer in model.modules():
        hook = getattr(layer, "after_loading", None)
        if hook is not None:
            hook()
