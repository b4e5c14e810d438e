"""config.Sm90Config on the CPU (no cutlass needed): its validation, its label and the label's parse, and what
tuning.sm90_config gives fp8_attention per head dim, SM count and key length."""
import dataclasses

import pytest

from dit_accel.kernels.fp8_attention.config import CONSUMER_REGS, DEFAULT_CONSUMER_WARPGROUPS, Sm90Config
from dit_accel.kernels.fp8_attention.support import Fp8AttentionUnsupported
from dit_accel.kernels.fp8_attention.tuning import PERSISTENT_MAX_KEYS, sm90_config


def test_defaults_are_one_cta_per_tile_two_level_128_key_blocks():
    config = Sm90Config()
    assert (config.tile_n, config.num_stages, config.two_level_pv, config.fma_exp2_tiles, config.consumer_warpgroups,
            config.persistent_ctas, config.q_stages, config.pv_row_sum, config.qk_int8) == (
        128, 2, True, 0, None, 0, 1, False, False)
    assert [config.warpgroups(d) for d in (64, 128)] == [DEFAULT_CONSUMER_WARPGROUPS[d] for d in (64, 128)] == [3, 2]
    assert Sm90Config(consumer_warpgroups=2).warpgroups(64) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tile_n = 192
    assert {Sm90Config(): 1}[Sm90Config()] == 1  # a plan's key


@pytest.mark.parametrize("options, message", [
    (dict(tile_n=100), "tile_n must be a multiple of the 32-key wgmma k-block"),
    (dict(consumer_warpgroups=4), f"consumer_warpgroups must be one of {tuple(CONSUMER_REGS)}"),
    (dict(fma_exp2_tiles=16), "fma_exp2_tiles must be in 0..15"),
    (dict(fma_exp2_tiles=-1), "fma_exp2_tiles must be in 0..15"),
    (dict(persistent_ctas=True), "persistent_ctas must be an int >= 0 (the device's SM count), got True"),
    (dict(persistent_ctas=-1), "persistent_ctas must be an int >= 0 (the device's SM count), got -1"),
    (dict(persistent_ctas=1.5), "persistent_ctas must be an int >= 0 (the device's SM count), got 1.5"),
    (dict(q_stages=3, persistent_ctas=132), "q_stages must be 1, or 2 with persistent_ctas"),
    (dict(q_stages=2), "q_stages must be 1, or 2 with persistent_ctas"),
    (dict(pv_row_sum=True, two_level_pv=False), "pv_row_sum needs two_level_pv and 128-key blocks"),
    (dict(pv_row_sum=True, tile_n=192), "pv_row_sum needs two_level_pv and 128-key blocks"),
    (dict(qk_int8=True, tile_n=192), "qk_int8 needs 128-key blocks (two 64-key scales) and fma_exp2_tiles = 0"),
    (dict(qk_int8=True, fma_exp2_tiles=2), "qk_int8 needs 128-key blocks"),
])
def test_refused_configurations_say_why(options, message):
    with pytest.raises(ValueError) as error:
        Sm90Config(**options)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("label", ["128x2", "192x2s", "128x3", "128x2p", "128x2p2", "128x2pr", "128x2p2re2w3",
                                   "160x4se3w2", "128x2r", "128x2i", "128x2p2riw3"])
def test_labels_parse_back_to_their_configuration(label):
    config = Sm90Config.parse(label, sm_count=132)
    assert config.label() == label
    assert config.persistent_ctas == (132 if "p" in label else 0)
    assert Sm90Config.parse(config.label(), 132) == config


def test_bad_labels_are_refused():
    with pytest.raises(ValueError, match=r"bad variant '128'; NxS\[s\]\[p\[Q\]\]\[r\]\[i\]\[eK\]\[wW\]"):
        Sm90Config.parse("128", 132)
    with pytest.raises(ValueError, match="pv_row_sum needs two_level_pv"):
        Sm90Config.parse("128x2sr", 132)


def test_fp8_attention_runs_persistent_ctas_where_they_pay_and_row_sums_at_d64():
    long = PERSISTENT_MAX_KEYS[128] + 1
    assert sm90_config(64, 132, 30272) == Sm90Config(persistent_ctas=132, pv_row_sum=True)
    assert sm90_config(128, 78, PERSISTENT_MAX_KEYS[128]) == Sm90Config(persistent_ctas=78)
    assert sm90_config(128, 132, long) == Sm90Config()
    with pytest.raises(Fp8AttentionUnsupported, match="head dim 96"):
        sm90_config(96, 132, 1024)
