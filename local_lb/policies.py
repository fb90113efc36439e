"""Local-tier policies by name: a plain mapping from name to factory.

A factory takes the tier's ``LocalView`` and an injected ``random.Random``
and returns a fresh ``Picker`` (pickers may keep per-instance state, such as
a round-robin index, so each tier builds its own).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from common.request.pick import Picker
from local_lb.baselines import (
    EnvoyLeastRequestPicker,
    LeastConnectionsPicker,
    LeastResponseTimePicker,
    PowerOfTwoPicker,
    RandomPicker,
    RoundRobinPicker,
    SglangCacheAwarePicker,
    WeightedLeastConnectionsPicker,
    WeightedRoundRobinPicker,
)
from local_lb.baselines_llm import InferenceGatewayPicker
from local_lb.picker import CompletionTimePicker
from local_lb.state import LocalView

PickerFactory = Callable[[LocalView, random.Random], Picker]

DEFAULT_POLICY = "default"

POLICIES: Mapping[str, PickerFactory] = {
    DEFAULT_POLICY: lambda view, rng: CompletionTimePicker(view, rng=rng),
    # The default without the length weight: every request by its completion time alone.
    "completion_time": lambda view, rng: CompletionTimePicker(view, rng=rng, length_bias=0.0),
    "round_robin": lambda view, rng: RoundRobinPicker(view),
    "weighted_round_robin": lambda view, rng: WeightedRoundRobinPicker(view),
    "random": lambda view, rng: RandomPicker(rng),
    "least_connections": lambda view, rng: LeastConnectionsPicker(rng),
    "power_of_two": lambda view, rng: PowerOfTwoPicker(rng),
    "least_response_time": lambda view, rng: LeastResponseTimePicker(rng),
    "sglang_cache_aware": lambda view, rng: SglangCacheAwarePicker(view, rng),
    "weighted_least_connections": lambda view, rng: WeightedLeastConnectionsPicker(),
    "envoy_least_request": lambda view, rng: EnvoyLeastRequestPicker(rng, view),
    "envoy_least_request_weighted": lambda view, rng: EnvoyLeastRequestPicker(
        rng, view, weighted=True
    ),
    "inference_gateway": lambda view, rng: InferenceGatewayPicker(view, rng),
}


def picker_factory(name: str, rng: random.Random) -> Callable[[LocalView], Picker]:
    """Builds the picker of policy ``name`` over a view (a balancer rebuilds it when its
    GPU set changes); ValueError naming it and the known ones, at once."""
    factory = POLICIES.get(name)
    if factory is None:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown local policy {name!r}; known policies: {known}")
    return lambda view: factory(view, rng)


def make_picker(name: str, view: LocalView, rng: random.Random) -> Picker:
    """The picker for policy ``name``; ValueError naming it and the known ones."""
    return picker_factory(name, rng)(view)
