"""The pipeline facts each family's adapter derives are the pipeline's own where diffusers has them."""
import inspect

import pytest

from dit_accel.adapters import FAMILIES, adapter_for_preset


def test_wan_steps_and_guidance_match_the_wan_pipeline():
    from diffusers import WanPipeline

    parameters = inspect.signature(WanPipeline.__call__).parameters
    wan = adapter_for_preset("wan")
    assert wan.default_steps == parameters["num_inference_steps"].default
    assert parameters["guidance_scale"].default > 1 and wan.passes_per_step == 2  # CFG on by default: two passes


@pytest.mark.slow
def test_every_family_states_its_facts_and_their_sources():
    for name in FAMILIES:
        adapter = adapter_for_preset(name)
        assert adapter.passes_per_step >= 1 and adapter.passes_per_step_source
        assert adapter.default_steps >= 1 and adapter.default_steps_source
