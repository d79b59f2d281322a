"""config.pbtxt rendering: one template, CPU (python backend) and GPU (libtorch) variants, validated specs."""

from __future__ import annotations

import pytest
from hybridflow.exceptions import ConfigError
from hybridflow.utils.triton import ModelConfigSpec, render_model_config


@pytest.mark.parametrize(
    "spec, present, absent",
    [
        (ModelConfigSpec(name="propensity", n_features=32),
         ['backend: "python"', "kind: KIND_CPU", "dims: [ 32 ]", "max_queue_delay_microseconds: 100",
          "latest: { num_versions: 1 }", 'string_value: "1"'],
         ["platform:", "KIND_GPU"]),
        (ModelConfigSpec(name="propensity", n_features=8, backend="pytorch_libtorch", instance_count=2,
                         max_queue_delay_us=None, versions=(3, 4)),
         ['platform: "pytorch_libtorch"', "kind: KIND_GPU", "count: 2", "specific: { versions: [ 3, 4 ] }"],
         ["backend:", "dynamic_batching"]),
    ],
    ids=["cpu-python-backend", "gpu-libtorch"],
)
def test_triton_render_model_config(spec, present, absent):
    text = render_model_config(spec)
    assert f'name: "{spec.name}"' in text
    assert 'name: "INPUT__0"' in text and 'name: "OUTPUT__0"' in text  # same tensor names on CPU and GPU
    for fragment in present:
        assert fragment in text
    for fragment in absent:
        assert fragment not in text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"name": "bad name"}, "name"),
        ({"name": "../escape"}, "name"),
        ({"backend": "onnx"}, "backend"),
        ({"n_features": 0}, "n_features"),
        ({"max_batch_size": -1}, "max_batch_size"),
        ({"max_queue_delay_us": -5}, "max_queue_delay_us"),
        ({"versions": (0,)}, "versions"),
    ],
)
def test_triton_model_config_spec_rejects_bad_fields(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfigSpec(**{"name": "m", "n_features": 4, **kwargs})
