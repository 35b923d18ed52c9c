"""The qos bench's hand-drawn plot (no matplotlib in the venv): well-formed SVG with one
line per QoS mode through every level, labelled."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from dsec.bench.qos import svg_plot


def test_svg_plot_draws_each_mode_through_every_level() -> None:
    svg = svg_plot({"off": [(0.0, 70.0), (0.1, 80.0), (0.3, 99.0), (0.5, 98.0)],
                    "on": [(0.0, 74.0), (0.1, 75.0), (0.3, 57.0), (0.5, 75.0)]})
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    lines = root.findall(f"{ns}polyline")
    assert len(lines) == 2
    for line in lines:
        pts = [tuple(map(float, p.split(","))) for p in line.attrib["points"].split()]
        assert len(pts) == 4 and [x for x, _ in pts] == sorted(x for x, _ in pts)
    # higher p99 is drawn higher (smaller y): off at 0.3 (99 ms) above on at 0.3 (57 ms)
    off, on = ([tuple(map(float, p.split(","))) for p in ln.attrib["points"].split()]
               for ln in lines)
    assert off[2][1] < on[2][1]
    texts = "".join(t.text or "" for t in root.iter(f"{ns}text"))
    assert "QoS off" in texts and "QoS on" in texts and "BE load" in texts


def test_in_sandbox_series_are_dashed_in_their_modes_colour() -> None:
    svg = svg_plot({"off": [(0.0, 10.0), (0.5, 20.0)], "on": [(0.0, 10.0), (0.5, 11.0)],
                    "off, in-sandbox": [(0.0, 6.0), (0.5, 9.0)],
                    "on, in-sandbox": [(0.0, 6.0), (0.5, 6.5)]})
    ns = "{http://www.w3.org/2000/svg}"
    lines = {ln.attrib["stroke"] + ("-" if "stroke-dasharray" in ln.attrib else "")
             for ln in ET.fromstring(svg).findall(f"{ns}polyline")}
    assert lines == {"#d62728", "#1f77b4", "#d62728-", "#1f77b4-"}


def test_windows_interleave_every_mode_once_per_round() -> None:
    from dsec.bench.qos import window_order

    modes = ("none", "off", "on")
    got = window_order(modes, 6, seed=1)
    rounds = [got[i:i + 3] for i in range(0, len(got), 3)]
    assert len(rounds) == 6 and all(sorted(r) == sorted(modes) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1   # shuffled, not one fixed order
    assert window_order(modes, 6, seed=1) == got   # reproducible per seed
