import pytest

from eval.tradeoff import plots


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def test_labels_of_crowded_points_do_not_overlap():
    # four 4-bit variants within a few MiB and a few hundredths of ppl of each other, as on SmolLM2
    pts = [("fp32", 513.0, 20.9), ("int8", 162.0, 20.95), ("nf4", 104.0, 23.9), ("rtn4", 99.0, 26.9),
           ("awq4", 99.5, 23.6), ("gptq4", 99.2, 23.62), ("awq-gptq4", 99.4, 23.34), ("awq4.onnx-int4", 101.0, 23.61)]
    fig, ax = _figure()
    ax.scatter([p[1] for p in pts], [p[2] for p in pts])
    ax.set_xscale("log")
    ax.margins(0.18, 0.15)
    fig.canvas.draw()
    labels = plots.place_labels(ax, pts)
    renderer = fig.canvas.get_renderer()
    boxes = [a.get_window_extent(renderer) for a in labels]
    frame = ax.get_window_extent(renderer)
    assert [a.get_text() for a in labels] == [p[0] for p in pts]
    for i, a in enumerate(boxes):
        assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1
        for b in boxes[i + 1:]:
            assert plots._overlap(a, b) == 0, (a, b)


@pytest.mark.parametrize("values, log", [([100, 540], False), ([1e-3, 0.2], True), ([0.0, 5.0], False)])
def test_log_scale_only_where_values_span_an_order_of_magnitude(values, log):
    assert plots._log(values) is log


def test_scatter_png_draws_a_labelled_frontier():
    s = plots.Series([("a", 100.0, 21.0), ("b", 500.0, 20.0), ("c", 300.0, 25.0)], ["a", "b"], "size (MiB)",
                     "perplexity", "t")
    png = plots.scatter_png(s, dpi=50)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
