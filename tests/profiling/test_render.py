"""breakdown.png's colours."""


def test_each_kind_and_module_keeps_its_colour_whatever_the_runs_rank():
    """breakdown.png's colours follow names, not rank: attention is the same colour in every run's plot."""
    from dit_accel.profiling.render import colour_of

    assert colour_of("attention") == colour_of("attention") != colour_of("gemm")
    assert colour_of("ffn") != colour_of("attention core")
    assert colour_of("some family's own range") == colour_of("some family's own range")


def test_no_two_named_kinds_or_modules_share_a_colour():
    """rope (a kind) and qk-norm (a module) were both green: every named kind and module now has its own colour, and
    a label that is both keeps one."""
    from dit_accel.profiling.render import KIND_COLOURS, MODULE_COLOURS, colour_of

    named = list(dict.fromkeys((*KIND_COLOURS, *MODULE_COLOURS)))
    assert len({colour_of(label) for label in named}) == len(named)
    assert colour_of("qk-norm") != colour_of("rope")


def test_a_model_of_several_stacks_names_each_bar_by_recipe_and_stack_in_the_terminals_order(tmp_path):
    """HunyuanVideo's two stacks under two recipes: four bars, each named by recipe and stack, the first run on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dit_accel.profiling import render

    runs = [{"backend": backend, "stack": stack, "categories": {"attention": {"ms": 1.0}},
             "modules": {"ffn": {"ms": 1.0}}}
            for backend in ("native", "fp8") for stack in ("transformer_blocks", "single_transformer_blocks")]
    assert render.bar_names(runs) == ["native, transformer_blocks", "native, single_transformer_blocks",
                                      "fp8, transformer_blocks", "fp8, single_transformer_blocks"]
    assert render.bar_names(runs[:1]) == ["native"]
    kept = []
    original_close = plt.close
    plt.close = kept.append
    try:
        render.plot_breakdown(tmp_path / "breakdown.png", {"runs": runs, "header": {"model": "HunyuanVideo"}})
    finally:
        plt.close = original_close
    axis = kept[0].axes[0]
    labels = [tick.get_text() for tick in axis.get_yticklabels()]
    positions = [tick.get_position()[1] for tick in axis.get_yticklabels()]
    top_to_bottom = [label for _, label in sorted(zip(positions, labels), reverse=axis.yaxis_inverted() is False)]
    assert top_to_bottom == render.bar_names(runs)
    original_close(kept[0])
