"""breakdown.png's colours."""


def test_each_kind_and_module_keeps_its_colour_whatever_the_runs_rank():
    """breakdown.png's colours follow names, not rank: attention is the same colour in every run's plot."""
    from dit_accel.profiling.render import colour_of

    assert colour_of("attention") == colour_of("attention") != colour_of("gemm")
    assert colour_of("ffn") != colour_of("attention core")
    assert colour_of("some family's own range") == colour_of("some family's own range")
