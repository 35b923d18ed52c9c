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
